//! SPEC §4.1 `key_from`: keys derived from what the request means, for callers that send no
//! key — a background job refunding a ticket, retried without an `Idempotency-Key`, runs once.

use harness::every_store;
use harness::{Backend, Env, Reply, TestProxy, client, send};
use http::{HeaderMap, HeaderName};
use idemproxy::key_from::{Value, derived_id, derived_key};
use idemproxy::route::KeyPart;
use proptest::prelude::*;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// A refund route keyed by ticket and reason code, a route keyed by every kind of part, and a
/// canonical-JSON-fingerprint route; `extra` adds lines to the refund route's idempotency.
fn yaml(env: &Env, extra: &str) -> String {
    let mut refund = String::new();
    for line in extra.lines().filter(|l| !l.trim().is_empty()) {
        refund.push_str("      ");
        refund.push_str(line.trim());
        refund.push('\n');
    }
    format!(
        "listen: 127.0.0.1:0
{store}upstreams:
  booking:
    url: {up}
routes:
  - name: refund-ticket
    methods: [POST]
    path: /tickets/{{ticket_id}}/refunds
    upstream: booking
    idempotency:
      key_from: [\"path:ticket_id\", \"json:/reason/code\"]
{refund}  - name: every-part
    path: /jobs/{{job}}/run
    upstream: booking
    idempotency:
      required: false
      key_from: [\"path:job\", \"json:/n\", \"query:day\", \"header:X-Tenant\", \"method\"]
      fingerprint: [method, path, query, json]
  - name: rest
    path: /*
    upstream: booking
",
        store = env.store_yaml(""),
        up = env.mock.url(),
    )
}

async fn refund(proxy: &TestProxy, ticket: &str, body: &str) -> Reply {
    send(
        client()
            .post(proxy.url(&format!("/tickets/{ticket}/refunds")))
            .header("Content-Type", "application/json")
            .body(body.to_owned()),
    )
    .await
}

async fn job(
    proxy: &TestProxy,
    method: &str,
    path_and_query: &str,
    tenant: &str,
    body: &str,
) -> Reply {
    let method = http::Method::from_bytes(method.as_bytes()).expect("method");
    send(
        client()
            .request(method, proxy.url(path_and_query))
            .header("X-Tenant", tenant)
            .body(body.to_owned()),
    )
    .await
}

fn assert_fresh(r: &Reply) {
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.header("idempotent-replayed"), "", "not a replay");
}

fn assert_replay(r: &Reply, first: &Reply) {
    assert_eq!(r.status, first.status, "{:?}", r.body);
    assert_eq!(r.header("idempotent-replayed"), "true", "a replay");
    assert_eq!(r.body, first.body, "byte-identical");
}

every_store!(
    a_keyless_refund_job_retried_runs_once,
    another_body_under_the_same_derived_key_is_a_422,
    every_kind_of_part_makes_its_own_key,
    values_that_are_not_utf8_never_share_a_key,
    every_unreadable_part_is_a_400_and_claims_nothing,
    values_are_canonical,
    the_header_key_wins,
    derived_keys_are_looked_up_by_their_parts,
);

/// The point of it all: a job that retries a refund without a key reaches the upstream once;
/// the upstream gets a stable derived key; the derivation is counted.
async fn a_keyless_refund_job_retried_runs_once(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&yaml(&env, "")).await;
    let body = r#"{"reason":{"code":"dup"},"amount":2400}"#;
    let first = refund(&proxy, "T-1", body).await;
    assert_fresh(&first);
    for _ in 0..3 {
        assert_replay(&refund(&proxy, "T-1", body).await, &first);
    }
    assert_eq!(env.mock.stats().total, 1, "the refund ran once");
    let seen = env.mock.last_request().expect("the upstream saw it");
    let key = seen
        .headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .expect("the derived key goes upstream")
        .to_owned();
    assert!(
        key.starts_with("derived-") && key.len() == "derived-".len() + 64,
        "{key}"
    );
    assert_eq!(env.mock.calls(&key), 1);
    // Another caller (another Authorization, the default scope) is another operation, and the
    // provider gets another key.
    let other = send(
        client()
            .post(proxy.url("/tickets/T-1/refunds"))
            .header("Authorization", "Bearer other-tenant")
            .body(body),
    )
    .await;
    assert_fresh(&other);
    let other_key = env
        .mock
        .last_request()
        .and_then(|r| {
            r.headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
        .expect("a key");
    assert_ne!(
        other_key, key,
        "two callers never send the provider one key"
    );
    let text = proxy.metrics().encode();
    assert!(
        text.contains(r#"idemproxy_derived_keys_total{route="refund-ticket"} 5"#),
        "{text}"
    );
}

/// The fingerprint still applies: the same ticket refunded with another amount is a 422, in
/// flight or finished; a new ticket is a new refund.
async fn another_body_under_the_same_derived_key_is_a_422(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&yaml(&env, "")).await;
    let first = refund(&proxy, "T-2", r#"{"reason":{"code":"dup"},"amount":100}"#).await;
    assert_fresh(&first);
    let r = refund(&proxy, "T-2", r#"{"reason":{"code":"dup"},"amount":200}"#).await;
    r.assert_problem(422, "idempotency-key-reused");
    let r = refund(&proxy, "T-3", r#"{"reason":{"code":"dup"},"amount":200}"#).await;
    assert_fresh(&r);
    let r = refund(&proxy, "T-2", r#"{"reason":{"code":"late"},"amount":200}"#).await;
    assert_fresh(&r);
    assert_eq!(env.mock.stats().total, 3);
}

/// Each kind of part counts: changing any one value makes a new key (a fresh run), the same
/// values replay.
async fn every_kind_of_part_makes_its_own_key(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&yaml(&env, "")).await;
    let first = job(&proxy, "POST", "/jobs/J1/run?day=mon", "t1", r#"{"n":1}"#).await;
    assert_fresh(&first);
    assert_replay(
        &job(&proxy, "POST", "/jobs/J1/run?day=mon", "t1", r#"{"n":1}"#).await,
        &first,
    );
    for (what, method, target, tenant, body) in [
        ("path", "POST", "/jobs/J2/run?day=mon", "t1", r#"{"n":1}"#),
        ("json", "POST", "/jobs/J1/run?day=mon", "t1", r#"{"n":2}"#),
        ("query", "POST", "/jobs/J1/run?day=tue", "t1", r#"{"n":1}"#),
        ("header", "POST", "/jobs/J1/run?day=mon", "t2", r#"{"n":1}"#),
        ("method", "PUT", "/jobs/J1/run?day=mon", "t1", r#"{"n":1}"#),
    ] {
        let r = job(&proxy, method, target, tenant, body).await;
        assert_eq!(r.status, 200, "{what}: {:?}", r.body);
        assert_eq!(
            r.header("idempotent-replayed"),
            "",
            "{what} makes a new key"
        );
    }
    assert_eq!(env.mock.stats().total, 6);
}

/// SPEC §4.1: values compare as the bytes they decode to. `%FF` and `%FE` are not UTF-8 and
/// not equal: a lossy decoding (both U+FFFD) gave them one key, and the second request got the
/// first one's response replayed. Checked for the query, the path and a header.
async fn values_that_are_not_utf8_never_share_a_key(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&yaml(&env, "")).await;
    let body = r#"{"n":1}"#;
    for (what, a, b) in [
        ("query", "/jobs/J1/run?day=%FF", "/jobs/J1/run?day=%FE"),
        ("path", "/jobs/%FF/run?day=mon", "/jobs/%FE/run?day=mon"),
    ] {
        let first = job(&proxy, "POST", a, "t1", body).await;
        assert_fresh(&first);
        let second = job(&proxy, "POST", b, "t1", body).await;
        assert_fresh(&second);
        assert_replay(&job(&proxy, "POST", a, "t1", body).await, &first);
        assert_ne!(
            first.body, second.body,
            "{what}: two operations, two answers"
        );
    }
    let tenant = |byte: u8| {
        let value = http::HeaderValue::from_bytes(&[b't', byte]).expect("obs-text value");
        client()
            .post(proxy.url("/jobs/J1/run?day=mon"))
            .header("X-Tenant", value)
            .body(body)
    };
    let first = send(tenant(0xFF)).await;
    assert_fresh(&first);
    assert_fresh(&send(tenant(0xFE)).await);
    assert_replay(&send(tenant(0xFF)).await, &first);
    assert_eq!(
        env.mock.stats().total,
        6,
        "six different operations ran, once each"
    );
}

/// A part that cannot be read answers 400 naming it; nothing is claimed or forwarded.
async fn every_unreadable_part_is_a_400_and_claims_nothing(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&yaml(&env, "")).await;
    for (body, words) in [
        ("not json", "the body is not JSON"),
        (r#"{"reason":{}}"#, "nothing at this pointer"),
        (r#"{"reason":{"code":{"a":1}}}"#, "an array or an object"),
        (r#"{"reason":{"code":[1]}}"#, "an array or an object"),
        (r#"{"reason":{"code":null}}"#, "null"),
    ] {
        let r = refund(&proxy, "T-9", body).await;
        let doc = r.assert_problem(400, "unreadable-key-part");
        let detail = doc["detail"].as_str().unwrap_or("");
        assert!(
            detail.contains("json:/reason/code") && detail.contains(words),
            "{body}: {detail}"
        );
    }
    /// A request target, its body, its headers, and the part its 400 must name.
    type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 4] = [
        ("/jobs/J1/run?day=mon", r#"{"n":1}"#, &[], "header:x-tenant"),
        (
            "/jobs/J1/run?day=mon",
            r#"{"n":1}"#,
            &[("X-Tenant", "a"), ("X-Tenant", "b")],
            "header:x-tenant",
        ),
        (
            "/jobs/J1/run",
            r#"{"n":1}"#,
            &[("X-Tenant", "a")],
            "query:day",
        ),
        (
            "/jobs/J1/run?day=a&day=b",
            r#"{"n":1}"#,
            &[("X-Tenant", "a")],
            "query:day",
        ),
    ];
    for (target, body, headers, part) in cases {
        let mut req = client().post(proxy.url(target)).body(body);
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        let r = send(req).await;
        let doc = r.assert_problem(400, "unreadable-key-part");
        assert!(
            doc["detail"].as_str().unwrap_or("").contains(part),
            "{target} {headers:?}: {doc}"
        );
    }
    assert_eq!(env.mock.stats().total, 0, "nothing forwarded");
    if let Some(keys) = env.stored_key_names() {
        assert!(keys.is_empty(), "nothing claimed: {keys:?}");
    }
    // Nothing was claimed: the readable request runs now.
    assert_fresh(&refund(&proxy, "T-9", r#"{"reason":{"code":"dup"}}"#).await);
}

/// Canonical values: a percent-encoded path segment is the decoded one; JSON numbers compare
/// by value and stay exact beyond 2^53; the string "1" is not the number 1; with the `json`
/// fingerprint part, a re-serialised body (key order, whitespace) is the same request.
async fn values_are_canonical(backend: Backend) {
    let env = Env::new(backend).await;
    // The fingerprint's `path` part is the path as sent; leave it out so that only the key's
    // canonical path segment decides.
    let proxy = env.proxy(&yaml(&env, "fingerprint: [method, json]")).await;
    let first = refund(&proxy, "T-1", r#"{"reason":{"code":1},"amount":10}"#).await;
    assert_fresh(&first);
    assert_replay(
        &refund(
            &proxy,
            "T%2D1",
            r#"{ "amount": 10.0, "reason": { "code": 1.0 } }"#,
        )
        .await,
        &first,
    );
    assert_replay(
        &refund(&proxy, "T-1", r#"{"amount":1e1,"reason":{"code":10e-1}}"#).await,
        &first,
    );
    let s = refund(&proxy, "T-1", r#"{"reason":{"code":"1"},"amount":10}"#).await;
    assert_fresh(&s);
    let big = refund(
        &proxy,
        "T-1",
        r#"{"reason":{"code":9007199254740993},"amount":10}"#,
    )
    .await;
    assert_fresh(&big);
    let big_neighbour = refund(
        &proxy,
        "T-1",
        r#"{"reason":{"code":9007199254740992},"amount":10}"#,
    )
    .await;
    assert_fresh(&big_neighbour);
    assert_replay(
        &refund(
            &proxy,
            "T-1",
            r#"{"reason":{"code":9007199254740993},"amount":10}"#,
        )
        .await,
        &big,
    );
    assert_eq!(env.mock.stats().total, 4);
}

/// A key header still wins over `key_from`.
async fn the_header_key_wins(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&yaml(&env, "")).await;
    let body = r#"{"reason":{"code":"dup"}}"#;
    let with_key = send(
        client()
            .post(proxy.url("/tickets/T-5/refunds"))
            .header("Idempotency-Key", "caller-key-1")
            .body(body),
    )
    .await;
    assert_fresh(&with_key);
    assert_eq!(
        env.mock.calls("caller-key-1"),
        1,
        "forwarded with the caller's key"
    );
    // Without the header, the same parts derive another key: a separate operation.
    assert_fresh(&refund(&proxy, "T-5", body).await);
    // The caller's key again, even with other parts, is the caller's operation.
    let again = send(
        client()
            .post(proxy.url("/tickets/T-5/refunds"))
            .header("Idempotency-Key", "caller-key-1")
            .body(body),
    )
    .await;
    assert_replay(&again, &with_key);
    assert_eq!(env.mock.stats().total, 2);
}

/// The key tooling finds a derived record by its part values.
async fn derived_keys_are_looked_up_by_their_parts(backend: Backend) {
    let env = Env::new(backend).await;
    let token = harness::write_config("parts-token\n");
    let config = yaml(&env, "").replace(
        "listen: 127.0.0.1:0\n",
        &format!(
            "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:1\nadmin_token_file: {}\n",
            token.path().display()
        ),
    );
    let proxy = env.proxy(&config).await;
    let token = "parts-token";
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (_stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(idemproxy::server::serve_admin(
        listener,
        proxy.proxy.clone(),
        async move {
            let _ = stopped.await;
        },
    ));
    assert_fresh(&refund(&proxy, "T-7", r#"{"reason":{"code":"dup"}}"#).await);
    let found = send(
        client()
            .get(format!("{base}/keys/refund-ticket?part=T-7&part=%22dup%22"))
            .bearer_auth(token),
    )
    .await;
    assert_eq!(found.status, 200, "{:?}", found.body);
    assert_eq!(found.json()["state"], "finished");
    let missing = send(
        client()
            .get(format!(
                "{base}/keys/refund-ticket?part=T-7&part=%22late%22"
            ))
            .bearer_auth(token),
    )
    .await;
    missing.assert_problem(404, "no-record");
    let wrong = send(
        client()
            .get(format!("{base}/keys/refund-ticket?part=T-7"))
            .bearer_auth(token),
    )
    .await;
    let doc = wrong.assert_problem(400, "invalid-record-name");
    assert!(
        doc["detail"]
            .as_str()
            .is_some_and(|d| d.contains("give one value each")),
        "one value per part: {doc}"
    );
}

fn part_strategy() -> impl Strategy<Value = (Vec<KeyPart>, Vec<Value>)> {
    let part = prop_oneof![
        "[a-z]{1,3}".prop_map(KeyPart::Path),
        "(/[a-z]{1,2}){0,2}".prop_map(KeyPart::Json),
        "[a-z]{1,3}".prop_map(KeyPart::Query),
        Just(KeyPart::Header(HeaderName::from_static("x-tenant"))),
        Just(KeyPart::Method),
    ];
    let value = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..6).prop_map(Value::Text),
        (-1000i64..1000).prop_map(|n| Value::Number(n.to_string())),
        any::<bool>().prop_map(Value::Bool),
    ];
    proptest::collection::vec((part, value), 1..4).prop_map(|pv| pv.into_iter().unzip())
}

proptest! {
    /// Different (part, value) lists never give the same derived key or store id; the same
    /// ones always do; and a derived id never equals a header key's id.
    #[test]
    fn different_part_values_never_give_the_same_store_key(
        a in part_strategy(),
        b in part_strategy(),
    ) {
        let scope = [HeaderName::from_static("authorization")];
        let headers = HeaderMap::new();
        let ka = derived_key(&a.0, &a.1, &scope, &headers);
        let kb = derived_key(&b.0, &b.1, &scope, &headers);
        prop_assert_eq!(ka == kb, a == b);
        prop_assert_eq!(derived_id(&ka) == derived_id(&kb), a == b);
        prop_assert_ne!(derived_id(&ka), idemproxy::key::key_id(&scope, &headers, &ka));
    }
}
