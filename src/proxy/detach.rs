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

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};

/// An exchange future that runs to its end whatever happens to whoever awaits it.
pub(super) struct Detachable<F: Future<Output: Send + 'static> + Send + 'static> {
    /// `None` once it has ended (or panicked).
    exchange: Option<Pin<Box<F>>>,
}

/// The exchange panicked; the message, for the log.
#[derive(Debug)]
pub(super) struct Panicked(pub String);

impl<F: Future<Output: Send + 'static> + Send + 'static> Detachable<F> {
    pub fn new(exchange: F) -> Self {
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
