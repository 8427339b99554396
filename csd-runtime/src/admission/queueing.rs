//! The queueing model: the delay a new request is predicted to wait,
//!
//! ```text
//! delay = (residual work of running requests
//!          + min(all queued work, this tenant's queued work / its share)) / slots
//! ```
//!
//! scaled by how far such predictions have been off lately ([`DelayScale`]).

use std::collections::VecDeque;
use std::time::Duration;

/// Queued requests whose prediction error the scale is learned from.
const PREDICTION_SAMPLES: usize = 256;
/// Predictions shorter than this are left out of it (wake-up jitter, not the model).
const MIN_PREDICTION: Duration = Duration::from_millis(2);

/// The predicted delay from its parts: the residual work of running requests, the
/// work queued by all tenants and by this one, this tenant's share of the slots
/// among the busy tenants, and the slots.
pub(super) fn predict(
    residual: Duration,
    queued_all: Duration,
    own: Duration,
    share: f64,
    slots: usize,
) -> Duration {
    let ahead = queued_all.min(own.div_f64(share));
    (residual + ahead) / slots.max(1) as u32
}

/// What predictions are multiplied by: the 90th percentile of actual over
/// predicted queueing of the last [`PREDICTION_SAMPLES`] queued requests, between
/// 0.5 and 4 (estimates err, running requests overrun theirs, raw reads share the
/// cores; the node measures the sum rather than model each).
#[derive(Debug)]
pub(super) struct DelayScale {
    /// Actual over predicted queueing of recent queued requests.
    ratios: VecDeque<f32>,
    /// Samples of `ratios` since start.
    samples: u64,
    scale: f64,
}

impl DelayScale {
    /// Nothing learned: 1.
    pub(super) fn new() -> Self {
        DelayScale {
            ratios: VecDeque::new(),
            samples: 0,
            scale: 1.0,
        }
    }

    /// The scale now.
    pub(super) fn scale(&self) -> f64 {
        self.scale
    }

    /// A queued request predicted to wait `predicted` (unscaled) waited `waited`.
    pub(super) fn learn(&mut self, predicted: Duration, waited: Duration) {
        if predicted < MIN_PREDICTION {
            return;
        }
        let ratio = (waited.as_secs_f64() / predicted.as_secs_f64()).clamp(0.1, 10.0);
        if self.ratios.len() == PREDICTION_SAMPLES {
            self.ratios.pop_front();
        }
        self.ratios.push_back(ratio as f32);
        self.samples += 1;
        let n = self.ratios.len();
        // Learned once there is enough to learn from; recomputed every 16 samples.
        if n >= 32 && self.samples.is_multiple_of(16) {
            let mut r: Vec<f32> = self.ratios.iter().copied().collect();
            r.sort_unstable_by(f32::total_cmp);
            let p90 = r[(n - 1) * 9 / 10] as f64;
            self.scale = p90.clamp(0.5, 4.0);
        }
    }
}
