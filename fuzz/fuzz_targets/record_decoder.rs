//! `record::Entry::decode` on arbitrary bytes.
//!
//! Invariants: never panics; an entry that decodes re-encodes to exactly the input (one encoding
//! per entry, so the byte-for-byte compare-and-set of the Redis scripts means what it says);
//! `decode_shared` (which slices the input instead of copying) agrees with `decode`; the cheap
//! `is_in_flight` and `is_finished` tests agree with a full decode.
#![no_main]

use bytes::Bytes;
use idemproxy::record::{self, Entry};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let decoded = Entry::decode(data);
    let shared = Entry::decode_shared(&Bytes::copy_from_slice(data));
    assert_eq!(decoded, shared, "decode and decode_shared disagree");
    match decoded {
        Ok(entry) => {
            assert_eq!(
                &entry.encode()[..],
                data,
                "{entry:?} decodes from bytes it does not encode to"
            );
            assert_eq!(
                record::is_in_flight(data),
                matches!(entry, Entry::InFlight { .. }),
                "is_in_flight disagrees with decode"
            );
            assert_eq!(
                record::is_finished(data),
                matches!(entry, Entry::Done { .. }),
                "is_finished disagrees with decode"
            );
            if let Entry::Done { .. } = entry {
                assert!(data.starts_with(record::FINISHED_PREFIX));
            }
        }
        Err(e) => assert!(!e.0.is_empty() && !e.to_string().is_empty()),
    }
});
