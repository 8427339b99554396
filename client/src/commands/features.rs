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
    /// A built-in architecture (efficientnet-lite0, resnet18, resnet50, minilm-l6),
    /// or an ONNX image model's file (`*.onnx`: uploaded to the nodes once, by
    /// content; split at its cut points, run on onnxruntime).
    #[arg(long, default_value = "efficientnet-lite0")]
    model: String,
    /// A built-in model's weights (safetensors; required for one); uploaded to the
    /// nodes once, by content.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// An ONNX model: per-channel mean subtracted from pixels scaled to [0, 1]
    /// (R,G,B; default 0,0,0).
    #[arg(long, value_parser = parse_rgb)]
    mean: Option<[f32; 3]>,
    /// An ONNX model: per-channel standard deviation pixels are divided by (R,G,B;
    /// default 1,1,1).
    #[arg(long, value_parser = parse_rgb)]
    std: Option<[f32; 3]>,
    /// An ONNX model: print its cut points (what each sends per sample) and exit.
    #[arg(long)]
    list_splits: bool,
    /// A text model's tokenizer.json (carried to the nodes inside the weights).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// auto (the planner's choice), N (stages [0, N) at the nodes; for an ONNX model
    /// its cut point N), none, full, or (ONNX) the name of a tensor a cut point sends.
    #[arg(long, default_value = "auto")]
    split: String,
    /// Partitions read raw and run whole on this machine while the nodes run the
    /// others to the split (default: the planner's share with --split auto, else
    /// none). With a share, planned or given, the nodes queue their partitions rather
    /// than hand them back.
    #[arg(long)]
    here: Option<usize>,
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
    /// Compression of the node's answers: auto (LZ4, and zstd for the pieces the link
    /// holds back), none, lz4 or zstd.
    #[arg(long, default_value = "auto")]
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
    use csd_client::features::{
        FeaturesOptions, Model, SplitChoice, features, received, write_parquet,
    };
    let onnx = args.model.ends_with(".onnx");
    if args.list_splits && !onnx {
        return Err(Error::InvalidInput(
            "--mean, --std and --list-splits are for ONNX models (--model FILE.onnx)".into(),
        ));
    }
    let model = Model::load(
        &args.model,
        args.weights.as_deref(),
        args.tokenizer.as_deref(),
        args.mean,
        args.std,
    )?;
    let (arch, weights, pixels) = (model.arch, model.bytes, model.pixels);
    if args.list_splits {
        let m =
            csd_ml_pushdown::model::OnnxModelStages::load(&weights, pixels.unwrap_or_default())?;
        print!("{}", list_splits(&m));
        return Ok(());
    }
    let split: SplitChoice = args.split.parse()?;
    // A node out of reach is asked lazily: a dataset whose partitions have copies
    // elsewhere is read from them (see `job::layout`).
    let mut clients = Vec::new();
    for n in &args.nodes {
        match args.creds.connect(n).await {
            Ok(c) => clients.push(c),
            Err(Error::Node(e)) if e.node_lost() && args.nodes.len() > 1 => {
                eprintln!(
                    "csd: {n} is out of reach ({e}): its partitions are read from their other copies"
                );
                let lazy = csd_client::NodeClient::connect_lazy_with(n, &args.creds.credentials()?);
                clients.push(lazy?);
            }
            Err(e) => return Err(e),
        }
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
        pixels,
        here: args.here,
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
        "{rows} samples through {} with split {}{} in {:.2} s ({:.2} s of it planning); {} bytes received; {} partitions pushed back; {} undecodable samples skipped",
        if onnx {
            args.model.as_str()
        } else {
            arch.name()
        },
        run.split,
        match run.here.len() {
            0 => String::new(),
            1 => " (1 partition run whole here)".into(),
            m => format!(" ({m} partitions run whole here)"),
        },
        started.elapsed().as_secs_f64(),
        run.plan_s,
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

/// `R,G,B` as three floats.
fn parse_rgb(s: &str) -> std::result::Result<[f32; 3], String> {
    let v: Vec<f32> = s
        .split(',')
        .map(|x| x.trim().parse::<f32>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| format!("{s:?}: {e}"))?;
    <[f32; 3]>::try_from(v).map_err(|v| format!("{s:?}: three values (R,G,B), not {}", v.len()))
}

/// The cut points of an ONNX model, one per line: number, per-sample floats, what
/// crosses.
fn list_splits(m: &csd_ml_pushdown::model::OnnxModelStages) -> String {
    use std::fmt::Write;
    let a = m.analysis();
    let last = a.cuts.len() - 1;
    let mut out = format!(
        "{:>5}  {:>6}  {:>12}  sends (per-sample shape)\n",
        "split", "nodes", "floats"
    );
    for (i, c) in a.cuts.iter().enumerate() {
        let what: Vec<String> = c
            .point
            .tensors
            .iter()
            .zip(&c.shapes)
            .map(|(t, s)| format!("{t} {s:?}"))
            .collect();
        let note = match i {
            0 => "  (nothing at the node: the images)",
            i if i == last => "  (the whole model at the node)",
            _ => "",
        };
        let _ = writeln!(
            out,
            "{i:>5}  {:>6}  {:>12}  {}{note}",
            c.point.at,
            c.elems(),
            what.join(", ")
        );
    }
    out
}
