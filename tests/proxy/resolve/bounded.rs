//! SPEC §4.8, "Bounded": at most `limits.max_resolutions` resolutions run at once on one
//! instance. A flood of unknown outcomes past the bound leaves the extra keys held in the
//! store (counted), and each is resolved when a repeat of its key takes it over.

use std::time::Duration;

use harness::{Backend, Env, book_with};

use super::{booking, bookings_for, resolving, retry_until_settled};

/// Unknown outcomes at once, against a bound of [`BOUND`].
const FLOOD: usize = 8;
const BOUND: usize = 2;

pub(super) async fn a_flood_of_unknown_outcomes_runs_at_most_the_bound(backend: Backend) {
    let env = Env::new(backend).await;
    let yaml = resolving(
        &env,
        "settle_after: 10s\ninterval: 200ms\ngive_up_after: 1m",
        "lock_ttl: 1s\n",
    )
    .replacen(
        "upstreams:\n",
        &format!("limits:\n  max_resolutions: {BOUND}\nupstreams:\n"),
        1,
    );
    let proxy = env.proxy(&yaml).await;
    let running = || proxy.metric("idemproxy_resolutions_running", &[]) as usize;
    let keys: Vec<(String, String)> = (0..FLOOD)
        .map(|i| (format!("k-flood-{i}"), format!("R-flood-{i}")))
        .collect();
    // Each booking is made, its response lost, and it becomes visible to a lookup 2s later:
    // every resolution keeps asking meanwhile.
    let mut most = 0;
    for (key, reference) in &keys {
        let first = book_with(
            &proxy.url(""),
            key,
            &booking(reference),
            &[
                ("X-Mock-Lose-Response", "after"),
                ("X-Mock-Commit-After", "2s"),
            ],
        )
        .await;
        first.assert_problem(502, "upstream-failed");
        most = most.max(running());
    }
    for _ in 0..20 {
        most = most.max(running());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(most, BOUND, "resolutions ran at the bound, never past it");
    assert_eq!(
        proxy.metric("idemproxy_resolutions_deferred_total", &[]) as usize,
        FLOOD - BOUND,
        "the ones past the bound were left held, counted"
    );
    // Every key ends found, the ones left held taken over by their repeats.
    for (key, reference) in &keys {
        let settled = retry_until_settled(&proxy, key, &booking(reference)).await;
        assert_eq!(settled.status, 200, "{key}: {:?}", settled.body);
        assert_eq!(settled.header("idempotent-resolved"), "true");
        assert_eq!(bookings_for(&env, reference), 1, "{key}: one booking");
        most = most.max(running());
    }
    assert!(most <= BOUND, "never past the bound: {most}");
    proxy.stop().await;
}
