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
//! "IDP" 0x01  'D'  fingerprint[32]  'T' status:u16 n:u16 (…headers as 'R'…) body_len:u64 body
//!                                       m:u16 (name_len:u16 name value_len:u32 value)*m
//! ```
//! `'T'` is a response with trailers (a gRPC call's: its `grpc-status` and the rest), replayed
//! with them; a proxy that knows only `'R'` and `'N'` fails to decode it, which is a store error
//! (never forwarded, never replayed).
//!
//! Version 2 adds what `on_unknown_outcome: resolve` needs, and only records of such a route
//! are written in it (every other record is still written as version 1, byte for byte):
//! ```text
//! "IDP" 0x02  'Q'  token[16]  lease_until:u64  claimed_at:u64  sent_at:u64  phase:u8
//!                  next_lookup_at:u64  fingerprint[32]  settle_after:u64  interval:u64
//!                  give_up_after:u64  upstream_len:u16 upstream  method_len:u16 method
//!                  target_len:u32 target  n:u16 (name_len:u16 name value_len:u32 value)*n
//! "IDP" 0x02  'D'  fingerprint[32]  'V' status:u16 n:u16 (…headers as 'R'…) body_len:u64 body
//! ```
//!
//! Version 3 is the `'Q'` claim of version 2 (same fixed offsets) followed by the statuses
//! that answer its lookups, and counting its `sent_at` from the claim plus the upstream's
//! `timeout` (version 2 counted it from the claim plus `connect_timeout`):
//! ```text
//! "IDP" 0x03  'Q'  …as version 2…  found_n:u16 (status:u16)*found_n  absent_n:u16 (status:u16)*absent_n
//! ```
//! Both are read; only version 3 claims are written. A proxy that knows only version 2 reads
//! a version 3 claim as an unknown version, a store error (`503` for that key, never a
//! forward), until it is upgraded.
//!
//! `'Q'` is a claim that can be resolved: the claim of a `resolve` route, with what a lookup
//! needs (the rendered lookup request and the route's resolve timings as they were when it was
//! claimed), so another instance can resolve it after its holder died. Its times are
//! milliseconds on the *store's* clock (Redis's `TIME`, PostgreSQL's `now()`, the SQLite host's
//! wall clock, the memory store's own), written by the store itself, never by the proxy: the
//! fixed offsets ([`resolvable`]) let Lua and SQL read and patch the token and the times without
//! decoding the rest. The durations are plain milliseconds. `'D'` with `'V'` is a response the
//! resolution found (replayed with `Idempotent-Resolved: true`).
//!
//! Anything else — another magic, an unknown version, trailing or missing bytes, an invalid
//! header — fails to decode, and an undecodable record is a store error: never forwarded, never
//! replayed. That is also what a proxy that only knows version 1 does with a version 2 record,
//! so a rolling deploy never forwards a key being resolved. A future version adds a new version
//! byte; the older ones stay readable.

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderName, HeaderValue, StatusCode};

use crate::fingerprint::Fingerprint;

pub mod layout;
pub mod resolvable;
use layout::{
    FINISHED, IN_FLIGHT, MAGIC, NOT_REPLAYABLE, PREFIX_LEN, RESOLVABLE, RESOLVED, RESPONSE,
    TRAILED, VERSION_1, VERSION_2, VERSION_3,
};
pub use resolvable::{Lookup, Phase, Resolvable};

/// A saved header that is not the upstream's: the unsigned delivery id a webhook provider sent
/// beside a body it signed alone (`X-GitHub-Delivery`, say), kept with the event's result so
/// the key tooling can show which delivery ran it. Never replayed, never shown as a header.
pub const DELIVERY_LABEL: HeaderName = HeaderName::from_static("idemproxy-delivery-label");

/// A claim's fencing token: random, so only the claimant can save or release the claim.
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
    /// The response a resolution's lookup found (`on_unknown_outcome: resolve`): replayed byte
    /// for byte, with `Idempotent-Resolved: true`. Written as version 2.
    Resolved(SavedResponse),
    /// A response and its trailers (a gRPC call's, SPEC §4.11), replayed with both.
    Trailed {
        response: SavedResponse,
        /// The trailers, in the upstream's order.
        trailers: Vec<(HeaderName, HeaderValue)>,
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
    /// Claimed on a `resolve` route: in flight, or being resolved. Written as version 2.
    Resolvable(Box<Resolvable>),
    /// Finished.
    Finished {
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
            Record::InFlight { fingerprint, .. } | Record::Finished { fingerprint, .. } => {
                fingerprint
            }
            Record::Resolvable(r) => &r.fingerprint,
        }
    }

    /// The claim's fencing token, if this is a claim.
    pub(crate) fn token(&self) -> Option<&Token> {
        match self {
            Record::InFlight { token, .. } => Some(token),
            Record::Resolvable(r) => Some(&r.token),
            Record::Finished { .. } => None,
        }
    }

    /// Encodes the record (current version).
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.encoded_len_hint());
        out.put_slice(&MAGIC);
        out.put_u8(self.version());
        match self {
            Record::Resolvable(r) => r.encode_into(&mut out),
            Record::InFlight { token, fingerprint } => {
                out.put_u8(IN_FLIGHT);
                out.put_slice(token);
                out.put_slice(fingerprint);
            }
            Record::Finished { fingerprint, saved } => {
                out.put_u8(FINISHED);
                out.put_slice(fingerprint);
                match saved {
                    Saved::Response(r) => {
                        out.put_u8(RESPONSE);
                        put_response(&mut out, r);
                    }
                    Saved::Resolved(r) => {
                        out.put_u8(RESOLVED);
                        put_response(&mut out, r);
                    }
                    Saved::NotReplayable { status } => {
                        out.put_u8(NOT_REPLAYABLE);
                        out.put_u16(status.as_u16());
                    }
                    Saved::Trailed { response, trailers } => {
                        out.put_u8(TRAILED);
                        put_response(&mut out, response);
                        put_headers(&mut out, trailers);
                    }
                }
            }
        }
        out.freeze()
    }

    /// The format version this record is written in: 3 for the claims of a `resolve` route
    /// (2 for one read from version 2), 2 for its resolved results, 1 for every other.
    fn version(&self) -> u8 {
        match self {
            Record::Resolvable(r) => r.version(),
            Record::Finished {
                saved: Saved::Resolved(_),
                ..
            } => VERSION_2,
            _ => VERSION_1,
        }
    }

    fn encoded_len_hint(&self) -> usize {
        match self {
            Record::InFlight { .. } => 4 + 1 + 16 + 32,
            Record::Resolvable(r) => r.encoded_len_hint(),
            Record::Finished { saved, .. } => match saved {
                Saved::Response(r) | Saved::Resolved(r) => {
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
                Saved::Trailed { response, trailers } => {
                    4 + 1
                        + 32
                        + 1
                        + 4
                        + headers_len(&response.headers)
                        + 8
                        + response.body.len()
                        + 2
                        + headers_len(trailers)
                }
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
        let mut b: &[u8] = bytes;
        if b.len() < PREFIX_LEN || b[..MAGIC.len()] != MAGIC {
            return Err(DecodeError("not an idemproxy record"));
        }
        let version = b[layout::VERSION_AT];
        if !matches!(version, VERSION_1 | VERSION_2 | VERSION_3) {
            return Err(DecodeError("unknown record format version"));
        }
        b.advance(layout::STATE_AT);
        let record = match (version, take_u8(&mut b)?) {
            (VERSION_2 | VERSION_3, RESOLVABLE) => Record::Resolvable(Box::new(
                Resolvable::decode_after_state(&mut b, bytes, version)?,
            )),
            (VERSION_1, IN_FLIGHT) => {
                let token = take_array::<16>(&mut b)?;
                let fingerprint = take_array::<32>(&mut b)?;
                Record::InFlight { token, fingerprint }
            }
            (_, FINISHED) => {
                let fingerprint = take_array::<32>(&mut b)?;
                let saved = match (version, take_u8(&mut b)?) {
                    (VERSION_1, RESPONSE) => Saved::Response(take_response(&mut b, bytes)?),
                    (VERSION_1, NOT_REPLAYABLE) => Saved::NotReplayable {
                        status: take_status(&mut b)?,
                    },
                    (VERSION_2, RESOLVED) => Saved::Resolved(take_response(&mut b, bytes)?),
                    (VERSION_1, TRAILED) => Saved::Trailed {
                        response: take_response(&mut b, bytes)?,
                        trailers: take_headers(&mut b, bytes)?,
                    },
                    _ => return Err(DecodeError("unknown outcome kind")),
                };
                Record::Finished { fingerprint, saved }
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
/// by the store's `renew`, `save` and `release` (and so encoded once, here).
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

    /// The claim that can be resolved this holds, if it is one.
    pub fn resolvable(&self) -> Option<&Resolvable> {
        match &self.record {
            Record::Resolvable(r) => Some(r),
            _ => None,
        }
    }
}

/// A finished record, encoded once: what a save writes. A save retried after a
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
        let record = Record::Finished { fingerprint, saved };
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

/// A record's bytes, as a save hands them to the store: a [`Finished`] record, which the
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

/// Whether encoded bytes are a claim in progress, of either kind (without decoding the rest).
pub fn is_in_flight(bytes: &[u8]) -> bool {
    bytes.starts_with(&IN_FLIGHT_PREFIX) || layout::is_resolvable(bytes)
}

/// The first bytes of a claim in flight (format version 1).
const IN_FLIGHT_PREFIX: [u8; PREFIX_LEN] = [MAGIC[0], MAGIC[1], MAGIC[2], VERSION_1, IN_FLIGHT];

pub use layout::{FINISHED_PREFIX, FINISHED_PREFIX_2, is_finished};

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

/// Milliseconds of a duration, saturating.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn put_short(out: &mut BytesMut, bytes: &[u8]) {
    out.put_u16(u16::try_from(bytes.len()).unwrap_or(u16::MAX));
    out.put_slice(&bytes[..bytes.len().min(u16::MAX as usize)]);
}

fn put_headers(out: &mut BytesMut, headers: &[(HeaderName, HeaderValue)]) {
    // Header count and lengths are bounded by the HTTP parser's limits, far below u16/u32;
    // saturate rather than wrap if that ever changes.
    out.put_u16(u16::try_from(headers.len()).unwrap_or(u16::MAX));
    for (name, value) in headers.iter().take(u16::MAX as usize) {
        put_short(out, name.as_str().as_bytes());
        let value = value.as_bytes();
        out.put_u32(u32::try_from(value.len()).unwrap_or(u32::MAX));
        out.put_slice(&value[..value.len().min(u32::MAX as usize)]);
    }
}

fn headers_len(headers: &[(HeaderName, HeaderValue)]) -> usize {
    headers
        .iter()
        .map(|(n, v)| 6 + n.as_str().len() + v.len())
        .sum::<usize>()
}

fn put_response(out: &mut BytesMut, r: &SavedResponse) {
    out.put_u16(r.status.as_u16());
    put_headers(out, &r.headers);
    out.put_u64(r.body.len() as u64);
    out.put_slice(&r.body);
}

/// Where `b` starts within `all` (`b` is a tail of it), to slice shared parts out of `all`.
fn offset_in(all: &Bytes, b: &[u8]) -> usize {
    all.len() - b.len()
}

fn take_headers(
    b: &mut &[u8],
    bytes: &Bytes,
) -> Result<Vec<(HeaderName, HeaderValue)>, DecodeError> {
    let n = take_u16(b)?;
    let mut headers = Vec::with_capacity(usize::from(n).min(128));
    for _ in 0..n {
        let name_len = usize::from(take_u16(b)?);
        let name = take_slice(b, name_len)?;
        let parsed =
            HeaderName::from_bytes(name).map_err(|_| DecodeError("invalid header name"))?;
        // The encoder writes names as `HeaderName` holds them, lower-case: other bytes are not
        // a record this proxy wrote, and one record must have one encoding.
        if parsed.as_str().as_bytes() != name {
            return Err(DecodeError("header name not in lower case"));
        }
        let value_len = take_u32(b)? as usize;
        let start = offset_in(bytes, b);
        take_slice(b, value_len)?;
        let value = HeaderValue::from_maybe_shared(bytes.slice(start..start + value_len))
            .map_err(|_| DecodeError("invalid header value"))?;
        headers.push((parsed, value));
    }
    Ok(headers)
}

fn take_response(b: &mut &[u8], bytes: &Bytes) -> Result<SavedResponse, DecodeError> {
    let status = take_status(b)?;
    let headers = take_headers(b, bytes)?;
    let body_len =
        usize::try_from(take_u64(b)?).map_err(|_| DecodeError("body length out of range"))?;
    let start = offset_in(bytes, b);
    take_slice(b, body_len)?;
    Ok(SavedResponse {
        status,
        headers,
        body: bytes.slice(start..start + body_len),
    })
}

fn take_text(b: &mut &[u8], n: usize) -> Result<String, DecodeError> {
    String::from_utf8(take_slice(b, n)?.to_vec()).map_err(|_| DecodeError("invalid text"))
}

#[cfg(test)]
mod tests;
