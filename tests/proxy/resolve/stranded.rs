//! SPEC §4.8: a record that carries a lookup is taken over and resolved as it says, whatever
//! the route's policy is now. A route reloaded from `resolve` to `keep` while a holder is dead
//! (stalled past its lease at the test pause point) strands no key: the repeat takes the claim
//! over, resolves it by the statuses and times its record carries, and a key being resolved is
//! answered `409` saying so, with its next lookup.

use std::time::{Duration, Instant};

use harness::{Backend, Env, book_with, eventually};
use idemproxy::config::Config;
use idemproxy::proxy::Reloaded;

use super::{booking, bookings_for, resolving};

pub(super) async fn a_route_reloaded_from_resolve_to_keep_strands_no_key(backend: Backend) {
    let env = Env::new(backend).await;
    let short = |yaml: String| yaml.replacen("    timeout: 5s\n", "    timeout: 2s\n", 1);
    let proxy = env
        .proxy(&short(resolving(
            &env,
            "settle_after: 1s\ninterval: 200ms\ngive_up_after: 1m",
            "lock_ttl: 1s\n",
        )))
        .await;
    let (key, reference) = (format!("k-stranded-{}", backend.name()), "R-stranded");
    let body = booking(reference);
    // The holder claims and stalls: it never renews its lease, as if it had died.
    idemproxy::proxy::pause::arm_after_claim(&key, Duration::from_secs(7));
    let stalled = {
        let (url, key, body) = (proxy.url(""), key.clone(), body.clone());
        tokio::spawn(async move { book_with(&url, &key, &body, &[]).await })
    };
    // Once it holds the claim, the route is reloaded under it.
    let claimed = || {
        proxy.metric(
            "idemproxy_store_operation_duration_seconds_count",
            &[("op", "claim")],
        ) >= 1.0
    };
    assert!(
        eventually(Duration::from_secs(5), claimed).await,
        "the holder claimed the key"
    );
    let keep = short(env.config("on_unknown_outcome: keep\nlock_ttl: 1s\n"));
    let reloaded = proxy.proxy.reload(Config::from_yaml(&keep).expect("valid"));
    assert!(matches!(reloaded, Reloaded::Applied(_)), "{reloaded:?}");
    // Past the lease: the repeat, on a route under keep now, takes the claim over.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let until = Instant::now() + Duration::from_secs(15);
    let mut said_resolving = false;
    let settled = loop {
        let reply = book_with(&proxy.url(""), &key, &body, &[]).await;
        if reply.status == 409 {
            let doc = reply.assert_problem(409, "request-in-progress");
            let detail = doc["detail"].as_str().unwrap_or_default().to_owned();
            assert!(!detail.contains("lock_ttl"), "{detail}");
            said_resolving |= detail.contains("being resolved") && detail.contains("next at");
        }
        if reply.status != 409 || Instant::now() >= until {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        settled.status, 201,
        "absent for good (its record's statuses and times), released, and the retry booked: {:?}",
        settled.body
    );
    assert!(said_resolving, "a 409 said the key was being resolved");
    let woke = stalled.await.expect("the stalled request");
    woke.assert_problem(502, "upstream-unavailable");
    assert_eq!(bookings_for(&env, reference), 1, "one booking");
    proxy.stop().await;
}
