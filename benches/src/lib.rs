//! Shared helpers of the benchmark binaries in `src/bin/`: result tables and JSON.
//!
//! Each binary runs the alternatives side by side in one process, prints a table with
//! ratios, and writes JSON under `target/bench-results/` (or `--json PATH`).

pub mod net;

use std::path::{Path, PathBuf};

use serde::Serialize;

/// Where a bench writes its JSON unless told otherwise.
pub fn default_json_path(name: &str) -> PathBuf {
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    Path::new(&target)
        .join("bench-results")
        .join(format!("{name}.json"))
}

/// Writes `value` as pretty JSON to `path`, creating directories.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(
        path,
        serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?,
    )?;
    println!("\nwrote {}", path.display());
    Ok(())
}

/// The median of `v` (the mean of the middle two for an even count; 0 when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The repository's root (the benches crate's parent folder).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// The options of the benches that measure a model's rate on pinned cores (`ml`,
/// `minilm`).
#[derive(clap::Args, Debug, Clone)]
pub struct RateOpts {
    /// ML assets (default: $CSD_ML_HOME, else ~/.cache/csd/ml).
    #[arg(long)]
    pub home: Option<PathBuf>,
    /// Cores of the rate measurement (`taskset -c` list; default: the last core).
    #[arg(long)]
    pub cores: Option<String>,
    /// Samples per forward call.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 8.0)]
    pub seconds: f64,
}

impl RateOpts {
    /// Runs a Python baseline (`script`, under `benches/`) with Python `py` pinned to
    /// `cores` (`taskset`), as `script INPUTS… --threads N --batch B --seconds S`;
    /// returns the JSON line it prints, or why not.
    pub fn baseline(
        &self,
        py: &Path,
        cores: &[usize],
        script: &str,
        inputs: &[&Path],
    ) -> Result<serde_json::Value, String> {
        let list: Vec<String> = cores.iter().map(usize::to_string).collect();
        let out = std::process::Command::new("taskset")
            .args(["-c", &list.join(",")])
            .arg(py)
            .arg(repo_root().join("benches").join(script))
            .args(inputs)
            .args(["--threads", &cores.len().to_string()])
            .args(["--batch", &self.batch.to_string()])
            .args(["--seconds", &self.seconds.to_string()])
            .output()
            .map_err(|e| format!("taskset {}: {e}", py.display()))?;
        if !out.status.success() {
            return Err(format!(
                "onnxruntime failed (run scripts/setup-ml.sh): {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        serde_json::from_slice(&out.stdout).map_err(|e| format!("{script} output: {e}"))
    }
}

/// The `csd` binary beside this bench's own (build it: `cargo build --release -p csd-client`).
pub fn csd_binary() -> PathBuf {
    std::env::current_exe()
        .expect("own path")
        .with_file_name("csd")
}

/// The `grpc://` URL a `csd serve` child prints on its first line of stdout (which
/// must be piped).
pub fn node_url(child: &mut std::process::Child) -> String {
    use std::io::BufRead;
    let out = child.stdout.take().expect("the node's stdout is piped");
    let mut line = String::new();
    std::io::BufReader::new(out)
        .read_line(&mut line)
        .expect("node output");
    line.split_whitespace()
        .find(|w| w.starts_with("grpc://") || w.starts_with("grpc+tls://"))
        .unwrap_or_else(|| panic!("node did not say where it listens: {line}"))
        .to_string()
}

/// A figure of `/proc/PID/status` in bytes (`VmRSS:`, `VmHWM:`; kB there).
pub fn proc_status_bytes(pid: u32, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb << 10)
}

/// The highest resident memory of a process, sampled every 5 ms on a thread of its
/// own from [`RssPeak::start`] to [`RssPeak::stop`].
pub struct RssPeak {
    peak: std::sync::Arc<std::sync::atomic::AtomicU64>,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    sampler: std::thread::JoinHandle<()>,
}

impl RssPeak {
    /// Starts sampling `pid`'s `VmRSS`, from `floor` bytes.
    pub fn start(pid: u32, floor: u64) -> RssPeak {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let peak = std::sync::Arc::new(AtomicU64::new(floor));
        let done = std::sync::Arc::new(AtomicBool::new(false));
        let sampler = std::thread::spawn({
            let (peak, done) = (peak.clone(), done.clone());
            move || {
                while !done.load(Ordering::Relaxed) {
                    if let Some(r) = proc_status_bytes(pid, "VmRSS:") {
                        peak.fetch_max(r, Ordering::Relaxed);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
        });
        RssPeak {
            peak,
            done,
            sampler,
        }
    }

    /// Stops sampling; the highest sample.
    pub fn stop(self) -> u64 {
        use std::sync::atomic::Ordering;
        self.done.store(true, Ordering::Relaxed);
        self.sampler.join().expect("the RSS sampler");
        self.peak.load(Ordering::Relaxed)
    }
}

/// A result's rows as text, sorted: answers compared by value, whatever the order.
pub fn canonical_rows(batches: &[arrow::record_batch::RecordBatch]) -> Vec<String> {
    let text = arrow::util::pretty::pretty_format_batches(batches)
        .expect("format")
        .to_string();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    lines.sort();
    lines
}

/// Megabytes (10^6 bytes) per second.
pub fn mbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / 1e6 / secs
}

/// A directory on a disk-backed filesystem (O_DIRECT needs one): `--dir` or the target dir.
pub fn scratch_dir(dir: Option<PathBuf>) -> std::io::Result<tempfile::TempDir> {
    let base = dir.unwrap_or_else(|| {
        PathBuf::from(std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()))
    });
    std::fs::create_dir_all(&base)?;
    tempfile::Builder::new()
        .prefix("csd-bench")
        .tempdir_in(base)
}

/// User + system CPU seconds of this process so far.
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct we pass.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// The three-step pipeline the `pipeline` and `shaped --pipeline` benches run over
/// lineitem: a filter keeping about half the rows, a key filter keeping 30% of
/// those (reading the first step's answer), an aggregate (reading the second's).
pub mod pipeline_steps {
    /// Step 1, over lineitem.
    pub const STEP1: &str = "SELECT l_orderkey, l_partkey, l_suppkey, l_quantity, l_extendedprice, \
                             l_discount, l_shipmode FROM lineitem WHERE l_shipdate >= DATE '1995-06-01'";

    /// Step 2, over step 1's answer as table `input`.
    pub fn step2(input: &str) -> String {
        format!(
            "SELECT l_orderkey, l_quantity, l_extendedprice, l_discount, l_shipmode FROM {input} \
             WHERE l_partkey % 10 < 3"
        )
    }

    /// Step 3, over step 2's answer as table `input`.
    pub fn step3(input: &str) -> String {
        format!(
            "SELECT l_shipmode, count(*) AS n, sum(l_quantity) AS quantity, \
             sum(l_extendedprice * (1 - l_discount)) AS revenue FROM {input} \
             GROUP BY l_shipmode ORDER BY l_shipmode"
        )
    }
}
