//! The mock's state: what it counted and the bookings it made.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::header::{ETAG, LOCATION};
use http::request::Parts;
use http::{HeaderMap, HeaderName, Method, StatusCode, Uri};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::reply::{Reply, body_json};

/// The header whose value the mock counts side effects under.
const IDEMPOTENCY_KEY: &str = "idempotency-key";
pub(crate) const X_BOOKING_ID: &str = "x-booking-id";

/// The state of a mock upstream: its side-effect counters and stored bookings.
///
/// Cheap to clone (an `Arc` inside); every clone sees the same counters. Serve one (each
/// request through [`MockUpstream::handle`]) and keep another to read the counters.
#[derive(Clone, Default)]
pub struct MockUpstream {
    ledger: Arc<Mutex<Ledger>>,
}

#[derive(Default)]
struct Ledger {
    total: u64,
    by_key: BTreeMap<String, u64>,
    bookings: u64,
    /// The last booking sequence number handed out. Not reset, so a booking id never names two
    /// different bookings in one process (a replayed `bk_3` can't be mistaken for a fresh one).
    last_seq: u64,
    store: HashMap<String, Booking>,
    /// The bookings made per `reference` (the request body's string field), in order.
    references: BTreeMap<String, Vec<String>>,
    /// Webhook deliveries handled, and how many carried each event id.
    webhooks: u64,
    events: BTreeMap<String, u64>,
    /// The ledger's transfers posted (`/ledger.v1.Ledger/Transfer`), and per reference.
    postings: u64,
    postings_by_reference: BTreeMap<String, u64>,
    last_request: Option<RecordedRequest>,
}

/// A stored booking, and when a lookup may see it (`X-Mock-Commit-After`): a booking service
/// whose write reaches the read side late.
struct Booking {
    value: Value,
    visible_at: Option<Instant>,
}

impl Booking {
    fn visible(&self) -> bool {
        self.visible_at.is_none_or(|at| Instant::now() >= at)
    }
}

/// A snapshot of the counters, as `GET /_mock/stats` reports them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MockStats {
    /// Every counted request since start or the last reset.
    pub total: u64,
    /// Bookings created since start or the last reset.
    pub bookings: u64,
    /// Counted requests per `Idempotency-Key` value, as received.
    pub by_key: BTreeMap<String, u64>,
    /// Bookings created per `reference` (the request body's `reference`, a JSON string),
    /// including those not yet visible to a lookup.
    pub by_reference: BTreeMap<String, u64>,
    /// Webhook deliveries handled by `POST /webhooks/{provider}`.
    pub webhooks: u64,
    /// Handled webhook deliveries per event id.
    pub events: BTreeMap<String, u64>,
    /// Transfers the gRPC ledger posted (`/ledger.v1.Ledger/Transfer`).
    pub postings: u64,
    /// The ledger's postings per reference.
    pub postings_by_reference: BTreeMap<String, u64>,
}

/// A counted request as the mock received it, so tests can check what the proxy forwarded
/// without parsing the JSON echo.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub method: Method,
    /// The request target (path and query) as received.
    pub uri: Uri,
    /// Every request header, including the `X-Mock-*` ones.
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl MockUpstream {
    /// Fresh state: every counter at zero, no bookings.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counted requests that carried `Idempotency-Key: key` (the value as received).
    pub fn calls(&self, key: &str) -> u64 {
        self.ledger().by_key.get(key).copied().unwrap_or(0)
    }

    /// Every counted request, with or without a key.
    pub fn total(&self) -> u64 {
        self.ledger().total
    }

    /// Bookings created by `POST /bookings`.
    pub fn bookings(&self) -> u64 {
        self.ledger().bookings
    }

    /// Bookings created with this `reference`, visible to a lookup yet or not.
    pub fn bookings_for(&self, reference: &str) -> u64 {
        self.ledger()
            .references
            .get(reference)
            .map_or(0, |ids| ids.len() as u64)
    }

    /// Handled webhook deliveries that carried this event id.
    pub fn events(&self, id: &str) -> u64 {
        self.ledger().events.get(id).copied().unwrap_or(0)
    }

    /// All counters at once.
    pub fn stats(&self) -> MockStats {
        let ledger = self.ledger();
        MockStats {
            total: ledger.total,
            bookings: ledger.bookings,
            by_key: ledger.by_key.clone(),
            by_reference: ledger
                .references
                .iter()
                .map(|(reference, ids)| (reference.clone(), ids.len() as u64))
                .collect(),
            webhooks: ledger.webhooks,
            postings: ledger.postings,
            postings_by_reference: ledger.postings_by_reference.clone(),
            events: ledger.events.clone(),
        }
    }

    /// The last counted request, if any since start or the last reset.
    pub fn last_request(&self) -> Option<RecordedRequest> {
        self.ledger().last_request.clone()
    }

    /// Zeroes every counter and forgets the stored bookings; booking ids keep growing.
    pub fn reset(&self) {
        let mut ledger = self.ledger();
        let last_seq = ledger.last_seq;
        *ledger = Ledger {
            last_seq,
            ..Ledger::default()
        };
    }

    /// The lock is a std `Mutex`: it is held for a few map operations and never across an
    /// `.await`, so an async mutex would only add cost. A panic while holding it cannot leave
    /// the counters half-updated in a way that matters to a mock, so poisoning is ignored.
    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the side effect of one request. Called as soon as head and body are read.
    pub(crate) fn record(&self, parts: &Parts, body: &Bytes) {
        let key = idempotency_key(&parts.headers);
        tracing::debug!(method = %parts.method, uri = %parts.uri, key = ?key, "mock upstream: counted");
        let mut ledger = self.ledger();
        ledger.total += 1;
        if let Some(key) = key {
            *ledger.by_key.entry(key).or_insert(0) += 1;
        }
        ledger.last_request = Some(RecordedRequest {
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            headers: parts.headers.clone(),
            body: body.clone(),
        });
    }

    /// `POST /bookings`: makes and stores a booking. With `commit_after`, a lookup sees it
    /// only that long after it was made (it exists, and is counted, at once).
    pub(crate) fn create_booking(
        &self,
        request_body: &Bytes,
        commit_after: Option<Duration>,
    ) -> Reply {
        let request = body_json(request_body);
        let reference = request
            .get("reference")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let mut ledger = self.ledger();
        ledger.last_seq += 1;
        ledger.bookings += 1;
        let seq = ledger.last_seq;
        let id = format!("bk_{seq}");
        let booking = json!({ "id": id, "seq": seq, "request": request });
        let mut reply = Reply::json(StatusCode::CREATED, &booking);
        let visible_at = commit_after.map(|after| Instant::now() + after);
        ledger.store.insert(
            id.clone(),
            Booking {
                value: booking,
                visible_at,
            },
        );
        if let Some(reference) = reference {
            ledger
                .references
                .entry(reference)
                .or_default()
                .push(id.clone());
        }
        drop(ledger);

        reply.insert(LOCATION, &format!("/bookings/{id}"));
        reply.insert(ETAG, &etag(&id));
        reply.insert(HeaderName::from_static(X_BOOKING_ID), &id);
        reply
    }

    /// `GET /bookings/{id}`: the stored booking, once visible.
    pub(crate) fn get_booking(&self, id: &str) -> Reply {
        match self.stored_reply(id) {
            Some(reply) => reply,
            None => Reply::json(
                StatusCode::NOT_FOUND,
                &json!({ "error": "booking not found", "id": id }),
            ),
        }
    }

    /// `GET /bookings/by-reference/{reference}`: the first visible booking made with this
    /// `reference`, as `GET /bookings/{id}` answers it.
    pub(crate) fn booking_by_reference(&self, reference: &str) -> Reply {
        let first_visible = {
            let ledger = self.ledger();
            ledger.references.get(reference).and_then(|ids| {
                ids.iter()
                    .find(|id| ledger.store.get(*id).is_some_and(Booking::visible))
                    .cloned()
            })
        };
        match first_visible.and_then(|id| self.stored_reply(&id)) {
            Some(reply) => reply,
            None => Reply::json(
                StatusCode::NOT_FOUND,
                &json!({ "error": "no booking with this reference", "reference": reference }),
            ),
        }
    }

    /// A visible stored booking as a `200`.
    fn stored_reply(&self, id: &str) -> Option<Reply> {
        // Serialized under the lock: `Value` is not cheap to clone, its text is.
        let mut reply = self
            .ledger()
            .store
            .get(id)
            .filter(|booking| booking.visible())
            .map(|booking| Reply::json(StatusCode::OK, &booking.value))?;
        reply.insert(ETAG, &etag(id));
        reply.insert(HeaderName::from_static(X_BOOKING_ID), id);
        Some(reply)
    }

    /// `POST /ledger.v1.Ledger/Transfer`: one posting, counted under its reference.
    pub(crate) fn post_transfer(&self, transfer: crate::ledger::Transfer) -> Reply {
        let mut ledger = self.ledger();
        ledger.postings += 1;
        let n = ledger.postings;
        let count = ledger
            .postings_by_reference
            .entry(transfer.reference)
            .or_insert(0);
        *count += 1;
        let count = *count;
        drop(ledger);
        crate::ledger::reply(&format!("p_{n}"), count)
    }

    /// `POST /webhooks/{provider}`: one handled delivery, counted under its event id (when it
    /// has one).
    pub(crate) fn receive_webhook(&self, provider: &str, event_id: Option<String>) -> Reply {
        let mut ledger = self.ledger();
        ledger.webhooks += 1;
        let deliveries = event_id.as_ref().map(|id| {
            let count = ledger.events.entry(id.clone()).or_insert(0);
            *count += 1;
            *count
        });
        drop(ledger);
        Reply::json(
            StatusCode::OK,
            &json!({
                "received": true,
                "provider": provider,
                "event_id": event_id,
                "deliveries": deliveries,
            }),
        )
    }

    pub(crate) fn stats_json(&self) -> Value {
        let stats = self.stats();
        json!({
            "total": stats.total,
            "bookings": stats.bookings,
            "by_key": stats.by_key,
            "by_reference": stats.by_reference,
            "webhooks": stats.webhooks,
            "events": stats.events,
            "postings": stats.postings,
            "postings_by_reference": stats.postings_by_reference,
        })
    }
}

fn etag(id: &str) -> String {
    format!("\"{id}.v1\"")
}

/// The `Idempotency-Key` as received; several fields are combined as HTTP combines them.
fn idempotency_key(headers: &HeaderMap) -> Option<String> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter().peekable();
    values.peek()?;
    let values: Vec<_> = values
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    Some(values.join(", "))
}
