//! One more try for a command whose connection had dropped.
//!
//! Redis closes its connections when it restarts, and closes one idle for longer than its
//! `timeout` setting; a load balancer or a NAT on the way may drop an idle one too. The client
//! notices only when the next command fails on the dead connection (`broken pipe`, a reset),
//! and reconnects for the command after that one ([`redis::aio::ConnectionManager`] does it by
//! itself). Without a second try, the first store operation after every such drop answers 503,
//! on every instance.
//!
//! The client cannot tell whether the failed command reached Redis before the connection
//! broke, so a command is sent again only where a second copy after a first that landed
//! answers the same (the store contract in [`crate::store`]):
//! - claim: `SET NX GET` finds its own claim (the same token) and reports the key claimed;
//! - renew: a lease extended twice is extended;
//! - save: the script finds its own finished record and answers done (a staged
//!   save writes its staging key again, and the script finds the record under the key
//!   identical to it, and deletes the copy);
//! - release: the script finds the key gone and answers so, which is no lost lease;
//! - get, inspect, ping: reads.
//!
//! `forget` is not sent again: a second try after the first deleted the record would report
//! the key absent. A timeout is not tried again either: Redis may be hung. A refused connection
//! sent nothing, so any command may go again; on one Redis it gets one more try, because the
//! refusal may be an old one: the connection manager makes one attempt per reconnection, and
//! the failed attempt stays in place until an operation finds it and starts the next. The
//! second try is that next attempt: Redis still down is refused again at once (a 503 without
//! waiting), and Redis back is served. The cluster client has retries of its own, so there a
//! refusal is final. Both tries run under the one deadline of the operation (`store.timeout`).

use redis::{RedisError, RedisResult};

/// Whether `e` says the connection had broken, as opposed to Redis refusing connections (it is
/// down: a second try would only wait for the reconnection to fail too), a timeout (it may be
/// hung) or an answer of Redis's.
pub(crate) fn dropped(e: &RedisError) -> bool {
    e.is_connection_dropped() && !e.is_connection_refusal()
}

/// Runs `attempt`, and once more if its connection had dropped, or (`refused_again`) if the
/// connection was refused. `op` names the operation for the log.
pub(crate) async fn once_more<T, Fut>(
    op: &'static str,
    refused_again: bool,
    mut attempt: impl FnMut() -> Fut,
) -> RedisResult<T>
where
    Fut: Future<Output = RedisResult<T>>,
{
    match attempt().await {
        Err(e) if dropped(&e) => {
            tracing::debug!(op, error = %e, "the Redis connection had dropped; sending again");
            attempt().await
        }
        Err(e) if refused_again && e.is_connection_refusal() => {
            tracing::debug!(op, error = %e, "the Redis connection was refused; one new attempt");
            attempt().await
        }
        done => done,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    #[test]
    fn only_a_broken_connection_is_tried_again() {
        let io = |kind| RedisError::from(io::Error::from(kind));
        assert!(dropped(&io(io::ErrorKind::BrokenPipe)));
        assert!(dropped(&io(io::ErrorKind::ConnectionReset)));
        assert!(dropped(&io(io::ErrorKind::UnexpectedEof)));
        assert!(!dropped(&io(io::ErrorKind::ConnectionRefused)), "down");
        assert!(!dropped(&io(io::ErrorKind::TimedOut)), "maybe hung");
        let answer = RedisError::from((redis::ErrorKind::Client, "an answer"));
        assert!(!dropped(&answer));
    }

    #[tokio::test]
    async fn a_dropped_connection_gets_one_more_try_and_no_more() {
        let mut tries = 0;
        let result: RedisResult<()> = once_more("test", false, || {
            tries += 1;
            async { Err(RedisError::from(io::Error::from(io::ErrorKind::BrokenPipe))) }
        })
        .await;
        assert!(result.is_err());
        assert_eq!(tries, 2);

        let mut tries = 0;
        let result = once_more("test", false, || {
            tries += 1;
            let n = tries;
            async move {
                if n == 1 {
                    Err(RedisError::from(io::Error::from(
                        io::ErrorKind::ConnectionReset,
                    )))
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(result.ok(), Some(2));

        for (refused_again, want) in [(false, 1), (true, 2)] {
            let mut tries = 0;
            let refused: RedisResult<()> = once_more("test", refused_again, || {
                tries += 1;
                async {
                    Err(RedisError::from(io::Error::from(
                        io::ErrorKind::ConnectionRefused,
                    )))
                }
            })
            .await;
            assert!(refused.is_err());
            assert_eq!(
                tries, want,
                "a refused connection is tried again only where asked, once"
            );
        }
    }
}
