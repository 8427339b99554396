//! Sequential read throughput of the block-device backends.
//!
//! 1. io_uring + O_DIRECT vs `std::fs` buffered `pread` (page cache dropped before each
//!    run) on the same file, 128 KiB reads, at queue depths 1, 8, 32. For std::fs the
//!    queue depth is the number of threads reading at once.
//! 2. The emulated NVMe's measured throughput against its timing model's prediction.
//!
//! `cargo run --release -p csd-benches --bin device-read -- [--size-mib 1024]`

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use csd_benches::{cpu_seconds, default_json_path, mbps, scratch_dir, write_json};
use csd_runtime::device::emulated::{EmulatedDevice, TimingModel};
use csd_runtime::device::uring::UringDevice;
use csd_runtime::device::{BlockDevice, DmaBuf};
use futures::StreamExt;
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// File size in MiB.
    #[arg(long, default_value_t = 1024)]
    size_mib: u64,
    /// Read size in KiB.
    #[arg(long, default_value_t = 128)]
    io_kib: usize,
    /// Directory for the test file (disk-backed).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Repetitions per cell (best is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// JSON output path.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Row {
    test: String,
    queue_depth: usize,
    mb_per_s: f64,
    /// Process CPU (user + system) per GB read.
    cpu_ms_per_gb: Option<f64>,
    predicted_mb_per_s: Option<f64>,
    ratio: f64,
}

async fn read_device(dev: Arc<dyn BlockDevice>, bytes: u64, io: usize, qd: usize) -> f64 {
    let bs = dev.geometry().block_size;
    let blocks_per_io = (io / bs) as u64;
    let n = bytes / io as u64;
    let t0 = Instant::now();
    let mut reads = futures::stream::iter(0..n)
        .map(|i| {
            let dev = dev.clone();
            async move {
                dev.read(i * blocks_per_io, DmaBuf::recycled(io))
                    .await
                    .map(|b| b.len())
            }
        })
        .buffer_unordered(qd);
    let mut total = 0u64;
    while let Some(r) = reads.next().await {
        total += r.expect("device read") as u64;
    }
    mbps(total, t0.elapsed().as_secs_f64())
}

fn drop_cache(file: &std::fs::File) {
    // SAFETY: advisory call on a valid descriptor.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

fn read_std(path: &std::path::Path, bytes: u64, io: usize, qd: usize) -> f64 {
    let file = Arc::new(std::fs::File::open(path).expect("open"));
    file.sync_all().ok();
    drop_cache(&file);
    let n = bytes / io as u64;
    let t0 = Instant::now();
    let total: u64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..qd as u64)
            .map(|k| {
                let file = file.clone();
                s.spawn(move || {
                    let mut buf = vec![0u8; io];
                    let mut t = 0u64;
                    let mut i = k;
                    while i < n {
                        file.read_exact_at(&mut buf, i * io as u64).expect("pread");
                        t += io as u64;
                        i += qd as u64;
                    }
                    t
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("reader thread"))
            .sum()
    });
    mbps(total, t0.elapsed().as_secs_f64())
}

fn best(v: impl IntoIterator<Item = f64>) -> f64 {
    v.into_iter().fold(0.0, f64::max)
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let dir = scratch_dir(args.dir.clone()).expect("scratch dir");
    let path = dir.path().join("read.img");
    let bytes = args.size_mib << 20;
    let io = args.io_kib << 10;
    let mut rows = Vec::new();

    // Fill the file through the io_uring device.
    let uring: Arc<dyn BlockDevice> =
        Arc::new(UringDevice::open(&path, Some(bytes), 64).expect("io_uring device"));
    let t0 = Instant::now();
    let mut writes = futures::stream::iter(0..(bytes >> 20))
        .map(|i| {
            let dev = uring.clone();
            async move {
                let mut b = DmaBuf::zeroed(1 << 20);
                b.iter_mut()
                    .enumerate()
                    .for_each(|(j, x)| *x = (j as u64 ^ i) as u8);
                dev.write(i * 256, b).await.map(|_| ())
            }
        })
        .buffer_unordered(16);
    while let Some(r) = writes.next().await {
        r.expect("write");
    }
    uring.flush().await.expect("flush");
    println!(
        "wrote {} MiB through io_uring in {:.2?}",
        args.size_mib,
        t0.elapsed()
    );

    println!(
        "\nsequential {}-KiB reads of a {} MiB file (best of {})",
        args.io_kib, args.size_mib, args.reps
    );
    let gb = (bytes * args.reps as u64) as f64 / 1e9;
    println!(
        "{:<36} {:>4} {:>10} {:>14} {:>10}",
        "backend", "QD", "MB/s", "CPU ms per GB", "speed ratio"
    );
    for qd in [1, 8, 32] {
        let c0 = cpu_seconds();
        let u = {
            let mut v = Vec::new();
            for _ in 0..args.reps {
                v.push(read_device(uring.clone(), bytes, io, qd).await);
            }
            best(v)
        };
        let uc = (cpu_seconds() - c0) * 1e3 / gb;
        let c0 = cpu_seconds();
        let s = best((0..args.reps).map(|_| read_std(&path, bytes, io, qd)));
        let sc = (cpu_seconds() - c0) * 1e3 / gb;
        println!(
            "{:<36} {:>4} {:>10.0} {:>14.0} {:>9.2}x",
            "io_uring O_DIRECT",
            qd,
            u,
            uc,
            u / s
        );
        println!(
            "{:<36} {:>4} {:>10.0} {:>14.0} {:>10}",
            "std::fs buffered pread (cold cache)", qd, s, sc, "1.00x"
        );
        rows.push(Row {
            test: "io_uring_odirect".into(),
            queue_depth: qd,
            mb_per_s: u,
            cpu_ms_per_gb: Some(uc),
            predicted_mb_per_s: None,
            ratio: u / s,
        });
        rows.push(Row {
            test: "std_fs_buffered_cold".into(),
            queue_depth: qd,
            mb_per_s: s,
            cpu_ms_per_gb: Some(sc),
            predicted_mb_per_s: None,
            ratio: 1.0,
        });
    }
    if let Ok(ra) = std::fs::read_to_string("/sys/block/vda/queue/read_ahead_kb")
        .or_else(|_| std::fs::read_to_string("/sys/block/nvme0n1/queue/read_ahead_kb"))
    {
        println!(
            "(kernel readahead on the test disk: {} KiB: buffered reads prefetch that far ahead even at QD 1)",
            ra.trim()
        );
    }

    // Emulated NVMe against its model. Memory-backed, so the model is the only limit.
    let models = [
        (
            "emulated 100us 2000MB/s par 8",
            TimingModel {
                latency_us: 100.0,
                read_mbps: 2000.0,
                write_mbps: 1000.0,
                queue_depth: 32,
                parallelism: 8,
            },
        ),
        (
            "emulated 20us 800MB/s par 4",
            TimingModel {
                latency_us: 20.0,
                read_mbps: 800.0,
                write_mbps: 400.0,
                queue_depth: 16,
                parallelism: 4,
            },
        ),
        (
            "emulated 500us 3000MB/s par 32",
            TimingModel {
                latency_us: 500.0,
                read_mbps: 3000.0,
                write_mbps: 1000.0,
                queue_depth: 64,
                parallelism: 32,
            },
        ),
    ];
    let emu_bytes = bytes.min(256 << 20);
    println!(
        "\nemulated NVMe, measured vs model ({} MiB of {}-KiB reads)",
        emu_bytes >> 20,
        args.io_kib
    );
    println!(
        "{:<34} {:>4} {:>12} {:>12} {:>8}",
        "model", "QD", "MB/s", "model MB/s", "meas/model"
    );
    let mut worst: f64 = 0.0;
    for (name, model) in models {
        let dev: Arc<dyn BlockDevice> =
            Arc::new(EmulatedDevice::open(None, emu_bytes, 4096, model.clone()).expect("emulated"));
        for qd in [1, 8, 32] {
            let got = best({
                let mut v = Vec::new();
                for _ in 0..args.reps {
                    v.push(read_device(dev.clone(), emu_bytes, io, qd).await);
                }
                v
            });
            let want = model.predicted_throughput(io, qd) / 1e6;
            worst = worst.max((got / want - 1.0).abs());
            println!(
                "{name:<34} {qd:>4} {got:>12.0} {want:>12.0} {:>9.3}",
                got / want
            );
            rows.push(Row {
                test: name.into(),
                queue_depth: qd,
                mb_per_s: got,
                cpu_ms_per_gb: None,
                predicted_mb_per_s: Some(want),
                ratio: got / want,
            });
        }
    }
    println!(
        "worst deviation of the emulated device from its model: {:.1}%",
        worst * 100.0
    );
    write_json(
        &args
            .json
            .unwrap_or_else(|| default_json_path("device-read")),
        &rows,
    )
    .expect("write json");
}
