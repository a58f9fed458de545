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
use http::{HeaderName, HeaderValue, Method, StatusCode};

use crate::fingerprint::Fingerprint;

const MAGIC: &[u8; 3] = b"IDP";
const VERSION: u8 = 1;
/// The version of the records of a `resolve` route.
const VERSION_2: u8 = 2;

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
    /// The response a resolution's lookup found (`on_unknown_outcome: resolve`): replayed byte
    /// for byte, with `Idempotent-Resolved: true`. Written as version 2.
    Resolved(SavedResponse),
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
            Record::Resolvable(r) => &r.fingerprint,
        }
    }

    /// The claim's fencing token, if this is a claim.
    pub(crate) fn token(&self) -> Option<&Token> {
        match self {
            Record::InFlight { token, .. } => Some(token),
            Record::Resolvable(r) => Some(&r.token),
            Record::Done { .. } => None,
        }
    }

    /// Encodes the record (current version).
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(self.encoded_len_hint());
        out.put_slice(MAGIC);
        out.put_u8(self.version());
        match self {
            Record::Resolvable(r) => r.encode_into(&mut out),
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
                        put_response(&mut out, r);
                    }
                    Saved::Resolved(r) => {
                        out.put_u8(b'V');
                        put_response(&mut out, r);
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

    /// The format version this record is written in: 2 for the records of a `resolve` route,
    /// 1 for every other.
    fn version(&self) -> u8 {
        match self {
            Record::Resolvable(_)
            | Record::Done {
                saved: Saved::Resolved(_),
                ..
            } => VERSION_2,
            _ => VERSION,
        }
    }

    fn encoded_len_hint(&self) -> usize {
        match self {
            Record::InFlight { .. } => 4 + 1 + 16 + 32,
            Record::Resolvable(r) => r.encoded_len_hint(),
            Record::Done { saved, .. } => match saved {
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
        if b.len() < 5 || &b[..3] != MAGIC {
            return Err(DecodeError("not an idemproxy record"));
        }
        let version = b[3];
        if version != VERSION && version != VERSION_2 {
            return Err(DecodeError("unknown record format version"));
        }
        b.advance(4);
        let record = match (version, take_u8(&mut b)?) {
            (VERSION_2, b'Q') => {
                Record::Resolvable(Box::new(Resolvable::decode_after_state(&mut b, bytes)?))
            }
            (VERSION, b'P') => {
                let token = take_array::<16>(&mut b)?;
                let fingerprint = take_array::<32>(&mut b)?;
                Record::InFlight { token, fingerprint }
            }
            (_, b'D') => {
                let fingerprint = take_array::<32>(&mut b)?;
                let saved = match (version, take_u8(&mut b)?) {
                    (VERSION, b'R') => Saved::Response(take_response(&mut b, bytes)?),
                    (VERSION, b'N') => Saved::NotReplayable {
                        status: take_status(&mut b)?,
                    },
                    (VERSION_2, b'V') => Saved::Resolved(take_response(&mut b, bytes)?),
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

/// How far a claim that can be resolved has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The request may be on its way to the upstream (or its answer on its way back).
    InFlight,
    /// The outcome was unknown: lookups are being sent.
    Resolving,
}

impl Phase {
    fn byte(self) -> u8 {
        match self {
            Phase::InFlight => b'F',
            Phase::Resolving => b'R',
        }
    }
}

/// The lookup a resolution sends, rendered when the request was claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    /// The name of the upstream it is sent to (`resolve.upstream`, or the route's).
    pub upstream: String,
    pub method: Method,
    /// The path and query, percent-encoded, as sent.
    pub target: String,
    /// The request headers copied onto it (`resolve.headers`). Kept in the store while the
    /// key resolves; never shown by the key tooling, never logged.
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

/// A claim on a `resolve` route (`'Q'`): the claim itself carries what a lookup needs, so that
/// whoever holds it — the instance that sent the request, or one that took it over after that
/// one's lease lapsed — can resolve an unknown outcome.
///
/// The four times are milliseconds on the store's clock, written by the store (a claim, a
/// takeover, a renewal, [`crate::store::StoreHandle::resolving`]); what the proxy encodes
/// there before a claim is overwritten. Compare them only with a `now` the store gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolvable {
    /// The holder's fencing token. The stores compare this (not the whole value, whose times
    /// they rewrite) to fence renewals, completions and releases.
    pub token: Token,
    /// The lease: the holder is alive until then; after it, a claim takes the record over.
    pub lease_until: u64,
    /// When the key was claimed.
    pub claimed_at: u64,
    /// The earliest the request can have been sent: the claim plus the upstream's
    /// `connect_timeout` (the claim is committed before the request is sent, and the request
    /// cannot be written later than its connect allows). `settle_after` and `give_up_after`
    /// count from it; the record lives until `give_up_after` + `ttl` after it.
    pub sent_at: u64,
    pub phase: Phase,
    /// While resolving: when the holder sends its next lookup (0 while in flight).
    pub next_lookup_at: u64,
    /// The fingerprint of the claiming request.
    pub fingerprint: Fingerprint,
    /// The route's `resolve.settle_after` when the key was claimed.
    pub settle_after: Duration,
    /// The route's `resolve.interval` when the key was claimed.
    pub interval: Duration,
    /// The route's `resolve.give_up_after` when the key was claimed.
    pub give_up_after: Duration,
    pub lookup: Lookup,
}

impl Resolvable {
    /// A new claim, before the store has stamped its times (they are written as 0 and set by
    /// the claim).
    pub fn claim(
        token: Token,
        fingerprint: Fingerprint,
        lookup: Lookup,
        settle_after: Duration,
        interval: Duration,
        give_up_after: Duration,
    ) -> Resolvable {
        Resolvable {
            token,
            lease_until: 0,
            claimed_at: 0,
            sent_at: 0,
            phase: Phase::InFlight,
            next_lookup_at: 0,
            fingerprint,
            settle_after,
            interval,
            give_up_after,
            lookup,
        }
    }

    /// When an `absent` answer becomes final: a lookup sent at or after this (store clock)
    /// means the operation did not happen.
    pub fn settles_at(&self) -> u64 {
        self.sent_at.saturating_add(millis(self.settle_after))
    }

    /// When the resolution gives up and saves `outcome-unknown` (store clock).
    pub fn gives_up_at(&self) -> u64 {
        self.sent_at.saturating_add(millis(self.give_up_after))
    }

    fn encode_into(&self, out: &mut BytesMut) {
        out.put_u8(b'Q');
        out.put_slice(&self.token);
        out.put_u64(self.lease_until);
        out.put_u64(self.claimed_at);
        out.put_u64(self.sent_at);
        out.put_u8(self.phase.byte());
        out.put_u64(self.next_lookup_at);
        out.put_slice(&self.fingerprint);
        out.put_u64(millis(self.settle_after));
        out.put_u64(millis(self.interval));
        out.put_u64(millis(self.give_up_after));
        let lookup = &self.lookup;
        put_short(out, lookup.upstream.as_bytes());
        put_short(out, lookup.method.as_str().as_bytes());
        out.put_u32(u32::try_from(lookup.target.len()).unwrap_or(u32::MAX));
        out.put_slice(&lookup.target.as_bytes()[..lookup.target.len().min(u32::MAX as usize)]);
        put_headers(out, &lookup.headers);
    }

    fn encoded_len_hint(&self) -> usize {
        resolvable::FIXED
            + 24
            + 2
            + self.lookup.upstream.len()
            + 2
            + self.lookup.method.as_str().len()
            + 4
            + self.lookup.target.len()
            + 2
            + headers_len(&self.lookup.headers)
    }

    /// Decodes what follows the state byte.
    fn decode_after_state(b: &mut &[u8], bytes: &Bytes) -> Result<Resolvable, DecodeError> {
        let token = take_array::<16>(b)?;
        let lease_until = take_u64(b)?;
        let claimed_at = take_u64(b)?;
        let sent_at = take_u64(b)?;
        let phase = match take_u8(b)? {
            b'F' => Phase::InFlight,
            b'R' => Phase::Resolving,
            _ => return Err(DecodeError("unknown resolution phase")),
        };
        let next_lookup_at = take_u64(b)?;
        let fingerprint = take_array::<32>(b)?;
        let settle_after = Duration::from_millis(take_u64(b)?);
        let interval = Duration::from_millis(take_u64(b)?);
        let give_up_after = Duration::from_millis(take_u64(b)?);
        let n = usize::from(take_u16(b)?);
        let upstream = take_text(b, n)?;
        let n = usize::from(take_u16(b)?);
        let method = Method::from_bytes(take_slice(b, n)?)
            .map_err(|_| DecodeError("invalid lookup method"))?;
        let n = take_u32(b)? as usize;
        let target = take_text(b, n)?;
        let headers = take_headers(b, bytes)?;
        Ok(Resolvable {
            token,
            lease_until,
            claimed_at,
            sent_at,
            phase,
            next_lookup_at,
            fingerprint,
            settle_after,
            interval,
            give_up_after,
            lookup: Lookup {
                upstream,
                method,
                target,
                headers,
            },
        })
    }
}

/// The fixed offsets of a `'Q'` record, for the stores that read and patch it in place (Lua,
/// SQL, the memory and SQLite stores' Rust): the token and the four times sit at the same
/// place in every such record. Lua and SQL count from 1: add one to these offsets.
pub mod resolvable {
    use std::ops::Range;

    /// The first bytes of every claim that can be resolved.
    pub const PREFIX: &[u8] = b"IDP\x02Q";
    pub const TOKEN: Range<usize> = 5..21;
    pub const LEASE_UNTIL: Range<usize> = 21..29;
    pub const CLAIMED_AT: Range<usize> = 29..37;
    pub const SENT_AT: Range<usize> = 37..45;
    pub const PHASE: usize = 45;
    pub const NEXT_LOOKUP_AT: Range<usize> = 46..54;
    /// Where the fixed part ends (the fingerprint follows).
    pub const FIXED: usize = 54 + 32;

    /// Whether encoded bytes are a claim that can be resolved (long enough to hold the fixed
    /// part; the rest is checked when it is decoded).
    pub fn is(bytes: &[u8]) -> bool {
        bytes.len() >= FIXED && bytes.starts_with(PREFIX)
    }

    /// The `u64` at `at`.
    pub fn read(bytes: &[u8], at: Range<usize>) -> u64 {
        let mut eight = [0u8; 8];
        eight.copy_from_slice(&bytes[at]);
        u64::from_be_bytes(eight)
    }

    /// Writes `value` at `at`.
    pub fn write(bytes: &mut [u8], at: Range<usize>, value: u64) {
        bytes[at].copy_from_slice(&value.to_be_bytes());
    }

    /// The token of a claim that can be resolved, if `bytes` is one.
    pub fn token(bytes: &[u8]) -> Option<&[u8]> {
        is(bytes).then(|| &bytes[TOKEN])
    }

    /// The lease of a claim that can be resolved, if `bytes` is one.
    pub fn lease_until(bytes: &[u8]) -> Option<u64> {
        is(bytes).then(|| read(bytes, LEASE_UNTIL))
    }

    /// Stamps a new claim's times: claimed `now`, leased until `now + lease`, sent at the
    /// latest `now + send_margin`, in flight (for the stores that write in Rust; Lua and SQL do
    /// the same in place).
    pub fn stamp_claim(bytes: &mut [u8], now: u64, lease: u64, send_margin: u64) {
        write(bytes, LEASE_UNTIL, now.saturating_add(lease));
        write(bytes, CLAIMED_AT, now);
        write(bytes, SENT_AT, now.saturating_add(send_margin));
        bytes[PHASE] = b'F';
        write(bytes, NEXT_LOOKUP_AT, 0);
    }

    /// Takes a claim over for `token`: leased until `now + lease`, resolving, its next lookup
    /// at once. Everything else — when it was sent, the lookup, the timings — stays as the
    /// first holder wrote it.
    pub fn stamp_takeover(bytes: &mut [u8], token: &[u8], now: u64, lease: u64) {
        bytes[TOKEN].copy_from_slice(token);
        write(bytes, LEASE_UNTIL, now.saturating_add(lease));
        bytes[PHASE] = b'R';
        write(bytes, NEXT_LOOKUP_AT, now);
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

    /// The claim that can be resolved this holds, if it is one.
    pub fn resolvable(&self) -> Option<&Resolvable> {
        match &self.record {
            Record::Resolvable(r) => Some(r),
            _ => None,
        }
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

/// Whether encoded bytes are a claim in progress, of either kind (without decoding the rest).
pub fn is_in_flight(bytes: &[u8]) -> bool {
    bytes.starts_with(b"IDP\x01P") || resolvable::is(bytes)
}

/// The first bytes of every finished record of format version 1.
pub const FINISHED_PREFIX: &[u8] = b"IDP\x01D";

/// The first bytes of every finished record of format version 2 (a resolved response).
pub const FINISHED_PREFIX_2: &[u8] = b"IDP\x02D";

/// Whether encoded bytes are a finished record of a known format version (without decoding it).
pub fn is_finished(bytes: &[u8]) -> bool {
    bytes.len() > 5 && (bytes.starts_with(FINISHED_PREFIX) || bytes.starts_with(FINISHED_PREFIX_2))
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
        let mut v3 = bytes.to_vec();
        v3[3] = 3;
        assert_eq!(
            Record::decode(&v3),
            Err(DecodeError("unknown record format version"))
        );
        assert!(Record::decode(b"garbage").is_err());
    }

    fn resolvable() -> Resolvable {
        let mut r = Resolvable::claim(
            [9; 16],
            [8; 32],
            Lookup {
                upstream: "booking".into(),
                method: Method::GET,
                target: "/bookings/by-reference/r%201?x=1".into(),
                headers: vec![(
                    HeaderName::from_static("authorization"),
                    HeaderValue::from_static("Bearer secret"),
                )],
            },
            Duration::from_secs(60),
            Duration::from_secs(5),
            Duration::from_secs(600),
        );
        r.lease_until = 1_764_656_010_123;
        r.claimed_at = 1_764_656_000_123;
        r.sent_at = 1_764_656_002_123;
        r.phase = Phase::Resolving;
        r.next_lookup_at = 1_764_656_005_000;
        r
    }

    fn resolved() -> Record {
        Record::Done {
            fingerprint: [4; 32],
            saved: Saved::Resolved(SavedResponse {
                status: StatusCode::OK,
                headers: vec![(
                    HeaderName::from_static("content-type"),
                    HeaderValue::from_static("application/json"),
                )],
                body: Bytes::from_static(b"{\"id\":\"bk_1\"}"),
            }),
        }
    }

    #[test]
    fn version_2_round_trips_and_version_1_is_unchanged() {
        for e in [Record::Resolvable(Box::new(resolvable())), resolved()] {
            let bytes = e.encode();
            assert_eq!(bytes[3], 2, "{e:?}");
            assert_eq!(Record::decode(&bytes), Ok(e));
        }
        // Every other record is still written as version 1, as before.
        let v1 = done().encode();
        assert_eq!(&v1[..5], FINISHED_PREFIX);
        let claim = Record::InFlight {
            token: [1; 16],
            fingerprint: [2; 32],
        }
        .encode();
        assert_eq!(&claim[..5], b"IDP\x01P");
        assert!(is_in_flight(&claim) && !is_finished(&claim));
        assert!(is_finished(&resolved().encode()));
        assert!(is_in_flight(
            &Record::Resolvable(Box::new(resolvable())).encode()
        ));
    }

    #[test]
    fn the_fixed_offsets_are_where_the_encoder_writes() {
        let r = resolvable();
        let bytes = Record::Resolvable(Box::new(r.clone())).encode();
        assert!(resolvable::is(&bytes));
        assert_eq!(resolvable::token(&bytes), Some(&r.token[..]));
        assert_eq!(resolvable::lease_until(&bytes), Some(r.lease_until));
        assert_eq!(
            resolvable::read(&bytes, resolvable::CLAIMED_AT),
            r.claimed_at
        );
        assert_eq!(resolvable::read(&bytes, resolvable::SENT_AT), r.sent_at);
        assert_eq!(bytes[resolvable::PHASE], b'R');
        assert_eq!(
            resolvable::read(&bytes, resolvable::NEXT_LOOKUP_AT),
            r.next_lookup_at
        );
        assert_eq!(&bytes[54..86], &r.fingerprint);

        let mut claim = bytes.to_vec();
        resolvable::stamp_claim(&mut claim, 1_000, 300, 20);
        let Ok(Record::Resolvable(c)) = Record::decode(&claim) else {
            panic!("a stamped claim decodes");
        };
        assert_eq!(
            (
                c.lease_until,
                c.claimed_at,
                c.sent_at,
                c.phase,
                c.next_lookup_at
            ),
            (1_300, 1_000, 1_020, Phase::InFlight, 0)
        );
        let mut taken = claim.clone();
        resolvable::stamp_takeover(&mut taken, &[7; 16], 5_000, 300);
        let Ok(Record::Resolvable(t)) = Record::decode(&taken) else {
            panic!("a taken-over claim decodes");
        };
        assert_eq!(
            (t.token, t.lease_until, t.phase, t.next_lookup_at),
            ([7; 16], 5_300, Phase::Resolving, 5_000)
        );
        assert_eq!(
            (t.claimed_at, t.sent_at, &t.lookup),
            (1_000, 1_020, &c.lookup)
        );
        assert_eq!(t.settles_at(), 1_020 + 60_000);
        assert_eq!(t.gives_up_at(), 1_020 + 600_000);
    }

    #[test]
    fn version_2_damage_and_unknown_versions_are_errors() {
        let bytes = Record::Resolvable(Box::new(resolvable())).encode();
        for cut in 0..bytes.len() {
            assert!(Record::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut v3 = bytes.to_vec();
        v3[3] = 3;
        assert_eq!(
            Record::decode(&v3),
            Err(DecodeError("unknown record format version"))
        );
        let mut phase = bytes.to_vec();
        phase[resolvable::PHASE] = b'X';
        assert!(Record::decode(&phase).is_err());
        // States belong to their version: no 'Q' in version 1, no 'P' in version 2, no
        // resolved outcome in version 1.
        let mut q1 = bytes.to_vec();
        q1[3] = 1;
        assert!(Record::decode(&q1).is_err());
        let mut p2 = Record::InFlight {
            token: [1; 16],
            fingerprint: [2; 32],
        }
        .encode()
        .to_vec();
        p2[3] = 2;
        assert!(Record::decode(&p2).is_err());
        let mut v1 = resolved().encode().to_vec();
        v1[3] = 1;
        assert!(Record::decode(&v1).is_err());
    }
}
