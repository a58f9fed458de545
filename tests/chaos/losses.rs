//! Loss windows: which faults may have cost an operation its claim, and so may explain that it
//! ran again. Restarts that lost the records and kills of proxy B count as they are; every
//! window of store unavailability (a stop, a blackhole, a reset, a crash's outage, a measured
//! machine stall) is merged with its neighbours, and a merged span counts once it covers two
//! renewal instants of one lease — unless all it holds is crashes, which explain nothing.

use super::*;

/// A fault that can make an operation run again.
#[derive(Debug, Clone)]
pub(crate) struct LossWindow {
    pub(crate) start: Duration,
    pub(crate) end: Duration,
    pub(crate) loss: Loss,
    pub(crate) what: String,
    /// Part of it was the machine stalling ([`Loss::Machine`]).
    pub(crate) machine: bool,
    /// Part of it was a PostgreSQL crash ([`Loss::Crash`]): never the reason it counts.
    pub(crate) crash: bool,
}

impl LossWindow {
    /// Its kind, for the summary: `Unavailable+Machine+Crash` and the like.
    pub(crate) fn kind(&self) -> String {
        format!(
            "{:?}{}{}",
            self.loss,
            if self.machine { "+Machine" } else { "" },
            if self.crash { "+Crash" } else { "" }
        )
    }
}

/// The claim-losing windows: restarts that lost data, kills of B, and store unavailability
/// merged with neighbours closer than `lock_ttl`, kept when the merged span reaches
/// `lock_ttl / 3` — two renewal instants of one lease — and holds something besides crashes.
///
/// A PostgreSQL crash ([`Loss::Crash`]) takes part in the merge (the database was unreachable,
/// and a stall next to it may cost a lease the renewal after the one the crash cost), but only
/// with a neighbour closer than `lock_ttl / 3` + `store.timeout` (past that, every lease had a
/// renewal due, and landed, between them), and a span is never claim-losing because of a crash:
/// it must hold a stop, a blackhole, a reset or a measured machine stall (a restart that
/// overran its bound is one).
pub(crate) fn loss_windows(windows: &[Window], lock_ttl: Duration) -> Vec<LossWindow> {
    let mut out: Vec<LossWindow> = windows
        .iter()
        .filter(|w| matches!(w.loss, Loss::RecordsLost | Loss::ClaimsOfB))
        .map(|w| LossWindow {
            start: w.start,
            end: w.end,
            loss: w.loss,
            what: w.what.clone(),
            machine: false,
            crash: false,
        })
        .collect();
    let mut stalls: Vec<&Window> = windows
        .iter()
        .filter(|w| matches!(w.loss, Loss::Unavailable | Loss::Machine | Loss::Crash))
        .collect();
    stalls.sort_by_key(|w| w.start);
    let crash_gap = lock_ttl / 3 + Duration::from_millis(STORE_TIMEOUT_MS);
    // Each merged span, whether something in it may explain a loss, and whether the member
    // that ends last is a crash (which narrows the gap to the next one).
    let mut merged: Vec<(LossWindow, bool, bool)> = Vec::new();
    for w in stalls {
        let is_crash = w.loss == Loss::Crash;
        match merged.last_mut() {
            Some((m, excuse, last_crash))
                if w.start
                    <= m.end
                        + if is_crash || *last_crash {
                            crash_gap
                        } else {
                            lock_ttl
                        } =>
            {
                if w.end >= m.end {
                    *last_crash = is_crash;
                }
                m.end = m.end.max(w.end);
                m.what = format!("{} + {}", m.what, w.what);
                m.machine |= w.loss == Loss::Machine;
                m.crash |= is_crash;
                *excuse |= !is_crash;
            }
            _ => merged.push((
                LossWindow {
                    start: w.start,
                    end: w.end,
                    loss: Loss::Unavailable,
                    what: w.what.clone(),
                    machine: w.loss == Loss::Machine,
                    crash: is_crash,
                },
                !is_crash,
                is_crash,
            )),
        }
    }
    out.extend(
        merged
            .into_iter()
            .filter(|(m, excuse, _)| *excuse && m.end - m.start >= lock_ttl / 3)
            .map(|(m, _, _)| m),
    );
    out.sort_by_key(|w| w.start);
    out
}

/// Does `w` explain that the execution at `prev` (through `via`) ran again at `next`? The
/// fault must come after the earlier execution's claim (at most `slack` before it reached the
/// upstream) and before the later one.
pub(crate) fn explains(w: &LossWindow, prev: &Exec, next: &Exec, slack: Duration) -> bool {
    let after_claim = w.end + slack >= prev.at;
    let before_next = w.start <= next.at;
    match w.loss {
        Loss::ClaimsOfB => prev.via == "b" && after_claim && before_next,
        _ => after_claim && before_next,
    }
}

// ---------------------------------------------------------------------------------------------
// The rule itself
// ---------------------------------------------------------------------------------------------

fn window(start_ms: u64, end_ms: u64, loss: Loss, what: &str) -> Window {
    Window {
        start: Duration::from_millis(start_ms),
        end: Duration::from_millis(end_ms),
        loss,
        what: what.into(),
    }
}

/// A crash explains nothing on its own, however long its window; a stop of the same length
/// does. A crash merged with a measured machine stall next to it counts (marked), one farther
/// away than a renewal period and a store timeout does not merge with it.
#[test]
fn loss_windows_never_blame_a_crash() {
    let ttl = Duration::from_secs(4);
    let crash = window(10_000, 11_500, Loss::Crash, "crash");
    assert!(loss_windows(std::slice::from_ref(&crash), ttl).is_empty());
    let pause = window(10_000, 11_500, Loss::Unavailable, "pause");
    assert_eq!(loss_windows(&[pause], ttl).len(), 1);

    let near = window(11_700, 11_950, Loss::Machine, "process stalled");
    let merged = loss_windows(&[crash.clone(), near], ttl);
    assert_eq!(merged.len(), 1, "{merged:?}");
    assert!(merged[0].crash && merged[0].machine, "{merged:?}");
    assert_eq!(merged[0].kind(), "Unavailable+Machine+Crash");

    // lock_ttl / 3 + store.timeout after the crash's end, still within lock_ttl: apart.
    let far = window(13_200, 13_450, Loss::Machine, "process stalled");
    assert!(loss_windows(&[crash, far], ttl).is_empty());
}

/// Without crashes, spans merge across gaps under `lock_ttl` and count from `lock_ttl / 3`.
#[test]
fn loss_windows_merge_stalls_as_before() {
    let ttl = Duration::from_secs(2);
    let a = window(1_000, 1_300, Loss::Unavailable, "paused");
    let b = window(3_200, 3_500, Loss::Machine, "process stalled");
    let merged = loss_windows(&[a.clone(), b], ttl);
    assert_eq!(merged.len(), 1, "{merged:?}");
    assert_eq!(merged[0].end, Duration::from_millis(3_500));
    assert!(merged[0].machine && !merged[0].crash);
    let short = window(1_000, 1_600, Loss::Unavailable, "paused");
    assert!(loss_windows(&[short], ttl).is_empty(), "under lock_ttl / 3");
    let killed = window(5_000, 5_000, Loss::ClaimsOfB, "proxy B killed");
    assert_eq!(loss_windows(&[a, killed], ttl).len(), 1);
}
