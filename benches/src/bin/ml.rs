//! ML pushdown bench, two parts side by side in one run.
//!
//! **rate**: a built-in image model's feature extraction (224×224, stem to pool) on the
//! same cores: onnxruntime in Python (EfficientNet-Lite0: the same weights written as
//! ONNX by `scripts/effnet_lite0_onnx.py`; ResNet: csd's own export), the model as csd
//! runs it (exported to ONNX, on onnxruntime), the model on csd's own kernels, and the
//! storage-side operator end to end (a real node: decode, preprocess, layers, Arrow IPC
//! over gRPC). The features are compared, and a per-stage profile says where the time
//! goes.
//!
//! **splits**: the testbed's HAPI scenario with every split as a policy, plus
//! compute-only, full pushdown and the planner's auto split, over throttled links of
//! 50/200/1000 Mbit/s: epoch time and bytes, auto against the best split.
//!
//! Needs `scripts/setup-ml.sh` (weights, textures, onnxruntime and onnx).
//!
//! `cargo run --release -p csd-benches --bin ml -- [--only rate|splits] [--cores 1] [--model resnet50]`

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor};
use clap::Parser;
use csd_benches::{RateOpts, default_json_path, median, repo_root, write_json};
use csd_ml_pushdown::model::{Arch, ImageSpec, Kernels, StagedModel};
use csd_ml_pushdown::stream::{self, FeatureJob};
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node;
use csd_runtime::node_client::NodeClient;
use csd_runtime::pool::{available_cores, parse_core_list};
use csd_testbed::scenario::{PolicyName, Scenario};
use futures::TryStreamExt;
use serde::Serialize;

/// ML pushdown bench: the rate part and the splits part.
#[derive(Parser)]
struct Args {
    #[command(flatten)]
    rate: RateOpts,
    /// Rounds of the rate part: onnxruntime and our model take turns (order
    /// alternating), and the ratio reported is the median of the rounds'.
    #[arg(long, default_value_t = 3)]
    rate_rounds: usize,
    /// The built-in model of the rate part: `efficientnet-lite0` (its ImageNet
    /// weights) or `resnet18`/`resnet50` (random weights from the tests' reference
    /// script, the same on both sides).
    #[arg(long, default_value = "efficientnet-lite0")]
    model: Arch,
    /// Run one part only: `rate` or `splits`.
    #[arg(long)]
    only: Option<String>,
    /// Link bandwidths (Mbit/s) for the splits part.
    #[arg(long, default_value = "50,200,1000")]
    bandwidths: String,
    /// Splits to sweep besides compute-only (0), full and auto (default: all).
    #[arg(long)]
    splits: Option<String>,
    /// Rounds of the splits part. Each round runs every policy once, in a rotated
    /// order; a policy's time is its median over the rounds, so that a slow phase of
    /// a shared machine does not fall on one policy only.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// How many times the training patches are stored (the epoch's size).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// The splits part's testbed report goes here.
    #[arg(long, default_value = "target/bench-ml")]
    out: PathBuf,
    /// JSON output path.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize, Default)]
struct Out {
    rate: Option<Rate>,
    splits: Vec<SplitRow>,
}

#[derive(Serialize)]
struct Rate {
    cores: Vec<usize>,
    batch: usize,
    model: String,
    onnxruntime: String,
    ort_images_per_s: f64,
    /// The model as csd runs it by default: on onnxruntime, in-process.
    ours_images_per_s: f64,
    /// The model on csd's own kernels (`CSD_ML_KERNELS=csd`).
    kernels_images_per_s: f64,
    operator_images_per_s: f64,
    /// The median of the rounds' ratios.
    ours_vs_ort: f64,
    kernels_vs_ort: f64,
    operator_vs_ort: f64,
    /// Each round's images/s: onnxruntime in Python, ours, csd's kernels.
    rounds: Vec<(f64, f64, f64)>,
    max_rel_err_vs_ort: f64,
    /// Seconds per image: decode+preprocess, then each stage.
    profile_decode_s: f64,
    profile_stage_s: Vec<f64>,
}

#[derive(Serialize)]
struct SplitRow {
    bandwidth_mbit: f64,
    /// Per policy: median seconds, bytes from the node, and each round's seconds.
    times: Vec<(String, f64, u64, Vec<f64>)>,
    best: String,
    best_s: f64,
    /// The split auto chose in each round.
    auto_splits: Vec<f64>,
    /// Seconds auto spent planning in each round (inside its epoch time).
    auto_plan_s: Vec<f64>,
    /// The epoch time auto's plan predicted for its choice, each round.
    auto_predicted_s: Vec<f64>,
    auto_s: f64,
    auto_over_best: f64,
    raw_over_full_bytes: f64,
}

fn die(msg: impl std::fmt::Display) -> ! {
    eprintln!("ml bench: {msg}");
    std::process::exit(1)
}

/// A float32 `.npy` file (format 1.0) holding `x`.
fn write_npy(path: &Path, x: &Tensor) -> std::io::Result<()> {
    let dims = x.dims();
    let shape: Vec<String> = dims.iter().map(usize::to_string).collect();
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': ({},), }}",
        shape.join(", ")
    );
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    let v: Vec<f32> = x
        .flatten_all()
        .and_then(|t| t.to_vec1())
        .map_err(std::io::Error::other)?;
    for f in v {
        out.extend_from_slice(&f.to_le_bytes());
    }
    std::fs::write(path, out)
}

async fn rate(args: &Args, home: &Path, weights: &[u8]) -> Rate {
    let cores = match &args.rate.cores {
        Some(c) => parse_core_list(c).unwrap_or_else(|e| die(e)),
        None => vec![*available_cores().last().unwrap_or(&0)],
    };
    let list: Vec<String> = cores.iter().map(usize::to_string).collect();
    let list = list.join(",");
    let py = home.join("venv/bin/python");
    let dir = tempfile::tempdir().unwrap_or_else(|e| die(e));
    let arch = args.model;
    let onnx = match arch {
        Arch::EfficientNetLite0 => home.join("efficientnet-lite0.onnx"),
        _ => dir.path().join("model.onnx"),
    };
    if arch != Arch::EfficientNetLite0 {
        let bytes = csd_ml_pushdown::model::export_onnx(arch, weights).unwrap_or_else(|e| die(e));
        std::fs::write(&onnx, bytes).unwrap_or_else(|e| die(e));
    } else if !onnx.is_file() {
        let st = std::process::Command::new(&py)
            .arg(repo_root().join("scripts/effnet_lite0_onnx.py"))
            .arg(home.join("efficientnet-lite0.safetensors"))
            .arg(&onnx)
            .status()
            .unwrap_or_else(|e| die(format!("{}: {e}", py.display())));
        if !st.success() {
            die("writing the ONNX model failed; run scripts/setup-ml.sh (installs onnx)");
        }
    }
    // The same real images for both: the first `batch` training patches.
    let folder = csd_ml_pushdown::dataset::image_folder(&home.join("textures200/train"), None)
        .unwrap_or_else(|e| die(e));
    let files: Vec<Vec<u8>> = folder
        .samples
        .iter()
        .cycle()
        .take(args.rate.batch)
        .map(|(p, _)| std::fs::read(p).unwrap_or_else(|e| die(format!("{}: {e}", p.display()))))
        .collect();
    let refs: Vec<&[u8]> = files.iter().map(Vec::as_slice).collect();
    let model = arch
        .load_with(weights, &Device::Cpu, Kernels::Onnxruntime)
        .unwrap_or_else(|e| die(e));
    let kernels = arch
        .load_with(weights, &Device::Cpu, Kernels::Csd)
        .unwrap_or_else(|e| die(e));
    let n = model.stages().len();
    let pool =
        csd_ml_pushdown::thread_pool("bench", cores.len(), Some(&cores)).unwrap_or_else(|e| die(e));
    let x = pool
        .install(|| {
            csd_ml_pushdown::preprocess::images(&refs, &ImageSpec::IMAGENET_224, &Device::Cpu)
        })
        .unwrap_or_else(|e| die(e));
    let npy = dir.path().join("input.npy");
    write_npy(&npy, &x).unwrap_or_else(|e| die(e));

    // onnxruntime and our model take turns, `rate_rounds` times each, so that a slow
    // phase of a shared machine falls on both; the ratio is the median of the rounds'.
    let run_ort = || {
        args.rate
            .baseline(&py, &cores, "ml_ort.py", &[&onnx, &npy])
            .unwrap_or_else(|e| die(e))
    };
    let y = pool.install(|| model.forward_range(&x, 0, n).unwrap_or_else(|e| die(e)));
    let run = |model: &dyn StagedModel| {
        pool.install(|| {
            model.forward_range(&x, 0, n).unwrap_or_else(|e| die(e));
            let t = Instant::now();
            let mut done = 0usize;
            while t.elapsed().as_secs_f64() < args.rate.seconds {
                model.forward_range(&x, 0, n).unwrap_or_else(|e| die(e));
                done += args.rate.batch;
            }
            done as f64 / t.elapsed().as_secs_f64()
        })
    };
    let mut ort = serde_json::Value::Null;
    let mut rounds = Vec::new();
    let n_rounds = args.rate_rounds.max(1);
    for r in 0..n_rounds {
        println!(
            "rate: round {}/{n_rounds}: onnxruntime in Python, csd on onnxruntime and csd's \
             kernels on cores {list} ...",
            r + 1
        );
        let (o, c, k) = if r % 2 == 0 {
            let o = run_ort();
            (o, run(model.as_ref()), run(kernels.as_ref()))
        } else {
            let k = run(kernels.as_ref());
            let c = run(model.as_ref());
            (run_ort(), c, k)
        };
        let o_rate = o["images_per_s"].as_f64().unwrap_or(0.0);
        println!(
            "  onnxruntime {o_rate:.1}/s, ours {c:.1}/s ({:.2}), csd's kernels {k:.1}/s ({:.2})",
            c / o_rate,
            k / o_rate
        );
        rounds.push((o_rate, c, k));
        ort = o;
    }
    let ort_rate = median(rounds.iter().map(|r| r.0).collect());
    let ours = median(rounds.iter().map(|r| r.1).collect());
    let kernels_rate = median(rounds.iter().map(|r| r.2).collect());
    let ratio = median(rounds.iter().map(|r| r.1 / r.0).collect());
    let kernels_ratio = median(rounds.iter().map(|r| r.2 / r.0).collect());
    let y: Vec<Vec<f32>> = y
        .flatten_from(1)
        .and_then(|t| t.to_vec2())
        .unwrap_or_else(|e| die(e));
    let mut err = 0f64;
    if let Some(rows) = ort["features"].as_array() {
        for (r, mine) in rows.iter().zip(&y) {
            let theirs: Vec<f64> = r
                .as_array()
                .map(|v| v.iter().filter_map(|f| f.as_f64()).collect())
                .unwrap_or_default();
            let scale = theirs.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-12);
            for (a, b) in theirs.iter().zip(mine) {
                err = err.max((a - *b as f64).abs() / scale);
            }
        }
    } else {
        die("ml_ort.py printed no features");
    }

    // Where the time goes: decode+preprocess and each stage, per image.
    let batch = csd_ml_pushdown::dataset::batch(
        &(0..refs.len() as u64).collect::<Vec<_>>(),
        &vec![0; refs.len()],
        &refs,
    )
    .unwrap_or_else(|e| die(e));
    let profile = pool
        .install(|| {
            csd_ml_pushdown::features::profile(
                model.as_ref(),
                &[batch],
                csd_ml_pushdown::request::PROFILE_BATCH,
            )
        })
        .unwrap_or_else(|e| die(e));

    println!("rate: the storage-side operator end to end (node pinned to cores {list}) ...");
    let op = operator_rate(&cores, cores.len(), home, weights, args).await;
    Rate {
        cores,
        batch: args.rate.batch,
        model: arch.name().into(),
        onnxruntime: ort["onnxruntime"].as_str().unwrap_or("?").into(),
        ort_images_per_s: ort_rate,
        ours_images_per_s: ours,
        kernels_images_per_s: kernels_rate,
        operator_images_per_s: op,
        ours_vs_ort: ratio,
        kernels_vs_ort: kernels_ratio,
        operator_vs_ort: op / ort_rate,
        rounds,
        max_rel_err_vs_ort: err,
        profile_decode_s: profile.decode_s,
        profile_stage_s: profile.stage_s,
    }
}

/// Random ResNet weights (torchvision's names), written by the tests' reference script.
fn random_weights(arch: Arch, home: &Path) -> Vec<u8> {
    let depth = match arch {
        Arch::ResNet18 => "18",
        Arch::ResNet50 => "50",
        other => die(format!(
            "--model {other}: the rate part runs efficientnet-lite0, resnet18 or resnet50"
        )),
    };
    let dir = tempfile::tempdir().unwrap_or_else(|e| die(e));
    let input = dir.path().join("input.safetensors");
    let x = Tensor::zeros((1, 3, 224, 224), candle_core::DType::F32, &Device::Cpu)
        .unwrap_or_else(|e| die(e));
    candle_core::safetensors::save(&[("input", x)].into_iter().collect(), &input)
        .unwrap_or_else(|e| die(e));
    let weights = dir.path().join("weights.safetensors");
    let st = std::process::Command::new(home.join("venv/bin/python"))
        .arg(repo_root().join("ml-pushdown/tests/reference/resnet.py"))
        .arg(depth)
        .arg(&weights)
        .arg(&input)
        .arg(dir.path().join("out.safetensors"))
        .status()
        .unwrap_or_else(|e| die(e));
    if !st.success() {
        die("the reference script failed to write ResNet weights (run scripts/setup-ml.sh)");
    }
    std::fs::read(&weights).unwrap_or_else(|e| die(e))
}

/// Images/s of full pushdown from a real node on `cores`, over loopback (no throttle).
async fn operator_rate(
    cores: &[usize],
    cpus: usize,
    home: &Path,
    weights: &[u8],
    args: &Args,
) -> f64 {
    let list: Vec<String> = cores.iter().map(usize::to_string).collect();
    let config = NodeConfig {
        device: "emulated:mem".into(),
        capacity: ByteSize::gib(2),
        listen: "127.0.0.1:0".into(),
        cpus,
        cpu_set: Some(list.join(",")),
        memory: ByteSize::gib(2),
        format: true,
        policy: csd_runtime::admission::Policy::Always,
        ..NodeConfig::default()
    };
    let ops = csd_runtime::operator::OperatorRegistry::new()
        .with(Arc::new(csd_ml_pushdown::MlOperator::new()));
    let node = node::start_with(&config, ops)
        .await
        .unwrap_or_else(|e| die(format!("starting the node: {e}")));
    let client = NodeClient::connect(&node.url)
        .await
        .unwrap_or_else(|e| die(e));
    let clients = vec![client.clone()];
    let (count, _) = csd_ml_pushdown::job::put_images(
        &clients,
        "bench_images",
        &home.join("textures200/train"),
        None,
        (1, 1),
        args.repeat.max(1),
        |_| {},
    )
    .await
    .unwrap_or_else(|e| die(e));
    let table = csd_ml_pushdown::weights::ensure(&client, weights)
        .await
        .unwrap_or_else(|e| die(e));
    let model: Arc<dyn StagedModel> = Arc::from(
        args.model
            .load(weights, &Device::Cpu)
            .unwrap_or_else(|e| die(e)),
    );
    let (srcs, _) = csd_ml_pushdown::job::sources(&clients, "bench_images")
        .await
        .unwrap_or_else(|e| die(e));
    let job = FeatureJob {
        max_node_batch: Some(args.rate.batch),
        ..FeatureJob::new("bench_images", args.model, &table, model.stages().len())
    };
    let mut best = 0f64;
    // The first pass also loads the model at the node; the second is the figure.
    for _ in 0..2 {
        let t = Instant::now();
        let (s, _) =
            stream::open(srcs.clone(), job.clone(), model.clone()).unwrap_or_else(|e| die(e));
        let batches: Vec<_> = s.try_collect().await.unwrap_or_else(|e| die(e));
        let got: usize = batches.iter().map(|b| b.ids.len()).sum();
        assert_eq!(got, count, "every stored sample comes back");
        best = got as f64 / t.elapsed().as_secs_f64();
    }
    node.shutdown().await.ok();
    best
}

async fn splits(args: &Args) -> Vec<SplitRow> {
    let path = repo_root().join("testbed/scenarios/hapi.toml");
    let mut s = Scenario::from_file(&path).unwrap_or_else(|e| die(e));
    let n = Arch::EfficientNetLite0.stages().len();
    let ks: Vec<usize> = match &args.splits {
        Some(list) => list
            .split(',')
            .map(|k| {
                k.trim()
                    .parse()
                    .unwrap_or_else(|_| die(format!("--splits: {k:?}")))
            })
            .collect(),
        None => (1..n).collect(),
    };
    s.policies = vec![PolicyName::ComputeOnly, PolicyName::Full, PolicyName::Auto];
    s.policies.extend(
        ks.iter()
            .filter(|&&k| k > 0 && k < n)
            .map(|&k| PolicyName::Split(k)),
    );
    s.baseline = Some(PolicyName::ComputeOnly);
    if let csd_testbed::scenario::DataSpec::Images { repeat, .. } = &mut s.data {
        *repeat = args.repeat.max(1);
    }
    let bw: Vec<f64> = args
        .bandwidths
        .split(',')
        .map(|b| {
            b.trim()
                .parse()
                .unwrap_or_else(|_| die(format!("--bandwidths: {b:?}")))
        })
        .collect();
    s.sweep[0].values = bw.clone();
    s.validate().unwrap_or_else(|e| die(e));
    let rounds = args.rounds.max(1);
    println!(
        "splits: {} policies × {} bandwidths × {rounds} round(s) through the testbed (report in {}) ...",
        s.policies.len(),
        bw.len(),
        args.out.display()
    );
    // A warm-up, discarded: in one two-round sweep the first runs of the fresh process
    // (round 1's compute-only, full and auto) ran 6-19% slower than the same policies
    // in round 2, charging that start-up to whichever policies came first.
    {
        let mut warm = s.clone();
        warm.policies = vec![PolicyName::ComputeOnly, PolicyName::Full];
        warm.sweep[0].values = bw[..1].to_vec();
        println!(
            "warm-up: compute-only and full once at {} Mbit/s (discarded)",
            bw[0]
        );
        csd_testbed::run(
            warm,
            &csd_testbed::RunOptions {
                out: args.out.join("warm-up"),
                quick: false,
                progress: true,
            },
        )
        .await
        .unwrap_or_else(|e| die(e));
    }
    // Round r starts the policy list r/rounds of the way along (compute-only, the
    // testbed's reference, always runs first at each point).
    let mut reports = Vec::new();
    for r in 0..rounds {
        let mut round = s.clone();
        let mut others: Vec<PolicyName> = round.policies[1..].to_vec();
        let by = r * others.len() / rounds;
        others.rotate_left(by);
        round.policies.truncate(1);
        round.policies.extend(others);
        let out = if rounds > 1 {
            args.out.join(format!("round{}", r + 1))
        } else {
            args.out.clone()
        };
        let report = csd_testbed::run(
            round,
            &csd_testbed::RunOptions {
                out,
                quick: false,
                progress: true,
            },
        )
        .await
        .unwrap_or_else(|e| die(e));
        reports.push(report);
    }
    let mut rows = Vec::new();
    for b in bw {
        let at: Vec<_> = reports
            .iter()
            .flat_map(|rep| rep.runs.iter())
            .filter(|r| r.point.first().map(|p| p.1) == Some(b))
            .collect();
        // One of auto's figures, per round.
        let auto_extra = |key: &str| -> Vec<f64> {
            at.iter()
                .filter(|r| r.policy == PolicyName::Auto)
                .map(|r| r.extra.get(key).copied().unwrap_or(f64::NAN))
                .collect()
        };
        for r in &at {
            if !r.mismatches.is_empty() || r.failed > 0 || r.timed_out {
                die(format!(
                    "{} at {b} Mbit/s: {} mismatches, {} failed, timed out {}",
                    r.policy,
                    r.mismatches.len(),
                    r.failed,
                    r.timed_out
                ));
            }
        }
        // Per policy, in the scenario's order: median time, bytes, each round's time.
        let times: Vec<(PolicyName, f64, u64, Vec<f64>)> = s
            .policies
            .iter()
            .filter_map(|&p| {
                let of: Vec<_> = at.iter().filter(|r| r.policy == p).collect();
                let first = of.first()?;
                let each: Vec<f64> = of.iter().map(|r| r.wall_s).collect();
                Some((p, median(each.clone()), first.bytes_from_nodes, each))
            })
            .collect();
        let get = |p: PolicyName| times.iter().find(|t| t.0 == p);
        let Some(best) = times
            .iter()
            .filter(|t| t.0 != PolicyName::Auto)
            .min_by(|a, b| a.1.total_cmp(&b.1))
        else {
            die("no runs")
        };
        let (Some(auto), Some(raw), Some(full)) = (
            get(PolicyName::Auto),
            get(PolicyName::ComputeOnly),
            get(PolicyName::Full),
        ) else {
            die("auto, compute-only or full is missing")
        };
        rows.push(SplitRow {
            bandwidth_mbit: b,
            times: times
                .iter()
                .map(|t| (t.0.to_string(), t.1, t.2, t.3.clone()))
                .collect(),
            best: best.0.to_string(),
            best_s: best.1,
            auto_splits: auto_extra("split"),
            auto_plan_s: auto_extra("plan_s"),
            auto_predicted_s: auto_extra("predicted_epoch_s"),
            auto_s: auto.1,
            auto_over_best: auto.1 / best.1,
            raw_over_full_bytes: raw.2 as f64 / full.2.max(1) as f64,
        });
    }
    rows
}

/// Median epoch time against the split (0 = compute-only, the last = full), one line
/// per bandwidth, and auto's median as a point at the split it chose most.
fn plot_splits(path: &Path, rows: &[SplitRow]) -> Result<(), csd_testbed::Error> {
    let n = Arch::EfficientNetLite0.stages().len();
    let x_of = |p: &str| match p {
        "compute-only" => Some(0),
        "full" => Some(n),
        _ => p.strip_prefix("split:").and_then(|k| k.parse().ok()),
    };
    let mut series = Vec::new();
    for r in rows {
        let mut pts: Vec<(f64, f64)> = r
            .times
            .iter()
            .filter_map(|(p, med, _, _)| x_of(p).map(|k| (k as f64, *med)))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        series.push((format!("{} Mbit/s, fixed splits", r.bandwidth_mbit), pts));
        let chosen = median(r.auto_splits.clone());
        series.push((
            format!("{} Mbit/s, auto", r.bandwidth_mbit),
            vec![(chosen.round(), r.auto_s)],
        ));
    }
    csd_testbed::report::plots::line_chart(
        path,
        "EfficientNet-Lite0 epoch time by split (median of rounds)",
        "split: stages at the node (0 = compute-only, last = full)",
        "epoch seconds",
        &series,
        false,
        true,
        None,
        2,
    )
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    // Off unless asked: RUST_LOG=csd_ml_pushdown=debug prints every auto plan's table.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let home = args
        .rate
        .home
        .clone()
        .unwrap_or_else(csd_ml_pushdown::assets_dir);
    let wpath = home.join("efficientnet-lite0.safetensors");
    let weights = std::fs::read(&wpath).unwrap_or_else(|e| {
        die(format!(
            "{}: {e} (run scripts/setup-ml.sh first)",
            wpath.display()
        ))
    });
    let mut out = Out::default();
    if args.only.as_deref() != Some("splits") {
        let rate_weights = match args.model {
            Arch::EfficientNetLite0 => weights.clone(),
            arch => random_weights(arch, &home),
        };
        let r = rate(&args, &home, &rate_weights).await;
        println!(
            "\n| cores {:?}, batch {} | images/s | vs onnxruntime |\n|---|---|---|",
            r.cores, r.batch
        );
        println!(
            "| onnxruntime {} | {:.1} | 1.00 |",
            r.onnxruntime, r.ort_images_per_s
        );
        println!(
            "| {} in csd, on onnxruntime (the default) | {:.1} | {:.2} |",
            r.model, r.ours_images_per_s, r.ours_vs_ort
        );
        println!(
            "| {} on csd's kernels (CSD_ML_KERNELS=csd) | {:.1} | {:.2} |",
            r.model, r.kernels_images_per_s, r.kernels_vs_ort
        );
        println!(
            "| node operator end to end (decode + model + Flight) | {:.1} | {:.2} |",
            r.operator_images_per_s, r.operator_vs_ort
        );
        println!(
            "features vs onnxruntime: max relative error {:.2e}",
            r.max_rel_err_vs_ort
        );
        let total: f64 = r.profile_decode_s + r.profile_stage_s.iter().sum::<f64>();
        println!(
            "where the time goes (ms per image): decode+preprocess {:.2} ({:.0}%)",
            r.profile_decode_s * 1e3,
            100.0 * r.profile_decode_s / total
        );
        let names = args.model.stages();
        for (i, t) in r.profile_stage_s.iter().enumerate() {
            println!(
                "  stage {i:>2} {:<14} {:>7.2} ms ({:>4.1}%)  {:>6.1} MFLOP",
                names.get(i).map(|s| s.name.as_str()).unwrap_or("?"),
                t * 1e3,
                100.0 * t / total,
                names.get(i).map(|s| s.flops as f64 / 1e6).unwrap_or(0.0)
            );
        }
        out.rate = Some(r);
    }
    if args.only.as_deref() != Some("rate") {
        let rows = splits(&args).await;
        println!(
            "\n| link | best fixed | best s | auto split(s) | auto s | auto/best | raw/full bytes |\n|---|---|---|---|---|---|---|"
        );
        for r in &rows {
            println!(
                "| {} Mbit/s | {} | {:.2} | {:?} | {:.2} | {:.3} | {:.1}x |",
                r.bandwidth_mbit,
                r.best,
                r.best_s,
                r.auto_splits,
                r.auto_s,
                r.auto_over_best,
                r.raw_over_full_bytes
            );
        }
        println!("\nauto per round: planning seconds (inside its epoch), predicted epoch seconds");
        for r in &rows {
            println!(
                "  {:>6} Mbit/s plan {:.2?} predicted {:.2?}",
                r.bandwidth_mbit, r.auto_plan_s, r.auto_predicted_s
            );
        }
        println!("\nmedian seconds per policy (each round's in brackets):");
        for r in &rows {
            for (p, med, bytes, each) in &r.times {
                println!(
                    "  {:>6} Mbit/s {p:<13} {med:>6.2} s {:>9.2} MB  {each:.2?}",
                    r.bandwidth_mbit,
                    *bytes as f64 / 1e6
                );
            }
        }
        let svg = args
            .json
            .clone()
            .unwrap_or_else(|| default_json_path("ml"))
            .with_extension("svg");
        // The JSON, which makes the folder, is written after the chart.
        if let Some(dir) = svg.parent()
            && let Err(e) = std::fs::create_dir_all(dir)
        {
            eprintln!("{}: {e}", dir.display());
        }
        match plot_splits(&svg, &rows) {
            Ok(()) => println!("wrote {}", svg.display()),
            Err(e) => eprintln!("{}: {e}", svg.display()),
        }
        out.splits = rows;
    }
    write_json(&args.json.unwrap_or_else(|| default_json_path("ml")), &out).expect("json");
}
