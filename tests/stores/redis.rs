//! Reaching a Redis that wants TLS and a password (SPEC §3 `url: rediss://…`): the CA of a
//! private PKI from `store.ca_file`, the password from `store.password_file` rather than the
//! YAML. The certificates are made by the test (rcgen); the servers are real `redis-server`s
//! with `--tls-port` and `--requirepass`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::secured::SecuredRedis;
use harness::{Backend, Env, Reply, TestProxy, book, client, send};
use idemproxy::config::RedisAccess;
use idemproxy::metrics::Metrics;
use idemproxy::record::Record;
use idemproxy::store::redis::RedisStore;
use idemproxy::store::{Held, StoreHandle, StoreKey};

// The store contract, each check a test of its own (`harness::store_checks`): a server of its own; shared by several proxies.
harness::store_contract!(Redis { shared });

const BODY: &str = r#"{"seat":"12A"}"#;

async fn post(proxy: &TestProxy, key: &str) -> Reply {
    send(
        client()
            .post(proxy.url("/bookings"))
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/json")
            .body(BODY),
    )
    .await
}

/// The harness's configuration on `server`, with extra `store:` lines.
fn config(env: &Env, server: &SecuredRedis, store: &str) -> String {
    let yaml = env.config_with("", store);
    let out = yaml.replacen(
        "  backend: memory\n",
        &format!("  backend: redis\n  url: {}\n", server.url()),
        1,
    );
    assert_ne!(out, yaml, "the harness's store section moved");
    out
}

fn assert_forward_then_replay(first: &Reply, again: &Reply) {
    assert_eq!(first.status, 201, "forwarded; body: {:?}", first.body);
    assert_eq!(first.header("idempotent-replayed"), "");
    assert_eq!(again.status, 201);
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(again.body, first.body, "byte-identical replay");
}

/// `rediss://` to a server whose certificate a private CA signed, trusted through
/// `store.ca_file`, with the password from `store.password_file`: forwarded, then replayed;
/// the record is in that Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_private_ca_and_a_password_file() {
    let env = Env::new(Backend::Memory).await;
    let server = SecuredRedis::start(true, Some("tls-s3cret"));
    let pki = server.pki.as_ref().expect("tls");
    let password = pki.file("redis-password", "tls-s3cret\n");
    let yaml = config(
        &env,
        &server,
        &format!(
            "ca_file: {}\npassword_file: {}",
            pki.ca.display(),
            password.display()
        ),
    );
    let proxy = TestProxy::start(&yaml).await;
    proxy.proxy.store().ping().await.expect("ready over TLS");
    let first = post(&proxy, "tls-1").await;
    let again = post(&proxy, "tls-1").await;
    assert_forward_then_replay(&first, &again);
    assert_eq!(env.mock.calls("tls-1"), 1);
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("idemproxy:*")
        .query(&mut server.conn())
        .expect("KEYS");
    assert_eq!(keys.len(), 1, "the record is in the TLS Redis: {keys:?}");
}

/// The same server without `ca_file`: its certificate is not signed by a public root, so the
/// store is unreachable — readiness and claims fail, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_without_the_ca_is_refused() {
    let server = SecuredRedis::start(true, None);
    // A deadline long enough for the connection attempts to fail by themselves, with their
    // reason.
    let timeout = Duration::from_secs(5);
    let redis = RedisStore::connect(
        &server.url(),
        &RedisAccess::default(),
        0,
        timeout,
        Arc::new(Metrics::new()),
    )
    .expect("store");
    let store = StoreHandle::new(Arc::new(redis), timeout, Arc::new(Metrics::new()));
    let started = Instant::now();
    let err = store
        .ping()
        .await
        .expect_err("an unknown issuer is not trusted");
    let text = err.to_string().to_lowercase();
    assert!(
        text.contains("certificate") || text.contains("issuer"),
        "the error says why: {err} (after {:?})",
        started.elapsed()
    );
    let held = Held::new(Record::InFlight {
        token: [1; 16],
        fingerprint: [2; 32],
    });
    let key = StoreKey::new(
        idemproxy::key::namespace("idemproxy:", "create-booking"),
        0,
        [3; 32],
    );
    store
        .claim(&key, &held, Duration::from_secs(10))
        .await
        .expect_err("no claim over an untrusted connection");
}

/// A `--requirepass` Redis and the password from `store.password_file` (not in the URL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_from_a_file() {
    let env = Env::new(Backend::Memory).await;
    let server = SecuredRedis::start(false, Some("file-s3cret"));
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("redis-password");
    std::fs::write(&file, "file-s3cret\n").expect("write the password");
    let proxy = TestProxy::start(&config(
        &env,
        &server,
        &format!("password_file: {}", file.display()),
    ))
    .await;
    proxy.proxy.store().ping().await.expect("authenticated");
    let first = post(&proxy, "pw-1").await;
    let again = post(&proxy, "pw-1").await;
    assert_forward_then_replay(&first, &again);
    assert_eq!(env.mock.calls("pw-1"), 1);
}

/// Without the password, the store refuses every command: readiness fails with Redis's own
/// reason (NOAUTH), and claims are 503 naming it, nothing forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_password_readiness_and_claims_fail_clearly() {
    let env = Env::new(Backend::Memory).await;
    let server = SecuredRedis::start(false, Some("needed"));
    let proxy = TestProxy::start(&config(&env, &server, "")).await;
    let err = proxy
        .proxy
        .store()
        .ping()
        .await
        .expect_err("unauthenticated");
    assert!(
        err.to_string().contains("NOAUTH") || err.to_string().contains("Authentication"),
        "the error says why: {err}"
    );
    let doc = post(&proxy, "pw-none")
        .await
        .assert_problem(503, "store-unavailable");
    let detail = doc["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("NOAUTH") || detail.contains("Authentication"),
        "the 503 says why: {detail}"
    );
    assert_eq!(env.mock.calls("pw-none"), 0);
}

// ---------------------------------------------------------------------------------------------
// Lua scripts Redis forgot
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_scripts_are_reloaded_after_script_flush() {
    let env = Env::new(Backend::Redis).await;
    let proxy = env.proxy(&env.config("")).await;
    let first = book(&proxy, "before-flush", "{}").await;
    assert_eq!(first.status, 201);

    // Redis forgets every cached script (as after a restart or failover with the same data).
    let mut conn = env.redis().conn();
    let flushed: String = ::redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut conn)
        .expect("SCRIPT FLUSH");
    assert_eq!(flushed, "OK");

    // Completing needs the compare-and-set script: EVALSHA fails with NOSCRIPT and the script
    // is loaded again. The replay proves the result was saved.
    let second = book(&proxy, "after-flush", "{}").await;
    assert_eq!(second.status, 201, "{:?}", second.body);
    let replay = book(&proxy, "after-flush", "{}").await;
    assert_eq!(replay.header("idempotent-replayed"), "true");
    assert_eq!(replay.body, second.body);
    assert_eq!(env.mock.calls("after-flush"), 1);
}
