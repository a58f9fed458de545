//! The store contract (`src/store/mod.rs`): every check that holds the same on every store —
//! memory, SQLite, PostgreSQL, Redis, Redis Cluster — written once here and run by each
//! backend's own test module in `tests/stores/` through [`store_contract!`](crate::store_contract),
//! with a flag for each optional capability the backend has ([`Capabilities`]).
//!
//! - [`basic`] — the plain claim: exclusive, fenced, renewed, released, completed once;
//!   `inspect`, `forget`, `wait_change`; small and large records.
//! - [`resolvable`] — the claim of a `resolve` route: its times on the store's clock, takeover,
//!   lifetime, fencing; on real time everywhere, and over minutes where the clock can be moved.
//! - [`written`] — what each transition writes, read back with the proxy's decoder.
//!
//! Each check talks to the bare backend through a [`StoreHandle`], as the proxy does (every
//! call under a deadline, records decoded in one place), and to the bare backend itself only
//! for what the handle keeps to the crate (`inspect`, `forget`, `wait_change`).
//!
//! Time passes one way, through the [`Subject`]'s [`Clock`]: on real time (SQLite, PostgreSQL
//! and Redis keep time themselves; the memory store on Tokio's clock, not paused) leases are
//! short and every wait for one to lapse polls with a generous deadline, as the machine is
//! small and shared; where the clock can be moved (Tokio's paused clock for memory, SQLite's
//! clock moved ahead) the checks of leases and lifetimes of minutes run in an instant.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderName, StatusCode};
use idemproxy::metrics::Metrics;
use idemproxy::record::{Record, Saved, SavedResponse};
use idemproxy::store::{Forgotten, Held, Store, StoreHandle, StoreKey};

use crate::{Backend, Env};

pub mod basic;
pub mod resolvable;
pub mod written;

pub use basic::*;
pub use resolvable::{
    a_claim_is_released_and_a_resolved_record_forgotten,
    a_claim_lives_its_lifetime_whatever_its_lease,
    a_lapsed_claim_is_taken_over_by_exactly_one_of_many,
    a_resolvable_claim_is_released_only_while_its_lease_holds,
    a_resolvable_claim_is_taken_over_after_its_lease_and_fences_its_first_holder,
    a_resolvable_claim_lives_its_lifetime_whatever_its_lease,
    a_version_2_claim_is_taken_over_and_counts_from_the_timeout,
};
pub use written::what_each_transition_writes_decodes;

/// Every check of the contract as a test of its own, for one backend: those on real time,
/// then one more set for each capability flag (`shared`, `moved_clock`, `paused_clock`; see
/// [`Capabilities`]). In a backend's test module:
///
/// ```ignore
/// harness::store_contract!(Sqlite { moved_clock });
/// ```
///
/// declares `mod contract` there, its tests named after the checks.
#[macro_export]
macro_rules! store_contract {
    ($backend:ident { $($cap:ident),* $(,)? }) => {
        /// The store contract (`harness::store_checks`), each check a test of its own.
        mod contract {
            const CAPS: $crate::store_checks::Capabilities = $crate::store_checks::Capabilities {
                $($cap: true,)*
                ..$crate::store_checks::Capabilities::NONE
            };
            $crate::store_contract!(@real $backend, [
                a_claim_is_exclusive_and_a_finished_record_is_what_claims_read,
                a_repeated_key_is_free_once_its_record_expires,
                one_of_many_concurrent_claims_takes_the_key,
                renewal_keeps_a_claim_and_its_end_frees_the_key,
                a_lapsed_claim_can_neither_renew_nor_complete,
                release_frees_only_the_holders_claim,
                only_the_same_completion_counts_twice,
                inspect_shows_the_remaining_time_to_live,
                forget_deletes_only_a_finished_record,
                a_record_of_several_mib_round_trips,
                a_large_record_is_fenced_like_a_small_one,
                wait_change_returns_by_its_bound,
                what_each_transition_writes_decodes,
                a_version_2_claim_is_taken_over_and_counts_from_the_timeout,
                a_lapsed_claim_is_taken_over_by_exactly_one_of_many,
                a_claim_lives_its_lifetime_whatever_its_lease,
                a_claim_is_released_and_a_resolved_record_forgotten,
            ]);
            $($crate::store_contract!(@$cap $backend);)*
        }
    };
    (@real $backend:ident, [$($check:ident),* $(,)?]) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                $crate::warm_up();
                let subject =
                    $crate::store_checks::Subject::new($crate::Backend::$backend, CAPS).await;
                $crate::store_checks::$check(&subject).await;
            }
        )*
    };
    // Shared by several proxies: the real-time checks race a second instance; no more tests.
    (@shared $backend:ident) => {};
    (@moved_clock $backend:ident) => {
        $crate::store_contract!(@minutes $backend, moved);
    };
    (@paused_clock $backend:ident) => {
        $crate::store_contract!(@minutes $backend, paused);
    };
    // The checks of leases and lifetimes of minutes, on a clock the test moves.
    (@minutes $backend:ident, $clock:ident) => {
        $crate::store_contract!(@each $backend, $clock, [
            a_resolvable_claim_is_taken_over_after_its_lease_and_fences_its_first_holder,
            a_resolvable_claim_lives_its_lifetime_whatever_its_lease,
            a_resolvable_claim_is_released_only_while_its_lease_holds,
        ]);
    };
    (@each $backend:ident, $clock:ident, [$($check:ident),* $(,)?]) => {
        $($crate::store_contract!(@one $clock, $backend, $check);)*
    };
    (@one moved, $backend:ident, $check:ident) => {
        #[tokio::test]
        async fn $check() {
            let subject =
                $crate::store_checks::Subject::timed($crate::Backend::$backend, CAPS).await;
            $crate::store_checks::$check(&subject).await;
        }
    };
    (@one paused, $backend:ident, $check:ident) => {
        #[tokio::test(start_paused = true)]
        async fn $check() {
            let subject =
                $crate::store_checks::Subject::timed($crate::Backend::$backend, CAPS).await;
            $crate::store_checks::$check(&subject).await;
        }
    };
}

/// The optional capabilities of a store: each check that needs one runs only where it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Several proxies may share the store (PostgreSQL, Redis, Redis Cluster; not memory, and
    /// SQLite's file takes one process): claims from a second instance race the first's.
    pub shared: bool,
    /// The test can move the store's clock ahead (SQLite's, `SqliteStore::advance_clock`): the
    /// checks of leases and lifetimes of minutes run on it.
    pub moved_clock: bool,
    /// The store keeps time on Tokio's clock, which a test can pause and advance (memory): the
    /// same checks run on it.
    pub paused_clock: bool,
}

impl Capabilities {
    /// No optional capability.
    pub const NONE: Capabilities = Capabilities {
        shared: false,
        moved_clock: false,
        paused_clock: false,
    };
}

/// How time passes on the clock of the store under test.
#[derive(Clone)]
pub enum Clock {
    /// The store keeps time itself, on real time: time passes by sleeping.
    Real,
    /// Tokio's paused clock (the memory store under `start_paused`): advanced at once.
    Paused,
    /// A clock the test moves ahead (SQLite's): moved at once.
    Moved(Arc<dyn Fn(Duration) + Send + Sync>),
}

impl Clock {
    /// Lets `by` pass on the store's clock.
    pub async fn pass(&self, by: Duration) {
        match self {
            Clock::Real => tokio::time::sleep(by).await,
            Clock::Paused => tokio::time::advance(by).await,
            Clock::Moved(advance) => advance(by),
        }
    }
}

/// The store a check runs on, how time passes on it, and what else it can do.
pub struct Subject {
    /// The bare backend.
    pub raw: Arc<dyn Store>,
    /// How time passes on its clock.
    pub clock: Clock,
    /// What it can do beyond the contract every store keeps.
    pub caps: Capabilities,
    /// The servers or the file it lives on, kept until the check ends.
    env: Option<Env>,
    _dir: Option<tempfile::TempDir>,
}

impl Subject {
    /// A store of the test's own on `backend`, built from its `store:` section as the proxy
    /// builds it (`Env::store`), on real time.
    pub async fn new(backend: Backend, caps: Capabilities) -> Subject {
        let env = Env::new(backend).await;
        Subject {
            raw: env.store().await,
            clock: Clock::Real,
            caps,
            env: Some(env),
            _dir: None,
        }
    }

    /// A store of the test's own on `backend` on a clock the test moves: memory on Tokio's
    /// clock (the test's runtime paused), SQLite on its clock moved ahead.
    pub async fn timed(backend: Backend, caps: Capabilities) -> Subject {
        match backend {
            Backend::Memory if caps.paused_clock => Subject {
                raw: Arc::new(idemproxy::store::memory::MemoryStore::new(10)),
                clock: Clock::Paused,
                caps,
                env: None,
                _dir: None,
            },
            Backend::Sqlite if caps.moved_clock => {
                let dir = tempfile::tempdir().expect("temp dir");
                let store = idemproxy::store::sqlite::SqliteStore::open(
                    &dir.path().join("records.db"),
                    idemproxy::config::SqliteSync::Normal,
                    Duration::from_secs(3600),
                    Arc::new(Metrics::new()),
                )
                .expect("open the SQLite store");
                let store = Arc::new(store);
                let moved = store.clone();
                Subject {
                    raw: store,
                    clock: Clock::Moved(Arc::new(move |by| moved.advance_clock(by))),
                    caps,
                    env: None,
                    _dir: Some(dir),
                }
            }
            other => panic!("{} has no clock a test can move ({caps:?})", other.name()),
        }
    }

    /// The store behind a handle with [`DEADLINE`], as the proxy holds it.
    pub fn handle(&self) -> StoreHandle {
        handle(self.raw.clone())
    }

    /// A second instance on the same store, as another proxy would hold it, where the store is
    /// shared ([`Capabilities::shared`]).
    pub async fn another(&self) -> Option<StoreHandle> {
        match &self.env {
            Some(env) if self.caps.shared => Some(handle(env.store().await)),
            _ => None,
        }
    }
}

/// The deadline of every store call in these checks: generous (they are about answers, not
/// speed), and shorter than any `lock_ttl` of the harness's configuration, as a configuration
/// must be.
pub const DEADLINE: Duration = Duration::from_secs(1);

/// A long lease or TTL: longer than any check runs.
const LONG: Duration = Duration::from_secs(30);

/// A bare backend behind a handle with [`DEADLINE`].
pub fn handle(store: Arc<dyn Store>) -> StoreHandle {
    StoreHandle::new(store, DEADLINE, Arc::new(Metrics::new()))
}

/// A finished record: a 201 JSON response with `body`.
pub fn done(fingerprint: [u8; 32], body: &'static str) -> Record {
    done_with(fingerprint, Bytes::from_static(body.as_bytes()))
}

/// A finished record: a 201 JSON response with `body`.
pub fn done_with(fingerprint: [u8; 32], body: Bytes) -> Record {
    Record::Finished {
        fingerprint,
        saved: Saved::Response(SavedResponse {
            status: StatusCode::CREATED,
            headers: vec![(
                HeaderName::from_static("content-type"),
                http::HeaderValue::from_static("application/json"),
            )],
            body,
        }),
    }
}

/// Key `n` of route `create-booking` (route number 0).
fn key(n: u8) -> StoreKey {
    StoreKey::new(
        idemproxy::key::namespace("idemproxy:", "create-booking"),
        0,
        [n; 32],
    )
}

/// An in-progress record with token `token` (all bytes) and fingerprint 7.
fn claim(token: u8) -> Held {
    Held::new(Record::InFlight {
        token: [token; 16],
        fingerprint: [7; 32],
    })
}

/// Waits until `key` reads as absent (a lease lapsed), at most a few seconds.
async fn until_absent(store: &StoreHandle, key: &StoreKey, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while store.get(key).await.expect("get").is_some() {
        assert!(Instant::now() < deadline, "{what} did not lapse");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A finished record with a 64 KiB body of `fill` bytes: large enough that Redis stages it
/// (a key of its own, moved under the record key by the fenced script), and of the same length
/// whatever `fill` is, so that two of them differ only in their bytes.
pub fn large(fill: u8) -> Record {
    done_with([7; 32], Bytes::from(vec![fill; 64 * 1024]))
}

/// `inspect` on the bare backend, decoded, under [`DEADLINE`].
async fn inspect(raw: &Arc<dyn Store>, key: &StoreKey) -> Option<(Record, Duration)> {
    let found = tokio::time::timeout(DEADLINE, raw.inspect(key))
        .await
        .expect("inspect within the deadline")
        .expect("inspect");
    found.map(|(bytes, ttl)| (Record::decode_shared(&bytes).expect("a record"), ttl))
}

/// `forget` on the bare backend, under [`DEADLINE`].
async fn forget(raw: &Arc<dyn Store>, key: &StoreKey) -> Forgotten {
    tokio::time::timeout(DEADLINE, raw.forget(key))
        .await
        .expect("forget within the deadline")
        .expect("forget")
}
