//! Transfer learning on features a storage node extracts: train an MLP head (candle,
//! AdamW) on EfficientNet-Lite0 features of texture patches, then report accuracy on
//! held-out patches.
//!
//! Needs the ML assets (`bash scripts/setup-ml.sh`). With no `--node`, it starts an
//! embedded node on this machine; with `--node URL`, it stores the patches on that node.
//!
//! ```text
//! cargo run --release --example train_head -- [--node URL] [--split auto]
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use csd_ml_pushdown::job::{self, FeaturesOptions, SplitChoice};
use csd_ml_pushdown::request::FeatureType;
use csd_ml_pushdown::train::MlpHead;
use csd_ml_pushdown::{Arch, MlOperator};
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node;
use csd_runtime::node_client::NodeClient;
use csd_runtime::operator::OperatorRegistry;
use csd_runtime::protocol::Compression;
use futures::TryStreamExt;

#[derive(Parser)]
struct Args {
    /// A running node (`csd serve`); default: an embedded one.
    #[arg(long)]
    node: Option<String>,
    /// ML assets (default: $CSD_ML_HOME, else ~/.cache/csd/ml).
    #[arg(long)]
    home: Option<PathBuf>,
    /// auto, none, full or a stage number.
    #[arg(long, default_value = "auto")]
    split: String,
    /// Passes over the training set (each streams its features from the node again).
    #[arg(long, default_value_t = 8)]
    epochs: usize,
    /// Training batch size (independent of the node's batch).
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Hidden units of the MLP head.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Keep the node's output of epoch 1 at the node; epochs 2.. read it back
    /// instead of running the node's stages again (results by reference).
    #[arg(long)]
    keep: bool,
}

type Error = Box<dyn std::error::Error>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args = Args::parse();
    let split: SplitChoice = args.split.parse()?;
    let home = args
        .home
        .clone()
        .unwrap_or_else(csd_ml_pushdown::assets_dir);
    let weights_path = home.join("efficientnet-lite0.safetensors");
    let weights = std::fs::read(&weights_path).map_err(|e| {
        format!(
            "{}: {e} (run `bash scripts/setup-ml.sh` first)",
            weights_path.display()
        )
    })?;
    let textures = home.join("textures");

    let embedded = match &args.node {
        Some(_) => None,
        None => {
            let config = NodeConfig {
                device: "emulated:mem".into(),
                capacity: ByteSize::gib(1),
                listen: "127.0.0.1:0".into(),
                memory: ByteSize::gib(1),
                format: true,
                ..NodeConfig::default()
            };
            let ops = OperatorRegistry::new().with(Arc::new(MlOperator::new()));
            Some(node::start_with(&config, ops).await?)
        }
    };
    let url = match &embedded {
        Some(n) => n.url.clone(),
        None => args.node.clone().unwrap_or_default(),
    };
    let clients = vec![NodeClient::connect(&url).await?];
    println!("node {url}");

    // Store the patches at the node: two datasets, training and held-out.
    let mut classes = Vec::new();
    for (table, dir) in [("textures_train", "train"), ("textures_test", "test")] {
        let dir = textures.join(dir);
        let (n, names) = job::put_images(&clients, table, &dir, None, (2, 1), 1, |_| {}).await?;
        println!("stored {n} patches of {names:?} as {table}");
        classes = names;
    }

    let keep = args
        .keep
        .then(|| csd_ml_pushdown::stream::KeepFeatures::new(std::time::Duration::from_secs(3600)));
    let opts = |dataset: &str, split: SplitChoice| FeaturesOptions {
        dataset: dataset.into(),
        arch: Arch::EfficientNetLite0,
        split,
        train_batch: args.batch,
        dtype: FeatureType::F32,
        compression: Compression::None,
        pool: None,
        skip_bad_samples: false,
        keep: keep.clone(),
        pixels: None,
        here: None,
    };
    let stages = Arch::EfficientNetLite0.stages();
    let features = stages.last().map(|s| s.out_elems());
    let mut head = MlpHead::new(features.unwrap_or(0), args.hidden, classes.len(), 1e-3)?;
    // The split is planned once (with `auto`, from measurements) and kept.
    let mut split = split;
    for epoch in 1..=args.epochs {
        let started = std::time::Instant::now();
        let (mut stream, run) =
            job::features(&clients, &weights, &opts("textures_train", split), false).await?;
        split = SplitChoice::Fixed(run.split);
        let (mut loss, mut batches) = (0f32, 0);
        while let Some(b) = stream.try_next().await? {
            loss += head.step(&b.features, &b.labels)?;
            batches += 1;
        }
        println!(
            "epoch {epoch}: {:.2} s, split {}/{} (stages before it run at the node{}), {batches} \
             batches, mean loss {:.4}, {} bytes received, {} partitions pushed back",
            started.elapsed().as_secs_f64(),
            run.split,
            stages.len(),
            if keep.is_some() && epoch > 1 {
                ", kept there by epoch 1"
            } else {
                ""
            },
            loss / batches.max(1) as f32,
            job::received(&run.stats),
            run.stats
                .pushed_back
                .load(std::sync::atomic::Ordering::Relaxed),
        );
    }

    let (mut stream, _) =
        job::features(&clients, &weights, &opts("textures_test", split), false).await?;
    let (mut right, mut total) = (0usize, 0usize);
    while let Some(b) = stream.try_next().await? {
        let p = head.predict(&b.features)?;
        right += p
            .iter()
            .zip(&b.labels)
            .filter(|(p, y)| **p as i64 == **y)
            .count();
        total += b.labels.len();
    }
    println!(
        "held-out accuracy: {right}/{total} = {:.1}% (chance {:.1}%)",
        100.0 * right as f64 / total.max(1) as f64,
        100.0 / classes.len().max(1) as f64
    );
    if let Some(k) = &keep {
        k.release().await?;
    }
    if let Some(n) = embedded {
        n.shutdown().await?;
    }
    Ok(())
}
