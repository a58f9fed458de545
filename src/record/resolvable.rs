//! A claim that can be resolved (`'Q'`, format versions 2 and 3): its fields. The fixed
//! offsets of its encoding, which the stores read and patch in place, and the stamps of its
//! transitions are in [`super::layout`]: the token and the four times sit at the same place in
//! every such record, of either version.
//!
//! Version 3 is what this proxy writes: its `sent_at` is the claim plus the upstream's
//! `timeout` (SPEC §4.8, "When the request was sent"), and it carries the `found` and `absent`
//! statuses the route had, so that it is resolved as it says whatever the route says later.
//! Version 2, written by earlier proxies, counted `sent_at` from the claim plus
//! `connect_timeout` and carries no statuses: it is read as counting from the claim plus the
//! claiming route's upstream `timeout` ([`crate::store::StoreHandle::claim_resolvable`]), and
//! resolved by the route's statuses.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderName, HeaderValue, Method};

use super::{
    DecodeError, Token, headers_len, layout, millis, put_headers, put_short, take_array,
    take_headers, take_slice, take_text, take_u8, take_u16, take_u32, take_u64,
};
use crate::fingerprint::Fingerprint;

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
            Phase::InFlight => layout::PHASE_IN_FLIGHT,
            Phase::Resolving => layout::PHASE_RESOLVING,
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
    /// they rewrite) to fence renewals, saves and releases.
    pub token: Token,
    /// The lease: the holder is alive until then; after it, a claim takes the record over.
    pub lease_until: u64,
    /// When the key was claimed.
    pub claimed_at: u64,
    /// The latest any byte of the request can have reached the upstream: the claim plus the
    /// upstream's `timeout` (the proxy writes nothing once `timeout` has passed since an
    /// instant taken before it sent the claim, and resets the connection then).
    /// `settle_after` and `give_up_after` count from it; the record lives until
    /// `give_up_after` + `ttl` after it.
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
    /// The route's `resolve.found` when the key was claimed (empty in a version 2 record,
    /// which does not say: the route's are used).
    pub found: Vec<u16>,
    /// The route's `resolve.absent` when the key was claimed (empty in a version 2 record).
    pub absent: Vec<u16>,
    /// Read from a version 2 record: its `sent_at` counted from the claim plus the upstream's
    /// `connect_timeout`, and it carries no statuses. Written back in version 2.
    pub legacy: bool,
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
            found: Vec::new(),
            absent: Vec::new(),
            legacy: false,
        }
    }

    /// With the statuses that answer its lookups: the route's `found` and `absent`.
    pub fn answered_by(mut self, found: &[u16], absent: &[u16]) -> Resolvable {
        self.found = found.to_vec();
        self.absent = absent.to_vec();
        self
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

    pub(super) fn encode_into(&self, out: &mut BytesMut) {
        out.put_u8(layout::RESOLVABLE);
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
        if !self.legacy {
            put_statuses(out, &self.found);
            put_statuses(out, &self.absent);
        }
    }

    /// The format version it is written in: 3, or 2 for a record read from version 2.
    pub(super) fn version(&self) -> u8 {
        if self.legacy { 2 } else { 3 }
    }

    pub(super) fn encoded_len_hint(&self) -> usize {
        layout::FIXED
            + 24
            + 2
            + self.lookup.upstream.len()
            + 2
            + self.lookup.method.as_str().len()
            + 4
            + self.lookup.target.len()
            + 2
            + headers_len(&self.lookup.headers)
            + 4
            + 2 * (self.found.len() + self.absent.len())
    }

    /// Decodes what follows the state byte of a record of format `version` (2 or 3).
    pub(super) fn decode_after_state(
        b: &mut &[u8],
        bytes: &Bytes,
        version: u8,
    ) -> Result<Resolvable, DecodeError> {
        let token = take_array::<16>(b)?;
        let lease_until = take_u64(b)?;
        let claimed_at = take_u64(b)?;
        let sent_at = take_u64(b)?;
        let phase = match take_u8(b)? {
            layout::PHASE_IN_FLIGHT => Phase::InFlight,
            layout::PHASE_RESOLVING => Phase::Resolving,
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
        let legacy = version < 3;
        let (found, absent) = if legacy {
            (Vec::new(), Vec::new())
        } else {
            (take_statuses(b)?, take_statuses(b)?)
        };
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
            found,
            absent,
            legacy,
        })
    }
}

/// A list of statuses: `n:u16 (status:u16)*n`.
fn put_statuses(out: &mut BytesMut, statuses: &[u16]) {
    out.put_u16(u16::try_from(statuses.len()).unwrap_or(u16::MAX));
    for status in statuses.iter().take(usize::from(u16::MAX)) {
        out.put_u16(*status);
    }
}

fn take_statuses(b: &mut &[u8]) -> Result<Vec<u16>, DecodeError> {
    let n = take_u16(b)?;
    (0..n).map(|_| take_u16(b)).collect()
}

/// The token of a claim that can be resolved, if `bytes` is one.
pub fn token(bytes: &[u8]) -> Option<&[u8]> {
    layout::is_resolvable(bytes).then(|| &bytes[layout::TOKEN])
}

/// The lease of a claim that can be resolved, if `bytes` is one.
pub fn lease_until(bytes: &[u8]) -> Option<u64> {
    layout::is_resolvable(bytes).then(|| layout::read(bytes, layout::LEASE_UNTIL))
}
