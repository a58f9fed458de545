//! The flow of a webhook route on every store: verified first, then run once per event id.

use std::sync::Arc;
use std::time::Duration;

use harness::every_store;
use harness::{Backend, Env, TestProxy};
use idemproxy::config::Config;
use idemproxy::metrics::Outcome;
use idemproxy::proxy::Reloaded;

use super::support::{Secret, SecretsFile, deliver, deliver_signed, handled, now, webhooks, yaml};

every_store!(
    a_redelivery_gets_the_saved_answer_and_the_handler_runs_once,
    a_forgery_with_a_real_event_id_is_refused_and_the_genuine_delivery_runs,
    every_bad_signature_is_a_401_that_claims_nothing,
    both_secrets_of_a_rotation_verify_until_a_reload_drops_one,
    a_handler_failure_releases_the_event_for_its_redelivery,
    a_redelivery_while_the_first_runs_is_a_409_with_retry_after,
    a_burst_of_duplicates_runs_each_event_once,
    signatures_are_checked_in_observe_mode_too,
    a_verified_delivery_without_an_id_is_forwarded_unprotected,
);

const BODY: &str = r#"{"type":"invoice.paid","data":{"amount":2400}}"#;

async fn a_redelivery_gets_the_saved_answer_and_the_handler_runs_once(backend: Backend) {
    let env = Env::new(backend).await;
    let secret = Secret::new(b"the route's secret");
    let file = SecretsFile::new(&[&secret]);
    let proxy = env.proxy(&yaml(&env, &file, "")).await;
    let ts = now();
    let first = deliver(&proxy, &secret, "msg_1", ts, BODY, &[]).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    assert_eq!(first.header("idempotent-replayed"), "");
    // The provider's own retry: a fresh timestamp, so a fresh signature; a key header of its
    // own plays no part.
    let again = deliver(
        &proxy,
        &secret,
        "msg_1",
        ts - 1,
        BODY,
        &[("idempotency-key", "something-else")],
    )
    .await;
    assert_eq!(again.status, 200, "{:?}", again.body);
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.body, first.body, "the saved answer, byte for byte");
    assert_eq!(handled(&env, "msg_1"), 1, "the handler ran once");
    // The body and the provider's headers reached the handler as sent.
    let seen = env.mock.last_request().expect("the handler saw it");
    assert_eq!(seen.body.as_ref(), BODY.as_bytes());
    for name in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
        assert!(seen.headers.contains_key(name), "{name} forwarded");
    }
    assert_eq!(webhooks(&proxy, "verified"), 2);
    // Another event runs on its own.
    let other = deliver(&proxy, &secret, "msg_2", now(), BODY, &[]).await;
    assert_eq!(other.status, 200);
    assert_eq!(handled(&env, "msg_2"), 1);
}

async fn a_forgery_with_a_real_event_id_is_refused_and_the_genuine_delivery_runs(backend: Backend) {
    let env = Env::new(backend).await;
    let secret = Secret::new(b"the route's secret");
    let file = SecretsFile::new(&[&secret]);
    let proxy = env.proxy(&yaml(&env, &file, "")).await;
    let forger = Secret::new(b"a guess");
    let forged = deliver(&proxy, &forger, "msg_real", now(), BODY, &[]).await;
    let doc = forged.assert_problem(401, "webhook-signature-invalid");
    let detail = doc["detail"].as_str().unwrap_or_default().to_owned();
    assert!(detail.contains("bad signature"), "{detail}");
    assert!(
        !detail.contains(&secret.written) && !detail.contains("v1,"),
        "{detail}"
    );
    assert_eq!(handled(&env, "msg_real"), 0, "nothing forwarded");
    // Nothing claimed: the genuine delivery is run, neither a 409 nor a replay.
    let genuine = deliver(&proxy, &secret, "msg_real", now(), BODY, &[]).await;
    assert_eq!(genuine.status, 200, "{:?}", genuine.body);
    assert_eq!(
        genuine.header("idempotent-replayed"),
        "",
        "run, not replayed"
    );
    assert_eq!(handled(&env, "msg_real"), 1);
    assert_eq!(webhooks(&proxy, "bad_signature"), 1);
}

async fn every_bad_signature_is_a_401_that_claims_nothing(backend: Backend) {
    let env = Env::new(backend).await;
    let secret = Secret::new(b"the route's secret");
    let file = SecretsFile::new(&[&secret]);
    let proxy = env.proxy(&yaml(&env, &file, "")).await;
    let stale_ts = now() - 600;
    let stale = secret.sign("msg_1", stale_ts, BODY);
    let cases: [(&str, u64, Option<&str>, &str); 4] = [
        ("stale", stale_ts, Some(&stale), "stale signature"),
        ("missing", now(), None, "missing signature"),
        (
            "malformed",
            now(),
            Some("v1,not base64!"),
            "malformed signature",
        ),
        (
            "malformed version",
            now(),
            Some("v9,AAAA"),
            "malformed signature",
        ),
    ];
    for (what, ts, signature, words) in cases {
        let r = deliver_signed(&proxy, "msg_1", ts, signature, BODY, &[]).await;
        let doc = r.assert_problem(401, "webhook-signature-invalid");
        let detail = doc["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(words), "{what}: {detail}");
    }
    let wrong = Secret::new(b"another route's secret");
    let r = deliver(&proxy, &wrong, "msg_1", now(), BODY, &[]).await;
    r.assert_problem(401, "webhook-signature-invalid");
    assert_eq!(env.mock.stats().webhooks, 0, "nothing forwarded");
    assert_eq!(webhooks(&proxy, "stale"), 1);
    assert_eq!(webhooks(&proxy, "missing_signature"), 1);
    assert_eq!(webhooks(&proxy, "bad_signature"), 3);
    assert_eq!(
        webhooks(&proxy, "verified"),
        0,
        "served at 0 from the start"
    );
    // Nothing claimed: the genuine delivery is run, neither a 409 nor a replay.
    let genuine = deliver(&proxy, &secret, "msg_1", now(), BODY, &[]).await;
    assert_eq!(genuine.status, 200, "{:?}", genuine.body);
    assert_eq!(genuine.header("idempotent-replayed"), "");
    assert_eq!(handled(&env, "msg_1"), 1);
}

async fn both_secrets_of_a_rotation_verify_until_a_reload_drops_one(backend: Backend) {
    let env = Env::new(backend).await;
    let old = Secret::new(b"the old secret");
    let new = Secret::new(b"the new secret");
    let file = SecretsFile::new(&[&old, &new]);
    let config = yaml(&env, &file, "");
    let proxy = env.proxy(&config).await;
    for (id, secret) in [("msg_old", &old), ("msg_new", &new)] {
        let r = deliver(&proxy, secret, id, now(), BODY, &[]).await;
        assert_eq!(r.status, 200, "{id}: {:?}", r.body);
    }
    // The rotation done: the file holds the new secret only, and a reload reads it again.
    file.write(&[&new]);
    reload(&proxy, &config);
    let r = deliver(&proxy, &old, "msg_late", now(), BODY, &[]).await;
    r.assert_problem(401, "webhook-signature-invalid");
    assert_eq!(handled(&env, "msg_late"), 0);
    let r = deliver(&proxy, &new, "msg_late", now(), BODY, &[]).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(handled(&env, "msg_late"), 1);
}

fn reload(proxy: &TestProxy, yaml: &str) {
    let config = Config::from_yaml(yaml).unwrap_or_else(|e| panic!("config: {e}\n{yaml}"));
    match proxy.proxy.reload(config) {
        Reloaded::Applied(_) => {}
        other => panic!("the reload was not applied: {other:?}"),
    }
}

async fn a_handler_failure_releases_the_event_for_its_redelivery(backend: Backend) {
    let env = Env::new(backend).await;
    let secret = Secret::new(b"the route's secret");
    let file = SecretsFile::new(&[&secret]);
    let proxy = env.proxy(&yaml(&env, &file, "")).await;
    let failed = deliver(
        &proxy,
        &secret,
        "msg_1",
        now(),
        BODY,
        &[("x-mock-status", "503")],
    )
    .await;
    assert_eq!(failed.status, 503);
    assert_eq!(handled(&env, "msg_1"), 0, "the handler failed");
    let again = deliver(&proxy, &secret, "msg_1", now(), BODY, &[]).await;
    assert_eq!(again.status, 200, "{:?}", again.body);
    assert_eq!(
        again.header("idempotent-replayed"),
        "",
        "run again, not replayed"
    );
    assert_eq!(handled(&env, "msg_1"), 1);
}

async fn a_redelivery_while_the_first_runs_is_a_409_with_retry_after(backend: Backend) {
    let env = Env::new(backend).await;
    let secret = Arc::new(Secret::new(b"the route's secret"));
    let file = SecretsFile::new(&[&secret]);
    let proxy = Arc::new(env.proxy(&yaml(&env, &file, "")).await);
    let slow = {
        let (proxy, secret) = (proxy.clone(), secret.clone());
        tokio::spawn(async move {
            deliver(
                &proxy,
                &secret,
                "msg_1",
                now(),
                BODY,
                &[("x-mock-delay", "1500ms")],
            )
            .await
        })
    };
    // The first is claimed, then runs for 1.5 s once it reaches the handler (which counts it
    // on arrival): a redelivery meanwhile finds it in flight.
    assert!(
        harness::eventually(Duration::from_secs(3), || env.mock.stats().total == 1).await,
        "the first delivery reached the handler"
    );
    let conflict = deliver(&proxy, &secret, "msg_1", now(), BODY, &[]).await;
    conflict.assert_problem(409, "request-in-progress");
    assert!(!conflict.header("retry-after").is_empty(), "Retry-After");
    let first = slow.await.expect("the first delivery");
    assert_eq!(first.status, 200, "{:?}", first.body);
    assert_eq!(handled(&env, "msg_1"), 1);
}

/// Duplicates of each event arrive together, while its first delivery runs (the handler takes
/// 100ms): each event runs once, and the duplicates that met its claim in flight were refused
/// with a 409 (counted `conflict`) — the burst did race the claim.
async fn a_burst_of_duplicates_runs_each_event_once(backend: Backend) {
    let env = Env::new(backend).await;
    let secret = Arc::new(Secret::new(b"the route's secret"));
    let file = SecretsFile::new(&[&secret]);
    // 32 claims of one key at once, on a machine that builds beside the test, can take longer
    // than the harness's 300ms store deadline (then 503, nothing forwarded): a store's
    // deadline is not what this test is about.
    let config = yaml(&env, &file, "").replacen("timeout: 300ms", "timeout: 3s", 1);
    let proxy = Arc::new(env.proxy(&config).await);
    // 10,000 deliveries on memory and PostgreSQL, 1,000 on the others: 100 events each time.
    let copies = match backend {
        Backend::Memory | Backend::Postgres => 100,
        _ => 10,
    };
    let events = 100;
    let senders = 32;
    let mut tasks = Vec::new();
    for s in 0..senders {
        let (proxy, secret) = (proxy.clone(), secret.clone());
        tasks.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            // Delivery n is of event n / copies: the senders start on the same events at
            // once, and move on together.
            for n in (s..events * copies).step_by(senders) {
                let id = format!("evt_{}", n / copies);
                let slow = [("x-mock-delay", "100ms")];
                let r = deliver(&proxy, &secret, &id, now(), BODY, &slow).await;
                statuses.push(r.status);
            }
            statuses
        }));
    }
    let (mut sent, mut refused) = (0, 0);
    for task in tasks {
        for status in task.await.expect("a sender") {
            assert!(status == 200 || status == 409, "status {status}");
            sent += 1;
            refused += u64::from(status == 409);
        }
    }
    assert_eq!(sent, events * copies);
    let stats = env.mock.stats();
    assert_eq!(stats.events.len(), events, "every event handled");
    assert!(
        stats.events.values().all(|&n| n == 1),
        "each event once: {:?}",
        stats.events
    );
    assert!(refused >= 1, "a duplicate met a claim in flight");
    assert_eq!(
        proxy.requests("events", Outcome::Conflict),
        refused,
        "each 409 counted as a conflict"
    );
}

async fn signatures_are_checked_in_observe_mode_too(backend: Backend) {
    let env = Env::new(backend).await;
    let secret = Secret::new(b"the route's secret");
    let file = SecretsFile::new(&[&secret]);
    let observed = "    idempotency:\n      mode: observe\n";
    let proxy = env.proxy(&yaml(&env, &file, observed)).await;
    let forger = Secret::new(b"a guess");
    let forged = deliver(&proxy, &forger, "msg_1", now(), BODY, &[]).await;
    forged.assert_problem(401, "webhook-signature-invalid");
    assert_eq!(
        env.mock.stats().webhooks,
        0,
        "a forgery never reaches the handler"
    );
    let genuine = deliver(&proxy, &secret, "msg_1", now(), BODY, &[]).await;
    assert_eq!(genuine.status, 200, "{:?}", genuine.body);
    assert_eq!(handled(&env, "msg_1"), 1);
    assert_eq!(webhooks(&proxy, "bad_signature"), 1);
    assert_eq!(webhooks(&proxy, "verified"), 1);
}

/// Slack's `url_verification` handshake carries no `event_id`: verified, forwarded without
/// idempotency every time, counted as `missing_key`, never refused.
async fn a_verified_delivery_without_an_id_is_forwarded_unprotected(backend: Backend) {
    let env = Env::new(backend).await;
    let secret = "8f742231b10e8888abcd99yyyzzz85a5";
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("slack-secret");
    std::fs::write(&file, format!("{secret}\n")).expect("write the secret");
    let config = format!(
        "listen: 127.0.0.1:0
{store}upstreams:
  mock:
    url: {up}
routes:
  - name: events
    path: /webhooks/slack
    upstream: mock
    webhook:
      provider: slack
      secrets_file: {file}
",
        store = env.store_yaml(""),
        up = env.mock.url(),
        file = file.display(),
    );
    let proxy = env.proxy(&config).await;
    let body = r#"{"type":"url_verification","challenge":"3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"}"#;
    let ts = now().to_string();
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes());
    let signature = format!(
        "v0={}",
        hex::encode(ring::hmac::sign(&key, format!("v0:{ts}:{body}").as_bytes()))
    );
    for _ in 0..2 {
        let r = harness::send(
            harness::client()
                .post(proxy.url("/webhooks/slack"))
                .header("x-slack-signature", &signature)
                .header("x-slack-request-timestamp", &ts)
                .body(body),
        )
        .await;
        assert_eq!(r.status, 200, "never a 400: {:?}", r.body);
        assert_eq!(r.header("idempotent-replayed"), "");
    }
    assert_eq!(env.mock.stats().webhooks, 2, "both forwarded, unprotected");
    assert_eq!(
        proxy.requests("events", idemproxy::metrics::Outcome::MissingKey),
        2,
        "counted as missing_key"
    );
    // A forged one without an id is still refused.
    let r = harness::send(
        harness::client()
            .post(proxy.url("/webhooks/slack"))
            .header("x-slack-signature", format!("v0={}", "0".repeat(64)))
            .header("x-slack-request-timestamp", &ts)
            .body(body),
    )
    .await;
    r.assert_problem(401, "webhook-signature-invalid");
    assert_eq!(env.mock.stats().webhooks, 2);
}
