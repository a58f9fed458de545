//! Each provider's deliveries as the provider sends them, on every store: the key bound to what
//! the provider signed (GitHub and Shopify sign the body alone, so a captured delivery under any
//! id is the same event, and one id with two bodies is two events), Svix's own header names,
//! and a Stripe redelivery whose body changed.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use harness::{Backend, Env, Reply, TestProxy, client, every_store, send};
use sha2::Digest as _;

use super::support::{Secret, SecretsFile, now};

every_store!(
    a_captured_github_delivery_runs_once_under_any_id_and_never_takes_another_events_id,
    one_github_delivery_id_with_two_bodies_is_two_events,
    two_shopify_topics_with_one_body_are_two_events,
    a_default_svix_delivery_verifies_and_a_mixed_set_is_refused,
    a_stripe_redelivery_whose_body_changed_replays,
);

/// A proxy with one webhook route, `/webhooks/{provider}` (the mock's handler), whose secret
/// file holds `secret`; `block` adds lines to the `webhook:` block.
async fn proxy_for(
    env: &Env,
    provider: &str,
    secret: &str,
    block: &str,
) -> (TestProxy, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("secret");
    std::fs::write(&file, format!("{secret}\n")).expect("write the secret");
    let yaml = format!(
        "listen: 127.0.0.1:0
{store}upstreams:
  mock:
    url: {up}
routes:
  - name: events
    path: /webhooks/{provider}
    upstream: mock
    webhook:
      provider: {provider}
      secrets_file: {file}
{block}",
        store = env.store_yaml(""),
        up = env.mock.url(),
        file = file.display(),
    );
    (env.proxy(&yaml).await, dir)
}

fn hmac(secret: &[u8], message: &[u8]) -> Vec<u8> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    ring::hmac::sign(&key, message).as_ref().to_vec()
}

const GITHUB_SECRET: &str = "It's a Secret to Everybody";

/// A GitHub delivery of `body` as GitHub signs it (`X-Hub-Signature-256` over the body), with
/// `event` in `X-GitHub-Event` and `delivery` (when given) in `X-GitHub-Delivery`.
async fn github(proxy: &TestProxy, body: &str, event: &str, delivery: Option<&str>) -> Reply {
    let signature = format!(
        "sha256={}",
        hex::encode(hmac(GITHUB_SECRET.as_bytes(), body.as_bytes()))
    );
    let mut req = client()
        .post(proxy.url("/webhooks/github"))
        .header("content-type", "application/json")
        .header("x-hub-signature-256", signature)
        .header("x-github-event", event)
        .body(body.to_owned());
    if let Some(delivery) = delivery {
        req = req.header("x-github-delivery", delivery);
    }
    send(req).await
}

async fn a_captured_github_delivery_runs_once_under_any_id_and_never_takes_another_events_id(
    backend: Backend,
) {
    let env = Env::new(backend).await;
    let (proxy, _dir) = proxy_for(&env, "github", GITHUB_SECRET, "").await;
    let push = r#"{"ref":"refs/heads/main","after":"a1b2c3"}"#;
    let first = github(&proxy, push, "push", Some("d-1")).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    assert_eq!(first.header("idempotent-replayed"), "");
    // The captured delivery sent again: under a fresh id, under none, and under the id of a
    // second real event that GitHub has not delivered yet.
    for delivery in [Some("d-fresh"), None, Some("d-2")] {
        let again = github(&proxy, push, "push", delivery).await;
        assert_eq!(again.status, 200, "{delivery:?}: {:?}", again.body);
        assert_eq!(again.header("idempotent-replayed"), "true", "{delivery:?}");
        assert_eq!(again.body, first.body, "{delivery:?}: the saved answer");
    }
    assert_eq!(
        env.mock.stats().webhooks,
        1,
        "the handler ran the push once"
    );
    // The genuine second event, under its own id: it runs, once.
    let release = r#"{"action":"published","release":{"tag_name":"v1.0"}}"#;
    let second = github(&proxy, release, "release", Some("d-2")).await;
    assert_eq!(second.status, 200, "{:?}", second.body);
    assert_eq!(
        second.header("idempotent-replayed"),
        "",
        "not the push's answer"
    );
    assert_eq!(env.mock.stats().webhooks, 2);
    let again = github(&proxy, release, "release", Some("d-2")).await;
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(env.mock.stats().webhooks, 2, "and only once");
}

async fn one_github_delivery_id_with_two_bodies_is_two_events(backend: Backend) {
    let env = Env::new(backend).await;
    let (proxy, _dir) = proxy_for(&env, "github", GITHUB_SECRET, "").await;
    // GitHub gives every hook that receives one event the same delivery id, each with its own
    // body (the hook's own `hook_id`, say).
    let hook_a = r#"{"action":"opened","hook_id":1}"#;
    let hook_b = r#"{"action":"opened","hook_id":2}"#;
    let a = github(&proxy, hook_a, "issues", Some("d-shared")).await;
    let b = github(&proxy, hook_b, "issues", Some("d-shared")).await;
    for r in [&a, &b] {
        assert_eq!(r.status, 200, "never a 422: {:?}", r.body);
        assert_eq!(r.header("idempotent-replayed"), "");
    }
    assert_eq!(env.mock.stats().webhooks, 2, "both ran");
}

const SHOPIFY_SECRET: &str = "shpss_hush";

/// A Shopify delivery as Shopify signs it (`X-Shopify-Hmac-Sha256`, base64, over the body).
async fn shopify(proxy: &TestProxy, body: &str, topic: &str, webhook_id: &str) -> Reply {
    let signature = STANDARD.encode(hmac(SHOPIFY_SECRET.as_bytes(), body.as_bytes()));
    send(
        client()
            .post(proxy.url("/webhooks/shopify"))
            .header("content-type", "application/json")
            .header("x-shopify-hmac-sha256", signature)
            .header("x-shopify-topic", topic)
            .header("x-shopify-webhook-id", webhook_id)
            .body(body.to_owned()),
    )
    .await
}

async fn two_shopify_topics_with_one_body_are_two_events(backend: Backend) {
    let env = Env::new(backend).await;
    let (proxy, _dir) = proxy_for(&env, "shopify", SHOPIFY_SECRET, "").await;
    let order = r#"{"id":820982911946154508,"email":"jon@example.com"}"#;
    let created = shopify(&proxy, order, "orders/create", "w-1").await;
    let updated = shopify(&proxy, order, "orders/updated", "w-2").await;
    for r in [&created, &updated] {
        assert_eq!(r.status, 200, "{:?}", r.body);
        assert_eq!(r.header("idempotent-replayed"), "");
    }
    assert_eq!(env.mock.stats().webhooks, 2, "two topics, two events");
    // Shopify's retry of the first, under a new webhook id: the same event.
    let retried = shopify(&proxy, order, "orders/create", "w-3").await;
    assert_eq!(retried.header("idempotent-replayed"), "true");
    assert_eq!(retried.body, created.body);
    assert_eq!(env.mock.stats().webhooks, 2);
}

async fn a_default_svix_delivery_verifies_and_a_mixed_set_is_refused(backend: Backend) {
    let env = Env::new(backend).await;
    let secret = Secret::new(b"svix's secret for this endpoint");
    let file = SecretsFile::new(&[&secret]);
    let proxy = env.proxy(&super::support::yaml(&env, &file, "")).await;
    let body = r#"{"type":"invoice.paid","data":{"amount":2400}}"#;
    let ts = now();
    let signature = secret.sign("msg_svix_1", ts, body);
    let svix = |id: &str, signature: &str| {
        client()
            .post(proxy.url("/webhooks/standard"))
            .header("content-type", "application/json")
            .header("svix-id", id.to_owned())
            .header("svix-timestamp", ts.to_string())
            .header("svix-signature", signature.to_owned())
            .body(body)
    };
    let first = send(svix("msg_svix_1", &signature)).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let again = send(svix("msg_svix_1", &signature)).await;
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(env.mock.stats().webhooks, 1);
    // An unsigned `webhook-id` beside a signed `svix-*` set can't choose the key: refused.
    let mixed = send(svix("msg_svix_1", &signature).header("webhook-id", "msg_other")).await;
    let doc = mixed.assert_problem(401, "webhook-signature-invalid");
    let detail = doc["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("malformed") && detail.contains("svix"),
        "{detail}"
    );
    assert_eq!(env.mock.stats().webhooks, 1, "nothing forwarded");
}

const STRIPE_SECRET: &str = "whsec_7Qk2eL3bV9xN4pA8sD1fG6hJ0mR5tY2u";

async fn stripe(proxy: &TestProxy, body: &str) -> Reply {
    let t = now();
    let v1 = hex::encode(hmac(
        STRIPE_SECRET.as_bytes(),
        format!("{t}.{body}").as_bytes(),
    ));
    send(
        client()
            .post(proxy.url("/webhooks/stripe"))
            .header("content-type", "application/json")
            .header("stripe-signature", format!("t={t},v1={v1}"))
            .body(body.to_owned()),
    )
    .await
}

async fn a_stripe_redelivery_whose_body_changed_replays(backend: Backend) {
    let env = Env::new(backend).await;
    let (proxy, _dir) = proxy_for(&env, "stripe", STRIPE_SECRET, "").await;
    let first = stripe(
        &proxy,
        r#"{"id":"evt_1","type":"charge.succeeded","pending_webhooks":2}"#,
    )
    .await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    // Stripe's retry: the same signed id, a counter in the body changed.
    let retry = stripe(
        &proxy,
        r#"{"id":"evt_1","type":"charge.succeeded","pending_webhooks":1}"#,
    )
    .await;
    assert_eq!(retry.status, 200, "never a 422: {:?}", retry.body);
    assert_eq!(retry.header("idempotent-replayed"), "true");
    assert_eq!(retry.body, first.body);
    assert_eq!(env.mock.stats().webhooks, 1);
    // With a fingerprint written, such a redelivery is a 422 that says what it is (one proxy
    // at a time: an SQLite file has one).
    proxy.stop().await;
    let (proxy, _dir) = proxy_for(
        &env,
        "stripe",
        STRIPE_SECRET,
        "    idempotency:\n      fingerprint: [body]\n",
    )
    .await;
    let first = stripe(&proxy, r#"{"id":"evt_2","pending_webhooks":2}"#).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let changed = stripe(&proxy, r#"{"id":"evt_2","pending_webhooks":1}"#).await;
    let doc = changed.assert_problem(422, "idempotency-key-reused");
    let detail = doc["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("redelivery") && !detail.contains("new key"),
        "{detail}"
    );
    assert_eq!(env.mock.stats().webhooks, 2);
}

/// The key tooling names a webhook record by its signed event id; where the provider signs the
/// body alone, the tooling says to use the hash from the request log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_tooling_finds_a_record_by_its_signed_event_id() {
    let env = Env::new(Backend::Memory).await;
    let token = harness::write_config("the-admin-token\n");
    let block = format!(
        "admin_listen: 127.0.0.1:1\nadmin_token_file: {}\nroutes:\n",
        token.path().display()
    );
    let (stripe_proxy, _dir) = {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("secret");
        std::fs::write(&file, format!("{STRIPE_SECRET}\n")).expect("write the secret");
        let (github_dir, github_file) = (tempfile::tempdir().expect("temp dir"), "github");
        let github_path = github_dir.path().join(github_file);
        std::fs::write(&github_path, format!("{GITHUB_SECRET}\n")).expect("write the secret");
        let yaml = format!(
            "listen: 127.0.0.1:0
{store}upstreams:
  mock:
    url: {up}
{block}  - name: events
    path: /webhooks/stripe
    upstream: mock
    webhook:
      provider: stripe
      secrets_file: {file}
  - name: pushes
    path: /webhooks/github
    upstream: mock
    webhook:
      provider: github
      secrets_file: {github}
",
            store = env.store_yaml(""),
            up = env.mock.url(),
            file = file.display(),
            github = github_path.display(),
        );
        (env.proxy(&yaml).await, (dir, github_dir))
    };
    let first = stripe(
        &stripe_proxy,
        r#"{"id":"evt_shown","type":"charge.succeeded"}"#,
    )
    .await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind admin");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let admin = tokio::spawn(idemproxy::server::serve_admin(
        listener,
        stripe_proxy.proxy.clone(),
        async move {
            let _ = stopped.await;
        },
    ));
    let get = |path: &str| {
        send(
            client()
                .get(format!("{base}{path}"))
                .bearer_auth("the-admin-token"),
        )
    };
    let shown = get("/keys/events?key=evt_shown").await;
    assert_eq!(shown.status, 200, "{:?}", shown.body);
    assert_eq!(shown.json()["state"], "finished");
    get("/keys/events?key=evt_other")
        .await
        .assert_problem(404, "no-record");
    let refused = get("/keys/pushes?key=d-1").await;
    assert_eq!(refused.status, 400, "{:?}", refused.body);
    // A GitHub event is found by its key's hash; its record names the delivery that ran it,
    // and the label never goes out with a replay.
    let push = r#"{"ref":"refs/heads/main"}"#;
    let first = github(&stripe_proxy, push, "push", Some("d-label")).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let text = format!(
        "webhook-body:{}:{}",
        hex::encode(<[u8; 32]>::from(sha2::Sha256::digest(push.as_bytes()))),
        hex::encode("push")
    );
    let hash = hex::encode(idemproxy::key::key_id(&[], &http::HeaderMap::new(), &text));
    let shown = get(&format!("/keys/pushes/{hash}")).await;
    assert_eq!(shown.status, 200, "{:?}", shown.body);
    assert_eq!(shown.json()["delivery"], "d-label", "{:?}", shown.body);
    let headers = shown.json()["headers"].to_string();
    assert!(!headers.contains("idemproxy-delivery-label"), "{headers}");
    let again = github(&stripe_proxy, push, "push", Some("d-other")).await;
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(
        again.header("idemproxy-delivery-label"),
        "",
        "never replayed"
    );
    let text = String::from_utf8_lossy(&refused.body).into_owned();
    assert!(text.contains("key hash"), "{text}");
    let _ = stop.send(());
    let _ = admin.await;
}
