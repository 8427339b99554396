//! `csd features`: DNN features of a dataset, the first layers run at the storage
//! nodes (or the split plan, with --explain).

use std::path::PathBuf;

use csd_client::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};

use super::{ClientCreds, parse_ttl};

#[derive(clap::Args)]
pub(crate) struct FeaturesArgs {
    /// Storage node URL (repeat for several nodes).
    #[arg(long = "node", default_value = "grpc://127.0.0.1:50051")]
    nodes: Vec<String>,
    /// Dataset table (stored with `csd put --images` or `--text`).
    #[arg(long)]
    dataset: String,
    /// Model architecture.
    #[arg(long, default_value = "efficientnet-lite0")]
    model: String,
    /// Model weights (safetensors); uploaded to the nodes once, by content.
    #[arg(long)]
    weights: PathBuf,
    /// A text model's tokenizer.json (carried to the nodes inside the weights).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// auto (the planner's choice), N (stages [0, N) at the nodes), none, or full.
    #[arg(long, default_value = "auto")]
    split: String,
    /// Print the planner's candidate table.
    #[arg(long)]
    explain: bool,
    /// With --explain: only print the plan.
    #[arg(long)]
    dry_run: bool,
    /// Write `id, label, features` here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Training batch size (independent of the node's batch size).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Send features as f16 (half the bytes).
    #[arg(long)]
    f16: bool,
    /// Compression of the node's answers: none, lz4 or zstd.
    #[arg(long, default_value = "lz4")]
    compression: String,
    /// Leave out samples that cannot be decoded (counted at the end) instead of
    /// failing on the first.
    #[arg(long)]
    skip_bad_samples: bool,
    /// Keep the nodes' output (the features before the split) at the nodes for
    /// --ttl and print a reference per partition on stderr (`kept {json}`), for
    /// later passes to read without running the node's stages again.
    #[arg(long)]
    keep: bool,
    /// With --keep: how long the nodes keep them (e.g. 10m, 2h).
    #[arg(long, default_value = "1h", requires = "keep", value_parser = parse_ttl)]
    ttl: std::time::Duration,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: FeaturesArgs) -> Result<()> {
    use csd_client::features::{FeaturesOptions, SplitChoice, features, received, write_parquet};
    let arch: csd_ml_pushdown::Arch = args.model.parse().map_err(Error::Ml)?;
    let split: SplitChoice = args.split.parse()?;
    let mut weights =
        std::fs::read(&args.weights).map_err(|e| Error::io(args.weights.display(), e))?;
    if let Some(t) = &args.tokenizer {
        let json = std::fs::read(t).map_err(|e| Error::io(t.display(), e))?;
        weights = csd_ml_pushdown::weights::with_tokenizer(&weights, &json)?;
    }
    let mut clients = Vec::new();
    for n in &args.nodes {
        clients.push(args.creds.connect(n).await?);
    }
    let opts = FeaturesOptions {
        dataset: args.dataset.clone(),
        arch,
        split,
        train_batch: args.batch,
        dtype: if args.f16 {
            csd_ml_pushdown::request::FeatureType::F16
        } else {
            csd_ml_pushdown::request::FeatureType::F32
        },
        compression: args.compression.parse()?,
        pool: None,
        skip_bad_samples: args.skip_bad_samples,
        keep: args
            .keep
            .then(|| csd_ml_pushdown::stream::KeepFeatures::new(args.ttl)),
    };
    let started = std::time::Instant::now();
    let (stream, run) = features(&clients, &weights, &opts, args.explain).await?;
    if let Some(p) = &run.plan
        && args.explain
    {
        print!("{}", p.explain());
        if args.dry_run {
            return Ok(());
        }
    }
    let bar = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template("{spinner} {pos} samples {per_sec}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    let rows = write_parquet(stream, args.out.as_deref(), &bar).await?;
    bar.finish_and_clear();
    let relaxed = std::sync::atomic::Ordering::Relaxed;
    eprintln!(
        "{rows} samples through {arch} with split {} in {:.2} s; {} bytes received; {} partitions pushed back; {} undecodable samples skipped",
        run.split,
        started.elapsed().as_secs_f64(),
        received(&run.stats),
        run.stats.pushed_back.load(relaxed),
        run.stats.skipped.load(relaxed),
    );
    if let Some(k) = &opts.keep {
        for r in k.references() {
            eprintln!("kept {}", serde_json::to_string(&r).unwrap_or_default());
        }
    }
    Ok(())
}
