//! Users' ONNX models split between a storage node and this machine, as a user runs
//! them. Two parts, each side by side in one run:
//!
//! **rate**: a `csd serve` process pinned to one core runs the whole model over stored
//! images (decode, resize, normalise, onnxruntime, Arrow IPC to this process) against
//! onnxruntime in Python on the same core decoding the same files with Pillow — what a
//! user of onnxruntime alone gets. Rounds alternate; the ratio is the median of the
//! rounds'.
//!
//! **splits**: HAPI's table for ONNX models. The node runs in a network namespace
//! behind a `tc`-shaped veth (one core); `csd features --model M.onnx` runs as its own
//! process on another core, once per system and run: compute-only (`--split none`,
//! the images over the link), all at the node (`full`), the planner's `auto`, and
//! cut points in between, each fixed split also with one of the dataset's two
//! partitions run whole on the compute side (`--here 1`). Seconds per epoch (median of the runs) and bytes on the
//! veth; each system runs once unshaped first (the model or its head sent once and
//! kept, as across epochs).
//!
//! Models: `effnet` (EfficientNet-Lite0 with its ImageNet weights, written by
//! `scripts/effnet_lite0_onnx.py`), `resnet50` (`scripts/resnet_onnx.py`, seeded
//! random weights: the graph is timed, not the weights), or ONNX files taking
//! `N,3,224,224`. Needs root and `scripts/setup-ml.sh`.
//!
//! `sudo target/release/onnx [--only rate|splits] [--models effnet,resnet50] [--rates 200,1000]`

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use csd_benches::net::{Net, start_nodes};
use csd_benches::{csd_binary, default_json_path, median, repo_root, scratch_dir, write_json};
use csd_ml_pushdown::model::{OnnxModelStages, PixelNorm, StagedModel};
use csd_ml_pushdown::stream::{self, FeatureJob};
use csd_ml_pushdown::{Arch, job, weights};
use csd_runtime::node_client::NodeClient;
use csd_runtime::pool::available_cores;
use futures::TryStreamExt;
use serde::Serialize;

const IMAGENET: PixelNorm = PixelNorm {
    mean: [0.485, 0.456, 0.406],
    std: [0.229, 0.224, 0.225],
};

#[derive(Parser)]
struct Args {
    /// ML assets (default: $CSD_ML_HOME, else ~/.cache/csd/ml).
    #[arg(long)]
    home: Option<PathBuf>,
    /// `effnet`, `resnet50` or ONNX files, comma-separated.
    #[arg(long, default_value = "effnet,resnet50")]
    models: String,
    /// Link rates (Mbit/s) of the splits part.
    #[arg(long, default_value = "200,1000")]
    rates: String,
    /// Runs per system in the splits part (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Times the 72 training patches (200x200 PNG) are stored: the epoch's size.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Cut points swept besides none, full and auto (evenly spaced among those that
    /// send one tensor).
    #[arg(long, default_value_t = 3)]
    cuts: usize,
    /// Seconds per measurement of the rate part's Python baseline.
    #[arg(long, default_value_t = 8.0)]
    seconds: f64,
    /// Rounds of the rate part.
    #[arg(long, default_value_t = 3)]
    rate_rounds: usize,
    /// Run one part only: `rate` or `splits`.
    #[arg(long)]
    only: Option<String>,
    /// Scratch directory (models, the node's device).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// JSON output path.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize, Default)]
struct Out {
    rate: Vec<Rate>,
    splits: Vec<SplitRow>,
}

#[derive(Serialize)]
struct Rate {
    model: String,
    core: usize,
    onnxruntime: String,
    /// Each round: Python's images/s (decode included), the model alone in Python,
    /// the node's.
    rounds: Vec<(f64, f64, f64)>,
    python_images_per_s: f64,
    python_model_images_per_s: f64,
    node_images_per_s: f64,
    node_vs_python: f64,
}

/// What a system ran: its split and the partitions it ran whole on the compute side.
type Ran = (usize, usize);

#[derive(Serialize)]
struct SplitRow {
    model: String,
    mbit: f64,
    /// Per system: name, the split it ran and the partitions it ran whole here,
    /// median seconds, median bytes on the veth, each run's seconds.
    systems: Vec<(String, Ran, f64, u64, Vec<f64>)>,
    best: String,
    best_s: f64,
    /// Auto's split and partitions run whole here.
    auto_split: Ran,
    auto_over_best: f64,
    /// Median seconds of auto's runs spent planning (probing the link, profiling
    /// both sides), once per process.
    auto_planning_s: f64,
    /// Auto's median seconds less its planning, over the best.
    auto_epoch_over_best: f64,
}

fn die(msg: impl std::fmt::Display) -> ! {
    eprintln!("onnx bench: {msg}");
    std::process::exit(1)
}

/// The model file for `name` (written into `dir` when it is a built-in name).
fn model_file(name: &str, home: &Path, dir: &Path) -> PathBuf {
    let py = home.join("venv/bin/python");
    let (out, cmd): (PathBuf, Vec<String>) = match name {
        "effnet" => (
            dir.join("effnet.onnx"),
            vec![
                repo_root()
                    .join("scripts/effnet_lite0_onnx.py")
                    .display()
                    .to_string(),
                home.join("efficientnet-lite0.safetensors")
                    .display()
                    .to_string(),
            ],
        ),
        "resnet50" => (
            dir.join("resnet50.onnx"),
            vec![
                repo_root()
                    .join("scripts/resnet_onnx.py")
                    .display()
                    .to_string(),
                "50".into(),
            ],
        ),
        file => return PathBuf::from(file),
    };
    if !out.is_file() {
        let st = Command::new(&py)
            .args(&cmd)
            .arg(&out)
            .status()
            .unwrap_or_else(|e| die(format!("{}: {e}", py.display())));
        if !st.success() {
            die(format!("writing {name} failed (run scripts/setup-ml.sh)"));
        }
    }
    out
}

fn rgb(v: [f32; 3]) -> String {
    format!("{},{},{}", v[0], v[1], v[2])
}

/// Stores the 72 training patches `repeat` times as dataset `imgs` over
/// `partitions` partitions; the samples stored.
async fn store_images(client: &NodeClient, home: &Path, partitions: usize, repeat: usize) -> usize {
    job::put_images(
        std::slice::from_ref(client),
        "imgs",
        &home.join("textures200/train"),
        None,
        (partitions, 1),
        repeat.max(1),
        |_| {},
    )
    .await
    .unwrap_or_else(|e| die(e))
    .0
}

/// Images/s of the whole model at `client`'s node, this process reading the features.
async fn node_rate(client: &NodeClient, bytes: &[u8], samples: usize) -> f64 {
    let model: Arc<dyn StagedModel> =
        Arc::new(OnnxModelStages::load(bytes, IMAGENET).unwrap_or_else(|e| die(e)));
    let table = weights::ensure(client, bytes)
        .await
        .unwrap_or_else(|e| die(e));
    let clients = [client.clone()];
    let (srcs, _) = job::sources(&clients, "imgs")
        .await
        .unwrap_or_else(|e| die(e));
    let n = model.stages().len();
    let job = FeatureJob {
        max_node_batch: Some(16),
        pixels: Some(IMAGENET),
        ..FeatureJob::new("imgs", Arch::Onnx, &table, n)
    };
    let t = Instant::now();
    let (s, _) = stream::open(srcs, job, model).unwrap_or_else(|e| die(e));
    let batches: Vec<_> = s.try_collect().await.unwrap_or_else(|e| die(e));
    let got: usize = batches.iter().map(|b| b.ids.len()).sum();
    assert_eq!(got, samples, "every stored sample comes back");
    got as f64 / t.elapsed().as_secs_f64()
}

async fn rate(args: &Args, home: &Path, models: &[(String, PathBuf)]) -> Vec<Rate> {
    let cores = available_cores();
    let core = *cores.last().unwrap_or(&0);
    let mut node = Command::new(csd_binary());
    node.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--device",
        "emulated:mem",
    ])
    .args(["--capacity", "2GiB", "--memory", "2GiB", "--cpus", "1"])
    .args(["--cpu-set", &core.to_string(), "--policy", "always"])
    .env("RUST_LOG", "warn")
    .stdout(std::process::Stdio::piped());
    let mut child = node.spawn().unwrap_or_else(|e| die(e));
    let url = csd_benches::node_url(&mut child);
    let client = NodeClient::connect(&url).await.unwrap_or_else(|e| die(e));
    let images = home.join("textures200/train");
    let samples = store_images(&client, home, 1, args.repeat).await;
    let py = home.join("venv/bin/python");
    let mut out = Vec::new();
    for (name, path) in models {
        let bytes = std::fs::read(path).unwrap_or_else(|e| die(e));
        // The first pass loads the model at the node.
        node_rate(&client, &bytes, samples).await;
        let python = || {
            let o = Command::new("taskset")
                .args(["-c", &core.to_string()])
                .arg(&py)
                .arg(repo_root().join("benches/onnx_rate.py"))
                .arg(path)
                .arg(&images)
                .args(["--threads", "1", "--batch", "16"])
                .args(["--seconds", &args.seconds.to_string()])
                .args(["--mean", &rgb(IMAGENET.mean), "--std", &rgb(IMAGENET.std)])
                .output()
                .unwrap_or_else(|e| die(e));
            if !o.status.success() {
                die(String::from_utf8_lossy(&o.stderr));
            }
            serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap_or_else(|e| die(e))
        };
        let mut rounds = Vec::new();
        let mut version = String::new();
        for r in 0..args.rate_rounds.max(1) {
            let (p, ours) = if r % 2 == 0 {
                let p = python();
                (p, node_rate(&client, &bytes, samples).await)
            } else {
                let ours = node_rate(&client, &bytes, samples).await;
                (python(), ours)
            };
            let f = |k: &str| p[k].as_f64().unwrap_or(0.0);
            println!(
                "rate {name} round {}: python {:.1}/s (model alone {:.1}/s), node {ours:.1}/s",
                r + 1,
                f("images_per_s"),
                f("model_images_per_s")
            );
            version = p["onnxruntime"].as_str().unwrap_or("?").to_string();
            rounds.push((f("images_per_s"), f("model_images_per_s"), ours));
        }
        let python_rate = median(rounds.iter().map(|r| r.0).collect());
        out.push(Rate {
            model: name.clone(),
            core,
            onnxruntime: version,
            python_images_per_s: python_rate,
            python_model_images_per_s: median(rounds.iter().map(|r| r.1).collect()),
            node_images_per_s: median(rounds.iter().map(|r| r.2).collect()),
            node_vs_python: median(rounds.iter().map(|r| r.2 / r.0).collect()),
            rounds,
        });
    }
    let _ = child.kill();
    let _ = child.wait();
    out
}

/// One `csd features` process: (seconds, bytes on the veth, the split it ran and
/// the partitions it ran whole here, seconds of it planning).
fn features_run(
    net: &Net,
    url: &str,
    model: &Path,
    split: &(String, Option<usize>),
    core: usize,
) -> (f64, u64, Ran, f64) {
    let (split, here) = split;
    let before = net.bytes();
    let t = Instant::now();
    let o = Command::new("taskset")
        .args(["-c", &core.to_string()])
        .arg(csd_binary())
        .args(["features", "--node", url, "--dataset", "imgs", "--model"])
        .arg(model)
        .args(["--split", split, "--mean", &rgb(IMAGENET.mean)])
        .args(["--std", &rgb(IMAGENET.std)])
        .args(here.map(|m| format!("--here={m}")))
        // The planner's table on stdout, printed below with the run.
        .args((split == "auto").then_some("--explain"))
        .env("RUST_LOG", "warn")
        .output()
        .unwrap_or_else(|e| die(e));
    let secs = t.elapsed().as_secs_f64();
    print!("{}", String::from_utf8_lossy(&o.stdout));
    let err = String::from_utf8_lossy(&o.stderr);
    if !o.status.success() {
        die(format!("csd features --split {split}: {err}"));
    }
    let ran = err
        .split("with split ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| die(format!("no split in {err:?}")));
    let here = err
        .split(" run whole here)")
        .next()
        .filter(|s| s.len() < err.len())
        .and_then(|s| s.rsplit('(').next())
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let planned = err
        .split(" s of it planning")
        .next()
        .and_then(|s| s.rsplit('(').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| die(format!("no planning time in {err:?}")));
    (secs, net.bytes() - before, (ran, here), planned)
}

async fn splits(
    args: &Args,
    home: &Path,
    dir: &Path,
    models: &[(String, PathBuf)],
) -> Vec<SplitRow> {
    let cores = available_cores();
    let node_core = *cores.last().unwrap_or(&0);
    let client_core = *cores.first().unwrap_or(&0);
    let mut net = Net::create();
    let device = dir.join("node.img");
    let urls = start_nodes(
        &mut net,
        &[device],
        true,
        "adaptive",
        &format!("--cpus 1 --cpu-set {node_core} --memory 3GiB"),
    );
    let url = urls[0].clone();
    let client = NodeClient::connect(&url).await.unwrap_or_else(|e| die(e));
    store_images(&client, home, 2, args.repeat).await;
    let rates: Vec<f64> = args
        .rates
        .split(',')
        .map(|r| {
            r.trim()
                .parse()
                .unwrap_or_else(|_| die(format!("--rates {r:?}")))
        })
        .collect();
    let mut rows = Vec::new();
    for (name, path) in models {
        let bytes = std::fs::read(path).unwrap_or_else(|e| die(e));
        let m = OnnxModelStages::load(&bytes, IMAGENET).unwrap_or_else(|e| die(e));
        let cuts = &m.analysis().cuts;
        let single: Vec<usize> = (1..cuts.len() - 1)
            .filter(|i| cuts[*i].point.tensors.len() == 1)
            .collect();
        // Fixed splits run with `--here 0` (the node keeps both partitions, none
        // handed back by chance) and again with one of the two partitions run whole
        // here (`--here 1`): the share the planner also weighs.
        let fixed = |name: String, split: String| {
            [
                (name.clone(), (split.clone(), Some(0))),
                (format!("{name} + 1 partition here"), (split, Some(1))),
            ]
        };
        let mut systems: Vec<(String, (String, Option<usize>))> = vec![
            ("compute-only".into(), ("none".into(), None)),
            ("auto".into(), ("auto".into(), None)),
        ];
        systems.extend(fixed("all at node".into(), "full".into()));
        for j in 1..=args.cuts {
            if let Some(k) = single.get(j * single.len() / (args.cuts + 1)) {
                systems.extend(fixed(format!("cut {k}"), k.to_string()));
            }
        }
        net.shape(0.0);
        for (name, split) in &systems {
            println!("{name}: warm-up (unshaped, discarded)");
            features_run(&net, &url, path, split, client_core);
        }
        for &mbit in &rates {
            net.shape(mbit);
            let mut got: Vec<(String, Ran, Vec<f64>, Vec<u64>)> = systems
                .iter()
                .map(|(s, _)| (s.clone(), (0, 0), vec![], vec![]))
                .collect();
            let mut planning: Vec<Vec<f64>> = vec![vec![]; systems.len()];
            for run in 0..args.runs.max(1) {
                // Each run starts one system further along, so a slow phase of the
                // machine does not fall on the same system every time.
                for j in 0..systems.len() {
                    let i = (j + run) % systems.len();
                    let (secs, moved, ran, plan_s) =
                        features_run(&net, &url, path, &systems[i].1, client_core);
                    println!(
                        "{name} {mbit} Mbit/s run {}: {} (split {}, {} partitions here) {secs:.2} s ({plan_s:.2} s planning), {:.1} MB",
                        run + 1,
                        systems[i].0,
                        ran.0,
                        ran.1,
                        moved as f64 / 1e6
                    );
                    planning[i].push(plan_s);
                    got[i].1 = ran;
                    got[i].2.push(secs);
                    got[i].3.push(moved);
                }
            }
            let systems_out: Vec<(String, Ran, f64, u64, Vec<f64>)> = got
                .into_iter()
                .map(|(s, k, secs, bytes)| {
                    let b = median(bytes.iter().map(|b| *b as f64).collect()) as u64;
                    (s, k, median(secs.clone()), b, secs)
                })
                .collect();
            let best = systems_out
                .iter()
                .min_by(|a, b| a.2.total_cmp(&b.2))
                .unwrap_or_else(|| die("no systems"));
            let auto_at = systems_out
                .iter()
                .position(|s| s.0 == "auto")
                .unwrap_or_else(|| die("no auto"));
            let auto = &systems_out[auto_at];
            let auto_planning_s = median(planning[auto_at].clone());
            rows.push(SplitRow {
                auto_planning_s,
                auto_epoch_over_best: (auto.2 - auto_planning_s) / best.2,
                model: name.clone(),
                mbit,
                best: best.0.clone(),
                best_s: best.2,
                auto_split: auto.1,
                auto_over_best: auto.2 / best.2,
                systems: systems_out.clone(),
            });
        }
    }
    net.shape(0.0);
    rows
}

fn print(out: &Out) {
    for r in &out.rate {
        println!(
            "\nrate {} (core {}, onnxruntime {}): python {:.1} images/s (model alone {:.1}), node {:.1}: {:.2}x",
            r.model,
            r.core,
            r.onnxruntime,
            r.python_images_per_s,
            r.python_model_images_per_s,
            r.node_images_per_s,
            r.node_vs_python
        );
    }
    for row in &out.splits {
        println!(
            "\n{} at {} Mbit/s (medians): auto ran split {} with {} partitions here, {:.2}x the best ({}); {:.2} s of auto's process planned, its epoch alone {:.2}x the best",
            row.model,
            row.mbit,
            row.auto_split.0,
            row.auto_split.1,
            row.auto_over_best,
            row.best,
            row.auto_planning_s,
            row.auto_epoch_over_best
        );
        println!("| system | split | partitions here | s/epoch | MB on veth |");
        println!("|---|---|---|---|---|");
        for (s, (k, here), secs, bytes, _) in &row.systems {
            println!(
                "| {s} | {k} | {here} | {secs:.2} | {:.1} |",
                *bytes as f64 / 1e6
            );
        }
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let home = args
        .home
        .clone()
        .unwrap_or_else(csd_ml_pushdown::assets_dir);
    let scratch = scratch_dir(args.dir.clone()).unwrap_or_else(|e| die(e));
    let dir = scratch.path().to_path_buf();
    let models: Vec<(String, PathBuf)> = args
        .models
        .split(',')
        .map(|m| (m.trim().to_string(), model_file(m.trim(), &home, &dir)))
        .collect();
    let mut out = Out::default();
    if args.only.as_deref() != Some("splits") {
        out.rate = rate(&args, &home, &models).await;
    }
    if args.only.as_deref() != Some("rate") {
        out.splits = splits(&args, &home, &dir, &models).await;
    }
    print(&out);
    let path = args
        .json
        .clone()
        .unwrap_or_else(|| default_json_path("onnx"));
    write_json(&path, &out).unwrap_or_else(|e| die(e));
}
