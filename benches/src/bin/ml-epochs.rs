//! HAPI with references: training epochs over the testbed's throttled link, with
//! the node's output recomputed every epoch vs kept at the node by epoch 1 and read
//! back by epochs 2.. (`KeepFeatures`). EfficientNet-Lite0 on the textures dataset
//! (`scripts/setup-ml.sh`), a fixed split, an MLP head trained on the features.
//! Prints each epoch's time and bytes over the link.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use csd_benches::{default_json_path, write_json};
use csd_ml_pushdown::job::{self, FeaturesOptions, SplitChoice};
use csd_ml_pushdown::request::FeatureType;
use csd_ml_pushdown::stream::KeepFeatures;
use csd_ml_pushdown::train::MlpHead;
use csd_ml_pushdown::{Arch, MlOperator};
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node;
use csd_runtime::node_client::NodeClient;
use csd_runtime::operator::OperatorRegistry;
use csd_runtime::protocol::Compression;
use csd_testbed::link::{LinkSpec, ThrottledLink};
use futures::TryStreamExt;
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// Link bandwidth, Mbit/s.
    #[arg(long, default_value_t = 200.0)]
    mbit: f64,
    /// Round-trip time, ms.
    #[arg(long, default_value_t = 1.0)]
    rtt_ms: f64,
    /// Epochs.
    #[arg(long, default_value_t = 5)]
    epochs: usize,
    /// Split: stages run at the node (a number, `full` or `auto`).
    #[arg(long, default_value = "full")]
    split: String,
    /// Node CPU workers.
    #[arg(long, default_value_t = 2)]
    cpus: usize,
    /// Write the JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Epoch {
    kept: bool,
    epoch: usize,
    seconds: f64,
    bytes: u64,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let split: SplitChoice = args.split.parse().expect("--split");
    let home = csd_ml_pushdown::assets_dir();
    let weights = std::fs::read(home.join("efficientnet-lite0.safetensors"))
        .unwrap_or_else(|e| panic!("{e}: run `bash scripts/setup-ml.sh` first"));
    let config = NodeConfig {
        device: "emulated:mem".into(),
        capacity: ByteSize::gib(2),
        listen: "127.0.0.1:0".into(),
        memory: ByteSize::gib(2),
        cpus: args.cpus,
        format: true,
        ..NodeConfig::default()
    };
    let ops = OperatorRegistry::new().with(Arc::new(MlOperator::new()));
    let node = node::start_with(&config, ops).await.expect("node");
    let direct = vec![NodeClient::connect(&node.url).await.expect("client")];
    let (n, classes) = job::put_images(
        &direct,
        "epochs",
        &home.join("textures/train"),
        None,
        (1, 1),
        1,
        |_| {},
    )
    .await
    .expect("images");
    let link = ThrottledLink::start(
        LinkSpec::mbit(args.mbit, (args.rtt_ms * 500.0) as u64),
        node.url
            .trim_start_matches("grpc://")
            .parse()
            .expect("addr"),
    )
    .await
    .expect("link");
    let clients = vec![NodeClient::connect(&link.url()).await.expect("client")];
    let stages = Arch::EfficientNetLite0.stages();
    let out = stages.last().map(|s| s.out_elems()).unwrap_or(0);
    println!(
        "{} epochs of {n} images ({} classes), EfficientNet-Lite0 ({} stages) split {}, {} Mbit/s, RTT {} ms",
        args.epochs,
        classes.len(),
        stages.len(),
        args.split,
        args.mbit,
        args.rtt_ms
    );
    println!(
        "{:>8} {:>6} {:>10} {:>12}",
        "kept", "epoch", "seconds", "bytes"
    );
    let mut rows = Vec::new();
    for kept in [false, true] {
        let keep = kept.then(|| KeepFeatures::new(Duration::from_secs(3600)));
        let opts = FeaturesOptions {
            dataset: "epochs".into(),
            arch: Arch::EfficientNetLite0,
            split: split.clone(),
            train_batch: 16,
            dtype: FeatureType::F32,
            compression: Compression::Lz4Frame,
            pool: None,
            skip_bad_samples: false,
            keep: keep.clone(),
            pixels: None,
            here: None,
        };
        let mut head = MlpHead::new(out, 64, classes.len(), 1e-3).expect("head");
        for epoch in 1..=args.epochs {
            let moved = || link.counters().up() + link.counters().down();
            let (b0, t) = (moved(), Instant::now());
            let (mut s, _) = job::features(&clients, &weights, &opts, false)
                .await
                .expect("features");
            while let Some(b) = s.try_next().await.expect("batch") {
                head.step(&b.features, &b.labels).expect("step");
            }
            let e = Epoch {
                kept,
                epoch,
                seconds: t.elapsed().as_secs_f64(),
                bytes: moved() - b0,
            };
            println!(
                "{:>8} {:>6} {:>10.2} {:>12}",
                if kept { "kept" } else { "recomp." },
                epoch,
                e.seconds,
                e.bytes
            );
            rows.push(e);
        }
        if let Some(k) = keep {
            k.release().await.expect("release");
        }
    }
    let mean = |kept: bool| {
        let v: Vec<f64> = rows
            .iter()
            .filter(|r| r.kept == kept && r.epoch > 1)
            .map(|r| r.seconds)
            .collect();
        v.iter().sum::<f64>() / v.len().max(1) as f64
    };
    println!(
        "epochs 2..{}: {:.2} s recomputed vs {:.2} s kept: {:.2}x",
        args.epochs,
        mean(false),
        mean(true),
        mean(false) / mean(true).max(1e-9)
    );
    write_json(
        &args.json.unwrap_or_else(|| default_json_path("ml-epochs")),
        &rows,
    )
    .expect("json");
}
