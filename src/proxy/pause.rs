//! Pause points, compiled only into the tests' builds (the `test-pauses` feature, which the
//! test harness turns on): a test arms one for a key, and the exchange that claims that key
//! stalls there as a paused process would, so a test can show what a holder that wakes late
//! does (SPEC §4.8, "When the request was sent"). SIGSTOP stops a whole process; this stops one
//! exchange between its claim and its first write, where the race lives.
//!
//! The second point holds back an observed request's shadow claim before its task's first
//! step, as a loaded machine does when the task is polled late: its forwarding runs and is
//! answered first.

use std::sync::Mutex;
use std::time::Duration;

use http::HeaderValue;

/// Armed pauses: the key header's value, and how long its exchange stalls.
static ARMED: Mutex<Vec<(String, Duration)>> = Mutex::new(Vec::new());

/// Armed pauses of observed requests' shadow claims, as [`ARMED`].
static SHADOWS: Mutex<Vec<(String, Duration)>> = Mutex::new(Vec::new());

/// Makes the next exchange whose key header is `key` stall for `pause` right after its claim,
/// before anything is written upstream (in any proxy of this process).
pub fn arm_after_claim(key: &str, pause: Duration) {
    ARMED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((key.to_owned(), pause));
}

/// Makes the shadow claim of the next observed request whose key header is `key` stall for
/// `pause` before its task's first step (in any proxy of this process); its forwarding goes on.
pub fn arm_before_shadow_claim(key: &str, pause: Duration) {
    SHADOWS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((key.to_owned(), pause));
}

/// The pause armed for `key` in `armed`, taken (once).
fn take(armed: &Mutex<Vec<(String, Duration)>>, key: Option<&HeaderValue>) -> Option<Duration> {
    let key = key.and_then(|k| k.to_str().ok())?;
    let mut armed = armed.lock().unwrap_or_else(|e| e.into_inner());
    let at = armed.iter().position(|(k, _)| k == key)?;
    Some(armed.remove(at).1)
}

/// The pause a shadow claim of `key` is to take before its first step, if one was armed.
pub(super) fn shadow_claim(key: Option<&HeaderValue>) -> Option<Duration> {
    take(&SHADOWS, key)
}

/// The pause point after a claim: stalls if a pause was armed for `key`, once.
pub(super) async fn after_claim(key: Option<&HeaderValue>) {
    if let Some(pause) = take(&ARMED, key) {
        tracing::warn!(
            pause_ms = pause.as_millis(),
            "test pause point: stalling after the claim"
        );
        tokio::time::sleep(pause).await;
    }
}
