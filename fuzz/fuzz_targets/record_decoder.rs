//! `record::Record::decode` on arbitrary bytes.
//!
//! Invariants: never panics; a record that decodes re-encodes to exactly the input (one encoding
//! per record, so the byte-for-byte compare-and-set of the Redis scripts means what it says);
//! `decode_shared` (which slices the input instead of copying) agrees with `decode`; the cheap
//! `is_in_flight` and `is_finished` tests agree with a full decode.
#![no_main]

use bytes::Bytes;
use idemproxy::record::{self, Record};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let decoded = Record::decode(data);
    let shared = Record::decode_shared(&Bytes::copy_from_slice(data));
    assert_eq!(decoded, shared, "decode and decode_shared disagree");
    match decoded {
        Ok(found) => {
            assert_eq!(
                &found.encode()[..],
                data,
                "{found:?} decodes from bytes it does not encode to"
            );
            assert_eq!(
                record::is_in_flight(data),
                matches!(found, Record::InFlight { .. } | Record::Resolvable(_)),
                "is_in_flight disagrees with decode"
            );
            assert_eq!(
                record::is_finished(data),
                matches!(found, Record::Finished { .. }),
                "is_finished disagrees with decode"
            );
            if let Record::Finished { .. } = found {
                assert!(
                    data.starts_with(record::FINISHED_PREFIX)
                        || data.starts_with(record::FINISHED_PREFIX_2)
                );
            }
            if let Record::Resolvable(r) = &found {
                // The fixed offsets the stores patch in place read what the decoder read.
                assert_eq!(record::resolvable::token(data), Some(&r.token[..]));
                assert_eq!(record::resolvable::lease_until(data), Some(r.lease_until));
            }
        }
        Err(e) => assert!(!e.0.is_empty() && !e.to_string().is_empty()),
    }
});
