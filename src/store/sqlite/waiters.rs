//! In-process wake-ups for `on_conflict: wait`.
//!
//! One process owns the file (the lock in `file.rs` makes sure of it), so every save and
//! release of a key is committed by this process's writer thread: it can wake the requests
//! waiting on that key itself, right after the commit, instead of leaving them to poll. A
//! [`Notify`] is made only for a key someone waits on, and dropped by the last waiter to
//! leave, so keys whose holder died (nobody ever completes them) leave nothing behind.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

/// The keys (as `StoreKey::text()`) that requests are waiting on.
#[derive(Debug, Default)]
pub(super) struct Waiters {
    keys: Mutex<HashMap<String, Arc<Notify>>>,
}

impl Waiters {
    /// Joins the waiters of `key`; the returned guard leaves on drop.
    pub(super) fn join<'a>(&'a self, key: &'a str) -> Waiting<'a> {
        let notify = self.lock().entry(key.to_owned()).or_default().clone();
        Waiting {
            waiters: self,
            key,
            notify,
        }
    }

    /// Wakes every request waiting on `key`. Called by the writer only after the commit that
    /// changed the key, so a woken waiter that reads the key again sees the change.
    pub(super) fn wake(&self, key: &str) {
        let notify = self.lock().remove(key);
        if let Some(n) = notify {
            n.notify_waiters();
        }
    }

    /// Whether anyone waits on `key` (tests).
    #[cfg(test)]
    pub(super) fn is_waited_on(&self, key: &str) -> bool {
        self.lock().contains_key(key)
    }

    /// Every critical section is one map operation with no await inside, so a std mutex is
    /// right, and a poisoned one (a panic elsewhere) still holds a consistent map.
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Notify>>> {
        self.keys.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A request waiting on one key.
pub(super) struct Waiting<'a> {
    waiters: &'a Waiters,
    key: &'a str,
    notify: Arc<Notify>,
}

impl Waiting<'_> {
    /// The key's notifier, to wait on.
    pub(super) fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut keys = self.waiters.lock();
        // Under the lock, the count is exact: new waiters clone the Arc only while holding it.
        // The map's copy and ours make two: nobody else waits, the entry can go. A wake may
        // have removed it already, and a later waiter may have put a new one in its place.
        if let Some(n) = keys.get(self.key)
            && Arc::ptr_eq(n, &self.notify)
            && Arc::strong_count(&self.notify) == 2
        {
            keys.remove(self.key);
        }
    }
}
