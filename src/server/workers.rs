//! Workers (`workers: N`): one current-thread Tokio runtime a worker, each on an OS thread of
//! its own, each with an accept loop on a socket of its own bound to the main listen address.
//! The sockets share the port with `SO_REUSEPORT`, so the kernel spreads new connections
//! across them; a connection then lives on the worker that accepted it, with everything its
//! requests use on the same thread: no work-stealing scheduler, no cross-thread wake-ups.
//!
//! What each worker has of its own: its runtime, socket and accept loop; a client for every
//! upstream, with its pooled connections (see `proxy/generation.rs`); with Redis or PostgreSQL,
//! its own store connections (see [`super::stores`]). What they all share: the [`Proxy`] — the
//! configuration in force, one `ArcSwap` that a reload swaps once for all of them —, the
//! memory or SQLite store, the metrics registry, the tracker of background tasks and the
//! pending saves (so a drain waits for every worker's), and the bound on open connections
//! (`limits.max_connections` is the address's, one semaphore for every socket).
//!
//! Worker 0 is the runtime [`Workers::start`] is called on (`main`'s), and what stays single
//! runs there too: signal handling (SIGHUP reloads, SIGTERM drains), the configuration reload
//! source, the pid file and the admin listener. Why there and not on a runtime of its own:
//! that work is rare and light (a signal, a reload, a scrape), and on worker 0 it uses worker
//! 0's store connections — readiness pings the very connections requests use, and no extra
//! thread or pool exists only to idle. With `workers: 1` the proxy is one thread.

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::bind::bind_shared;
use super::error::RunError;
use super::serving::{Drained, begin_drain, serve_worker};
use super::stores;
use crate::config::{BackendSettings, Config};
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::store::{Store, StoreHandle};
use crate::traces::Traces;

/// The proxy's workers, serving. [`Workers::drain`] ends them; dropped, they stop accepting
/// and drain on their own.
pub struct Workers {
    proxy: Arc<Proxy>,
    /// Cancels, when dropped, the token on which every worker stops accepting.
    stop: DropGuard,
    /// Worker 0's accept loop and drain, a task on the caller's runtime.
    first: JoinHandle<Drained>,
    /// Each other worker's end: its drain's, sent once its runtime is gone.
    others: Vec<oneshot::Receiver<Drained>>,
}

impl Workers {
    /// Builds the store(s) and the proxy and starts `config.workers` workers on `listener`'s
    /// address: worker 0 on `listener`, here; each other on a thread of its own, on a socket
    /// bound to the same address (the port `listener` has, when it asked for port 0). Returns
    /// once every worker's socket listens (connections queue there until its accept loop
    /// takes them). A worker that cannot bind or open its store fails the start, and the
    /// workers already started are stopped first.
    pub async fn start(
        listener: TcpListener,
        config: Config,
        metrics: Arc<Metrics>,
    ) -> Result<Workers, RunError> {
        let workers = config.workers.max(1);
        // Before anything serves: every request finds the tracer in place. The exporter's
        // thread lives as long as the proxy; [`Workers::stop`] flushes its queue.
        let traces = Traces::configured(&config, &metrics).map_err(RunError::Traces)?;
        let addr = listener.local_addr()?;
        // Every worker's series from the start, at 0.
        for worker in 0..workers {
            let _ = metrics.worker_connections(worker);
        }
        let max_connections = usize::try_from(config.limits.max_connections).unwrap_or(usize::MAX);
        let slots = Arc::new(Semaphore::new(max_connections.max(1)));
        let stop = CancellationToken::new();
        // Every worker's socket first, before anything slow: until a worker's socket is bound,
        // every new connection lands on the sockets already there.
        let sockets = bind_others(addr, workers)?;
        if let BackendSettings::Postgres(pg) = &config.store.backend
            && usize::try_from(pg.pool_size).is_ok_and(|pool| pool < workers)
        {
            tracing::warn!(
                pool_size = pg.pool_size,
                workers,
                "store.pool_size is below workers: every worker opens one PostgreSQL connection, {workers} in all"
            );
        }
        // A shared store is opened once, here; each worker of a per-worker backend opens its
        // own, on its own runtime.
        let shared = if stores::is_shared(&config.store.backend) {
            Some(stores::open(&config, metrics.clone(), 0, workers).await?)
        } else {
            None
        };
        let mut starting = Vec::with_capacity(workers - 1);
        for (worker, socket) in (1..workers).zip(sockets) {
            let seed = Seed {
                worker,
                workers,
                socket,
                config: config.clone(),
                metrics: metrics.clone(),
                shared: shared.clone(),
                slots: slots.clone(),
                stop: stop.clone(),
            };
            match seed.spawn() {
                Ok(started) => starting.push(started),
                Err(e) => {
                    abandon(starting).await;
                    return Err(e);
                }
            }
        }
        let (first, more) = match open_stores(&config, &metrics, shared, &mut starting).await {
            Ok(stores) => stores,
            Err(e) => {
                abandon(starting).await;
                return Err(e);
            }
        };
        let timeout = config.store.timeout;
        let handle = |store: Arc<dyn Store>| StoreHandle::new(store, timeout, metrics.clone());
        let more = more.into_iter().map(handle).collect();
        let first = handle(first);
        let proxy =
            Arc::new(Proxy::with_workers(config, first, more, metrics.clone()).traced(traces));
        let mut others = Vec::with_capacity(starting.len());
        for s in starting {
            // A worker gone meanwhile reports it through its `done`.
            let _ = s.proxy.send(proxy.clone());
            others.push(s.done);
        }
        let first = tokio::spawn(serve_worker(
            listener,
            proxy.clone(),
            0,
            slots,
            stop.clone().cancelled_owned(),
        ));
        Ok(Workers {
            proxy,
            stop: stop.drop_guard(),
            first,
            others,
        })
    }

    /// The proxy every worker serves.
    pub fn proxy(&self) -> &Arc<Proxy> {
        &self.proxy
    }

    /// The graceful shutdown, on every worker: readiness answers 503 from now on, every worker
    /// keeps accepting for `drain_delay`, then every one stops accepting, finishes the
    /// requests in flight and waits for the background tasks (detached upstream calls, saves
    /// being retried, their lease renewals) — of every worker, as they share one tracker — all
    /// within `shutdown_timeout`. Returns once every worker has ended.
    pub async fn drain(self) {
        begin_drain(&self.proxy).await;
        self.stop().await;
    }

    /// Stops every worker's accept loop now (no `drain_delay`), then drains as
    /// [`Workers::drain`] does.
    pub async fn stop(self) {
        let Workers {
            proxy,
            stop,
            first,
            others,
        } = self;
        let timeout = proxy.config().shutdown_timeout;
        tracing::info!(
            ?timeout,
            workers = others.len() + 1,
            "shutting down: no new connections; waiting for requests in flight on every worker"
        );
        drop(stop);
        let mut in_time = match first.await {
            Ok(drained) => drained.in_time,
            Err(e) => {
                tracing::error!(worker = 0, error = %e, "a worker ended without its drain");
                false
            }
        };
        for (i, done) in others.into_iter().enumerate() {
            match done.await {
                Ok(drained) => in_time &= drained.in_time,
                Err(_) => {
                    tracing::error!(worker = i + 1, "a worker ended without its drain");
                    in_time = false;
                }
            }
        }
        if in_time {
            tracing::info!("shutdown complete");
        } else {
            tracing::warn!("shutdown_timeout reached with work still in flight; exiting anyway");
        }
        proxy.log_pending_saves();
        // Last, so that the drain's spans go too; bounded (a collector that is down delays
        // the exit by one export timeout at most), off the runtime's thread.
        if let Some(traces) = proxy.traces().cloned() {
            let _ = tokio::task::spawn_blocking(move || traces.shutdown()).await;
        }
    }
}

/// Every worker's socket but worker 0's, bound to `addr` (its port resolved): first, before
/// anything slow, since until a worker's socket is bound every new connection lands on the
/// sockets already there.
fn bind_others(
    addr: std::net::SocketAddr,
    workers: usize,
) -> Result<Vec<std::net::TcpListener>, RunError> {
    (1..workers)
        .map(|worker| {
            bind_shared(addr)
                .and_then(TcpListener::into_std)
                .map_err(|error| RunError::Worker {
                    worker,
                    what: "cannot bind a socket of its own to the listen address (SO_REUSEPORT)",
                    error,
                })
        })
        .collect()
}

/// Worker 0's store (`shared`, or its own opened here while the others open theirs), then
/// each starting worker's, as it reports it ready; the first failure, if any.
async fn open_stores(
    config: &Config,
    metrics: &Arc<Metrics>,
    shared: Option<Arc<dyn Store>>,
    starting: &mut [Starting],
) -> Result<(Arc<dyn Store>, Vec<Arc<dyn Store>>), RunError> {
    let workers = starting.len() + 1;
    let first = match shared {
        Some(store) => Ok(store),
        None => stores::open(config, metrics.clone(), 0, workers)
            .await
            .inspect(|store| stores::warm(store, config.store.timeout)),
    };
    let mut more = Ok(Vec::with_capacity(starting.len()));
    for s in starting {
        let ready = (&mut s.ready)
            .await
            .unwrap_or(Err(RunError::WorkerLost(s.worker)));
        match (&mut more, ready) {
            (Ok(stores), Ok(store)) => stores.push(store),
            (Ok(_), Err(e)) => more = Err(e),
            (Err(_), _) => {}
        }
    }
    Ok((first?, more?))
}

/// Stops workers that started while the start failed elsewhere, and waits until each thread
/// has dropped its runtime (and with it its connections).
async fn abandon(starting: Vec<Starting>) {
    for s in starting {
        // Dropping its `proxy` sender tells a worker waiting for the proxy to end.
        let Starting { done, proxy, .. } = s;
        drop(proxy);
        let _ = done.await;
    }
}

/// What a worker thread starts with.
struct Seed {
    worker: usize,
    workers: usize,
    /// Its socket, bound to worker 0's address and listening; registered with its runtime
    /// once that runs.
    socket: std::net::TcpListener,
    config: Config,
    metrics: Arc<Metrics>,
    /// The store every worker shares, if the backend is one.
    shared: Option<Arc<dyn Store>>,
    slots: Arc<Semaphore>,
    stop: CancellationToken,
}

/// A worker thread, starting: how it says it is ready (or why it cannot be), how it gets the
/// proxy, and how it says it has ended.
struct Starting {
    worker: usize,
    ready: oneshot::Receiver<Result<Arc<dyn Store>, RunError>>,
    proxy: oneshot::Sender<Arc<Proxy>>,
    done: oneshot::Receiver<Drained>,
}

impl Seed {
    /// Starts the worker's thread.
    fn spawn(self) -> Result<Starting, RunError> {
        let worker = self.worker;
        let (ready_tx, ready) = oneshot::channel();
        let (proxy, proxy_rx) = oneshot::channel();
        let (done_tx, done) = oneshot::channel();
        std::thread::Builder::new()
            // Short: Linux keeps 15 bytes of a thread's name (`top -H`, `/proc/PID/task`).
            .name(format!("worker-{worker}"))
            .spawn(move || self.run(ready_tx, proxy_rx, done_tx))
            .map_err(|error| RunError::Worker {
                worker,
                what: "cannot start its thread",
                error,
            })?;
        Ok(Starting {
            worker,
            ready,
            proxy,
            done,
        })
    }

    /// The worker thread: its runtime; on it, its store; then, once the proxy is built, its
    /// accept loop until the drain. `done` is sent after the runtime is dropped,
    /// so that the worker's connections are closed by then.
    fn run(
        self,
        ready: oneshot::Sender<Result<Arc<dyn Store>, RunError>>,
        proxy: oneshot::Receiver<Arc<Proxy>>,
        done: oneshot::Sender<Drained>,
    ) {
        let worker = self.worker;
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(error) => {
                let _ = ready.send(Err(RunError::Worker {
                    worker,
                    what: "cannot start its runtime",
                    error,
                }));
                return;
            }
        };
        let drained = runtime.block_on(async move {
            let listener = match TcpListener::from_std(self.socket) {
                Ok(listener) => listener,
                Err(error) => {
                    let _ = ready.send(Err(RunError::Worker {
                        worker,
                        what: "cannot register its socket with its runtime",
                        error,
                    }));
                    return None;
                }
            };
            let store = match self.shared {
                Some(store) => Ok(store),
                None => stores::open(&self.config, self.metrics, worker, self.workers)
                    .await
                    .inspect(|store| stores::warm(store, self.config.store.timeout)),
            };
            let failed = store.is_err();
            if ready.send(store).is_err() || failed {
                return None;
            }
            // No proxy: the start failed elsewhere.
            let proxy = proxy.await.ok()?;
            Some(
                serve_worker(
                    listener,
                    proxy,
                    worker,
                    self.slots,
                    self.stop.cancelled_owned(),
                )
                .await,
            )
        });
        drop(runtime);
        if let Some(drained) = drained {
            let _ = done.send(drained);
        }
    }
}
