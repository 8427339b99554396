//! What a side measures of a model on a dataset ([`Profile`]: decode and per-stage
//! seconds per sample; measured by [`crate::features::profile`]), and the cache that
//! spares measuring again ([`ProfileCache`]). The node profiles when asked (a `Profile`
//! request), the compute tier profiles itself; the planner weighs both.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Measured costs of one side, per sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Samples timed.
    pub samples: usize,
    /// Mean encoded sample size in bytes.
    pub sample_bytes: f64,
    /// Seconds to decode and preprocess one sample.
    pub decode_s: f64,
    /// Seconds per sample of every stage.
    pub stage_s: Vec<f64>,
}

/// How long a measured profile stands in for a new one. Per-sample stage times depend
/// on the model, the data and the CPUs, none of which a profile's key lets change; the
/// node's *load* does change, and the planner reads that afresh each time.
pub(crate) const PROFILE_TTL: Duration = Duration::from_secs(600);

/// Profiles measured lately, by a key naming what they depend on, each good for
/// [`PROFILE_TTL`]: a job that plans again (the next epoch, the next job on the same
/// data and model) gets the figures without paying for them again. The node keeps one,
/// the compute side another.
#[derive(Debug, Default)]
pub(crate) struct ProfileCache(Mutex<HashMap<String, (Instant, Profile)>>);

impl ProfileCache {
    /// The profile under `key`, unless it is older than [`PROFILE_TTL`].
    pub(crate) fn get(&self, key: &str) -> Option<Profile> {
        let m = self.0.lock().ok()?;
        m.get(key)
            .filter(|(at, _)| at.elapsed() < PROFILE_TTL)
            .map(|(_, p)| p.clone())
    }

    /// Keeps `profile` under `key`, dropping expired ones.
    pub(crate) fn insert(&self, key: String, profile: Profile) {
        if let Ok(mut m) = self.0.lock() {
            m.retain(|_, (at, _)| at.elapsed() < PROFILE_TTL);
            m.insert(key, (Instant::now(), profile));
        }
    }
}
