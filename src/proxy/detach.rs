//! Running an exchange in the request's own task, handed to a task of its own only if the
//! client leaves first.
//!
//! An exchange must never be cancelled halfway (a claim half made, an upstream call with
//! nobody to complete it): the disconnect rule. Spawning every exchange into its own task
//! keeps that rule but costs each request a spawn, a wake-up of the waiting request task and,
//! often, a hop to the other worker thread. [`Detachable`] keeps the rule at the price of the
//! rare case: it polls the exchange inline, and when the request future is dropped before the
//! exchange has ended (the client went away), it moves the still-pinned exchange into a task
//! of its own, where it runs to its end exactly as it would have.
//!
//! Whether it did is counted (`idemproxy_detached_exchanges`, which bounds them) by two guards
//! over one [`Attachment`]: [`ExchangeEnd`] inside the exchange and [`ClientWatch`] in the
//! client's request future; whichever is dropped first decides.

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll};

use prometheus_client::metrics::gauge::Gauge;

/// An exchange future that runs to its end whatever happens to whoever awaits it.
pub(super) struct Detachable<F: Future<Output: Send + 'static> + Send + 'static> {
    /// `None` once it has ended (or panicked).
    exchange: Option<Pin<Box<F>>>,
}

/// The exchange panicked; the message, for the log.
#[derive(Debug)]
pub(super) struct Panicked(pub String);

impl<F: Future<Output: Send + 'static> + Send + 'static> Detachable<F> {
    pub(crate) fn new(exchange: F) -> Self {
        Detachable {
            exchange: Some(Box::pin(exchange)),
        }
    }
}

impl<F: Future<Output: Send + 'static> + Send + 'static> Future for Detachable<F> {
    type Output = Result<F::Output, Panicked>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(exchange) = self.exchange.as_mut() else {
            return Poll::Ready(Err(Panicked("polled after it ended".to_owned())));
        };
        // A panic inside is the exchange's own failure, answered as such (500), as a panic in
        // a spawned task would be; it must not take the client's connection down with it.
        match catch_unwind(AssertUnwindSafe(|| exchange.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => {
                self.exchange = None;
                Poll::Ready(Ok(out))
            }
            Err(panic) => {
                self.exchange = None;
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".to_owned());
                Poll::Ready(Err(Panicked(message)))
            }
        }
    }
}

impl<F: Future<Output: Send + 'static> + Send + 'static> Drop for Detachable<F> {
    fn drop(&mut self) {
        if let Some(exchange) = self.exchange.take() {
            // The box keeps the exchange where it was pinned; only the pointer moves. Outside
            // a runtime (the process is going away) there is nothing left to run it on.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(exchange);
            }
        }
    }
}

/// Whether the client still waits for an exchange: `ATTACHED`, then `GONE` (the client left
/// first) or `FINISHED` (the exchange ended first). Each side moves it once.
#[derive(Default)]
pub(super) struct Attachment(AtomicU8);

const ATTACHED: u8 = 0;
const GONE: u8 = 1;
const FINISHED: u8 = 2;

impl Attachment {
    /// The client left; `true` if the exchange was still running.
    fn leave(&self) -> bool {
        self.0
            .compare_exchange(ATTACHED, GONE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The exchange ended; `true` if its client had left before.
    fn finish(&self) -> bool {
        self.0.swap(FINISHED, Ordering::AcqRel) == GONE
    }

    /// Whether the client has left.
    pub(crate) fn is_gone(&self) -> bool {
        self.0.load(Ordering::Acquire) == GONE
    }
}

/// A new exchange's attachment and its two guards, counting in `detached` the time the
/// exchange runs after its client left.
pub(super) fn guards(detached: Gauge) -> (Arc<Attachment>, ExchangeEnd, ClientWatch) {
    let attachment = Arc::new(Attachment::default());
    let end = ExchangeEnd {
        attachment: attachment.clone(),
        detached: detached.clone(),
    };
    let watch = ClientWatch {
        attachment: attachment.clone(),
        detached,
    };
    (attachment, end, watch)
}

/// Uncounts a detached exchange when it ends; held by the exchange, so a panic drops it too
/// and the gauge never drifts.
pub(super) struct ExchangeEnd {
    attachment: Arc<Attachment>,
    detached: Gauge,
}

impl Drop for ExchangeEnd {
    fn drop(&mut self) {
        if self.attachment.finish() {
            self.detached.dec();
        }
    }
}

/// Counts an exchange as detached when its client's request future is dropped first.
pub(super) struct ClientWatch {
    attachment: Arc<Attachment>,
    detached: Gauge,
}

impl Drop for ClientWatch {
    fn drop(&mut self) {
        if self.attachment.leave() {
            self.detached.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[tokio::test]
    async fn an_exchange_dropped_halfway_runs_to_its_end_in_a_task_of_its_own() {
        let ended = Arc::new(AtomicBool::new(false));
        let exchange = {
            let ended = ended.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                ended.store(true, Ordering::SeqCst);
            }
        };
        // The client gives up after 5 ms: its wait is dropped, the exchange is not.
        let waited =
            tokio::time::timeout(Duration::from_millis(5), Detachable::new(exchange)).await;
        assert!(waited.is_err(), "the exchange was still running");
        assert!(!ended.load(Ordering::SeqCst));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            ended.load(Ordering::SeqCst),
            "the detached exchange ran to its end"
        );
    }

    #[tokio::test]
    async fn a_panicking_exchange_is_an_error_not_a_panic_of_the_caller() {
        let out = Detachable::new(async {
            if true {
                panic!("the exchange failed inside");
            }
        })
        .await;
        let Err(Panicked(message)) = out else {
            panic!("a panic is an error")
        };
        assert_eq!(message, "the exchange failed inside");
    }

    #[tokio::test]
    async fn a_finished_exchange_is_not_run_again_on_drop() {
        let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = runs.clone();
        let out = Detachable::new(async move { counted.fetch_add(1, Ordering::SeqCst) }).await;
        assert!(matches!(out, Ok(0)));
        tokio::task::yield_now().await;
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
}
