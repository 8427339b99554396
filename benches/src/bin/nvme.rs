//! NVMe passthrough against the block layer, in a QEMU guest on one emulated NVMe
//! controller and backing file (TCG: the figures are an emulated machine's, not a
//! real drive's — they compare two paths through the same guest kernel).
//!
//! 1. Device: this binary boots a guest that runs itself with `--inside`, which
//!    writes a region through each device and reads it back: 4 KiB random reads at
//!    QD 1 and 32, 1 MiB sequential reads at QD 1 and 8, 1 MiB sequential writes.
//! 2. TPC-H SF 0.01, every query pushed down (`full`), on two guest nodes storing
//!    through `nvme:/dev/ng0n1` and through `uring:/dev/nvme0n1`: wall time and
//!    latency per configuration (the `qemu` testbed scenario).
//!
//! 3. With `--spdk SPDK_DIR` (this binary built with `--features csd-runtime/spdk`
//!    against that SPDK build): the device tests again in a second guest, through
//!    SPDK's user-space PCIe driver on the same emulated controller (bound to
//!    `uio_pci_generic`, hugepages reserved).
//!
//! `sudo target/release/nvme [--mib 256] [--secs 4] [--lba 512] [--spdk DIR] [--json PATH]`
//! (needs `scripts/setup-qemu.sh`; `csd` built beside this binary).
//!
//! `--inside=SPEC,…` runs the device tests right here on any `--device` specs: on
//! the host, SPDK (a `--features csd-runtime/spdk` build) against io_uring on the
//! same file (`spdk:aio=F` vs `uring:F`), or in memory (`spdk:malloc=M` vs
//! `emulated:mem`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use csd_benches::{default_json_path, median, repo_root, write_json};
use csd_runtime::device::{BlockDevice, DeviceSpec, DmaBuf};
use csd_testbed::guest::{Guest, GuestSpec};
use csd_testbed::scenario::{GuestDevice, PolicyName, Scenario};
use futures::StreamExt;
use serde::{Deserialize, Serialize};

#[derive(Parser)]
struct Args {
    /// Run the device tests here (inside the guest) on these `--device` specs.
    #[arg(long, value_delimiter = ',')]
    inside: Option<Vec<String>>,
    /// MiB of the namespace to write and read.
    #[arg(long, default_value_t = 256)]
    mib: u64,
    /// Seconds per random-read test.
    #[arg(long, default_value_t = 4.0)]
    secs: f64,
    /// Bytes per LBA of the emulated namespace.
    #[arg(long, default_value_t = 512)]
    lba: u32,
    /// Repetitions of the TPC-H queries per configuration.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Virtual CPUs of the device tests' guests.
    #[arg(long, default_value_t = 1)]
    vcpus: usize,
    /// Skip the TPC-H part.
    #[arg(long)]
    no_tpch: bool,
    /// Also run the device tests through SPDK's PCIe driver in a guest, loading SPDK
    /// from this build (`SPDK_DIR`).
    #[arg(long)]
    spdk: Option<std::path::PathBuf>,
    /// JSON output path.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// One device test's figures, as the guest prints them.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct DeviceRow {
    device: String,
    test: String,
    queue_depth: usize,
    iops: f64,
    mb_per_s: f64,
    mean_latency_us: f64,
    /// Commands the guest kernel interrupted and the device sent again.
    #[serde(default)]
    retried: u64,
}

#[derive(Serialize)]
struct TpchRow {
    device: String,
    reps: usize,
    wall_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    bytes_from_nodes: u64,
    boot_s: Vec<f64>,
}

#[derive(Serialize)]
struct Results {
    lba_bytes: u32,
    guest_s: f64,
    device: Vec<DeviceRow>,
    tpch: Vec<TpchRow>,
}

const MARK: &str = "CSD-BENCH ";

/// A small xorshift generator: the same offsets for every device.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Runs `ops` (first block, bytes, write?) with `qd` in flight until they end or
/// `secs` pass; returns how many completed, the seconds taken and how many commands
/// the device sent again.
async fn run_ops(
    dev: &Arc<dyn BlockDevice>,
    qd: usize,
    secs: f64,
    ops: impl Iterator<Item = (u64, usize, bool)>,
) -> (u64, f64, u64) {
    let retried = dev.stats().retried;
    let t = Instant::now();
    let deadline = Duration::from_secs_f64(secs);
    let n = futures::stream::iter(ops.take_while(move |_| t.elapsed() < deadline))
        .map(|(lba, len, write)| {
            let dev = dev.clone();
            async move {
                let buf = DmaBuf::recycled(len);
                if write {
                    dev.write(lba, buf).await.expect("device write");
                } else {
                    dev.read(lba, buf).await.expect("device read");
                }
            }
        })
        .buffer_unordered(qd)
        .count()
        .await as u64;
    let s = t.elapsed().as_secs_f64();
    (n, s, dev.stats().retried - retried)
}

/// Inside the guest: every test on every device, one JSON line each, after the
/// machine's memory copy rate (1 MiB copies for a second: what a bounce buffer costs).
async fn inside(specs: &[String], mib: u64, secs: f64) {
    let (from, mut to) = (vec![7u8; 1 << 20], vec![0u8; 1 << 20]);
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed().as_secs_f64() < 1.0 {
        to.copy_from_slice(std::hint::black_box(&from));
        std::hint::black_box(&mut to);
        n += 1;
    }
    let s = t.elapsed().as_secs_f64();
    let copy = DeviceRow {
        device: "memory".into(),
        test: "1 MiB memcpy".into(),
        queue_depth: 1,
        iops: n as f64 / s,
        mb_per_s: (n << 20) as f64 / s / 1e6,
        mean_latency_us: s * 1e6 / n.max(1) as f64,
        retried: 0,
    };
    println!("{MARK}{}", serde_json::to_string(&copy).expect("json"));
    let mut filled = false;
    for spec in specs {
        // Files and memory devices are made twice the region (a device keeps its size).
        let dev = spec
            .parse::<DeviceSpec>()
            .and_then(|s| s.open(Some(mib << 21)))
            .unwrap_or_else(|e| panic!("{spec}: {e}"));
        let bs = dev.geometry().block_size as u64;
        let per = (1 << 20) / bs;
        let blocks = ((mib << 20).min(dev.geometry().capacity()) / bs) / per * per;
        let mut rows = Vec::new();
        let mut row = |test: &str, qd: usize, (n, s, retried): (u64, f64, u64), bytes_each: u64| {
            rows.push(DeviceRow {
                device: spec.clone(),
                test: test.into(),
                queue_depth: qd,
                iops: n as f64 / s,
                mb_per_s: (n * bytes_each) as f64 / s / 1e6,
                mean_latency_us: s * 1e6 * qd as f64 / n.max(1) as f64,
                retried,
            })
        };
        let seq = |write: bool| (0..).map(move |i| ((i * per) % blocks, 1 << 20, write));
        if !filled {
            // The backing file starts sparse: allocate it on the host before anything
            // is timed, or the first device's writes pay for that.
            run_ops(&dev, 8, 1e6, seq(true).take((blocks / per) as usize)).await;
            dev.flush().await.expect("flush");
            filled = true;
        }
        let written = run_ops(&dev, 8, 1e6, seq(true).take((blocks / per) as usize)).await;
        dev.flush().await.expect("flush");
        row("sequential 1 MiB write", 8, written, 1 << 20);
        for qd in [1usize, 32] {
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
            let ops = std::iter::repeat_with(move || (rng.next() % blocks, bs as usize, false));
            row(
                "random 4 KiB read",
                qd,
                run_ops(&dev, qd, secs, ops).await,
                bs,
            );
        }
        for qd in [1usize, 8] {
            row(
                "sequential 1 MiB read",
                qd,
                run_ops(&dev, qd, secs, seq(false)).await,
                1 << 20,
            );
        }
        for r in rows {
            println!("{MARK}{}", serde_json::to_string(&r).expect("json"));
        }
    }
}

/// Boots `spec` (which runs this binary `--inside`) and returns the device rows it
/// printed for its `n` specs, and the seconds the guest ran.
async fn device_tests(spec: GuestSpec, n: usize) -> (Vec<DeviceRow>, f64) {
    let (log, guest_s) = Guest::run_to_exit(spec, Duration::from_secs(900))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let device: Vec<DeviceRow> = log
        .lines()
        .filter_map(|l| l.split_once(MARK).map(|(_, j)| j))
        .map(|j| serde_json::from_str(j.trim()).expect("a bench line"))
        .collect();
    assert!(
        device.len() == 5 * n + 1,
        "the guest printed {} of {} results:\n{log}",
        device.len(),
        5 * n + 1
    );
    (device, guest_s)
}

/// On the host: the guest's device tests, then TPC-H on guest nodes per device.
async fn host(args: Args) {
    let scratch = tempfile::tempdir().expect("scratch dir");
    let me = std::env::current_exe().expect("own path");
    let specs = [GuestDevice::Nvme.spec(), GuestDevice::Block.spec()];
    let mut spec = GuestSpec::new(
        me,
        scratch.path().join("bench.img"),
        scratch.path().to_path_buf(),
    );
    spec.disk_bytes = (args.mib << 20).max(64 << 20) + (64 << 20);
    spec.lba_bytes = args.lba;
    spec.memory_mib = 1024;
    spec.cpus = args.vcpus;
    spec.run = Some(vec![
        format!("--inside={}", specs.join(",")),
        format!("--mib={}", args.mib),
        format!("--secs={}", args.secs),
    ]);
    println!(
        "device tests in a QEMU guest (TCG, {} vCPU), {} MiB region, {}-byte LBAs...",
        args.vcpus, args.mib, args.lba
    );
    let spdk_spec = args.spdk.clone().map(|dir| {
        let mut s = spec.clone().with_spdk(dir);
        s.disk = scratch.path().join("bench-spdk.img");
        s.run = Some(vec![
            format!("--inside={}", s.device),
            format!("--mib={}", args.mib),
            format!("--secs={}", args.secs),
        ]);
        s
    });
    let (mut device, guest_s) = device_tests(spec, specs.len()).await;
    if let Some(s) = spdk_spec {
        println!("device tests through SPDK's PCIe driver in a second guest...");
        device.extend(device_tests(s, 1).await.0);
    }
    println!(
        "\n{:<24} {:<24} {:>4} {:>10} {:>10} {:>12} {:>8}",
        "device", "test", "QD", "IOPS", "MB/s", "latency us", "retried"
    );
    for r in &device {
        println!(
            "{:<24} {:<24} {:>4} {:>10.0} {:>10.1} {:>12.0} {:>8}",
            r.device, r.test, r.queue_depth, r.iops, r.mb_per_s, r.mean_latency_us, r.retried
        );
    }
    let mut tpch = Vec::new();
    if !args.no_tpch {
        let path = repo_root().join("testbed/scenarios/qemu.toml");
        for d in [GuestDevice::Nvme, GuestDevice::Block] {
            let mut s = Scenario::from_file(&path).expect("the qemu scenario");
            s.policies = vec![PolicyName::Full];
            s.nodes.qemu.device = d;
            s.nodes.qemu.lba_bytes = args.lba;
            if let csd_testbed::scenario::WorkloadSpec::Sql { repetitions, .. } = &mut s.workload {
                *repetitions = Some(args.reps);
            }
            println!("\nTPC-H SF 0.01 on two guest nodes through {}...", d.spec());
            let out = scratch.path().join(format!("tpch-{d:?}"));
            let r = csd_testbed::run(
                s,
                &csd_testbed::RunOptions {
                    out,
                    quick: false,
                    progress: false,
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            let run = &r.runs[0];
            assert!(
                run.mismatches.is_empty() && run.failed == 0,
                "{:?} {:?}",
                run.mismatches,
                run.errors
            );
            tpch.push(TpchRow {
                device: d.spec().into(),
                reps: args.reps,
                wall_s: run.wall_s,
                p50_ms: run.p50_ms,
                p99_ms: run.p99_ms,
                bytes_from_nodes: run.bytes_from_nodes,
                boot_s: r.boot_s.clone(),
            });
        }
        println!(
            "\n{:<24} {:>6} {:>10} {:>10} {:>10} {:>14}",
            "TPC-H, all pushed", "reps", "wall s", "p50 ms", "p99 ms", "boot s"
        );
        for t in &tpch {
            println!(
                "{:<24} {:>6} {:>10.2} {:>10.1} {:>10.1} {:>14}",
                t.device,
                t.reps,
                t.wall_s,
                t.p50_ms,
                t.p99_ms,
                format!("{:.1}", median(t.boot_s.clone()))
            );
        }
    }
    write_json(
        &args.json.unwrap_or_else(|| default_json_path("nvme")),
        &Results {
            lba_bytes: args.lba,
            guest_s,
            device,
            tpch,
        },
    )
    .expect("write json");
}

fn main() {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    if let Some(specs) = &args.inside {
        rt.block_on(inside(specs, args.mib, args.secs));
        return;
    }
    rt.block_on(host(args));
}
