//! What the store keeps under a key, and its versioned binary encoding.
//!
//! A record is either a claim in progress (its holder's random fencing token and the request
//! fingerprint) or a finished operation (the fingerprint and the saved response). Redis holds
//! the encoded bytes; the Lua scripts compare a holder's whole in-progress value byte for byte,
//! which is the compare-and-set on the token.
//!
//! Layout (version 1), all integers big-endian:
//! ```text
//! "IDP" 0x01  'P'  token[16]  fingerprint[32]
//! "IDP" 0x01  'D'  fingerprint[32]  'R' status:u16 n:u16 (name_len:u16 name value_len:u32 value)*n body_len:u64 body
//! "IDP" 0x01  'D'  fingerprint[32]  'N' status:u16      (a response too large to replay)
//! ```
//! Anything else — another magic, an unknown version, trailing or missing bytes, an invalid
//! header — fails to decode, and an undecodable record is a store error: never forwarded, never
//! replayed. A future version adds a new version byte; this one stays readable.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderName, HeaderValue, StatusCode};

use crate::fingerprint::Fingerprint;

const MAGIC: &[u8; 3] = b"IDP";
const VERSION: u8 = 1;

/// A claim's fencing token: random, so only the claimant can complete or release the claim.
pub(crate) type Token = [u8; 16];

/// A new random token.
pub(crate) fn new_token() -> Token {
    rand::random()
}

/// A saved upstream response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedResponse {
    pub status: StatusCode,
    /// End-to-end headers, in the upstream's order (hop-by-hop ones already removed).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
}

/// How a finished operation ended, as far as replays are concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Saved {
    /// The response, to replay byte for byte.
    Response(SavedResponse),
    /// The response was larger than `max_response_body`: the operation happened, its response
    /// cannot be replayed.
    NotReplayable {
        /// The status the first client got.
        status: StatusCode,
    },
}

/// What the store holds under one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// Claimed; the upstream call may be running.
    InFlight {
        /// The holder's fencing token.
        token: Token,
        /// The fingerprint of the claiming request.
        fingerprint: Fingerprint,
    },
    /// Finished.
    Done {
        /// The fingerprint of the request that ran.
        fingerprint: Fingerprint,
        /// What was saved for its repeats.
        saved: Saved,
    },
}

impl Record {
    /// The fingerprint of the request this record belongs to.
    pub(crate) fn fingerprint(&self) -> &Fingerprint {
        match self {
            Record::InFlight { fingerprint, .. } | Record::Done { fingerprint, .. } => fingerprint,
        }
    }

    /// Encodes the record (current version).
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.encoded_len_hint());
        out.put_slice(MAGIC);
        out.put_u8(VERSION);
        match self {
            Record::InFlight { token, fingerprint } => {
                out.put_u8(b'P');
                out.put_slice(token);
                out.put_slice(fingerprint);
            }
            Record::Done { fingerprint, saved } => {
                out.put_u8(b'D');
                out.put_slice(fingerprint);
                match saved {
                    Saved::Response(r) => {
                        out.put_u8(b'R');
                        out.put_u16(r.status.as_u16());
                        // Header count and lengths are bounded by the HTTP parser's limits,
                        // far below u16/u32; saturate rather than wrap if that ever changes.
                        out.put_u16(u16::try_from(r.headers.len()).unwrap_or(u16::MAX));
                        for (name, value) in r.headers.iter().take(u16::MAX as usize) {
                            let name = name.as_str().as_bytes();
                            out.put_u16(u16::try_from(name.len()).unwrap_or(u16::MAX));
                            out.put_slice(&name[..name.len().min(u16::MAX as usize)]);
                            let value = value.as_bytes();
                            out.put_u32(u32::try_from(value.len()).unwrap_or(u32::MAX));
                            out.put_slice(&value[..value.len().min(u32::MAX as usize)]);
                        }
                        out.put_u64(r.body.len() as u64);
                        out.put_slice(&r.body);
                    }
                    Saved::NotReplayable { status } => {
                        out.put_u8(b'N');
                        out.put_u16(status.as_u16());
                    }
                }
            }
        }
        out.freeze()
    }

    fn encoded_len_hint(&self) -> usize {
        match self {
            Record::InFlight { .. } => 4 + 1 + 16 + 32,
            Record::Done { saved, .. } => match saved {
                Saved::Response(r) => {
                    4 + 1
                        + 32
                        + 1
                        + 4
                        + r.headers
                            .iter()
                            .map(|(n, v)| 6 + n.as_str().len() + v.len())
                            .sum::<usize>()
                        + 8
                        + r.body.len()
                }
                Saved::NotReplayable { .. } => 4 + 1 + 32 + 3,
            },
        }
    }

    /// Decodes a record from a copy of `bytes`. Any deviation from a known layout is an error.
    pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
        Record::decode_shared(&Bytes::copy_from_slice(bytes))
    }

    /// Decodes a record whose header values and body share `bytes` instead of copying them
    /// (a replay costs no copy of the saved response). Any deviation from a known layout is
    /// an error.
    pub fn decode_shared(bytes: &Bytes) -> Result<Record, DecodeError> {
        let all: &[u8] = bytes;
        let mut b = all;
        // Where `b` starts within `bytes`, to slice shared parts out of it.
        let at = |b: &[u8]| all.len() - b.len();
        if b.len() < 5 || &b[..3] != MAGIC {
            return Err(DecodeError("not an idemproxy record"));
        }
        if b[3] != VERSION {
            return Err(DecodeError("unknown record format version"));
        }
        b.advance(4);
        let record = match take_u8(&mut b)? {
            b'P' => {
                let token = take_array::<16>(&mut b)?;
                let fingerprint = take_array::<32>(&mut b)?;
                Record::InFlight { token, fingerprint }
            }
            b'D' => {
                let fingerprint = take_array::<32>(&mut b)?;
                let saved = match take_u8(&mut b)? {
                    b'R' => {
                        let status = take_status(&mut b)?;
                        let n = take_u16(&mut b)?;
                        let mut headers = Vec::with_capacity(usize::from(n).min(128));
                        for _ in 0..n {
                            let name_len = usize::from(take_u16(&mut b)?);
                            let name = take_slice(&mut b, name_len)?;
                            let parsed = HeaderName::from_bytes(name)
                                .map_err(|_| DecodeError("invalid header name"))?;
                            // The encoder writes names as `HeaderName` holds them, lower-case:
                            // other bytes are not a record this proxy wrote, and one record
                            // must have one encoding.
                            if parsed.as_str().as_bytes() != name {
                                return Err(DecodeError("header name not in lower case"));
                            }
                            let name = parsed;
                            let value_len = take_u32(&mut b)? as usize;
                            let start = at(b);
                            take_slice(&mut b, value_len)?;
                            let value = HeaderValue::from_maybe_shared(
                                bytes.slice(start..start + value_len),
                            )
                            .map_err(|_| DecodeError("invalid header value"))?;
                            headers.push((name, value));
                        }
                        let body_len = usize::try_from(take_u64(&mut b)?)
                            .map_err(|_| DecodeError("body length out of range"))?;
                        let start = at(b);
                        take_slice(&mut b, body_len)?;
                        let body = bytes.slice(start..start + body_len);
                        Saved::Response(SavedResponse {
                            status,
                            headers,
                            body,
                        })
                    }
                    b'N' => Saved::NotReplayable {
                        status: take_status(&mut b)?,
                    },
                    _ => return Err(DecodeError("unknown outcome kind")),
                };
                Record::Done { fingerprint, saved }
            }
            _ => return Err(DecodeError("unknown record state")),
        };
        if !b.is_empty() {
            return Err(DecodeError("trailing bytes after the record"));
        }
        Ok(record)
    }
}

/// A claim held by this proxy: the in-progress record and its encoding, compared byte for byte
/// by the store's `renew`, `complete` and `release` (and so encoded once, here).
#[derive(Debug, Clone)]
pub struct Held {
    /// The in-progress record (token and fingerprint).
    pub record: Record,
    /// Its encoding, as stored.
    pub encoded: Bytes,
}

impl Held {
    /// Wraps an in-progress record.
    pub fn new(record: Record) -> Held {
        let encoded = record.encode();
        Held { record, encoded }
    }
}

/// A finished record, encoded once: what a completion writes. A completion retried after a
/// store failure writes these very bytes again, so the store's "already holds exactly this"
/// check holds, and the pending-save bounds count them.
#[derive(Debug, Clone)]
pub struct Finished {
    record: Record,
    encoded: Bytes,
}

impl Finished {
    /// The finished record of the request whose fingerprint is `fingerprint`, encoded.
    pub fn new(fingerprint: Fingerprint, saved: Saved) -> Finished {
        let record = Record::Done { fingerprint, saved };
        let encoded = record.encode();
        Finished { record, encoded }
    }

    pub fn record(&self) -> &Record {
        &self.record
    }

    pub fn encoded(&self) -> &Bytes {
        &self.encoded
    }
}

/// A record's bytes, as a completion hands them to the store: a [`Finished`] record, which the
/// proxy writes; or `Bytes` encoded elsewhere (a tool, or a check that writes what it read
/// back, or bytes that are no record at all).
pub trait Encoded {
    fn encoded(&self) -> &Bytes;
}

impl Encoded for Finished {
    fn encoded(&self) -> &Bytes {
        &self.encoded
    }
}

impl Encoded for Bytes {
    fn encoded(&self) -> &Bytes {
        self
    }
}

/// Whether encoded bytes are a claim in progress (without decoding the rest).
pub fn is_in_flight(bytes: &[u8]) -> bool {
    bytes.len() > 4 && &bytes[..3] == MAGIC && bytes[3] == VERSION && bytes[4] == b'P'
}

/// The first bytes of every finished record of this format version.
pub const FINISHED_PREFIX: &[u8] = b"IDP\x01D";

/// Whether encoded bytes are a finished record of this format version (without decoding it).
pub fn is_finished(bytes: &[u8]) -> bool {
    bytes.len() > 4 && &bytes[..3] == MAGIC && bytes[3] == VERSION && bytes[4] == b'D'
}

/// Why a stored record could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("undecodable idempotency record: {0}")]
pub struct DecodeError(pub &'static str);

const SHORT: DecodeError = DecodeError("truncated record");

fn take_slice<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], DecodeError> {
    if b.len() < n {
        return Err(SHORT);
    }
    let (head, tail) = b.split_at(n);
    *b = tail;
    Ok(head)
}

fn take_array<const N: usize>(b: &mut &[u8]) -> Result<[u8; N], DecodeError> {
    take_slice(b, N)?.try_into().map_err(|_| SHORT)
}

fn take_u8(b: &mut &[u8]) -> Result<u8, DecodeError> {
    Ok(take_array::<1>(b)?[0])
}

fn take_u16(b: &mut &[u8]) -> Result<u16, DecodeError> {
    Ok(u16::from_be_bytes(take_array(b)?))
}

fn take_u32(b: &mut &[u8]) -> Result<u32, DecodeError> {
    Ok(u32::from_be_bytes(take_array(b)?))
}

fn take_u64(b: &mut &[u8]) -> Result<u64, DecodeError> {
    Ok(u64::from_be_bytes(take_array(b)?))
}

fn take_status(b: &mut &[u8]) -> Result<StatusCode, DecodeError> {
    StatusCode::from_u16(take_u16(b)?).map_err(|_| DecodeError("invalid status code"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done() -> Record {
        Record::Done {
            fingerprint: [7; 32],
            saved: Saved::Response(SavedResponse {
                status: StatusCode::CREATED,
                headers: vec![
                    (
                        HeaderName::from_static("content-type"),
                        HeaderValue::from_static("application/json"),
                    ),
                    (
                        HeaderName::from_static("x-a"),
                        HeaderValue::from_static("1"),
                    ),
                    (
                        HeaderName::from_static("x-a"),
                        HeaderValue::from_static("2"),
                    ),
                ],
                body: Bytes::from_static(b"{\"id\":\"bk_1\"}\x00\xff"),
            }),
        }
    }

    #[test]
    fn round_trips() {
        for e in [
            done(),
            Record::InFlight {
                token: [1; 16],
                fingerprint: [2; 32],
            },
            Record::Done {
                fingerprint: [3; 32],
                saved: Saved::NotReplayable {
                    status: StatusCode::OK,
                },
            },
        ] {
            assert_eq!(Record::decode(&e.encode()), Ok(e));
        }
    }

    #[test]
    fn damage_is_detected() {
        let bytes = done().encode();
        for cut in 0..bytes.len() {
            assert!(Record::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut extra = bytes.to_vec();
        extra.push(0);
        assert!(Record::decode(&extra).is_err());
        let mut v2 = bytes.to_vec();
        v2[3] = 2;
        assert_eq!(
            Record::decode(&v2),
            Err(DecodeError("unknown record format version"))
        );
        assert!(Record::decode(b"garbage").is_err());
    }
}
