//! Gauges that several workers each hold a part of, and whose series is the sum of the parts.
//!
//! A counter shared by every worker sums by itself (each one adds), and so does a gauge that
//! each worker only moves up and down (`inc`, `dec`). A gauge that a worker *sets* from what it
//! sees of its own resources — a PostgreSQL pool's open connections, say — does not: with two
//! workers each writing its own pool's size, the series would show whichever wrote last. Each
//! worker holds a [`GaugePart`] instead: setting it adds the difference from the part's last
//! value to the shared gauge, so the series is always the sum of every part's last value.

use std::sync::atomic::{AtomicI64, Ordering};

use prometheus_client::metrics::gauge::Gauge;

/// One worker's part of a gauge summed over workers. Dropped (its worker's resource is gone),
/// it takes its value out of the sum.
#[derive(Debug)]
pub struct GaugePart {
    gauge: Gauge,
    mine: AtomicI64,
}

impl GaugePart {
    /// A part of `gauge`, at zero.
    pub fn of(gauge: &Gauge) -> GaugePart {
        GaugePart {
            gauge: gauge.clone(),
            mine: AtomicI64::new(0),
        }
    }

    /// Sets this part to `value`: the gauge moves by the difference from its last value.
    /// Calls racing each other still leave the gauge at the sum of the parts (each adds the
    /// difference between the value it swapped out and the one it swapped in).
    pub fn set(&self, value: i64) {
        let before = self.mine.swap(value, Ordering::AcqRel);
        self.gauge.inc_by(value.wrapping_sub(before));
    }
}

impl Drop for GaugePart {
    fn drop(&mut self) {
        self.gauge.dec_by(*self.mine.get_mut());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gauge_is_the_sum_of_its_parts_not_the_last_value_set() {
        let gauge = Gauge::default();
        let (first, second) = (GaugePart::of(&gauge), GaugePart::of(&gauge));
        first.set(3);
        second.set(4);
        assert_eq!(gauge.get(), 7, "a last-writer gauge would show 4");
        first.set(1);
        assert_eq!(gauge.get(), 5);
        second.set(0);
        assert_eq!(gauge.get(), 1);
        drop(first);
        assert_eq!(gauge.get(), 0, "a part dropped takes its value out");
    }

    #[test]
    fn parts_set_from_many_threads_sum_exactly() {
        let gauge = Gauge::default();
        std::thread::scope(|s| {
            for n in 1..=8 {
                let gauge = &gauge;
                s.spawn(move || {
                    let part = GaugePart::of(gauge);
                    for v in 0..1000 {
                        part.set(v % 7);
                    }
                    part.set(n);
                    // Kept past the scope's end by leaking its value into the gauge.
                    std::mem::forget(part);
                });
            }
        });
        assert_eq!(gauge.get(), (1..=8).sum::<i64>());
    }
}
