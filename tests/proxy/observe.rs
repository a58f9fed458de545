//! SPEC §4.7, observe mode: every request on an observed route is forwarded (the mock counts
//! one side effect per request) and none is replayed or refused for idempotency reasons, while
//! the key is claimed and the result saved as `enforce` would, and
//! `idemproxy_observed_total{route,would}` counts what `enforce` would have answered. Switching
//! the route to `enforce` on the same store replays the first observed response. Each rule is
//! written once and run on each store the harness runs behaviour tests on (`every_store!`:
//! memory, sqlite, postgres, redis, redis-cluster); the slow-store rule needs a relay in front of Redis.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use harness::every_store;
use harness::relay::Relay;
use harness::{
    Backend, Env, Reply, TestProxy, book, book_with, booking_store_key, client, eventually, send,
    spawn_booking,
};
use idemproxy::config::Config;
use idemproxy::metrics::{Metrics, Outcome, Would};
use idemproxy::proxy::{Proxy, RecordName, Reloaded};
use idemproxy::record::{Record, Saved};
use idemproxy::store::StoreHandle;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

every_store!(
    observed_repeats_are_forwarded_and_counted_as_replays,
    in_flight_duplicates_are_forwarded_and_counted_as_conflicts,
    mismatches_are_forwarded_and_counted_in_flight_and_finished,
    with_on_conflict_wait_a_duplicate_of_a_request_that_finishes_is_a_replay,
    with_on_conflict_wait_held_repeats_are_bounded_and_the_others_counted_at_once,
    missing_and_invalid_keys_are_forwarded_and_counted,
    unreadable_key_from_parts_are_invalid_keys_and_derived_keys_are_claimed,
    bodies_over_max_request_body_are_forwarded_whole_and_not_claimed,
    store_errors_are_counted_and_forwarded,
    retry_statuses_release_the_key_as_enforce_does,
    a_client_that_leaves_still_gets_its_result_saved_and_the_detached_bound_holds,
    switching_to_enforce_keeps_the_records,
    switching_to_enforce_with_a_reload_keeps_the_records,
    a_repeat_sent_as_soon_as_the_first_is_answered_counts_as_a_replay,
    a_repeat_answered_before_the_first_claim_starts_counts_as_a_replay,
);

const ROUTE: &str = "create-booking";
const SEAT: &str = r#"{"seat":"12A"}"#;
const OTHER_SEAT: &str = r#"{"seat":"14C"}"#;

/// How long a count or a save may take to land in the background.
const LANDS_WITHIN: Duration = Duration::from_secs(10);

/// The harness configuration with `create-booking` observed (and `lines` added to its
/// idempotency section).
fn observing(env: &Env, lines: &str) -> String {
    env.config(&format!("mode: observe\n{lines}"))
}

/// Every `idemproxy_observed_total` series of `create-booking`, by `would`.
fn counts(proxy: &TestProxy) -> BTreeMap<&'static str, u64> {
    Would::ALL
        .iter()
        .map(|w| {
            let labels = [("route", ROUTE), ("would", w.as_str())];
            (
                w.as_str(),
                proxy.metric("idemproxy_observed_total", &labels) as u64,
            )
        })
        .collect()
}

/// The counts expected: the values given, every other one zero.
fn expected(nonzero: &[(Would, u64)]) -> BTreeMap<&'static str, u64> {
    Would::ALL
        .iter()
        .map(|w| {
            let n = nonzero.iter().find(|(x, _)| x == w).map_or(0, |(_, n)| *n);
            (w.as_str(), n)
        })
        .collect()
}

/// Waits until the observed counts are exactly `nonzero` (the claims run in the background),
/// then checks they stay there a little while (nothing is counted twice).
async fn until_counted(proxy: &TestProxy, nonzero: &[(Would, u64)]) {
    let want = expected(nonzero);
    let landed = eventually(LANDS_WITHIN, || counts(proxy) == want).await;
    assert_eq!(
        counts(proxy),
        want,
        "idemproxy_observed_total (landed: {landed})"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(counts(proxy), want, "counted once");
}

/// `idemproxy_observed_unclaimed_total` of `create-booking` for `reason`.
fn unclaimed(proxy: &TestProxy, reason: &str) -> u64 {
    let labels = [("route", ROUTE), ("reason", reason)];
    proxy.metric("idemproxy_observed_unclaimed_total", &labels) as u64
}

/// Claims sent to the store so far.
fn claims(proxy: &TestProxy) -> u64 {
    proxy.metric(
        "idemproxy_store_operation_duration_seconds_count",
        &[("op", "claim")],
    ) as u64
}

/// What the store holds under `key` on `create-booking` (a caller without `Authorization`).
async fn record(proxy: &Proxy, key: &str) -> Option<Record> {
    let store_key = proxy
        .keys()
        .store_key(ROUTE, RecordName::Key(key), &http::HeaderMap::new())
        .expect("an idempotent route");
    proxy.store().get(&store_key).await.expect("store read")
}

/// Waits until `key` holds a finished record, and returns its saved response's status and body.
async fn until_saved(proxy: &Proxy, key: &str) -> (u16, Bytes) {
    let deadline = Instant::now() + LANDS_WITHIN;
    loop {
        if let Some(Record::Finished { saved, .. }) = record(proxy, key).await {
            let Saved::Response(saved) = saved else {
                panic!("{key}: a response was saved, not {saved:?}");
            };
            return (saved.status.as_u16(), saved.body);
        }
        assert!(Instant::now() < deadline, "{key}: nothing was saved");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `key` is claimed (in flight).
async fn until_in_flight(proxy: &Proxy, key: &str) {
    let deadline = Instant::now() + LANDS_WITHIN;
    while !matches!(record(proxy, key).await, Some(Record::InFlight { .. })) {
        assert!(Instant::now() < deadline, "{key}: never claimed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A response of the upstream itself: never a replay, never a problem of the proxy's.
fn assert_forwarded(reply: &Reply, status: u16) {
    assert_eq!(reply.status, status, "status; body: {:?}", reply.body);
    assert_eq!(reply.header("idempotent-replayed"), "", "not a replay");
    assert_ne!(
        reply.header("content-type"),
        "application/problem+json",
        "not a refusal: {:?}",
        reply.body
    );
}

/// The booking id the mock gave a `201`.
fn booking_id(reply: &Reply) -> String {
    reply.json()["id"]
        .as_str()
        .unwrap_or_else(|| panic!("a booking: {:?}", reply.body))
        .to_owned()
}

/// `requests_total` says what the proxy did: every request passed through.
fn assert_passed_through(proxy: &TestProxy, n: u64) {
    assert_eq!(
        proxy.requests(ROUTE, Outcome::Passthrough),
        n,
        "passthrough"
    );
    for outcome in [
        Outcome::Forwarded,
        Outcome::Replayed,
        Outcome::Conflict,
        Outcome::Mismatch,
        Outcome::MissingKey,
        Outcome::InvalidKey,
        Outcome::TooLarge,
        Outcome::StoreError,
    ] {
        assert_eq!(proxy.requests(ROUTE, outcome), 0, "{outcome:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Duplicates.

async fn observed_repeats_are_forwarded_and_counted_as_replays(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&observing(&env, "")).await;
    let first = book(&proxy, "obs-repeat", SEAT).await;
    assert_forwarded(&first, 201);
    // Saved as enforce saves it: the first response, whole.
    assert_eq!(
        until_saved(&proxy.proxy, "obs-repeat").await,
        (201, first.body.clone())
    );

    let again = book(&proxy, "obs-repeat", SEAT).await;
    assert_forwarded(&again, 201);
    assert_ne!(booking_id(&again), booking_id(&first), "run again upstream");
    assert_eq!(env.mock.calls("obs-repeat"), 2, "both forwarded");
    until_counted(&proxy, &[(Would::Forward, 1), (Would::Replay, 1)]).await;
    assert_eq!(
        until_saved(&proxy.proxy, "obs-repeat").await,
        (201, first.body.clone()),
        "a repeat saves nothing: the record is the first request's"
    );
    assert_passed_through(&proxy, 2);
}

async fn in_flight_duplicates_are_forwarded_and_counted_as_conflicts(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&observing(&env, "")).await;
    let slow = spawn_booking(proxy.url(""), "obs-inflight", SEAT, "800ms");
    until_in_flight(&proxy.proxy, "obs-inflight").await;

    let started = Instant::now();
    let dup = book(&proxy, "obs-inflight", SEAT).await;
    assert_forwarded(&dup, 201);
    assert!(
        started.elapsed() < Duration::from_millis(700),
        "the duplicate did not wait for the first: {:?}",
        started.elapsed()
    );
    let first = slow.await.expect("first request");
    assert_forwarded(&first, 201);
    assert_ne!(booking_id(&dup), booking_id(&first));
    assert_eq!(env.mock.calls("obs-inflight"), 2, "both forwarded");
    until_counted(&proxy, &[(Would::Forward, 1), (Would::Conflict, 1)]).await;
    assert_eq!(
        until_saved(&proxy.proxy, "obs-inflight").await,
        (201, first.body),
        "the holder's response is saved, not the duplicate's"
    );
    assert_passed_through(&proxy, 2);
}

async fn mismatches_are_forwarded_and_counted_in_flight_and_finished(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&observing(&env, "")).await;
    let slow = spawn_booking(proxy.url(""), "obs-reused", SEAT, "600ms");
    until_in_flight(&proxy.proxy, "obs-reused").await;
    // Another body under the key while the first is in flight, then once it has finished.
    let in_flight = book(&proxy, "obs-reused", OTHER_SEAT).await;
    assert_forwarded(&in_flight, 201);
    let first = slow.await.expect("first request");
    assert_forwarded(&first, 201);
    until_saved(&proxy.proxy, "obs-reused").await;
    let finished = book(&proxy, "obs-reused", OTHER_SEAT).await;
    assert_forwarded(&finished, 201);
    assert_eq!(
        finished.json()["request"]["seat"],
        "14C",
        "its own body went upstream"
    );
    assert_eq!(env.mock.calls("obs-reused"), 3, "every one forwarded");
    until_counted(&proxy, &[(Would::Forward, 1), (Would::Mismatch, 2)]).await;
    assert_eq!(
        until_saved(&proxy.proxy, "obs-reused").await,
        (201, first.body)
    );
}

async fn with_on_conflict_wait_a_duplicate_of_a_request_that_finishes_is_a_replay(
    backend: Backend,
) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&observing(&env, "on_conflict: wait\nwait_timeout: 5s"))
        .await;
    let slow = spawn_booking(proxy.url(""), "obs-wait", SEAT, "500ms");
    until_in_flight(&proxy.proxy, "obs-wait").await;
    let started = Instant::now();
    let dup = book(&proxy, "obs-wait", SEAT).await;
    assert_forwarded(&dup, 201);
    assert!(
        started.elapsed() < Duration::from_millis(450),
        "observe never makes a duplicate wait: {:?}",
        started.elapsed()
    );
    let first = slow.await.expect("first request");
    assert_forwarded(&first, 201);
    // Enforce would have waited for the first and replayed it.
    until_counted(&proxy, &[(Would::Forward, 1), (Would::Replay, 1)]).await;
    assert_eq!(env.mock.calls("obs-wait"), 2);
}

/// SPEC §4.7: observe's background work is bounded. Under `on_conflict: wait` a repeat of a
/// request in flight is held in the background until the first lands (its client already has
/// its answer, so no connection bound holds it back): at most `limits.max_detached_exchanges`
/// are held; the repeats past that are counted `conflict` at once, while the first is still in
/// flight, and never held.
async fn with_on_conflict_wait_held_repeats_are_bounded_and_the_others_counted_at_once(
    backend: Backend,
) {
    const BOUND: u64 = 3;
    const REPEATS: u64 = 8;
    let env = Env::new(backend).await;
    let yaml = format!(
        "{}limits:\n  max_detached_exchanges: {BOUND}\n",
        observing(&env, "on_conflict: wait\nwait_timeout: 30s")
    );
    let proxy = env.proxy(&yaml).await;
    let held = || proxy.metric("idemproxy_observed_held", &[]) as u64;
    // The upstream's timeout is 5s: the first answers well within it, and long after the
    // repeats have all been counted, even on a loaded machine.
    let slow = spawn_booking(proxy.url(""), "obs-held", SEAT, "4s");
    until_in_flight(&proxy.proxy, "obs-held").await;
    for _ in 0..REPEATS {
        let dup = book(&proxy, "obs-held", SEAT).await;
        assert_forwarded(&dup, 201);
        assert!(held() <= BOUND, "held: {}", held());
    }
    until_counted(
        &proxy,
        &[(Would::Forward, 1), (Would::Conflict, REPEATS - BOUND)],
    )
    .await;
    assert!(
        !slow.is_finished(),
        "the conflicts were counted while the first was in flight"
    );
    assert_eq!(held(), BOUND, "the repeats within the bound are held");

    let first = slow.await.expect("first request");
    assert_forwarded(&first, 201);
    // The held ones see the first land, as enforce's waiters would have: replays.
    until_counted(
        &proxy,
        &[
            (Would::Forward, 1),
            (Would::Conflict, REPEATS - BOUND),
            (Would::Replay, BOUND),
        ],
    )
    .await;
    assert!(
        eventually(LANDS_WITHIN, || held() == 0).await,
        "held: {}",
        held()
    );
    assert_eq!(
        env.mock.calls("obs-held"),
        1 + REPEATS,
        "every request forwarded"
    );
}

// ---------------------------------------------------------------------------------------------
// Keys enforce would refuse.

async fn missing_and_invalid_keys_are_forwarded_and_counted(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&observing(&env, "required: true")).await;
    let post = || {
        client()
            .post(proxy.url("/bookings"))
            .header("Content-Type", "application/json")
            .body(SEAT)
    };
    let no_key = send(post()).await;
    assert_forwarded(&no_key, 201);
    let twice = send(
        post()
            .header("Idempotency-Key", "obs-twice")
            .header("Idempotency-Key", "obs-twice"),
    )
    .await;
    assert_forwarded(&twice, 201);
    let too_long = "k".repeat(256);
    let malformed = send(post().header("Idempotency-Key", too_long.as_str())).await;
    assert_forwarded(&malformed, 201);
    let last = env.mock.last_request().expect("a request");
    assert_eq!(
        last.headers.get("idempotency-key").map(|v| v.as_bytes()),
        Some(too_long.as_bytes()),
        "forwarded as sent"
    );

    // `Connection` naming the key header: enforce answers 400 hop-by-hop-conflict and counts
    // it `invalid_key`; observe counts it so too.
    let hop = send(
        post()
            .header("Idempotency-Key", "obs-hop")
            .header("Connection", "Idempotency-Key"),
    )
    .await;
    assert_forwarded(&hop, 201);

    assert_eq!(env.mock.total(), 4, "every one forwarded");
    until_counted(&proxy, &[(Would::MissingKey, 1), (Would::InvalidKey, 3)]).await;
    assert_eq!(claims(&proxy), 0, "nothing claimed");
    assert_passed_through(&proxy, 4);
}

async fn unreadable_key_from_parts_are_invalid_keys_and_derived_keys_are_claimed(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&observing(&env, r#"key_from: ["json:/ticket"]"#))
        .await;
    let post = |body: &'static str| {
        client()
            .post(proxy.url("/bookings"))
            .header("Content-Type", "application/json")
            .body(body)
    };
    let unreadable = send(post(SEAT)).await;
    assert_forwarded(&unreadable, 201);
    until_counted(&proxy, &[(Would::InvalidKey, 1)]).await;
    assert_eq!(claims(&proxy), 0, "nothing claimed");

    let ticket = r#"{"ticket":"T-1","seat":"3F"}"#;
    let first = send(post(ticket)).await;
    assert_forwarded(&first, 201);
    let sent = env.mock.last_request().expect("a request");
    let derived = sent
        .headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(
        derived.starts_with("derived-"),
        "the derived key goes upstream, as enforce sends it: {derived:?}"
    );
    until_counted(&proxy, &[(Would::InvalidKey, 1), (Would::Forward, 1)]).await;
    let again = send(post(ticket)).await;
    assert_forwarded(&again, 201);
    until_counted(
        &proxy,
        &[
            (Would::InvalidKey, 1),
            (Would::Forward, 1),
            (Would::Replay, 1),
        ],
    )
    .await;
    assert_eq!(env.mock.total(), 3);
    let text = proxy.proxy.encode_metrics();
    assert_eq!(
        harness::metric_value(&text, "idemproxy_derived_keys_total", &[("route", ROUTE)]),
        2.0
    );
}

async fn bodies_over_max_request_body_are_forwarded_whole_and_not_claimed(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&observing(&env, "max_request_body: 16")).await;
    // Declared too large (Content-Length).
    let big = r#"{"seat":"12A","note":"window, please"}"#;
    let declared = book(&proxy, "obs-big", big).await;
    assert_forwarded(&declared, 201);
    let last = env.mock.last_request().expect("a request");
    assert_eq!(&last.body[..], big.as_bytes(), "forwarded whole");
    // Found too large while reading a chunked body: what was read goes first, then the rest.
    let chunked = send_chunked(
        &proxy.url("/bookings"),
        "obs-big-chunked",
        &[b"0123456", b"789abcd", b"efghijk"],
    )
    .await;
    assert_forwarded(&chunked, 201);
    let last = env.mock.last_request().expect("a request");
    assert_eq!(&last.body[..], b"0123456789abcdefghijk", "forwarded whole");

    assert_eq!(env.mock.total(), 2);
    assert_eq!(unclaimed(&proxy, "too_large"), 2);
    assert_eq!(unclaimed(&proxy, "overloaded"), 0);
    until_counted(&proxy, &[]).await;
    assert_eq!(
        claims(&proxy),
        0,
        "a body that cannot be fingerprinted is not claimed"
    );
}

/// A chunked `POST /bookings` (no `Content-Length`) with `key`, in these chunks.
async fn send_chunked(url: &str, key: &str, chunks: &[&'static [u8]]) -> Reply {
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let frames: Vec<Result<Frame<Bytes>, std::convert::Infallible>> = chunks
        .iter()
        .map(|c| Ok(Frame::data(Bytes::from_static(c))))
        .collect();
    let body = StreamBody::new(futures_util::stream::iter(frames));
    let client = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(url)
        .header("idempotency-key", key)
        .body(body)
        .expect("request");
    let resp = client.request(req).await.expect("chunked request failed");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("read body").to_bytes();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

// ---------------------------------------------------------------------------------------------
// The store.

async fn store_errors_are_counted_and_forwarded(backend: Backend) {
    let mut env = Env::new(backend).await;
    let store = if backend == Backend::Memory {
        "max_entries: 1"
    } else {
        ""
    };
    let proxy = env.proxy(&env.config_with("mode: observe", store)).await;
    // Memory: one record fills the store; every other store is cut off after it.
    let filler = book(&proxy, "obs-filler", SEAT).await;
    assert_forwarded(&filler, 201);
    until_saved(&proxy.proxy, "obs-filler").await;
    if backend != Backend::Memory {
        env.make_store_unreachable();
    }
    let reply = book(&proxy, "obs-no-store", SEAT).await;
    assert_forwarded(&reply, 201);
    assert_eq!(env.mock.calls("obs-no-store"), 1, "forwarded all the same");
    until_counted(&proxy, &[(Would::Forward, 1), (Would::StoreError, 1)]).await;
    assert_eq!(
        proxy.requests(ROUTE, Outcome::StoreError),
        0,
        "nobody got a 503"
    );
    assert_eq!(proxy.lost_leases(), 0);
}

async fn retry_statuses_release_the_key_as_enforce_does(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&observing(&env, "")).await;
    let busy = book_with(
        &proxy.url(""),
        "obs-retry",
        SEAT,
        &[("X-Mock-Status", "503")],
    )
    .await;
    assert_eq!(busy.status, 503, "the upstream's own answer, passed on");
    assert_ne!(busy.header("content-type"), "application/problem+json");
    // The claim runs beside the call and may land after the answer: until it has, "no
    // record" says nothing (a retry sent meanwhile finds the first claim, SPEC §4.7).
    until_counted(&proxy, &[(Would::Forward, 1)]).await;
    // Released in the background: the key is free again.
    let deadline = Instant::now() + LANDS_WITHIN;
    while record(&proxy.proxy, "obs-retry").await.is_some() {
        assert!(Instant::now() < deadline, "the claim was never released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let retry = book(&proxy, "obs-retry", SEAT).await;
    assert_forwarded(&retry, 201);
    // Enforce would have forwarded the retry too, and saved it.
    until_counted(&proxy, &[(Would::Forward, 2)]).await;
    assert_eq!(
        until_saved(&proxy.proxy, "obs-retry").await,
        (201, retry.body)
    );
    assert_eq!(env.mock.calls("obs-retry"), 2);
}

/// A client that leaves mid-call does not cancel the call or the save (SPEC §4.3, as in
/// enforce); while its exchange runs detached at `limits.max_detached_exchanges`, a new
/// observed request is forwarded without a claim, counted as `overloaded`, never refused.
async fn a_client_that_leaves_still_gets_its_result_saved_and_the_detached_bound_holds(
    backend: Backend,
) {
    let env = Env::new(backend).await;
    let yaml = observing(&env, "").replace(
        "upstreams:",
        "limits:\n  max_detached_exchanges: 1\nupstreams:",
    );
    let proxy = env.proxy(&yaml).await;
    let leaving = spawn_booking(proxy.url(""), "obs-left", SEAT, "1500ms");
    until_in_flight(&proxy.proxy, "obs-left").await;
    leaving.abort();
    let detached = || proxy.metric("idemproxy_detached_exchanges", &[]) as u64;
    assert!(
        eventually(Duration::from_secs(5), || detached() == 1).await,
        "the exchange runs on after its client left"
    );

    let meanwhile = book(&proxy, "obs-meanwhile", SEAT).await;
    assert_forwarded(&meanwhile, 201);
    assert_eq!(env.mock.calls("obs-meanwhile"), 1);
    assert_eq!(unclaimed(&proxy, "overloaded"), 1);
    assert!(
        record(&proxy.proxy, "obs-meanwhile").await.is_none(),
        "not claimed"
    );

    // The call the client left ends, and its result is saved.
    let (status, body) = until_saved(&proxy.proxy, "obs-left").await;
    assert_eq!(status, 201);
    assert!(body.starts_with(b"{"), "the booking: {body:?}");
    assert_eq!(env.mock.calls("obs-left"), 1);
    assert!(eventually(Duration::from_secs(5), || detached() == 0).await);
    until_counted(&proxy, &[(Would::Forward, 1)]).await;
}

// ---------------------------------------------------------------------------------------------
// Switching to enforce.

/// A proxy served in this process on a store of the test's choosing (two proxies, one after
/// the other, on one store), stopped gracefully by [`Served::stop`].
struct Served {
    proxy: Arc<Proxy>,
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Served {
    async fn start(yaml: &str, store: StoreHandle) -> Served {
        let config = Config::from_yaml(yaml).unwrap_or_else(|e| panic!("config: {e}\n{yaml}"));
        let proxy = Arc::new(Proxy::new(config, store, Arc::new(Metrics::new())));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(idemproxy::server::serve(
            listener,
            proxy.clone(),
            async move {
                let _ = stopped.await;
            },
        ));
        Served {
            proxy,
            addr,
            stop,
            task,
        }
    }

    fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, lets requests in flight and background saves finish.
    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

async fn switching_to_enforce_keeps_the_records(backend: Backend) {
    let env = Env::new(backend).await;
    let observe_yaml = observing(&env, "");
    let enforce_yaml = env.config("mode: enforce");
    let config = Config::from_yaml(&observe_yaml).expect("config");
    let store = idemproxy::server::build_store(&config, Arc::new(Metrics::new()))
        .await
        .expect("store");

    let observer = Served::start(&observe_yaml, store.clone()).await;
    let first = book_with(&observer.base(), "obs-switch", SEAT, &[]).await;
    assert_forwarded(&first, 201);
    // The claim runs beside the call: the repeat is sent once it has landed and the result is
    // saved (a repeat sent sooner may meet no claim yet, or a claim that failed on a slow
    // store: then the repeat's own claim would hold the key, as enforce's would).
    until_saved(&observer.proxy, "obs-switch").await;
    let observed_repeat = book_with(&observer.base(), "obs-switch", SEAT, &[]).await;
    assert_forwarded(&observed_repeat, 201);
    assert_ne!(booking_id(&observed_repeat), booking_id(&first));
    // Stopping waits for the background saves.
    observer.stop().await;
    assert_eq!(env.mock.calls("obs-switch"), 2);

    let enforcer = Served::start(&enforce_yaml, store).await;
    let replay = book_with(&enforcer.base(), "obs-switch", SEAT, &[]).await;
    assert_eq!(
        replay.header("idempotent-replayed"),
        "true",
        "{:?}",
        replay.body
    );
    assert_eq!(replay.status, first.status);
    assert_eq!(
        replay.body, first.body,
        "the first observed response, byte for byte"
    );
    assert_eq!(replay.header_lines(), first.header_lines());
    assert_eq!(env.mock.calls("obs-switch"), 2, "not run again");
    let reused = book_with(&enforcer.base(), "obs-switch", OTHER_SEAT, &[]).await;
    reused.assert_problem(422, "idempotency-key-reused");
    enforcer.stop().await;
}

/// The same switch by a reload of the running proxy (SPEC §2, §4.7): a request observed before
/// it is replayed after it, and one still in flight across it finishes as observed (forwarded,
/// its claim and save untouched), its result replayed to the first enforced repeat.
async fn switching_to_enforce_with_a_reload_keeps_the_records(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&observing(&env, "")).await;
    let first = book(&proxy, "obs-reload", SEAT).await;
    assert_forwarded(&first, 201);
    until_saved(&proxy.proxy, "obs-reload").await;
    let slow = spawn_booking(proxy.url(""), "obs-reload-slow", SEAT, "800ms");
    until_in_flight(&proxy.proxy, "obs-reload-slow").await;

    let enforce = Config::from_yaml(&env.config("mode: enforce")).expect("config");
    let reloaded = proxy.proxy.reload(enforce);
    assert!(matches!(reloaded, Reloaded::Applied(_)), "{reloaded:?}");

    let replay = book(&proxy, "obs-reload", SEAT).await;
    assert_eq!(
        replay.header("idempotent-replayed"),
        "true",
        "{:?}",
        replay.body
    );
    assert_eq!(
        replay.body, first.body,
        "the observed response, byte for byte"
    );
    assert_eq!(replay.header_lines(), first.header_lines());
    assert_eq!(env.mock.calls("obs-reload"), 1);

    let slow = slow.await.expect("the request in flight across the reload");
    assert_forwarded(&slow, 201);
    until_saved(&proxy.proxy, "obs-reload-slow").await;
    let slow_replay = book(&proxy, "obs-reload-slow", SEAT).await;
    assert_eq!(slow_replay.header("idempotent-replayed"), "true");
    assert_eq!(slow_replay.body, slow.body);
    assert_eq!(env.mock.calls("obs-reload-slow"), 1);
    // Counted while observed; the series stay registered, and enforce counts nothing there.
    until_counted(&proxy, &[(Would::Forward, 2)]).await;
    assert_eq!(proxy.requests(ROUTE, Outcome::Replayed), 2);
}

// ---------------------------------------------------------------------------------------------
// The client's answer does not wait for the store.

/// Redis 800ms away (400ms each way, a relay in front): an observed request is answered in a
/// fraction of that, while its claim and save take their round trips in the background; an
/// enforced request on the same proxy waits for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_an_observed_answer_does_not_wait_for_a_slow_store() {
    let env = Env::new(Backend::Redis).await;
    let relay = Relay::start(env.redis().addr()).await;
    let yaml = env
        .config_with("mode: observe\nlock_ttl: 10s", "timeout: 1800ms")
        .replace(&env.redis().url(), &format!("redis://{}/0", relay.addr()));
    let proxy = env.proxy(&yaml).await;
    // Connected (TestProxy pings first) while the relay is still fast.
    relay.set_latency(Duration::from_millis(400), Duration::from_millis(400));

    for key in ["obs-slow-1", "obs-slow-2"] {
        let started = Instant::now();
        let reply = book(&proxy, key, SEAT).await;
        let took = started.elapsed();
        assert_forwarded(&reply, 201);
        assert!(
            took < Duration::from_millis(400),
            "{key}: answered in {took:?}, not after a store round trip (800ms)"
        );
    }
    until_counted(&proxy, &[(Would::Forward, 2)]).await;
    // The saves landed in Redis (read past the relay).
    let mut conn = env.redis().conn();
    for key in ["obs-slow-1", "obs-slow-2"] {
        let deadline = Instant::now() + LANDS_WITHIN;
        loop {
            let raw: Option<Vec<u8>> = ::redis::cmd("GET")
                .arg(booking_store_key(key))
                .query(&mut conn)
                .expect("GET");
            let done =
                raw.is_some_and(|raw| matches!(Record::decode(&raw), Ok(Record::Finished { .. })));
            if done {
                break;
            }
            assert!(Instant::now() < deadline, "{key}: never saved");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let claim_time = proxy.metric(
        "idemproxy_store_operation_duration_seconds_sum",
        &[("op", "claim")],
    );
    assert!(
        claim_time >= 1.6,
        "the store was slow indeed: {claim_time}s for two claims"
    );

    // The enforced route of the same proxy waits for its claim and its save.
    let started = Instant::now();
    let enforced = send(
        client()
            .post(proxy.url("/pay/obs-slow"))
            .header("Idempotency-Key", "obs-slow-pay")
            .body(SEAT),
    )
    .await;
    assert_eq!(enforced.status, 200, "{:?}", enforced.body);
    assert!(
        started.elapsed() >= Duration::from_millis(1600),
        "an enforced request waits for two round trips: {:?}",
        started.elapsed()
    );
    relay.set_latency(Duration::ZERO, Duration::ZERO);
    proxy.stop().await;
}

/// Enforce saves before it answers, so a repeat sent once the first's answer has arrived is
/// always a replay there. Observe answers first and saves after: a repeat in that gap finds the
/// claim still in flight, and must still be counted as the replay enforce would answer, never a
/// conflict (on PostgreSQL the gap is wide enough to hit every time).
async fn a_repeat_sent_as_soon_as_the_first_is_answered_counts_as_a_replay(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&observing(&env, "")).await;
    let keys = 20;
    for n in 0..keys {
        let key = format!("obs-gap-{n}");
        let first = book(&proxy, &key, SEAT).await;
        assert_eq!(first.status, 201, "{:?}", first.body);
        // At once: no pause for the save to land.
        let again = book(&proxy, &key, SEAT).await;
        assert_eq!(again.status, 201, "forwarded: {:?}", again.body);
    }
    until_counted(&proxy, &[(Would::Forward, keys), (Would::Replay, keys)]).await;
}

/// The same gap made certain: the first request's shadow claim is held back before its task's
/// first step (as on a loaded machine, where the task is polled after the upstream has
/// answered), so its answer arrives, and the repeat is sent, before that claim has begun. The
/// first must still be its key's first here from the moment it was forwarded: the repeat waits
/// for its save and counts a replay, never a claim of its own (`forward`) that leaves the
/// first's claim a `conflict`.
async fn a_repeat_answered_before_the_first_claim_starts_counts_as_a_replay(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&observing(&env, "")).await;
    let key = format!("obs-late-shadow-{backend:?}");
    let stall = Duration::from_secs(2);
    idemproxy::proxy::pause::arm_before_shadow_claim(&key, stall);
    let started = Instant::now();
    let first = book(&proxy, &key, SEAT).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let again = book(&proxy, &key, SEAT).await;
    assert_eq!(again.status, 201, "forwarded: {:?}", again.body);
    assert!(
        started.elapsed() < stall,
        "both answered while the first's claim was held back: {:?}",
        started.elapsed()
    );
    assert_eq!(claims(&proxy), 0, "no claim sent before the first's");
    until_counted(&proxy, &[(Would::Forward, 1), (Would::Replay, 1)]).await;
    assert_eq!(env.mock.stats().by_key.get(&key).copied(), Some(2));
    proxy.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Repeats of a request in flight read the store within the held bound
// ---------------------------------------------------------------------------------------------

/// The held bound of the two tests below, and how many repeats they send at once.
const READ_BOUND: u64 = 3;
const BURST: u64 = 24;

/// `idemproxy_observed_total{would}` of `create-booking` in the metrics text `text`.
fn would_in(text: &str, would: Would) -> u64 {
    let labels = [("route", ROUTE), ("would", would.as_str())];
    harness::metric_value(text, "idemproxy_observed_total", &labels) as u64
}

/// [`BURST`] repeats of `key` at once, each forwarded (observe): their answers.
async fn burst_of_repeats(base: &str, key: &str) {
    let sends: Vec<_> = (0..BURST)
        .map(|_| {
            let (base, key) = (base.to_owned(), key.to_owned());
            tokio::spawn(async move { book_with(&base, &key, SEAT, &[]).await })
        })
        .collect();
    for send in sends {
        assert_forwarded(&send.await.expect("a repeat"), 201);
    }
}

/// Under observe + `on_conflict: wait`, with the store stalled once the first request holds its
/// key: of a burst of repeats, at most `limits.max_detached_exchanges` read the record (those
/// reads wait on the store); the others are counted `conflict` at once, while the store still
/// answers nothing — no read of theirs queues behind it (before, every repeat read the record,
/// and each was counted `store_error` at the store's deadline).
async fn repeats_past_the_bound_are_counted_without_a_read(
    base: &str,
    metrics: impl Fn() -> String,
    stall: impl FnOnce(),
) {
    let text = metrics();
    assert_eq!(
        would_in(&text, Would::Forward),
        1,
        "the first claimed its key"
    );
    stall();
    burst_of_repeats(base, "obs-burst").await;
    let counted = || {
        let text = metrics();
        (
            would_in(&text, Would::Conflict),
            would_in(&text, Would::StoreError),
        )
    };
    // The repeats past the bound are counted `conflict` without asking the store; the reads
    // within it end at the store's deadline (1.5s) as `store_error`. Had every repeat read the
    // record, each would have ended so.
    let landed = eventually(LANDS_WITHIN, || {
        counted() == (BURST - READ_BOUND, READ_BOUND)
    })
    .await;
    assert!(
        landed,
        "(conflict, store_error) = {:?}: only the repeats within the bound read the stalled store",
        counted()
    );
}

/// The observed configuration of the two tests: `on_conflict: wait`, the held bound, a store
/// deadline of 1.5s.
fn burst_config(env: &Env) -> String {
    format!(
        "{}limits:\n  max_detached_exchanges: {READ_BOUND}\n",
        env.config_with(
            "mode: observe\non_conflict: wait\nwait_timeout: 30s",
            "timeout: 1500ms"
        )
    )
}

/// On memory, stalled as a store that stops answering (its claims answered 10s late, past
/// the 1.5s deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_repeats_past_the_held_bound_never_read_a_stalled_store() {
    use std::sync::atomic::{AtomicU32, Ordering};

    use idemproxy::store::memory::MemoryStore;

    use super::claim::LateClaims;

    let env = Env::new(Backend::Memory).await;
    let config = Config::from_yaml(&burst_config(&env)).expect("config");
    let metrics = Arc::new(Metrics::new());
    let late = Arc::new(LateClaims {
        inner: MemoryStore::new(1000),
        delay_ms: AtomicU32::new(0),
    });
    let store = StoreHandle::new(late.clone(), Duration::from_millis(1500), metrics.clone());
    let proxy = Arc::new(Proxy::new(config, store, metrics.clone()));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop, stopped) = oneshot::channel::<()>();
    let served = tokio::spawn(idemproxy::server::serve(
        listener,
        proxy.clone(),
        async move {
            let _ = stopped.await;
        },
    ));
    let slow = spawn_booking(base.clone(), "obs-burst", SEAT, "3s");
    until_in_flight(&proxy, "obs-burst").await;
    let text = || metrics.encode();
    assert!(
        eventually(LANDS_WITHIN, || would_in(&text(), Would::Forward) == 1).await,
        "the first's claim counted"
    );
    repeats_past_the_bound_are_counted_without_a_read(&base, text, || {
        late.delay_ms.store(10_000, Ordering::SeqCst)
    })
    .await;
    late.delay_ms.store(0, Ordering::SeqCst);
    assert_forwarded(&slow.await.expect("the first"), 201);
    let _ = stop.send(());
    let _ = served.await;
}

/// On Redis, stalled by SIGSTOP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_repeats_past_the_held_bound_never_read_a_stalled_store() {
    let env = Env::new(Backend::Redis).await;
    let proxy = env.proxy(&burst_config(&env)).await;
    let slow = spawn_booking(proxy.url(""), "obs-burst", SEAT, "3s");
    until_in_flight(&proxy.proxy, "obs-burst").await;
    let text = || proxy.proxy.encode_metrics();
    assert!(
        eventually(LANDS_WITHIN, || would_in(&text(), Would::Forward) == 1).await,
        "the first's claim counted"
    );
    repeats_past_the_bound_are_counted_without_a_read(&proxy.url(""), text, || env.redis().pause())
        .await;
    env.redis().resume();
    assert_forwarded(&slow.await.expect("the first"), 201);
}

/// On PostgreSQL, stalled at its relay (a blackhole: the pool's connections get no answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_repeats_past_the_held_bound_never_read_a_stalled_store() {
    let env = Env::new(Backend::Postgres).await;
    let proxy = env.proxy(&burst_config(&env)).await;
    let slow = spawn_booking(proxy.url(""), "obs-burst", SEAT, "3s");
    until_in_flight(&proxy.proxy, "obs-burst").await;
    let text = || proxy.proxy.encode_metrics();
    assert!(
        eventually(LANDS_WITHIN, || would_in(&text(), Would::Forward) == 1).await,
        "the first's claim counted"
    );
    repeats_past_the_bound_are_counted_without_a_read(&proxy.url(""), text, || {
        env.postgres().relay.blackhole()
    })
    .await;
    env.postgres().relay.pass();
    assert_forwarded(&slow.await.expect("the first"), 201);
}
