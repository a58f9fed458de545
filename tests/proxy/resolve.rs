//! SPEC §4.8, `on_unknown_outcome: resolve`: a request whose response is lost after the
//! upstream may have acted is answered its 502/504 at once, its key held (repeats 409, nothing
//! forwarded) while the proxy asks the upstream's lookup — the mock's
//! `GET /bookings/by-reference/{reference}` — and the answer decides: `found` becomes the key's
//! result (replayed with `Idempotent-Resolved: true`), a final `absent` releases the key so the
//! retry runs once, and lookups that never settle it end as `outcome-unknown`, never forwarded
//! again. Each rule is written once and run on every store (`every_store!`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemproxy::config::Config;
use idemproxy::proxy::Reloaded;

use harness::relay::{Direction, Relay, Tap};
use harness::{Backend, Env, ProxyProcess, Reply, TestProxy, book_with, eventually, every_store};

mod bounded;
mod deadline;
use bounded::a_flood_of_unknown_outcomes_runs_at_most_the_bound;
mod stranded;
use deadline::{
    a_body_cut_off_at_the_deadline_is_never_booked_after_a_final_absent,
    a_holder_stalled_past_its_deadline_writes_nothing,
    a_lookup_value_naming_another_resource_is_refused_before_the_claim,
};
use stranded::a_route_reloaded_from_resolve_to_keep_strands_no_key;

every_store!(
    a_lost_response_is_resolved_to_the_booking_the_lookup_finds,
    a_final_absent_releases_the_key_and_the_retry_books_once,
    an_early_absent_is_not_final_and_a_late_booking_is_found,
    lookups_that_never_answer_end_as_outcome_unknown_and_never_forward,
    lookups_answering_another_status_end_as_outcome_unknown_naming_it,
    a_repeat_during_the_resolution_is_409_and_not_forwarded,
    with_on_conflict_wait_a_repeat_waits_for_the_resolution,
    a_lookup_part_that_cannot_be_read_is_refused_before_the_claim,
    a_request_never_sent_is_released_and_never_resolved,
    a_reload_during_a_resolution_leaves_it_under_what_it_started_with,
    an_observed_route_resolves_in_the_background_and_forwards_repeats,
    a_running_resolution_counts_against_the_observed_bound,
    a_holder_stalled_past_its_deadline_writes_nothing,
    a_body_cut_off_at_the_deadline_is_never_booked_after_a_final_absent,
    a_lookup_value_naming_another_resource_is_refused_before_the_claim,
    a_route_reloaded_from_resolve_to_keep_strands_no_key,
    a_flood_of_unknown_outcomes_runs_at_most_the_bound,
);

const ROUTE: &str = "create-booking";

/// How long a resolution may take to land in these tests' short settings.
const LANDS_WITHIN: Duration = Duration::from_secs(15);

/// The booking body with this reference.
fn booking(reference: &str) -> String {
    format!(r#"{{"seat":"12A","reference":"{reference}"}}"#)
}

/// The harness configuration with `create-booking` resolving by reference, and `lines` added
/// to its idempotency section.
fn resolving(env: &Env, resolve: &str, lines: &str) -> String {
    let yaml = env.config(&format!("on_unknown_outcome: resolve\nresolve:\n{lines}"));
    // The block's own fields, indented under `resolve:` (the harness indents each line of the
    // idempotency section alike).
    let mut block = String::from("        request: GET /bookings/by-reference/{json:/reference}\n");
    for line in resolve.lines().filter(|l| !l.trim().is_empty()) {
        block.push_str("        ");
        block.push_str(line.trim());
        block.push('\n');
    }
    yaml.replacen("      resolve:\n", &format!("      resolve:\n{block}"), 1)
}

/// The bookings the mock made for `reference`, visible to a lookup or not.
fn bookings_for(env: &Env, reference: &str) -> u64 {
    env.mock
        .stats()
        .by_reference
        .get(reference)
        .copied()
        .unwrap_or(0)
}

/// Sends the same booking until the answer is not a 409 (the key being resolved), within
/// [`LANDS_WITHIN`].
async fn retry_until_settled(proxy: &TestProxy, key: &str, body: &str) -> Reply {
    let until = Instant::now() + LANDS_WITHIN;
    loop {
        let reply = book_with(&proxy.url(""), key, body, &[]).await;
        if reply.status != 409 || Instant::now() >= until {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `idemproxy_resolutions_total{result}` of the route.
fn resolutions(proxy: &TestProxy, result: &str) -> u64 {
    proxy.metric(
        "idemproxy_resolutions_total",
        &[("route", ROUTE), ("result", result)],
    ) as u64
}

/// `idemproxy_resolve_lookups_total{answer}` of the route.
fn lookups(proxy: &TestProxy, answer: &str) -> u64 {
    proxy.metric(
        "idemproxy_resolve_lookups_total",
        &[("route", ROUTE), ("answer", answer)],
    ) as u64
}

async fn a_lost_response_is_resolved_to_the_booking_the_lookup_finds(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&resolving(&env, "settle_after: 5s\ninterval: 200ms", ""))
        .await;
    let body = booking("R-found");
    let first = book_with(
        &proxy.url(""),
        "k-found",
        &body,
        &[("X-Mock-Lose-Response", "after")],
    )
    .await;
    let doc = first.assert_problem(502, "upstream-failed");
    assert!(
        doc["detail"]
            .as_str()
            .is_some_and(|d| d.contains("asking the upstream")),
        "the detail says the outcome is being resolved: {doc}"
    );
    let retry = retry_until_settled(&proxy, "k-found", &body).await;
    assert_eq!(retry.status, 200, "the lookup's answer: {:?}", retry.body);
    assert_eq!(retry.header("idempotent-replayed"), "true");
    assert_eq!(retry.header("idempotent-resolved"), "true");
    assert_eq!(retry.json()["request"]["reference"], "R-found");
    assert_eq!(
        bookings_for(&env, "R-found"),
        1,
        "booked once, never forwarded again"
    );
    assert_eq!(resolutions(&proxy, "found"), 1);
    assert!(lookups(&proxy, "found") >= 1);
    // The replay of a resolved key stays the same.
    let again = book_with(&proxy.url(""), "k-found", &body, &[]).await;
    assert_eq!(
        (again.status, again.body.clone()),
        (200, retry.body.clone())
    );
    proxy.stop().await;
}

async fn a_request_never_sent_is_released_and_never_resolved(backend: Backend) {
    let env = Env::new(backend).await;
    // The upstream's address has nobody listening: the connection is refused, so nothing of
    // the request was written and its outcome is known (SPEC §4.4): the claim is released, no
    // lookup is sent, and the retry is tried again rather than held as a resolution.
    let refused = format!("http://127.0.0.1:{}", harness::free_port());
    let yaml = resolving(&env, "settle_after: 5s\ninterval: 200ms", "").replacen(
        &env.mock.url(),
        &refused,
        1,
    );
    let proxy = env.proxy(&yaml).await;
    let body = booking("R-unsent");
    let first = book_with(&proxy.url(""), "k-unsent", &body, &[]).await;
    first.assert_problem(502, "upstream-unavailable");
    let retry = book_with(&proxy.url(""), "k-unsent", &body, &[]).await;
    retry.assert_problem(502, "upstream-unavailable");
    assert!(
        retry.headers.get("idempotent-replayed").is_none(),
        "tried again, not a replay of the first's failure"
    );
    assert_eq!(bookings_for(&env, "R-unsent"), 0);
    // The upstream comes up on that address: the next retry is run by it, not replayed.
    let upstream = tokio::net::TcpListener::bind(refused.trim_start_matches("http://"))
        .await
        .expect("bind the upstream's address");
    let mock = env.mock.addr();
    let forwarding = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = upstream.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(mock).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    let ran = book_with(&proxy.url(""), "k-unsent", &body, &[]).await;
    assert_eq!(ran.status, 201, "run by the upstream: {:?}", ran.body);
    assert!(
        ran.headers.get("idempotent-replayed").is_none(),
        "the upstream's answer, not a replay"
    );
    assert_eq!(
        bookings_for(&env, "R-unsent"),
        1,
        "the upstream ran it once"
    );
    for answer in ["found", "absent", "other", "failed"] {
        assert_eq!(lookups(&proxy, answer), 0, "no lookup sent ({answer})");
    }
    forwarding.abort();
    proxy.stop().await;
}

async fn a_final_absent_releases_the_key_and_the_retry_books_once(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&resolving(&env, "settle_after: 1s\ninterval: 200ms", ""))
        .await;
    let body = booking("R-absent");
    let first = book_with(
        &proxy.url(""),
        "k-absent",
        &body,
        &[("X-Mock-Lose-Response", "before")],
    )
    .await;
    first.assert_problem(502, "upstream-failed");
    assert_eq!(bookings_for(&env, "R-absent"), 0, "lost before the booking");
    assert!(
        eventually(LANDS_WITHIN, || resolutions(&proxy, "absent") == 1).await,
        "the resolution ends absent once settle_after has passed"
    );
    assert!(
        lookups(&proxy, "absent") >= 2,
        "an early absent, then the final one"
    );
    let retry = book_with(&proxy.url(""), "k-absent", &body, &[]).await;
    assert_eq!(retry.status, 201, "the released key runs: {:?}", retry.body);
    assert_eq!(bookings_for(&env, "R-absent"), 1, "one booking in all");
    let replay = book_with(&proxy.url(""), "k-absent", &body, &[]).await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("idempotent-replayed"), "true");
    assert!(replay.headers.get("idempotent-resolved").is_none());
    assert_eq!(bookings_for(&env, "R-absent"), 1);
    proxy.stop().await;
}

async fn an_early_absent_is_not_final_and_a_late_booking_is_found(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&resolving(&env, "settle_after: 5s\ninterval: 200ms", ""))
        .await;
    let body = booking("R-late");
    // The booking is made, its response lost, and a lookup sees it only 1.5s later: the
    // lookups before answer 404, which must not release the key.
    let first = book_with(
        &proxy.url(""),
        "k-late",
        &body,
        &[
            ("X-Mock-Lose-Response", "after"),
            ("X-Mock-Commit-After", "1500ms"),
        ],
    )
    .await;
    first.assert_problem(502, "upstream-failed");
    let retry = retry_until_settled(&proxy, "k-late", &body).await;
    assert_eq!(retry.status, 200, "found once visible: {:?}", retry.body);
    assert_eq!(retry.header("idempotent-resolved"), "true");
    assert!(lookups(&proxy, "absent") >= 1, "it was asked while absent");
    assert_eq!(resolutions(&proxy, "absent"), 0, "never released");
    assert_eq!(bookings_for(&env, "R-late"), 1, "never booked twice");
    proxy.stop().await;
}

async fn lookups_that_never_answer_end_as_outcome_unknown_and_never_forward(backend: Backend) {
    let env = Env::new(backend).await;
    // Lookups go to an upstream nobody listens on: each fails.
    let nowhere = harness::free_port();
    let yaml = resolving(
        &env,
        "upstream: lookups\nsettle_after: 500ms\ninterval: 100ms\ngive_up_after: 1s",
        "",
    )
    .replacen(
        "upstreams:\n",
        &format!(
            "upstreams:\n  lookups:\n    url: http://127.0.0.1:{nowhere}\n    connect_timeout: 100ms\n    timeout: 200ms\n"
        ),
        1,
    );
    let proxy = env.proxy(&yaml).await;
    let body = booking("R-unknown");
    let first = book_with(
        &proxy.url(""),
        "k-unknown",
        &body,
        &[("X-Mock-Lose-Response", "after")],
    )
    .await;
    first.assert_problem(502, "upstream-failed");
    let retry = retry_until_settled(&proxy, "k-unknown", &body).await;
    retry.assert_problem(502, "outcome-unknown");
    assert_eq!(retry.header("idempotent-replayed"), "true");
    assert!(retry.headers.get("idempotent-resolved").is_none());
    assert_eq!(resolutions(&proxy, "gave_up"), 1);
    assert!(lookups(&proxy, "failed") >= 1);
    assert_eq!(bookings_for(&env, "R-unknown"), 1, "never forwarded again");
    proxy.stop().await;
}

/// Lookups that do answer, with a status in neither `found` nor `absent` (here the mock's 200
/// for the booking, on a route that reads only 201 as found), end as `outcome-unknown` too;
/// its detail says what the last lookup answered and points at the lists, not at the network.
async fn lookups_answering_another_status_end_as_outcome_unknown_naming_it(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&resolving(
            &env,
            "found: [201]\nabsent: [404]\nsettle_after: 500ms\ninterval: 100ms\ngive_up_after: 1s",
            "",
        ))
        .await;
    let body = booking("R-other");
    let first = book_with(
        &proxy.url(""),
        "k-other",
        &body,
        &[("X-Mock-Lose-Response", "after")],
    )
    .await;
    first.assert_problem(502, "upstream-failed");
    let retry = retry_until_settled(&proxy, "k-other", &body).await;
    let doc = retry.assert_problem(502, "outcome-unknown");
    let detail = doc["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("answered status 200")
            && detail.contains("resolve.found [201]")
            && detail.contains("resolve.absent [404]"),
        "{detail}"
    );
    assert!(!detail.contains("no answer"), "{detail}");
    assert!(lookups(&proxy, "other") >= 1);
    assert_eq!(lookups(&proxy, "failed"), 0);
    assert_eq!(bookings_for(&env, "R-other"), 1, "never forwarded again");
    proxy.stop().await;
}

async fn a_repeat_during_the_resolution_is_409_and_not_forwarded(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&resolving(&env, "settle_after: 10s\ninterval: 200ms", ""))
        .await;
    let body = booking("R-held");
    let first = book_with(
        &proxy.url(""),
        "k-held",
        &body,
        &[
            ("X-Mock-Lose-Response", "after"),
            ("X-Mock-Commit-After", "3s"),
        ],
    )
    .await;
    first.assert_problem(502, "upstream-failed");
    let posts = env.mock.calls("k-held");
    let repeat = book_with(&proxy.url(""), "k-held", &body, &[]).await;
    repeat.assert_problem(409, "request-in-progress");
    assert!(
        !repeat.header("retry-after").is_empty(),
        "409 with Retry-After"
    );
    assert_eq!(
        env.mock.calls("k-held"),
        posts,
        "the repeat was not forwarded"
    );
    let settled = retry_until_settled(&proxy, "k-held", &body).await;
    assert_eq!(settled.status, 200);
    assert_eq!(bookings_for(&env, "R-held"), 1);
    proxy.stop().await;
}

async fn with_on_conflict_wait_a_repeat_waits_for_the_resolution(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&resolving(
            &env,
            "settle_after: 5s\ninterval: 200ms",
            "on_conflict: wait\nwait_timeout: 10s\n",
        ))
        .await;
    let body = booking("R-wait");
    let first = book_with(
        &proxy.url(""),
        "k-wait",
        &body,
        &[
            ("X-Mock-Lose-Response", "after"),
            ("X-Mock-Commit-After", "1s"),
        ],
    )
    .await;
    first.assert_problem(502, "upstream-failed");
    let waited = book_with(&proxy.url(""), "k-wait", &body, &[]).await;
    assert_eq!(
        waited.status, 200,
        "the repeat waited for the answer: {:?}",
        waited.body
    );
    assert_eq!(waited.header("idempotent-resolved"), "true");
    assert_eq!(bookings_for(&env, "R-wait"), 1);
    proxy.stop().await;
}

async fn a_lookup_part_that_cannot_be_read_is_refused_before_the_claim(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&resolving(&env, "settle_after: 5s", "")).await;
    // No `reference` in the body: the lookup could never be sent, so nothing is claimed.
    let refused = book_with(&proxy.url(""), "k-noref", r#"{"seat":"12A"}"#, &[]).await;
    let doc = refused.assert_problem(400, "unreadable-key-part");
    assert!(
        doc["detail"]
            .as_str()
            .is_some_and(|d| d.contains("json:/reference")),
        "the detail names the part: {doc}"
    );
    assert_eq!(env.mock.calls("k-noref"), 0, "nothing forwarded");
    // Nothing claimed: the same key with a readable body runs.
    let body = booking("R-noref");
    let ran = book_with(&proxy.url(""), "k-noref", &body, &[]).await;
    assert_eq!(ran.status, 201, "{:?}", ran.body);
    proxy.stop().await;
}

async fn a_reload_during_a_resolution_leaves_it_under_what_it_started_with(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&resolving(&env, "settle_after: 10s\ninterval: 200ms", ""))
        .await;
    let body = booking("R-reload");
    let first = book_with(
        &proxy.url(""),
        "k-reload",
        &body,
        &[
            ("X-Mock-Lose-Response", "after"),
            ("X-Mock-Commit-After", "1500ms"),
        ],
    )
    .await;
    first.assert_problem(502, "upstream-failed");
    // A reload that would end a resolution at once (absent final at once, giving up at once)
    // applies only to resolutions that start after it.
    let changed = resolving(
        &env,
        "settle_after: 200ms\ninterval: 200ms\ngive_up_after: 200ms",
        "",
    );
    let config = Config::from_yaml(&changed).expect("valid");
    let reloaded = proxy.proxy.reload(config);
    assert!(matches!(reloaded, Reloaded::Applied(_)), "{reloaded:?}");
    let settled = retry_until_settled(&proxy, "k-reload", &body).await;
    assert_eq!(
        settled.status, 200,
        "found under the first times: {:?}",
        settled.body
    );
    assert_eq!(settled.header("idempotent-resolved"), "true");
    assert_eq!(resolutions(&proxy, "gave_up"), 0);
    assert_eq!(bookings_for(&env, "R-reload"), 1);
    proxy.stop().await;
}

async fn an_observed_route_resolves_in_the_background_and_forwards_repeats(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env
        .proxy(&resolving(
            &env,
            "settle_after: 10s\ninterval: 200ms",
            "mode: observe\n",
        ))
        .await;
    let body = booking("R-observed");
    let first = book_with(
        &proxy.url(""),
        "k-observed",
        &body,
        &[("X-Mock-Lose-Response", "after")],
    )
    .await;
    assert_eq!(first.status, 502, "{:?}", first.body);
    assert!(
        eventually(LANDS_WITHIN, || resolutions(&proxy, "found") == 1).await,
        "the observed route resolved the key in the background"
    );
    // Observe forwards every request: the repeat runs, and is counted as a replay of the
    // resolved result.
    let repeat = book_with(&proxy.url(""), "k-observed", &body, &[]).await;
    assert_eq!(repeat.status, 201, "forwarded: {:?}", repeat.body);
    assert!(repeat.headers.get("idempotent-replayed").is_none());
    assert_eq!(
        bookings_for(&env, "R-observed"),
        2,
        "observe forwards every request"
    );
    proxy.stop().await;
}

async fn a_running_resolution_counts_against_the_observed_bound(backend: Backend) {
    let env = Env::new(backend).await;
    // Lookups go through a relay that keeps what the proxy asked, to tell whose they were.
    let asked = Arc::new(Asked::default());
    let relay = Relay::start_with_tap(env.mock.addr(), asked.clone()).await;
    let yaml = resolving(
        &env,
        "upstream: lookups\nsettle_after: 10s\ninterval: 200ms",
        "mode: observe\n",
    )
    .replacen(
        "upstreams:\n",
        &format!(
            "limits:\n  max_detached_exchanges: 1\nupstreams:\n  lookups:\n    url: http://{}\n",
            relay.addr()
        ),
        1,
    );
    let proxy = env.proxy(&yaml).await;
    // The first resolution runs until its booking becomes visible, 2s on: it fills the bound.
    let slow = booking("R-bound-1");
    let first = book_with(
        &proxy.url(""),
        "k-bound-1",
        &slow,
        &[
            ("X-Mock-Lose-Response", "after"),
            ("X-Mock-Commit-After", "2s"),
        ],
    )
    .await;
    assert_eq!(first.status, 502);
    assert!(
        eventually(LANDS_WITHIN, || lookups(&proxy, "absent") >= 1).await,
        "the first resolution is running"
    );
    // The second, past the bound, is forwarded without a claim (as observe does at its
    // bound): never asked about.
    let second = book_with(
        &proxy.url(""),
        "k-bound-2",
        &booking("R-bound-2"),
        &[("X-Mock-Lose-Response", "after")],
    )
    .await;
    assert_eq!(second.status, 502);
    assert_eq!(bookings_for(&env, "R-bound-2"), 1, "forwarded all the same");
    // Every resolution has ended once none runs and the first's booking was found (a
    // resolution of the second, had it started, would have found its booking at once).
    let running = || proxy.metric("idemproxy_resolutions_running", &[]) as u64;
    assert!(
        eventually(LANDS_WITHIN, || asked.about("R-bound-1", "200")
            && resolutions(&proxy, "found") >= 1
            && running() == 0)
        .await,
        "the first resolution ends found"
    );
    assert!(
        !asked.about("R-bound-2", ""),
        "no lookup was ever sent for the second request's reference"
    );
    assert_eq!(
        resolutions(&proxy, "found"),
        1,
        "the second was not resolved"
    );
    assert_eq!(lookups(&proxy, "found"), 1);
    proxy.stop().await;
}

/// What the proxy asked through a relay in front of the lookups' upstream, and what each
/// answer's status line said: the first 1 MiB each way, in order.
#[derive(Default)]
struct Asked(std::sync::Mutex<(String, String)>);

impl Tap for Asked {
    fn forwarded(&self, _conn: u64, dir: Direction, bytes: &[u8]) {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let side = match dir {
            Direction::Up => &mut kept.0,
            Direction::Down => &mut kept.1,
        };
        if side.len() < 1 << 20 {
            side.push_str(&String::from_utf8_lossy(bytes));
        }
    }
}

impl Asked {
    /// Whether a lookup for `reference` was sent and, when `status` is not empty, whether
    /// some lookup was answered with it.
    fn about(&self, reference: &str, status: &str) -> bool {
        let kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        kept.0
            .contains(&format!("GET /bookings/by-reference/{reference} "))
            && (status.is_empty() || kept.1.contains(&format!("HTTP/1.1 {status} ")))
    }
}

/// The stores whose records outlive the proxy (SPEC §4.6): a proxy SIGKILLed mid-request or
/// mid-resolution, started again on the same store, resolves the key and never forwards it
/// twice.
macro_rules! across_restarts {
    ($($module:ident: $backend:ident),* $(,)?) => {
        $(
            mod $module {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn a_proxy_killed_mid_request_is_resolved_after_its_restart() {
                    super::killed(harness::Backend::$backend, super::Killed::MidRequest).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn a_proxy_killed_mid_resolution_is_resolved_after_its_restart() {
                    super::killed(harness::Backend::$backend, super::Killed::MidResolution).await
                }
            }
        )*
    };
}

across_restarts!(restart_sqlite: Sqlite, restart_postgres: Postgres, restart_redis: Redis);

/// Two instances on one store: after the holder dies, repeats to both race to take the claim
/// over, and exactly one resolves it (the takeover is the claim's atomic step).
async fn two_instances_never_both_resolve_one_key(backend: Backend) {
    let env = Env::new(backend).await;
    let yaml = resolving(
        &env,
        "settle_after: 30s\ninterval: 200ms\ngive_up_after: 1m",
        "lock_ttl: 2s\n",
    );
    let mut victim = ProxyProcess::spawn(&yaml);
    let (key, reference) = ("k-two", "R-two");
    let body = booking(reference);
    let first = book_with(
        &victim.url(""),
        key,
        &body,
        &[
            ("X-Mock-Lose-Response", "after"),
            ("X-Mock-Commit-After", "3s"),
        ],
    )
    .await;
    first.assert_problem(502, "upstream-failed");
    kill(&mut victim);
    let (b, c) = (env.proxy(&yaml).await, env.proxy(&yaml).await);
    let (on_b, on_c) = tokio::join!(
        retry_until_settled(&b, key, &body),
        retry_until_settled(&c, key, &body)
    );
    for reply in [&on_b, &on_c] {
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        assert_eq!(reply.header("idempotent-resolved"), "true");
    }
    assert_eq!(on_b.body, on_c.body, "one result");
    let resolved = resolutions(&b, "found") + resolutions(&c, "found");
    assert_eq!(resolved, 1, "exactly one instance resolved the key");
    assert_eq!(bookings_for(&env, reference), 1, "never forwarded twice");
    b.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_redis_never_both_resolve_one_key() {
    two_instances_never_both_resolve_one_key(Backend::Redis).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_redis_a_stalled_holder_writes_nothing() {
    deadline::two_instances_a_stalled_holder_writes_nothing(Backend::Redis).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_postgres_a_stalled_holder_writes_nothing() {
    deadline::two_instances_a_stalled_holder_writes_nothing(Backend::Postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_postgres_never_both_resolve_one_key() {
    two_instances_never_both_resolve_one_key(Backend::Postgres).await
}

/// A drain (SIGTERM) waits for a running resolution, within `shutdown_timeout`: the proxy
/// exits once the lookup has found the booking, and the proxy started again on the file
/// replays it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_waits_for_a_running_resolution() {
    let env = Env::new(Backend::Sqlite).await;
    let yaml = resolving(&env, "settle_after: 30s\ninterval: 200ms", "");
    let port = harness::free_port();
    let mut proxy = ProxyProcess::spawn_on(&yaml, port);
    let body = booking("R-drain");
    let first = book_with(
        &proxy.url(""),
        "k-drain",
        &body,
        &[
            ("X-Mock-Lose-Response", "after"),
            ("X-Mock-Commit-After", "1500ms"),
        ],
    )
    .await;
    first.assert_problem(502, "upstream-failed");
    let draining = Instant::now();
    proxy.signal("-TERM");
    let code = proxy.wait(Duration::from_secs(10));
    assert_eq!(code, Some(0), "a clean exit:\n{}", proxy.log());
    assert!(
        draining.elapsed() >= Duration::from_millis(800),
        "the drain waited for the lookup to find the booking"
    );
    assert!(
        proxy.log().contains("result=\"found\""),
        "resolved before the exit:\n{}",
        proxy.log()
    );
    let again = ProxyProcess::spawn_on(&yaml, port);
    let replay = book_with(&again.url(""), "k-drain", &body, &[]).await;
    assert_eq!(replay.status, 200, "{:?}", replay.body);
    assert_eq!(replay.header("idempotent-resolved"), "true");
    assert_eq!(bookings_for(&env, "R-drain"), 1);
}

/// When the proxy dies.
enum Killed {
    /// While the upstream call is running (the booking made, the response not yet sent).
    MidRequest,
    /// After the first client got its 502, while the lookups still answer 404.
    MidResolution,
}

/// SIGKILL, and wait for the process to be gone.
fn kill(proxy: &mut ProxyProcess) {
    proxy.signal("-KILL");
    // A process killed by a signal has no exit code: `wait` reaps it and answers `None`.
    let _ = proxy.wait(Duration::from_secs(5));
}

async fn killed(backend: Backend, when: Killed) {
    let env = Env::new(backend).await;
    let yaml = resolving(
        &env,
        "settle_after: 30s\ninterval: 200ms\ngive_up_after: 1m",
        "lock_ttl: 2s\n",
    );
    let port = harness::free_port();
    let mut victim = ProxyProcess::spawn_on(&yaml, port);
    let (key, reference) = ("k-killed", "R-killed");
    let body = booking(reference);
    match when {
        Killed::MidRequest => {
            let url = victim.url("");
            let body = body.clone();
            // Fails when the process dies; only the side effect matters.
            tokio::spawn(async move {
                let _ = harness::send(
                    harness::client()
                        .post(format!("{url}/bookings"))
                        .header("Idempotency-Key", key)
                        .header("Content-Type", "application/json")
                        .header("X-Mock-Hang", "30s")
                        .body(body),
                )
                .await;
            });
            assert!(
                eventually(Duration::from_secs(5), || bookings_for(&env, reference)
                    == 1)
                .await,
                "the booking was made"
            );
        }
        Killed::MidResolution => {
            let first = book_with(
                &victim.url(""),
                key,
                &body,
                &[
                    ("X-Mock-Lose-Response", "after"),
                    ("X-Mock-Commit-After", "6s"),
                ],
            )
            .await;
            first.assert_problem(502, "upstream-failed");
            // A lookup or two answered 404.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    kill(&mut victim);

    let proxy = ProxyProcess::spawn_on(&yaml, port);
    let until = Instant::now() + Duration::from_secs(30);
    let settled = loop {
        let reply = book_with(&proxy.url(""), key, &body, &[]).await;
        if reply.status != 409 || Instant::now() >= until {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        settled.status,
        200,
        "the restarted proxy resolved the key to the booking: {:?}\n{}",
        settled.body,
        proxy.log()
    );
    assert_eq!(settled.header("idempotent-resolved"), "true");
    assert_eq!(bookings_for(&env, reference), 1, "never forwarded twice");
    assert!(
        proxy.log().contains("taken over"),
        "the restarted proxy took the claim over:\n{}",
        proxy.log()
    );
}
