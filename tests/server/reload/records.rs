//! What a reload does to requests and records: a request in flight finishes under its own
//! configuration and saves; a route keeps its records as long as it keeps its name, wherever
//! it moves in the file; a renamed route starts afresh; a route made idempotent replays.

use std::time::Duration;

use idemproxy::metrics::Outcome;

use super::{BOOKINGS, PAY, PLAIN_BOOKINGS, REST, reload, reloads, yaml};
use harness::every_store;
use harness::{Backend, Env, Reply, book, client, eventually, send, spawn_booking};

every_store!(
    a_request_in_flight_across_a_reload_gets_its_answer_and_its_record_is_saved,
    reordered_routes_keep_their_own_records_and_a_new_route_sees_none,
    a_renamed_route_starts_its_records_afresh_and_the_old_name_keeps_its_own,
    a_route_made_idempotent_by_a_reload_replays_from_then_on,
);

/// The mock's booking under the route `create-booking` with a longer `ttl` and `lock_ttl`.
const BOOKINGS_CHANGED: &str = "  - name: create-booking\n    methods: [POST]\n    path: /bookings\n    upstream: booking\n    idempotency:\n      ttl: 2h\n      lock_ttl: 5s\n";

/// Asserts `repeat` is a replay of `first`: the status, headers and body byte for byte.
fn assert_replay_of(repeat: &Reply, first: &Reply) {
    assert_eq!(repeat.status, first.status, "status of the replay");
    assert_eq!(repeat.header("idempotent-replayed"), "true", "a replay");
    assert_eq!(repeat.body, first.body, "the first response's bytes");
    assert_eq!(
        repeat.header_lines(),
        first.header_lines(),
        "the first response's headers"
    );
}

/// Asserts `reply` is a first response (forwarded), with `status`.
fn assert_forwarded(reply: &Reply, status: u16) {
    assert_eq!(reply.status, status, "body: {:?}", reply.body);
    assert_eq!(reply.header("idempotent-replayed"), "", "not a replay");
}

/// `POST {proxy}/pay/x` with a key.
async fn pay(base: &str, key: &str) -> Reply {
    send(
        client()
            .post(format!("{base}/pay/x"))
            .header("Idempotency-Key", key)
            .body("{}"),
    )
    .await
}

async fn a_request_in_flight_across_a_reload_gets_its_answer_and_its_record_is_saved(
    backend: Backend,
) {
    let env = Env::new(backend).await;
    let p = env.proxy(&yaml(&env, "", "", &[BOOKINGS, REST])).await;
    let body = r#"{"seat":"1A"}"#;
    let first = spawn_booking(p.url(""), "in-flight", body, "1s");
    assert!(
        eventually(Duration::from_secs(5), || env.mock.calls("in-flight") == 1).await,
        "the first request reached the upstream"
    );
    // The new file changes the route's policy and the upstream's settings (a new client and
    // pool): the request in flight keeps its route, its client, its lease and its save.
    let changes = reload(
        &p,
        &yaml(
            &env,
            "",
            "    pool_idle_timeout: 2s\n",
            &[PAY, BOOKINGS_CHANGED, REST],
        ),
    );
    assert_eq!(changes.routes_changed, ["create-booking"], "{changes}");
    assert_eq!(changes.upstreams_changed, ["booking"], "{changes}");
    let first = first.await.expect("the first request's task");
    assert_forwarded(&first, 201);
    let repeat = book(&p, "in-flight", body).await;
    assert_replay_of(&repeat, &first);
    assert_eq!(env.mock.calls("in-flight"), 1, "the operation ran once");
    assert_eq!(p.requests("create-booking", Outcome::Forwarded), 1);
    assert_eq!(p.requests("create-booking", Outcome::Replayed), 1);
    assert_eq!(p.lost_leases(), 0);
    assert_eq!(reloads(&p, "applied"), 1);

    // A reload that removes the route under a request in flight: it still completes and
    // saves, and the route, back under its name, replays it.
    let first = spawn_booking(p.url(""), "route-removed", body, "1s");
    assert!(
        eventually(Duration::from_secs(5), || env.mock.calls("route-removed")
            == 1)
        .await,
        "the first request reached the upstream"
    );
    let changes = reload(&p, &yaml(&env, "", "", &[REST]));
    assert_eq!(
        changes.routes_removed,
        ["pay", "create-booking"],
        "{changes}"
    );
    let first = first.await.expect("the first request's task");
    assert_forwarded(&first, 201);
    reload(&p, &yaml(&env, "", "", &[BOOKINGS, REST]));
    assert_replay_of(&book(&p, "route-removed", body).await, &first);
    assert_eq!(env.mock.calls("route-removed"), 1, "the operation ran once");
    assert_eq!(p.lost_leases(), 0);
}

async fn reordered_routes_keep_their_own_records_and_a_new_route_sees_none(backend: Backend) {
    let env = Env::new(backend).await;
    let p = env.proxy(&yaml(&env, "", "", &[BOOKINGS, PAY, REST])).await;
    let booked = book(&p, "same", "{}").await;
    assert_forwarded(&booked, 201);
    let paid = pay(&p.url(""), "same").await;
    assert_forwarded(&paid, 200);
    assert_ne!(booked.body, paid.body, "two operations, two responses");
    // A new idempotent route first, then the two swapped: by position, every route would now
    // name another's records (the memory store keys them by route number).
    let first = "  - name: first\n    path: /first\n    upstream: booking\n    idempotency: {}\n";
    let changes = reload(&p, &yaml(&env, "", "", &[first, PAY, BOOKINGS, REST]));
    assert_eq!(changes.routes_added, ["first"], "{changes}");
    assert!(changes.routes_reordered, "{changes}");
    assert_replay_of(&book(&p, "same", "{}").await, &booked);
    assert_replay_of(&pay(&p.url(""), "same").await, &paid);
    let fresh = send(
        client()
            .post(p.url("/first"))
            .header("Idempotency-Key", "same")
            .body("{}"),
    )
    .await;
    assert_forwarded(&fresh, 200);
    assert_eq!(
        env.mock.calls("same"),
        3,
        "once per route, never replayed across routes"
    );
    // And back: each still replays its own.
    reload(&p, &yaml(&env, "", "", &[BOOKINGS, PAY, REST]));
    assert_replay_of(&book(&p, "same", "{}").await, &booked);
    assert_replay_of(&pay(&p.url(""), "same").await, &paid);
    assert_eq!(env.mock.calls("same"), 3);
}

async fn a_renamed_route_starts_its_records_afresh_and_the_old_name_keeps_its_own(
    backend: Backend,
) {
    let env = Env::new(backend).await;
    let p = env.proxy(&yaml(&env, "", "", &[BOOKINGS, REST])).await;
    let first = book(&p, "renamed", "{}").await;
    assert_forwarded(&first, 201);
    // The name is in every store key (SPEC §4.1): a new name is a new namespace of records.
    let renamed = BOOKINGS.replace("create-booking", "bookings-v2");
    let changes = reload(&p, &yaml(&env, "", "", &[&renamed, REST]));
    assert_eq!(changes.routes_added, ["bookings-v2"], "{changes}");
    assert_eq!(changes.routes_removed, ["create-booking"], "{changes}");
    let again = book(&p, "renamed", "{}").await;
    assert_forwarded(&again, 201);
    assert_ne!(again.body, first.body, "a new booking");
    assert_replay_of(&book(&p, "renamed", "{}").await, &again);
    assert_eq!(env.mock.calls("renamed"), 2);
    // The old name back: its records were kept (within their ttl).
    reload(&p, &yaml(&env, "", "", &[BOOKINGS, REST]));
    assert_replay_of(&book(&p, "renamed", "{}").await, &first);
    assert_eq!(env.mock.calls("renamed"), 2);
}

async fn a_route_made_idempotent_by_a_reload_replays_from_then_on(backend: Backend) {
    let env = Env::new(backend).await;
    let p = env
        .proxy(&yaml(&env, "", "", &[PLAIN_BOOKINGS, REST]))
        .await;
    assert_forwarded(&book(&p, "before", "{}").await, 201);
    assert_forwarded(&book(&p, "before", "{}").await, 201);
    assert_eq!(
        env.mock.calls("before"),
        2,
        "passed through: no idempotency yet"
    );
    let changes = reload(&p, &yaml(&env, "", "", &[BOOKINGS, REST]));
    assert_eq!(changes.routes_changed, ["create-booking"], "{changes}");
    // Nothing was saved under the key while the route passed requests through.
    let first = book(&p, "before", "{}").await;
    assert_forwarded(&first, 201);
    assert_replay_of(&book(&p, "before", "{}").await, &first);
    assert_eq!(env.mock.calls("before"), 3);
    let missing = send(client().post(p.url("/bookings")).body("{}")).await;
    missing.assert_problem(400, "missing-idempotency-key");
    assert_eq!(env.mock.calls("before"), 3);
}
