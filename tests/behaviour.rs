//! SPEC §4.1–§4.3 on an idempotent route, each rule written once and run on both stores.

mod common;

use common::{Backend, Env, book};

both_stores!(first_request_is_forwarded_and_repeat_replayed);

async fn first_request_is_forwarded_and_repeat_replayed(backend: Backend) {
    let env = Env::new(backend).await;
    let proxy = env.proxy(&env.config("")).await;
    let first = book(&proxy, "k-1", r#"{"seat":"12A"}"#).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.header("idempotent-replayed"), "");
    let again = book(&proxy, "k-1", r#"{"seat":"12A"}"#).await;
    assert_eq!(again.status, 201);
    assert_eq!(again.body, first.body, "replayed body is byte-identical");
    assert_eq!(again.header("location"), first.header("location"));
    assert_eq!(again.header("idempotent-replayed"), "true");
    assert_eq!(
        env.mock.calls("k-1"),
        1,
        "the upstream ran the operation once"
    );
}
