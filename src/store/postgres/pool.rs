//! Connections: the tokio-postgres settings, the deadpool pool, and [`Conn`], the checkout
//! that discards its connection unless the call on it finished.
//!
//! Why a call that did not finish loses its connection: `StoreHandle` drops an operation's
//! future at `store.timeout`, and the connection it was using is then most likely to a server
//! that hangs (SIGSTOP, a blackholed network) with that query still in flight on it. Handed back
//! to the pool, it would be checked out again and every later operation on it would queue
//! behind the stuck query, one `store.timeout` each, until the server answers or the kernel
//! gives up on the socket. Detached with `Object::take` and dropped, its client and socket
//! close (the server rolls back whatever it had not committed) and the pool opens a fresh one.
//! A call that failed with an error is treated the same way: cheaper than telling which errors
//! leave a connection fit.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime, Timeouts};

use super::error;
use crate::config::PostgresSettings;
use crate::metrics::{GaugePart, Metrics};
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

/// The pool: at most `pool_size` connections, made on demand (none at start, so the proxy
/// starts while the database is down). Waiting for a free connection, opening one and checking
/// a returned one are each bounded by `store.timeout`; `StoreHandle` bounds the whole call too.
pub(super) fn build(settings: &PostgresSettings, timeout: Duration) -> Result<Pool, StoreError> {
    let tls = super::tls::connector(settings.ca_pem.as_deref())
        .map_err(|why| error::backend("connect", why))?;
    let manager = Manager::from_config(
        pg_config(settings, timeout),
        tls,
        ManagerConfig {
            // A returned connection is checked only for being closed: a test query would be one
            // more round trip per operation, and a connection that failed mid-call is never
            // returned (see `Conn`).
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(usize::try_from(settings.pool_size).unwrap_or(usize::MAX))
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(timeout))
        .create_timeout(Some(timeout))
        .recycle_timeout(Some(timeout))
        .build()
        .map_err(|e| error::backend("connect", format!("cannot build the pool: {e}")))
}

/// The pool and the gauges that show it.
pub(super) struct Connections {
    pool: Pool,
    /// `store.timeout`: how long a returned connection's check may take.
    timeout: Duration,
    gauges: PoolGauges,
}

/// This pool's parts of the pool gauges: every worker has a pool of its own, and the series
/// show the sum of them all.
struct PoolGauges {
    connections: GaugePart,
    in_use: GaugePart,
    waiting: GaugePart,
}

impl Connections {
    pub(super) fn new(pool: Pool, timeout: Duration, metrics: &Metrics) -> Connections {
        let connections = Connections {
            pool,
            timeout,
            gauges: PoolGauges {
                connections: GaugePart::of(&metrics.postgres_pool_connections),
                in_use: GaugePart::of(&metrics.postgres_pool_in_use),
                waiting: GaugePart::of(&metrics.postgres_pool_waiting),
            },
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

    /// Copies the pool's status into the gauges: cheap (one uncontended lock), done at every
    /// checkout and return.
    fn show(&self) {
        let status = self.pool.status();
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.gauges.connections.set(gauge(status.size));
        self.gauges
            .in_use
            .set(gauge(status.size.saturating_sub(status.available)));
        self.gauges.waiting.set(gauge(status.waiting));
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
            } else {
                // Dropping the client aborts its connection task: the socket closes, and the
                // server ends the session (rolling back whatever it had not committed).
                drop(Object::take(object));
            }
        }
        self.connections.show();
    }
}
