//! What a side measures of a model on a dataset ([`Profile`]: decode and per-stage
//! seconds per sample; measured by [`crate::features::profile`]), and the cache that
//! spares measuring again ([`ProfileCache`]). The node profiles when asked (a `Profile`
//! request), the compute tier profiles itself; the planner weighs both.

use std::collections::HashMap;
use std::path::PathBuf;
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
/// the compute side another, which also keeps them in files ([`ProfileCache::on_disk`])
/// so that the next `csd features` process on this machine finds them too.
#[derive(Debug, Default)]
pub(crate) struct ProfileCache {
    recent: Mutex<HashMap<String, (Instant, Profile)>>,
    dir: Option<PathBuf>,
}

/// A profile as kept in a file: its key (checked on reading: a file name is only a
/// digest of it) and when it was measured.
#[derive(Serialize, Deserialize)]
struct Kept {
    key: String,
    measured_unix_s: u64,
    profile: Profile,
}

impl ProfileCache {
    /// A cache that also keeps each profile in a file under `dir` (created when
    /// first written; a cache that cannot write there works in memory only).
    pub(crate) fn on_disk(dir: PathBuf) -> Self {
        ProfileCache {
            dir: Some(dir),
            ..ProfileCache::default()
        }
    }

    /// The profile under `key`, unless it is older than [`PROFILE_TTL`].
    pub(crate) fn get(&self, key: &str) -> Option<Profile> {
        let recent = self.recent.lock().ok()?.get(key).cloned();
        if let Some((at, p)) = recent {
            return (at.elapsed() < PROFILE_TTL).then_some(p);
        }
        let kept: Kept = serde_json::from_slice(&std::fs::read(self.file(key)?).ok()?).ok()?;
        let age = unix_now().checked_sub(kept.measured_unix_s)?;
        (kept.key == key && age < PROFILE_TTL.as_secs()).then_some(kept.profile)
    }

    /// Keeps `profile` under `key`, dropping expired ones.
    pub(crate) fn insert(&self, key: String, profile: Profile) {
        if let Some(path) = self.file(&key) {
            let kept = Kept {
                key: key.clone(),
                measured_unix_s: unix_now(),
                profile: profile.clone(),
            };
            if let Err(e) = write_atomically(&path, &kept) {
                tracing::debug!("profile not kept in {}: {e}", path.display());
            }
        }
        if let Ok(mut m) = self.recent.lock() {
            m.retain(|_, (at, _)| at.elapsed() < PROFILE_TTL);
            m.insert(key, (Instant::now(), profile));
        }
    }

    fn file(&self, key: &str) -> Option<PathBuf> {
        let name = csd_protocol::ModuleDigest::of(key.as_bytes()).hex();
        Some(self.dir.as_ref()?.join(format!("{name}.json")))
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Writes `kept` to `path` through a temporary file, so a reader never sees half.
fn write_atomically(path: &std::path::Path, kept: &Kept) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(
        &tmp,
        serde_json::to_vec(kept).map_err(std::io::Error::other)?,
    )?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(decode_s: f64) -> Profile {
        Profile {
            samples: 8,
            sample_bytes: 1000.0,
            decode_s,
            stage_s: vec![0.001, 0.002],
        }
    }

    #[test]
    fn the_next_process_finds_a_kept_profile_until_it_expires() {
        let dir = tempfile::tempdir().unwrap();
        let first = ProfileCache::on_disk(dir.path().join("profiles"));
        first.insert("data/p0/onnx/w".into(), profile(0.5));
        // Another process: a cache of its own over the same folder.
        let next = ProfileCache::on_disk(dir.path().join("profiles"));
        assert_eq!(next.get("data/p0/onnx/w"), Some(profile(0.5)));
        assert_eq!(next.get("data/p1/onnx/w"), None);
        // A file whose key is another's (or garbage) is not believed.
        let path = next.file("data/p0/onnx/w").unwrap();
        let mut kept: Kept = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        kept.key = "other".into();
        std::fs::write(&path, serde_json::to_vec(&kept).unwrap()).unwrap();
        assert_eq!(
            ProfileCache::on_disk(dir.path().join("profiles")).get("data/p0/onnx/w"),
            None
        );
        std::fs::write(&path, b"{ not json").unwrap();
        assert_eq!(
            ProfileCache::on_disk(dir.path().join("profiles")).get("data/p0/onnx/w"),
            None
        );
        // Measured longer ago than the TTL: measured again.
        kept.key = "data/p0/onnx/w".into();
        kept.measured_unix_s = unix_now() - PROFILE_TTL.as_secs() - 1;
        std::fs::write(&path, serde_json::to_vec(&kept).unwrap()).unwrap();
        assert_eq!(
            ProfileCache::on_disk(dir.path().join("profiles")).get("data/p0/onnx/w"),
            None
        );
        // A folder it cannot write keeps profiles in memory only.
        let blocked = dir.path().join("file");
        std::fs::write(&blocked, b"").unwrap();
        let mem = ProfileCache::on_disk(blocked.join("profiles"));
        mem.insert("k".into(), profile(0.1));
        assert_eq!(mem.get("k"), Some(profile(0.1)));
    }
}
