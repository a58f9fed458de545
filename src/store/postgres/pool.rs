//! Connections: the tokio-postgres settings, the deadpool pool, and [`Conn`], the checkout
//! that settles its connection unless the call on it finished.
//!
//! Why a call that did not finish never hands its connection straight back: `StoreHandle`
//! drops an operation's future at `store.timeout`, and the connection's session may still be
//! running its statement — waiting on a row lock another transaction holds, or on a server that
//! hangs (SIGSTOP, a blackholed network). Handed back to the pool, it would be checked out
//! again and every later operation on it would queue behind the stuck statement. Closed at
//! once, its server session would go on waiting for that lock all the same (a backend notices
//! a closed socket only when it next reads or writes), while the pool opened a replacement
//! beside it: under a storm of timeouts on one locked row, an instance would hold far more
//! sessions than `pool_size` (SPEC §4.6: the most it opens).
//!
//! So such a connection is *settled* ([`settle`]), in a task of its own, while it still counts
//! in the pool's size (no replacement is opened beside it): its statement is cancelled
//! (PostgreSQL's cancel request, on a connection of its own), then a `ROLLBACK` waits for the
//! session to be idle, outside any transaction. Answered within `store.timeout`, the connection
//! is fit, gets every statement prepared afresh and goes back to the pool; otherwise (a server
//! that does not answer) it is detached with `Object::take` and dropped: its client and socket
//! close, the server rolls back whatever it had not committed, and the pool opens a fresh one.
//! A call that failed with an error is settled the same way: cheaper than telling which errors
//! leave a connection fit. A connection already closed is dropped at once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime, Timeouts};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::error;
use crate::config::PostgresSettings;
use crate::metrics::{GaugePart, Metrics, StoreSeries, encode_one};
use crate::store::StoreError;

/// How long a socket's sent data may go unacknowledged before the kernel closes it
/// (`TCP_USER_TIMEOUT`), and keepalives, for connections that sit idle in the pool: a peer that
/// vanished (a failover, a blackhole) is noticed within seconds, not the kernel's default two
/// hours, so a connection checked out later is not a dead one. Calls themselves are bounded by
/// `store.timeout` whatever these say.
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(3);
const KEEPALIVE_RETRIES: u32 = 3;

/// The connection settings: the URL's, with the password from outside it, and every step of a
/// connection bounded.
pub(super) fn pg_config(settings: &PostgresSettings, timeout: Duration) -> tokio_postgres::Config {
    let mut config = settings.config.clone();
    if let Some(password) = &settings.password {
        config.password(password.expose());
    }
    if config.get_application_name().is_none() {
        // Operators find the proxy's sessions in pg_stat_activity by it.
        config.application_name("idemproxy");
    }
    // The TCP connect alone; the pool's create timeout bounds the whole start-up (TLS, auth).
    config
        .connect_timeout(timeout)
        .tcp_user_timeout(TCP_USER_TIMEOUT)
        .keepalives(true)
        .keepalives_idle(KEEPALIVE_IDLE)
        .keepalives_interval(KEEPALIVE_INTERVAL)
        .keepalives_retries(KEEPALIVE_RETRIES);
    config
}

/// The pool: at most `size` connections (`pool_size`, less the shared reader's), made on
/// demand (none at start, so the proxy starts while the database is down). Waiting for a free
/// connection, opening one and checking a returned one are each bounded by `store.timeout`;
/// `StoreHandle` bounds the whole call too.
pub(super) fn build(
    settings: &PostgresSettings,
    size: u32,
    timeout: Duration,
) -> Result<(Pool, MakeRustlsConnect), StoreError> {
    let tls = super::secured::connector(settings.ca_pem.as_deref())
        .map_err(|why| error::backend("connect", why))?;
    let manager = Manager::from_config(
        pg_config(settings, timeout),
        tls.clone(),
        ManagerConfig {
            // A returned connection is checked only for being closed: a test query would be one
            // more round trip per operation, and a connection that failed mid-call is never
            // returned (see `Conn`).
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager)
        .max_size(usize::try_from(size).unwrap_or(usize::MAX))
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(timeout))
        .create_timeout(Some(timeout))
        .recycle_timeout(Some(timeout))
        .build()
        .map_err(|e| error::backend("connect", format!("cannot build the pool: {e}")))?;
    Ok((pool, tls))
}

/// The pool and the gauges that show it.
pub(super) struct Connections {
    pool: Pool,
    /// `store.timeout`: how long a returned connection's check, or a connection's settling,
    /// may take.
    timeout: Duration,
    /// For the cancel requests of [`settle`]: TLS as the pool's connections have it.
    tls: MakeRustlsConnect,
    /// Every statement the store runs, prepared on a settled connection before it goes back.
    statements: Vec<String>,
    /// Shared with the settling tasks, which show the pool again once their connection is
    /// back or closed.
    gauges: Arc<PoolGauges>,
}

/// The PostgreSQL store's series: its pools' gauges, every worker's together (each worker sets
/// its part through a [`GaugePart`]).
#[derive(Clone, Debug, Default)]
pub struct PostgresSeries {
    /// Connections the pools hold open.
    pub(super) connections: Gauge,
    /// Connections lent out to an operation.
    pub(super) in_use: Gauge,
    /// Operations waiting for a connection.
    pub(super) waiting: Gauge,
}

impl StoreSeries for PostgresSeries {
    fn register(registry: &mut Registry) -> Self {
        let series = PostgresSeries::default();
        registry.register_collector(Box::new(series.clone()));
        series
    }
}

impl Collector for PostgresSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let e = &mut encoder;
        encode_one(
            e,
            "idemproxy_postgres_pool_connections",
            "PostgreSQL connections the pools and the shared readers hold open, every worker's together (at most store.pool_size, or workers when that is larger)",
            &self.connections,
        )?;
        encode_one(
            e,
            "idemproxy_postgres_pool_in_use",
            "PostgreSQL connections lent out to a store operation, every worker's together",
            &self.in_use,
        )?;
        encode_one(
            e,
            "idemproxy_postgres_pool_waiting",
            "Store operations waiting for a PostgreSQL connection, every worker's together",
            &self.waiting,
        )
    }
}

/// This pool's parts of the pool gauges: every worker has a pool of its own, and the series
/// show the sum of them all.
struct PoolGauges {
    connections: GaugePart,
    in_use: GaugePart,
    waiting: GaugePart,
    /// Held from reading the pool's status to setting the parts, so that of two callers racing
    /// the one that read the later status sets the parts last: a settling task that closes its
    /// connection while a request returns one never leaves the gauges at the earlier status.
    showing: Mutex<()>,
}

impl PoolGauges {
    fn of(series: &PostgresSeries) -> PoolGauges {
        PoolGauges {
            connections: GaugePart::of(&series.connections),
            in_use: GaugePart::of(&series.in_use),
            waiting: GaugePart::of(&series.waiting),
            showing: Mutex::new(()),
        }
    }

    /// Copies the pool's status into the gauges: cheap (two uncontended locks), done at every
    /// checkout and return, and when a settling task is done with its connection.
    fn show(&self, pool: &Pool) {
        let _showing = self
            .showing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let status = pool.status();
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.connections.set(gauge(status.size));
        self.in_use
            .set(gauge(status.size.saturating_sub(status.available)));
        self.waiting.set(gauge(status.waiting));
    }
}

impl Connections {
    pub(super) fn new(
        pool: Pool,
        tls: MakeRustlsConnect,
        statements: Vec<String>,
        timeout: Duration,
        metrics: &Metrics,
    ) -> Connections {
        let connections = Connections {
            pool,
            timeout,
            tls,
            statements,
            gauges: Arc::new(PoolGauges::of(&metrics.store_series())),
        };
        connections.show();
        connections
    }

    /// Whether the pool has room for one more connection and none idle: requests would open
    /// their own (see `warm.rs`).
    pub(super) fn wants_one(&self) -> bool {
        let status = self.pool.status();
        status.available == 0 && status.size < status.max_size
    }

    /// Drops the idle connections whose session has ended (reset by a failover or a network
    /// fault, or closed by a restarted server). Left in the pool, each would be lent to the next
    /// operation, which would find it closed and open a new connection inside its own
    /// `store.timeout` — a 503 on a database far away — and the warmer, seeing an idle
    /// connection, would open none ahead of it. With a pool a worker, that would be one such
    /// request on every worker after every reset. One lock and a flag an idle connection.
    pub(super) fn drop_closed(&self) {
        let dropped = self
            .pool
            .retain(|client, _| !client.is_closed())
            .removed
            .len();
        if dropped > 0 {
            self.show();
            tracing::debug!(dropped, "postgres: idle connections found closed; dropped");
        }
    }

    /// A connection for the warmer: an idle one if there is one, else a new one with
    /// [`super::warm::OPEN_WITHIN`] to open, and only if the pool has room now (it never waits
    /// for a request's connection to come back).
    pub(super) async fn open(&self, op: &'static str) -> Result<Conn<'_>, StoreError> {
        let timeouts = Timeouts {
            wait: Some(Duration::ZERO),
            create: Some(super::warm::OPEN_WITHIN),
            recycle: Some(self.timeout),
        };
        let got = self.pool.timeout_get(&timeouts).await;
        self.show();
        Ok(Conn {
            object: Some(got.map_err(error::pool(op))?),
            finished: false,
            connections: self,
        })
    }

    /// A connection for `op`, within `store.timeout`.
    pub(super) async fn get(&self, op: &'static str) -> Result<Conn<'_>, StoreError> {
        let got = self.pool.get().await;
        self.show();
        Ok(Conn {
            object: Some(got.map_err(error::pool(op))?),
            finished: false,
            connections: self,
        })
    }

    fn show(&self) {
        self.gauges.show(&self.pool);
    }
}

/// A checked-out connection. Goes back to the pool only after [`Conn::finished`]; dropped before
/// that (the call failed, or its future was dropped at `store.timeout`), it is detached from
/// the pool and closed.
pub(super) struct Conn<'a> {
    object: Option<Object>,
    finished: bool,
    connections: &'a Connections,
}

impl Conn<'_> {
    /// The call on this connection completed: it may serve the next one.
    pub(super) fn finished(mut self) {
        self.finished = true;
    }
}

impl std::ops::Deref for Conn<'_> {
    type Target = deadpool_postgres::ClientWrapper;

    fn deref(&self) -> &Self::Target {
        // Set in `get` and taken only in `drop`.
        match &self.object {
            Some(object) => object,
            None => unreachable!("a connection is used after it was dropped"),
        }
    }
}

impl std::ops::DerefMut for Conn<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match &mut self.object {
            Some(object) => object,
            None => unreachable!("a connection is used after it was dropped"),
        }
    }
}

impl Drop for Conn<'_> {
    fn drop(&mut self) {
        if let Some(object) = self.object.take() {
            if self.finished {
                drop(object);
            } else if object.is_closed() {
                // Nothing runs on a session that has ended.
                drop(Object::take(object));
            } else if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let c = self.connections;
                let settling = settle(object, c.tls.clone(), c.statements.clone(), c.timeout);
                let (pool, gauges) = (c.pool.clone(), Arc::clone(&c.gauges));
                runtime.spawn(async move {
                    settling.await;
                    // Nothing else may check out or return a connection after this one is
                    // done with: without this the gauges would show it in use until then.
                    gauges.show(&pool);
                });
            } else {
                drop(Object::take(object));
            }
        }
        self.connections.show();
    }
}

/// Settles a connection whose call did not finish (see the module): its statement cancelled,
/// its session seen idle and outside a transaction, its statements prepared afresh, all within
/// `within`; then it goes back to the pool. Otherwise it is closed. Meanwhile it counts in the
/// pool's size, so no replacement is opened beside a session that may still be running.
async fn settle(object: Object, tls: MakeRustlsConnect, statements: Vec<String>, within: Duration) {
    let settled = tokio::time::timeout(within, async {
        object.cancel_token().cancel_query(tls).await?;
        // Answered only once the cancelled statement has ended; it ends any transaction
        // left open (a schema setup cut short) and is a no-op outside one.
        object.batch_execute("ROLLBACK").await?;
        // A statement that failed may have been one the server no longer knows.
        object.statement_cache.clear();
        futures_util::future::try_join_all(statements.iter().map(|sql| object.prepare_cached(sql)))
            .await
            .map(drop)
    })
    .await;
    match settled {
        Ok(Ok(())) => drop(object),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "postgres: a connection whose call did not finish could not be settled; closed");
            drop(Object::take(object));
        }
        Err(_) => {
            tracing::debug!(within = ?within, "postgres: a connection whose call did not finish was not settled in time; closed");
            drop(Object::take(object));
        }
    }
}
