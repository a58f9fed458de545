//! The store contract (`harness::store_checks`), each check a test of its own on every store.

use harness::{Backend, Env, store_checks};

/// Each check of `harness::store_checks` as a test of its own on every store, on a store of the
/// test's own built from its `store:` section as the proxy builds it.
macro_rules! contract_checks {
    ($($check:ident),* $(,)?) => {
        $(
            async fn $check(backend: Backend) {
                let env = Env::new(backend).await;
                store_checks::$check(env.store().await).await;
            }
        )*
        harness::every_store!($($check),*);
    };
}

contract_checks!(
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
);
