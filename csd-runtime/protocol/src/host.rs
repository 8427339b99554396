//! The host a process runs on, as admission prices handing work back: which host and
//! which cores it may use ([`HostCores`]), and how busy the host's cores are
//! ([`busy_fraction`]).
//!
//! An asker sends both with its operator requests. A node whose asker runs on the
//! same host (the same kernel boot) with no core the node does not have gains nothing
//! by handing work back: the asker would read the bytes over its link and then decode
//! them on the node's own cores, behind the node's own queue.
//!
//! Read from `/proc` (Linux); elsewhere nothing is known: no host, no cores, load 0.

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A host and the cores a process may run on there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostCores {
    /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`): equal on one host,
    /// across network namespaces and containers (empty: unknown).
    pub host: String,
    /// The CPUs this process may run on (`Cpus_allowed_list`), ascending (empty:
    /// unknown).
    pub cpus: Vec<u32>,
}

impl HostCores {
    /// This process's host and cores.
    pub fn this() -> HostCores {
        let host = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        let cpus = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                    .map(parse_cpu_list)
            })
            .unwrap_or_default();
        HostCores { host, cpus }
    }

    /// Whether a process on `host` that may use `cpus` runs on this host's cores
    /// only, all of them ones this process may use too: work moved there runs on
    /// the cores it left.
    pub fn within(&self, host: &str, cpus: &[u32]) -> bool {
        !self.host.is_empty()
            && self.host == host
            && !cpus.is_empty()
            && cpus.iter().all(|c| self.cpus.binary_search(c).is_ok())
    }
}

/// A `Cpus_allowed_list` (`0-3,8,10-11`) as CPUs, ascending; malformed parts skipped.
pub fn parse_cpu_list(s: &str) -> Vec<u32> {
    let mut cpus = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let range = match part.split_once('-') {
            Some((a, b)) => a
                .trim()
                .parse::<u32>()
                .ok()
                .zip(b.trim().parse::<u32>().ok()),
            None => part.trim().parse::<u32>().ok().map(|c| (c, c)),
        };
        if let Some((a, b)) = range.filter(|(a, b)| a <= b && b - a < 65_536) {
            cpus.extend(a..=b);
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    cpus
}

/// Samples of `/proc/stat` closer than this reuse the last figure.
const SAMPLE_EVERY: Duration = Duration::from_millis(50);

struct Sample {
    at: Instant,
    busy: u64,
    total: u64,
    fraction: f64,
}

static LAST: Mutex<Option<Sample>> = Mutex::new(None);

/// Fraction of the CPU time of the cores this process may run on that was busy
/// lately (with anyone's work), 0 to 1: over the time since the last sample
/// (`/proc/stat`), or on a process's first call the one-minute load average per core
/// (a new process has no interval of its own yet).
pub fn busy_fraction() -> f64 {
    static CPUS: OnceLock<Vec<u32>> = OnceLock::new();
    let cpus = CPUS.get_or_init(|| HostCores::this().cpus);
    let Some((busy, total)) = cpu_times(cpus) else {
        return 0.0;
    };
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    let fraction = match last.as_ref() {
        Some(s) if s.at.elapsed() < SAMPLE_EVERY => return s.fraction,
        Some(s) if total > s.total => {
            (busy.saturating_sub(s.busy)) as f64 / (total - s.total) as f64
        }
        Some(s) => s.fraction,
        None => load_average_per_core(),
    };
    let fraction = fraction.clamp(0.0, 1.0);
    *last = Some(Sample {
        at: Instant::now(),
        busy,
        total,
        fraction,
    });
    fraction
}

/// Busy and total jiffies of `cpus` (all CPUs if empty) from `/proc/stat`; idle and
/// iowait count as not busy.
fn cpu_times(cpus: &[u32]) -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let (mut busy, mut total, mut seen) = (0u64, 0u64, false);
    for line in stat.lines() {
        let Some((name, rest)) = line.split_once(' ') else {
            continue;
        };
        let wanted = match name.strip_prefix("cpu") {
            Some("") => cpus.is_empty(),
            Some(n) => n
                .parse::<u32>()
                .is_ok_and(|c| cpus.binary_search(&c).is_ok()),
            None => false,
        };
        if !wanted {
            continue;
        }
        let v: Vec<u64> = rest
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        if v.len() < 5 {
            continue;
        }
        // user nice system idle iowait irq softirq steal (guest time is in user).
        let t: u64 = v.iter().take(8).sum();
        busy += t.saturating_sub(v[3] + v[4]);
        total += t;
        seen = true;
    }
    seen.then_some((busy, total))
}

fn load_average_per_core() -> f64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |l| l / cores)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list("1"), vec![1]);
        assert_eq!(parse_cpu_list("3-1,x,2"), vec![2]);
        assert_eq!(parse_cpu_list(""), Vec::<u32>::new());
    }

    #[test]
    fn work_moves_onto_the_same_cores_only_on_one_host_within_its_cpus() {
        let node = HostCores {
            host: "boot-a".into(),
            cpus: vec![0, 1],
        };
        let same = HostCores {
            host: "boot-a".into(),
            cpus: vec![0, 1],
        };
        let pinned_apart = HostCores {
            host: "boot-a".into(),
            cpus: vec![2],
        };
        let elsewhere = HostCores {
            host: "boot-b".into(),
            cpus: vec![0, 1],
        };
        assert!(node.within(&same.host, &same.cpus));
        assert!(!node.within(&pinned_apart.host, &pinned_apart.cpus));
        assert!(!node.within(&elsewhere.host, &elsewhere.cpus));
        assert!(!HostCores::default().within("", &[]));
    }

    #[test]
    fn this_host_is_known_on_linux_and_busy_is_a_fraction() {
        let me = HostCores::this();
        if cfg!(target_os = "linux") {
            assert!(!me.host.is_empty() && !me.cpus.is_empty());
            assert!(me.within(&me.host, &me.cpus));
        }
        for _ in 0..3 {
            let b = busy_fraction();
            assert!((0.0..=1.0).contains(&b), "{b}");
            std::thread::sleep(SAMPLE_EVERY);
        }
    }
}
