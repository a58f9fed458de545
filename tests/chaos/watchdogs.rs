//! The watchdogs: what the machine did that the plan did not. A stall of this process (the
//! relays and proxy A run here) or of the store outside any injected fault is recorded as a
//! [`Loss::Machine`] window, which may explain a re-execution like any store unavailability,
//! and is printed on the timeline.

use super::*;

/// How late a watchdog's answer must be to count as a stall of the machine.
pub(crate) const MACHINE_STALL: Duration = Duration::from_millis(250);

/// Watches this process's scheduling: a wake-up due every 20ms that comes [`MACHINE_STALL`]
/// late or more is a stall of the whole process (a loaded machine), recorded as a window. Runs
/// until aborted.
pub(crate) async fn process_watchdog(clock: Clock, tl: Arc<Timeline>) {
    let tick = Duration::from_millis(20);
    loop {
        let before = clock.now();
        tokio::time::sleep(tick).await;
        let after = clock.now();
        let late = (after - before).saturating_sub(tick);
        if late >= MACHINE_STALL {
            tl.note(
                before,
                "-",
                format!("this process stalled for {late:?} (CPU starvation)"),
            );
            tl.window(before, after, Loss::Machine, "process stalled".into());
        }
    }
}

/// Watches Redis itself, on a direct connection (not through the relay): a PING every 50ms
/// that takes [`MACHINE_STALL`] or more while no fault is injected into Redis (`disturbed` is
/// odd during a pause or a restart, and moves on at each start and end) is a stall of Redis,
/// recorded as a window. Runs until aborted.
pub(crate) async fn redis_watchdog(
    url: String,
    clock: Clock,
    tl: Arc<Timeline>,
    disturbed: Arc<AtomicU64>,
) {
    let client = ::redis::Client::open(url).expect("redis url");
    let mut conn: Option<::redis::aio::MultiplexedConnection> = None;
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let Some(c) = conn.as_mut() else {
            let connect = client.get_multiplexed_async_connection();
            conn = tokio::time::timeout(Duration::from_secs(1), connect)
                .await
                .ok()
                .and_then(Result::ok);
            continue;
        };
        let epoch = disturbed.load(Ordering::SeqCst);
        let sent = clock.now();
        let cmd = ::redis::cmd("PING");
        let ping = cmd.query_async::<String>(c);
        let answered = tokio::time::timeout(Duration::from_secs(2), ping).await;
        let took = clock.now() - sent;
        if !matches!(answered, Ok(Ok(_))) {
            conn = None;
        }
        let undisturbed = epoch.is_multiple_of(2) && disturbed.load(Ordering::SeqCst) == epoch;
        if undisturbed && took >= MACHINE_STALL {
            tl.note(
                sent,
                "redis",
                format!("redis stalled for {took:?} (not injected)"),
            );
            tl.window(sent, sent + took, Loss::Machine, "redis stalled".into());
        }
    }
}

/// PostgreSQL's twin of [`redis_watchdog`]: a `SELECT 1` every 50ms on a direct connection
/// (not through the relay). One that takes [`MACHINE_STALL`] or more while no fault is injected
/// into the server is a stall of PostgreSQL (a checkpoint on a busy disk, a starved backend),
/// recorded as a window. So is a connection that takes that long to open and answer its first
/// `SELECT 1` while undisturbed: it measures what a proxy's first call on a fresh connection
/// meets after a crash or a stop (the margin [`crash_outage_bound`] leaves for it). Runs until
/// aborted.
pub(crate) async fn postgres_watchdog(
    url: String,
    clock: Clock,
    tl: Arc<Timeline>,
    disturbed: Arc<AtomicU64>,
) {
    let stalled = |sent: Duration, took: Duration, what: &str| {
        tl.note(
            sent,
            "postgres",
            format!("postgres {what} took {took:?} (not injected)"),
        );
        tl.window(
            sent,
            sent + took,
            Loss::Machine,
            format!("postgres stalled ({what})"),
        );
    };
    let mut client: Option<tokio_postgres::Client> = None;
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let epoch = disturbed.load(Ordering::SeqCst);
        let sent = clock.now();
        let fresh = client.is_none();
        if fresh {
            let connect = tokio_postgres::connect(&url, tokio_postgres::NoTls);
            client = match tokio::time::timeout(Duration::from_secs(2), connect).await {
                Ok(Ok((c, connection))) => {
                    // Drives the socket; ends when the client is dropped or the server goes.
                    tokio::spawn(connection);
                    Some(c)
                }
                _ => None,
            };
        }
        let Some(c) = client.as_ref() else {
            continue;
        };
        let answered =
            tokio::time::timeout(Duration::from_secs(2), c.simple_query("SELECT 1")).await;
        let took = clock.now() - sent;
        if !matches!(answered, Ok(Ok(_))) {
            client = None;
        }
        let undisturbed = epoch.is_multiple_of(2) && disturbed.load(Ordering::SeqCst) == epoch;
        if undisturbed && took >= MACHINE_STALL {
            let what = if fresh {
                "a new connection and its first SELECT 1"
            } else {
                "SELECT 1"
            };
            stalled(sent, took, what);
        }
    }
}
