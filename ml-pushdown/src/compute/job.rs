//! The compute side of a feature job, as the `csd` CLI and the testbed run it: load
//! image and text datasets, measure what the planner needs, pick the split, open the stream.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use arrow::record_batch::RecordBatch;
use candle_core::Device;
use csd_protocol::Compression;
use csd_protocol::node_client::{Error as ClientError, NodeClient};
use futures::TryStreamExt;

use crate::dataset::{self, image_folder};
use crate::features::{blocking, profile};
use crate::model::{OnnxModelStages, PixelNorm, StagedModel};
use crate::planner::{self, Part, Plan, PlanInputs};
use crate::profile::{Profile, ProfileCache};
use crate::request::{
    DEFAULT_NODE_BATCH, FeatureRequest, FeatureType, MlDetails, Mode, OPERATOR_NAME, PROFILE_BATCH,
    PROFILE_SAMPLES,
};
use crate::stream::{self, FeatureJob, FeatureStats, Probed, Source, TrainBatch};
use crate::{Arch, Error, Result, weights};

fn protocol(m: impl Into<String>) -> Error {
    Error::Client(ClientError::Protocol(m.into()))
}

/// Samples per `DoPut` batch when loading images.
const PUT_BATCH: usize = 64;

/// Stores a folder of images as dataset `table`, spread round-robin over `partitions`
/// partitions (partition `i` on node `i % nodes`, and with `copies` above 1 on the
/// nodes after it too), every sample `repeat` times (ids stay unique).
/// `progress(n)` is called as `n` more samples are read. Returns (samples stored,
/// class names).
#[allow(clippy::too_many_arguments)]
pub async fn put_images(
    clients: &[NodeClient],
    table: &str,
    dir: &Path,
    labels: Option<&Path>,
    (partitions, copies): (usize, usize),
    repeat: usize,
    progress: impl FnMut(u64),
) -> Result<(usize, Vec<String>)> {
    let mut folder = image_folder(dir, labels)?;
    let one = folder.samples.clone();
    for _ in 1..repeat.max(1) {
        folder.samples.extend(one.iter().cloned());
    }
    let samples = &folder.samples;
    put_samples(
        clients,
        table,
        samples.len(),
        (partitions, copies),
        |i| samples[i].1,
        |i| {
            let path = &samples[i].0;
            std::fs::read(path).map_err(|e| {
                csd_protocol::Error::io(format!("reading {}", path.display()), e).into()
            })
        },
        progress,
    )
    .await?;
    Ok((folder.samples.len(), folder.classes))
}

/// Stores labelled text (a Parquet or CSV file, see [`dataset::text_file`]) as dataset
/// `table` of UTF-8 samples, spread like [`put_images`]. Returns (samples stored, class
/// names; empty for integer labels).
pub async fn put_text(
    clients: &[NodeClient],
    table: &str,
    file: &Path,
    text_col: &str,
    label_col: &str,
    (partitions, copies): (usize, usize),
    progress: impl FnMut(u64),
) -> Result<(usize, Vec<String>)> {
    let t = dataset::text_file(file, text_col, label_col)?;
    put_samples(
        clients,
        table,
        t.texts.len(),
        (partitions, copies),
        |i| t.labels[i],
        |i| Ok(t.texts[i].as_bytes().to_vec()),
        progress,
    )
    .await?;
    Ok((t.texts.len(), t.classes))
}

/// Stores samples `0..n` (id `i`, `label(i)`, `bytes(i)`) as dataset `table`, sample
/// `i` in partition `i % partitions` and partition `p` on node `p % nodes` — and, in
/// `copies` copies, on the `copies - 1` nodes after it, every copy of one put (the
/// same bytes everywhere); a partition stored short of its copies is deleted again.
async fn put_samples(
    clients: &[NodeClient],
    table: &str,
    n: usize,
    (partitions, copies): (usize, usize),
    label: impl Fn(usize) -> i64,
    bytes: impl Fn(usize) -> Result<Vec<u8>>,
    mut progress: impl FnMut(u64),
) -> Result<()> {
    if clients.is_empty() {
        return Err(Error::InvalidArgument("no storage nodes given".into()));
    }
    let copies = copies.max(1);
    if copies > clients.len() || copies > csd_protocol::MAX_COPIES as usize {
        return Err(Error::InvalidArgument(format!(
            "{copies} copies of each partition need as many nodes ({} given, at most {})",
            clients.len(),
            csd_protocol::MAX_COPIES
        )));
    }
    let parts = partitions.max(1);
    for p in 0..parts {
        let mine: Vec<usize> = (p..n).step_by(parts).collect();
        let mut batches = Vec::new();
        for chunk in mine.chunks(PUT_BATCH) {
            let data: Vec<Vec<u8>> = chunk.iter().map(|&i| bytes(i)).collect::<Result<_>>()?;
            let refs: Vec<&[u8]> = data.iter().map(|b| b.as_slice()).collect();
            let ids: Vec<u64> = chunk.iter().map(|&i| i as u64).collect();
            let labels: Vec<i64> = chunk.iter().map(|&i| label(i)).collect();
            batches.push(dataset::batch(&ids, &labels, &refs)?);
            progress(chunk.len() as u64);
        }
        if batches.is_empty() {
            continue;
        }
        let put = (copies > 1).then(|| format!("{:016x}", rand::random::<u64>()));
        let partition = p.to_string();
        for j in 0..copies {
            let client = &clients[(p + j) % clients.len()];
            let stored = client
                .put_copy(
                    table,
                    &partition,
                    copies as u32,
                    put.as_deref(),
                    dataset::image_schema(),
                    futures::stream::iter(batches.clone().into_iter().map(Ok)),
                )
                .await;
            if let Err(e) = stored {
                for k in 0..j {
                    let _ = clients[(p + k) % clients.len()]
                        .delete(table, Some(&partition))
                        .await;
                }
                return Err(e.into());
            }
        }
    }
    Ok(())
}

/// Every partition of `dataset` (see [`layout`]), and its sample count.
pub async fn sources(clients: &[NodeClient], dataset: &str) -> Result<(Vec<Source>, u64)> {
    let l = layout(clients, dataset).await?;
    let rows = l.iter().map(|(_, p)| p.rows).sum();
    Ok((l.into_iter().map(|(s, _)| s).collect(), rows))
}

/// Every partition of `dataset`, with its node (an index into `clients`) and its
/// samples. A partition kept on several nodes (`csd put --replicas`) is one
/// [`Source`] whose other copies stand by ([`Source::replicas`]); a copy a node
/// remembers deleting is none. Nodes out of reach are left out while fewer are
/// out than the partitions have copies (else a partition may be on them alone).
pub async fn layout(clients: &[NodeClient], dataset: &str) -> Result<Vec<(Source, Part)>> {
    // Partition name → its copies (node, rows, objects), in node order.
    type Copy = (usize, csd_protocol::PartitionDescription);
    let mut copies: std::collections::BTreeMap<String, Vec<Copy>> = Default::default();
    let mut deleted: Vec<csd_protocol::DeletedCopy> = Vec::new();
    let mut out_of_reach: Vec<String> = Vec::new();
    let mut fewest = u32::MAX;
    for (node, c) in clients.iter().enumerate() {
        let listed = match c.list_tables(dataset).await {
            Ok(l) => l,
            Err(e) if e.node_lost() && clients.len() > 1 => {
                tracing::warn!(node = %c.url(), "storage node out of reach: {e}");
                out_of_reach.push(format!("{} ({e})", c.url()));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        for t in listed.into_iter().filter(|t| t.name == dataset) {
            deleted.extend(t.description.deleted);
            if t.description.partitions.is_empty() {
                continue;
            }
            dataset::check_schema(dataset, &t.schema)?;
            for p in t.description.partitions {
                fewest = fewest.min(p.copies.max(1));
                copies.entry(p.name.clone()).or_default().push((node, p));
            }
        }
    }
    if !out_of_reach.is_empty()
        && (copies.is_empty() || out_of_reach.len() as u64 >= u64::from(fewest))
    {
        return Err(Error::Node(csd_protocol::Error::Unavailable(format!(
            "dataset {dataset} cannot be read whole: {} cannot be reached and its \
                 partitions are kept in {fewest} cop{}, so some may be on those nodes only",
            out_of_reach.join(", "),
            if fewest == 1 { "y" } else { "ies" }
        ))));
    }
    let mut out = Vec::new();
    for (name, mut held) in copies {
        held.retain(|(_, p)| !deleted.iter().any(|d| d.matches(&name, &p.objects)));
        let Some(((node, first), others)) =
            held.split_first().map(|(f, o)| (f.clone(), o.to_vec()))
        else {
            continue;
        };
        for (other, p) in &others {
            let digests = |p: &csd_protocol::PartitionDescription| {
                p.objects
                    .iter()
                    .map(|o| (o.len, o.digest))
                    .collect::<Vec<_>>()
            };
            if p.rows != first.rows || digests(p) != digests(&first) {
                return Err(Error::InvalidArgument(format!(
                    "partition {name} of dataset {dataset} is stored on {} and on {}, and \
                     the copies differ: they are not replicas of each other",
                    clients[node].url(),
                    clients[*other].url()
                )));
            }
        }
        out.push((
            Source {
                client: clients[node].clone(),
                partition: name,
                replicas: others.iter().map(|(n, _)| clients[*n].clone()).collect(),
            },
            Part {
                node,
                rows: first.rows,
            },
        ));
    }
    if out.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "no node holds dataset {dataset}"
        )));
    }
    Ok(out)
}

/// How to choose the split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SplitChoice {
    /// The planner's least predicted epoch time.
    Auto,
    /// Stages `[0, k)` at the node.
    Fixed(usize),
    /// Nothing at the node: ship the samples.
    None,
    /// Every feature stage at the node.
    Full,
    /// An ONNX model's cut point that sends this tensor.
    Tensor(String),
}

impl std::str::FromStr for SplitChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => SplitChoice::Auto,
            "none" => SplitChoice::None,
            "full" => SplitChoice::Full,
            n => match n.parse() {
                Ok(k) => SplitChoice::Fixed(k),
                Err(_) if !n.is_empty() => SplitChoice::Tensor(n.to_string()),
                Err(_) => {
                    return Err(Error::InvalidArgument(
                        "--split must be auto, none, full, a stage number or (for an ONNX \
                         model) a tensor name"
                            .into(),
                    ));
                }
            },
        })
    }
}

/// Measures what the planner needs: the node's and this machine's per-stage times on
/// the first samples, the link's bandwidth, and the node's free CPU share. Also
/// returns the first rows of `src` the link probe read (the stream reuses them when
/// that partition is read raw).
pub async fn plan_inputs(
    src: &Source,
    samples: u64,
    dataset: &str,
    model: &Arc<dyn StagedModel>,
    weights_table: &str,
    dtype: FeatureType,
    pool: Option<Arc<rayon::ThreadPool>>,
) -> Result<(PlanInputs, RecordBatch)> {
    let pixels = model.onnx().map(|m| m.pixels());
    let arch = model.arch();
    // The link first: the profile's samples, then one sample. Each read pays a round
    // trip and the node's start-up besides the transfer; the difference of the two is
    // the transfer alone. The larger read goes first, so cold caches slow it and not
    // the small one: an error that makes the link look slower, not faster. (Only the
    // first samples: on a slow link a whole batch of the partition cost up to a
    // second.) Not at the same time as the node's profile: the node admits the reads
    // behind it, and the queueing would read as a slow link.
    //
    // A link that is shaped lets a burst through at full speed (`tc`'s token bucket
    // holds at least 10 ms of its rate, cloud links hold burst credits), and a read of
    // a few samples ends inside it: the link looked unlimited (a 200 Mbit/s veth
    // measured at the 4x cap, so splits sending 6x the images' bytes won). The rate
    // read is therefore at least LINK_PROBE_BYTES when the profile's samples are less.
    let started = Instant::now();
    let (bytes, secs, first) = probe(src, dataset, PROFILE_SAMPLES as u64).await?;
    let per_sample = bytes / first.num_rows().max(1) as f64;
    let n = ((LINK_PROBE_BYTES as f64 / per_sample.max(1.0)).ceil() as u64)
        .clamp(PROFILE_SAMPLES as u64, LINK_PROBE_SAMPLES);
    let (large, probed) = if n > PROFILE_SAMPLES as u64 {
        let (b, s, rows) = probe(src, dataset, n).await?;
        ((b, s), rows)
    } else {
        ((bytes, secs), first.clone())
    };
    let (one_bytes, one_s, _) = probe(src, dataset, 1).await?;
    let link_bps = link_bandwidth((one_bytes, one_s), large);
    let probed_s = started.elapsed().as_secs_f64();
    // Then both sides' per-stage times at once (different CPUs): the node's (a
    // zero-row request whose report carries the timings; the node reuses a recent one)
    // and this side's on the same samples (reused likewise).
    let req = FeatureRequest {
        dataset: dataset.into(),
        partition: src.partition.clone(),
        model: arch,
        weights: weights_table.into(),
        split: model.stages().len(),
        dtype,
        max_batch: None,
        limit: None,
        mode: Mode::Profile,
        skip_bad_samples: false,
        pixels,
    };
    let node = async {
        let t = Instant::now();
        let reply = src
            .client
            .operator(OPERATOR_NAME, req.encode(), Compression::None)
            .await?;
        let stats = reply.stats.clone();
        let _: Vec<_> = reply.batches.try_collect().await?;
        let details = stats.report().and_then(|r| r.details::<MlDetails>());
        let cached = details.as_ref().and_then(|d| d.profile_cached);
        let node: Profile = details
            .and_then(|d| d.profile)
            .ok_or_else(|| protocol("the node's profile report is missing"))?;
        tracing::debug!(
            secs = t.elapsed().as_secs_f64(),
            ?cached,
            "the node's profile"
        );
        Ok::<_, Error>(node)
    };
    let threads = pool
        .as_ref()
        .map(|p| p.current_num_threads())
        .unwrap_or_else(rayon::current_num_threads);
    // Not the node's address: the same node can be reached by several (a proxy).
    let key = format!(
        "{dataset}/{}/{arch}:{}/{weights_table}/{threads}/{}x{bytes}",
        src.partition,
        model.engine(),
        first.num_rows()
    );
    let compute = async {
        if let Some(p) = COMPUTE_PROFILES.get(&key) {
            return Ok(p);
        }
        let t = Instant::now();
        let take = vec![first];
        let m = model.clone();
        let p = blocking(pool, move || profile(m.as_ref(), &take, PROFILE_BATCH)).await?;
        tracing::debug!(secs = t.elapsed().as_secs_f64(), "this side's profile");
        COMPUTE_PROFILES.insert(key, p.clone());
        Ok::<_, Error>(p)
    };
    let (node, compute) = futures::future::try_join(node, compute).await?;
    tracing::debug!(
        probed_s,
        profiled_s = started.elapsed().as_secs_f64() - probed_s,
        "planning: the link probe, then both profiles"
    );
    // The node's load; a tenant without `admin` may not read it: plan for an idle node.
    let (slots, running, waiting) = match src.client.stats().await {
        Ok(s) => (
            s.admission.slots.max(1) as f64,
            s.admission.running as f64,
            s.admission.waiting as f64,
        ),
        Err(e) if e.code() == Some(tonic::Code::PermissionDenied) => (1.0, 0.0, 0.0),
        Err(e) => return Err(e.into()),
    };
    let inputs = PlanInputs {
        // One partition of `samples` until the caller gives the layout.
        parts: Vec::new(),
        samples,
        stages: model.stages().to_vec(),
        node,
        node_share: (1.0 - (running + waiting) / slots).max(1.0 / (1.0 + running + waiting)),
        compute,
        link_bps,
        feature_bytes: dtype.bytes(),
        batch: DEFAULT_NODE_BATCH as u64,
        // The node's batch until the caller gives its own.
        train_batch: DEFAULT_NODE_BATCH as u64,
    };
    Ok((inputs, probed))
}

/// Bytes the link probe reads at least (see [`plan_inputs`]): several times a shaped
/// link's burst, under a second at 50 Mbit/s.
const LINK_PROBE_BYTES: u64 = 4 << 20;
/// Most samples the link probe reads.
const LINK_PROBE_SAMPLES: u64 = 256;

/// Recent profiles of the compute side, like the node's: keyed by dataset,
/// partition, model, weights, threads and the probed samples' count and size; kept
/// in `profiles/` under the ML assets directory too, so that the next process on
/// this machine plans without profiling again.
static COMPUTE_PROFILES: std::sync::LazyLock<ProfileCache> =
    std::sync::LazyLock::new(|| ProfileCache::on_disk(crate::assets_dir().join("profiles")));

/// Reads the first `n` samples of `src`: (bytes of them on the wire, seconds, the samples).
async fn probe(src: &Source, dataset: &str, n: u64) -> Result<(f64, f64, RecordBatch)> {
    let t = Instant::now();
    let batches: Vec<RecordBatch> = src
        .client
        .scan_limit(dataset, Some(&src.partition), &[], Some(n))
        .await?
        .try_collect()
        .await
        .map_err(ClientError::from)?;
    let secs = t.elapsed().as_secs_f64();
    let schema = batches
        .first()
        .map(|b| b.schema())
        .unwrap_or_else(dataset::image_schema);
    let batch = arrow::compute::concat_batches(&schema, &batches)?;
    if batch.num_rows() == 0 {
        return Err(Error::InvalidArgument(format!(
            "dataset {dataset} partition {} is empty",
            src.partition
        )));
    }
    Ok((wire_bytes(&batch) as f64, secs, batch))
}

/// The bytes of `batch`'s rows as the IPC writer sends them. Not
/// `get_array_memory_size`: a batch decoded from IPC holds slices of one message
/// buffer, and each column counts the whole buffer's capacity (3-4x the payload for a
/// sample table, which made a 50 Mbit/s link look like 185).
fn wire_bytes(batch: &RecordBatch) -> usize {
    batch
        .columns()
        .iter()
        .map(|c| {
            let d = c.to_data();
            d.get_slice_memory_size()
                .unwrap_or_else(|_| c.get_array_memory_size())
        })
        .sum()
}

/// Link bandwidth (bytes/s) from two reads of different sizes, `(bytes, seconds)`:
/// the larger one's extra bytes over its extra time, which cancels the round trip and
/// the node's per-request start-up both pay. Falls back to the larger read's plain
/// rate when the two do not order (timer noise on a fast link), which errs low.
fn link_bandwidth(small: (f64, f64), large: (f64, f64)) -> f64 {
    let (db, dt) = (large.0 - small.0, large.1 - small.1);
    let plain = large.0 / large.1.max(1e-6);
    if db > 0.0 && dt > 0.0 {
        // Never below the plain rate (the difference only removes fixed costs), and at
        // most 4x it: a jittery small read must not make the link look free.
        (db / dt).clamp(plain, 4.0 * plain)
    } else {
        plain
    }
}

/// Options of [`features`].
#[derive(Debug, Clone)]
pub struct FeaturesOptions {
    /// Dataset table.
    pub dataset: String,
    /// Model.
    pub arch: Arch,
    /// Split choice.
    pub split: SplitChoice,
    /// Training batch size.
    pub train_batch: usize,
    /// Wire element type.
    pub dtype: FeatureType,
    /// IPC compression.
    pub compression: Compression,
    /// The compute tier's threads (`None`: rayon's global pool). The planner profiles
    /// the compute side on them too.
    pub pool: Option<Arc<rayon::ThreadPool>>,
    /// Leave out undecodable samples, counted in [`FeatureStats::skipped`], instead
    /// of failing the job.
    pub skip_bad_samples: bool,
    /// Keep the nodes' output between epochs (see [`crate::stream::KeepFeatures`]).
    pub keep: Option<crate::stream::KeepFeatures>,
    /// An ONNX model's pixel normalisation.
    pub pixels: Option<PixelNorm>,
    /// Partitions read raw and run whole here while the nodes run the others to the
    /// split (`None`: the planner's share with `SplitChoice::Auto`, else none).
    /// Given or planned, the nodes are asked to queue their partitions rather than
    /// hand them back.
    pub here: Option<usize>,
}

/// The outcome of [`features`].
pub struct FeaturesRun {
    /// Split used.
    pub split: usize,
    /// Partitions (in the order of [`layout`]) read raw and run whole here.
    pub here: Vec<usize>,
    /// The plan, when the split was chosen automatically or explained.
    pub plan: Option<Plan>,
    /// Seconds spent planning (the probe read and both profiles; 0 without a plan).
    pub plan_s: f64,
    /// Figures of the stream.
    pub stats: Arc<FeatureStats>,
}

/// The weights table on every node that can be reached (a node lost streams
/// nothing: its partitions are read from their other copies).
async fn ensure_weights(clients: &[NodeClient], bytes: &[u8]) -> Result<String> {
    let mut table = None;
    let mut lost = None;
    for c in clients {
        match weights::ensure(c, bytes).await {
            Ok(t) => table = Some(t),
            Err(Error::Client(e)) if e.node_lost() && clients.len() > 1 => {
                tracing::warn!(node = %c.url(), "storage node out of reach: {e}");
                lost = Some(Error::Client(e));
            }
            Err(e) => return Err(e),
        }
    }
    match (table, lost) {
        (Some(t), _) => Ok(t),
        (None, Some(e)) => Err(e),
        (None, None) => Err(Error::InvalidArgument("no storage nodes given".into())),
    }
}

/// Uploads weights if needed, picks the split and opens the feature stream.
pub async fn features(
    clients: &[NodeClient],
    weights_bytes: &[u8],
    opts: &FeaturesOptions,
    explain: bool,
) -> Result<(
    futures::stream::BoxStream<'static, Result<TrainBatch>>,
    FeaturesRun,
)> {
    let model: Arc<dyn StagedModel> = match opts.arch {
        Arch::Onnx => Arc::new(OnnxModelStages::load(
            weights_bytes,
            opts.pixels.unwrap_or_default(),
        )?),
        arch => Arc::from(arch.load(weights_bytes, &Device::Cpu)?),
    };
    let layout = layout(clients, &opts.dataset).await?;
    let parts: Vec<Part> = layout.iter().map(|(_, p)| *p).collect();
    let samples = parts.iter().map(|p| p.rows).sum();
    let srcs: Vec<Source> = layout.into_iter().map(|(s, _)| s).collect();
    if let Some(m) = opts.here
        && m > parts.len()
    {
        return Err(Error::InvalidArgument(format!(
            "--here {m}: dataset {} has {} partitions",
            opts.dataset,
            parts.len()
        )));
    }
    // The planner profiles every stage at the node, so it needs the whole model
    // there; an ONNX model with a split given sends its head only (below).
    let planned = opts.split == SplitChoice::Auto || explain;
    let mut table = String::new();
    if planned || opts.arch != Arch::Onnx {
        table = ensure_weights(clients, weights_bytes).await?;
    }
    let n = model.stages().len();
    let planning = Instant::now();
    // The link probe reads the partition the planner would run here first, so that
    // its rows are not read twice when it does.
    let probe_at = planner::here_set(&parts, 1).first().copied().unwrap_or(0);
    let mut probed = None;
    let plan = if planned {
        // Probed at the first copy that answers.
        let at = &srcs[probe_at];
        let copies: Vec<&NodeClient> = std::iter::once(&at.client).chain(&at.replicas).collect();
        let mut answered = None;
        for (k, client) in copies.iter().enumerate() {
            let src = Source::new((*client).clone(), at.partition.clone());
            match plan_inputs(
                &src,
                samples,
                &opts.dataset,
                &model,
                &table,
                opts.dtype,
                opts.pool.clone(),
            )
            .await
            {
                Err(Error::Client(e)) if e.node_lost() && k + 1 < copies.len() => {
                    tracing::warn!(node = %client.url(), "probing another copy: {e}");
                }
                r => {
                    answered = Some(r?);
                    break;
                }
            }
        }
        let (mut inputs, rows) = answered.ok_or_else(|| {
            Error::InvalidArgument(format!("no copy of partition {} to probe", at.partition))
        })?;
        inputs.parts = parts.clone();
        inputs.train_batch = opts.train_batch as u64;
        probed = Some(Probed {
            part: probe_at,
            rows,
        });
        Some(planner::plan(&inputs))
    } else {
        None
    };
    let plan_s = if plan.is_some() {
        planning.elapsed().as_secs_f64()
    } else {
        0.0
    };
    if let Some(p) = &plan {
        tracing::debug!(plan_s, "split plan:\n{}", p.explain());
    }
    let split = match &opts.split {
        SplitChoice::Auto => plan.as_ref().map(|p| p.split()).unwrap_or(n),
        SplitChoice::None => 0,
        SplitChoice::Full => n,
        SplitChoice::Tensor(t) => match model.onnx() {
            Some(m) => m.analysis().find(t)?,
            None => {
                return Err(Error::InvalidArgument(format!(
                    "--split {t:?} names a tensor, which only an ONNX model has; {} splits \
                     at stage numbers 0..={n}",
                    opts.arch
                )));
            }
        },
        SplitChoice::Fixed(k) if *k <= n => *k,
        SplitChoice::Fixed(k) => {
            return Err(Error::InvalidArgument(format!(
                "--split {k} is past the last {} ({n}) of {}",
                if opts.arch == Arch::Onnx {
                    "cut point (see --list-splits)"
                } else {
                    "stage"
                },
                opts.arch
            )));
        }
    };
    let (here, patient) = match (opts.here, &plan) {
        (Some(m), _) => (planner::here_set(&parts, m), true),
        (None, Some(p)) if opts.split == SplitChoice::Auto => (p.here().to_vec(), true),
        _ => (Vec::new(), false),
    };
    let mut node_split = None;
    if let Some(onnx) = model.onnx().filter(|_| !planned && split > 0) {
        let (bytes, stages): (std::borrow::Cow<'_, [u8]>, usize) = if split == n {
            (weights_bytes.into(), n)
        } else {
            let head = onnx.analysis().head(split)?;
            let stages = OnnxModelStages::load(&head, onnx.pixels())?.stages().len();
            (head.into(), stages)
        };
        table = ensure_weights(clients, &bytes).await?;
        node_split = Some(stages);
    }
    let job = FeatureJob {
        dataset: opts.dataset.clone(),
        arch: opts.arch,
        weights: table,
        split,
        node_split,
        train_batch: opts.train_batch,
        dtype: opts.dtype,
        compression: opts.compression,
        limit: None,
        max_node_batch: None,
        pool: opts.pool.clone(),
        skip_bad_samples: opts.skip_bad_samples,
        keep: opts.keep.clone(),
        pixels: opts.pixels,
        here: here.clone(),
        patient,
        probed,
    };
    let (s, stats) = stream::open(srcs, job, model)?;
    Ok((
        s,
        FeaturesRun {
            split,
            here,
            plan,
            plan_s,
            stats,
        },
    ))
}

/// Bytes received so far.
pub fn received(stats: &FeatureStats) -> u64 {
    stats.bytes_received.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::ipc::reader::StreamReader;
    use arrow::ipc::writer::StreamWriter;

    #[test]
    fn wire_bytes_counts_the_payload_of_a_batch_decoded_from_ipc() {
        let blobs: Vec<Vec<u8>> = (0..8).map(|i| vec![i as u8; 50_000]).collect();
        let refs: Vec<&[u8]> = blobs.iter().map(|b| b.as_slice()).collect();
        let ids: Vec<u64> = (0..8).collect();
        let b = dataset::batch(&ids, &[0; 8], &refs).expect("batch");
        let mut buf = Vec::new();
        let mut w = StreamWriter::try_new(&mut buf, &b.schema()).expect("writer");
        w.write(&b).expect("write");
        w.finish().expect("finish");
        drop(w);
        let decoded: Vec<RecordBatch> = StreamReader::try_new(buf.as_slice(), None)
            .expect("reader")
            .collect::<std::result::Result<_, _>>()
            .expect("read");
        let one = arrow::compute::concat_batches(&decoded[0].schema(), &decoded).expect("concat");
        let payload = 8 * 50_000;
        let w = wire_bytes(&one);
        assert!(
            (payload..payload + 1_000).contains(&w),
            "{w} bytes counted for {payload} of samples"
        );
        // What the probe used to count: every column charged the whole message buffer.
        assert!(one.get_array_memory_size() > 2 * payload);
    }

    #[test]
    fn link_bandwidth_cancels_the_fixed_cost_of_a_read() {
        // 10 MB/s with 20 ms of round trip and start-up per read.
        let read = |bytes: f64| (bytes, 0.020 + bytes / 10e6);
        let bw = link_bandwidth(read(50e3), read(400e3));
        assert!((bw - 10e6).abs() < 1e3, "{bw}");
        // The plain rate of the large read alone is 40% low here.
        assert!(400e3 / read(400e3).1 < 0.7 * 10e6);
        // Reads that do not order fall back to the plain rate; a tiny time difference
        // is capped at 4x it.
        assert_eq!(link_bandwidth((50e3, 0.05), (400e3, 0.04)), 400e3 / 0.04);
        assert_eq!(
            link_bandwidth((50e3, 0.0399), (400e3, 0.04)),
            4.0 * 400e3 / 0.04
        );
    }
}
