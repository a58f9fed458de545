//! Unit tests of the PostgreSQL store that need no server (the server tests are in
//! `tests/stores/postgres.rs`).

use super::*;
use crate::config::Secret;

fn settings(url: &str) -> PostgresSettings {
    PostgresSettings {
        config: url.parse().expect("a URL"),
        password: None,
        ca_pem: None,
        schema: "idemproxy".into(),
        pool_size: 4,
        sweep_interval: Duration::from_secs(30),
    }
}

/// A loopback port nobody listens on (bound, then closed).
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

#[test]
fn durations_are_clamped_to_what_a_timestamp_can_hold() {
    assert_eq!(millis(Duration::ZERO), 1);
    assert_eq!(millis(Duration::from_millis(1500)), 1500);
    assert_eq!(millis(Duration::from_secs(86_400)), 86_400_000);
    assert_eq!(millis(Duration::MAX), MAX_MILLIS);
}

#[test]
fn the_connection_settings_bound_every_step_and_carry_the_password() {
    let mut s = settings("postgres://proxy@127.0.0.1:5999/bookings");
    s.password = Some(Secret::new("s3cret"));
    let config = pool::pg_config(&s, Duration::from_millis(300));
    assert_eq!(config.get_password(), Some(&b"s3cret"[..]));
    assert_eq!(
        config.get_connect_timeout(),
        Some(&Duration::from_millis(300))
    );
    assert!(config.get_tcp_user_timeout().is_some());
    assert!(config.get_keepalives());
    assert!(config.get_keepalives_idle() < Duration::from_secs(60));
    assert_eq!(config.get_application_name(), Some("idemproxy"));
    assert_eq!(config.get_dbname(), Some("bookings"));

    // The URL's own application name is kept.
    let named = settings("postgres://proxy@127.0.0.1:5999/bookings?application_name=billing");
    let config = pool::pg_config(&named, Duration::from_millis(300));
    assert_eq!(config.get_application_name(), Some("billing"));
}

#[test]
fn every_statement_names_the_schema_s_table() {
    let sql = Statements::new("bookings_idem");
    for statement in [
        &sql.claim,
        &sql.renew,
        &sql.save,
        &sql.saved,
        &sql.release,
        &sql.get,
        &sql.inspect,
        &sql.forget,
        &sql.sweep,
    ] {
        assert!(statement.contains("bookings_idem.records"), "{statement}");
        // Fenced or filtered on the server's clock: an expired row is never acted on as live.
        assert!(statement.contains("now()"), "{statement}");
    }
    for fenced in [&sql.renew, &sql.save, &sql.release] {
        assert!(fenced.contains("token = $2"), "{fenced}");
        assert!(fenced.contains("expires_at > now()"), "{fenced}");
    }
    assert!(
        !sql.claim.contains("DO UPDATE"),
        "the replay path must not lock"
    );
}

/// The database is down at start: the store is built all the same, and every operation fails
/// as a store error within the timeout instead of hanging or panicking.
#[tokio::test]
async fn a_database_that_is_down_at_start_is_a_store_error_not_a_failed_start() {
    let url = format!("postgres://proxy@127.0.0.1:{}/bookings", closed_port());
    let metrics = Arc::new(Metrics::new());
    let timeout = Duration::from_millis(300);
    let start = std::time::Instant::now();
    let store = PostgresStore::connect(&settings(&url), timeout, metrics.clone())
        .await
        .expect("the proxy starts while the database is down");
    let handle = crate::store::StoreHandle::new(Arc::new(store), timeout, metrics.clone());
    let err = handle.ping().await.expect_err("nobody listens");
    let text = err.to_string();
    assert!(text.contains("connect"), "{text}");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    let series = metrics.store_series::<PostgresSeries>();
    assert_eq!(series.in_use.get(), 0);
    assert_eq!(series.connections.get(), 0);
}

#[test]
fn a_worker_gives_one_connection_to_its_reader_once_its_share_is_eight_or_more() {
    // One reader, never more: a second would split the worker's pipelined reads in two.
    let readers: Vec<u32> = [1, 7, 8, 9, 16, 32, 1000]
        .into_iter()
        .map(Readers::for_share)
        .collect();
    assert_eq!(readers, [0, 0, 1, 1, 1, 1, 1]);
}
