//! The compute side: a stream of training batches.
//!
//! [`open`] asks every (node, partition) for stage `split - 1`'s output, in
//! parallel. A partition the node pushes back, one the job keeps here
//! ([`FeatureJob::here`]), and every partition with `split = 0` is read raw (after
//! the rows the planner's probe read of it, [`FeatureJob::probed`]) and its prefix is
//! run here, so the stream is the same either way. Rows are re-cut into
//! the *training* batch size, independent of the node's batch size, and the remaining
//! stages `[split, n)` run here; each [`TrainBatch`] holds `[B, D]` features.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arrow::array::{Array, AsArray};
use arrow::datatypes::{DataType, Float16Type, Float32Type};
use arrow::record_batch::RecordBatch;
use candle_core::{Device, Tensor};
use csd_protocol::Compression;
use csd_protocol::OperatorReport;
use csd_protocol::node_client::{self, NodeClient};
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt, TryStreamExt};

use super::boundary::Boundary;
use super::copies::Rows;
use crate::dataset::{self, Samples};
use crate::features::{blocking, decodable, forward_range_chunked};
use crate::model::{Arch, StagedModel};
use crate::request::{FeatureRequest, FeatureType, MlDetails, Mode, OPERATOR_NAME};
use crate::{Error, Result};

/// One partition of a dataset, at the node asked first.
#[derive(Clone)]
pub struct Source {
    /// The node.
    pub client: NodeClient,
    /// The partition.
    pub partition: String,
    /// Nodes holding other copies of it (`csd put --replicas`), asked in turn should
    /// `client` be lost (see `compute::copies`).
    pub replicas: Vec<NodeClient>,
}

impl Source {
    /// `partition` at `client` alone.
    pub fn new(client: NodeClient, partition: impl Into<String>) -> Self {
        Source {
            client,
            partition: partition.into(),
            replicas: vec![],
        }
    }
}

/// What to stream.
#[derive(Debug, Clone)]
pub struct FeatureJob {
    /// Dataset table.
    pub dataset: String,
    /// Model.
    pub arch: Arch,
    /// Weights table at the nodes ([`weights::ensure`](crate::weights::ensure)).
    pub weights: String,
    /// Stages `[0, split)` at the nodes.
    pub split: usize,
    /// When the nodes hold only the head of an ONNX model (cut at `split`): the
    /// head's own stage count, which the nodes run whole.
    pub node_split: Option<usize>,
    /// Rows per training batch.
    pub train_batch: usize,
    /// Feature element type on the wire.
    pub dtype: FeatureType,
    /// IPC compression of the node's answer.
    pub compression: Compression,
    /// Only the first samples of each partition.
    pub limit: Option<u64>,
    /// Cap on the node batch.
    pub max_node_batch: Option<usize>,
    /// The compute tier's threads for decoding and layers; `None`: rayon's global pool.
    pub pool: Option<Arc<rayon::ThreadPool>>,
    /// Leave out samples that cannot be decoded (counted in
    /// [`FeatureStats::skipped`]) instead of failing the job.
    pub skip_bad_samples: bool,
    /// Keep each partition's node output at its node and read it back in later
    /// epochs instead of running the node's stages again (see [`KeepFeatures`]).
    pub keep: Option<KeepFeatures>,
    /// An ONNX model's pixel normalisation.
    pub pixels: Option<crate::model::PixelNorm>,
    /// Partitions (indices into the sources given to [`open`]) read raw and run
    /// whole here, the planner's share of the samples for this side.
    pub here: Vec<usize>,
    /// Ask the nodes to queue their partitions rather than hand them back when
    /// busy: the work was divided between the sides by plan, and a partition handed
    /// back by chance would load this side twice.
    pub patient: bool,
    /// The first rows of one partition, read already (the planner's link probe):
    /// when that partition is read raw here, its read starts after them.
    pub probed: Option<Probed>,
}

impl FeatureJob {
    /// Stages `[0, split)` of `arch` (weights table `weights`) at the nodes over
    /// `dataset`, the rest here: training batches of 64, f32 features, nothing kept,
    /// no share, no limit.
    pub fn new(dataset: &str, arch: Arch, weights: &str, split: usize) -> Self {
        FeatureJob {
            dataset: dataset.into(),
            arch,
            weights: weights.into(),
            split,
            node_split: None,
            train_batch: 64,
            dtype: FeatureType::F32,
            compression: Compression::None,
            limit: None,
            max_node_batch: None,
            pool: None,
            skip_bad_samples: false,
            keep: None,
            pixels: None,
            here: Vec::new(),
            patient: false,
            probed: None,
        }
    }
}

/// The first rows of a partition, read before the stream opened.
#[derive(Debug, Clone)]
pub struct Probed {
    /// The partition (an index into the sources given to [`open`]).
    pub part: usize,
    /// Its first rows, in storage order, with the dataset's columns.
    pub rows: RecordBatch,
}

impl Probed {
    /// The rows in pieces of about [`PROBED_PIECE_BYTES`], as a scan sends them, so
    /// that the first local batch does not wait for all of them.
    fn pieces(&self) -> Vec<RecordBatch> {
        let n = self.rows.num_rows();
        let bytes = self.rows.get_array_memory_size().max(1);
        let per = (n * PROBED_PIECE_BYTES / bytes).clamp(1, n.max(1));
        (0..n)
            .step_by(per)
            .map(|at| self.rows.slice(at, per.min(n - at)))
            .collect()
    }
}

/// Bytes per piece of the probed rows run here.
const PROBED_PIECE_BYTES: usize = 2 << 20;

/// Features kept at the nodes between epochs (results by reference, HAPI with
/// ProxyStore): the first epoch asks each node to keep its output (the features
/// before the split) for `ttl` and reads it from there; later epochs with the same
/// dataset, split and type read the kept output without running the node's stages
/// again. Features are deterministic for fixed weights and split, so every epoch
/// sees the same ones.
#[derive(Clone)]
pub struct KeepFeatures {
    /// How long the nodes keep them.
    pub ttl: std::time::Duration,
    refs:
        Arc<Mutex<std::collections::HashMap<String, (NodeClient, csd_protocol::refs::Reference)>>>,
}

impl std::fmt::Debug for KeepFeatures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeepFeatures")
            .field("ttl", &self.ttl)
            .field("kept", &self.references())
            .finish()
    }
}

impl KeepFeatures {
    /// Kept for `ttl`.
    pub fn new(ttl: std::time::Duration) -> Self {
        KeepFeatures {
            ttl,
            refs: Arc::default(),
        }
    }

    /// The references kept so far.
    pub fn references(&self) -> Vec<csd_protocol::refs::Reference> {
        self.refs
            .lock()
            .map(|r| r.values().map(|(_, r)| r.clone()).collect())
            .unwrap_or_default()
    }

    /// Frees them at their nodes (through the clients that kept them).
    pub async fn release(&self) -> Result<()> {
        let held: Vec<(NodeClient, csd_protocol::refs::Reference)> = self
            .refs
            .lock()
            .map(|mut m| m.drain().map(|(_, v)| v).collect())
            .unwrap_or_default();
        for (c, r) in held {
            c.release(&r).await?;
        }
        Ok(())
    }

    fn get(&self, key: &str) -> Option<csd_protocol::refs::Reference> {
        Some(self.refs.lock().ok()?.get(key)?.1.clone())
    }

    fn put(&self, key: String, client: NodeClient, r: csd_protocol::refs::Reference) {
        if let Ok(mut m) = self.refs.lock() {
            m.insert(key, (client, r));
        }
    }
}

/// One training batch.
#[derive(Debug, Clone)]
pub struct TrainBatch {
    /// Sample ids.
    pub ids: Vec<u64>,
    /// Labels.
    pub labels: Vec<i64>,
    /// `[B, D]` float32 features (the model's last stage, flattened).
    pub features: Tensor,
}

/// Figures of a feature stream.
#[derive(Debug, Default)]
pub struct FeatureStats {
    /// Bytes received (Flight data for features; encoded samples for raw reads).
    pub bytes_received: AtomicU64,
    /// Partitions the nodes pushed back (computed here).
    pub pushed_back: AtomicU64,
    /// Samples streamed.
    pub samples: AtomicU64,
    /// Samples left out because they could not be decoded (with
    /// [`FeatureJob::skip_bad_samples`]), here and at the nodes.
    pub skipped: AtomicU64,
    /// The nodes' reports.
    pub reports: Mutex<Vec<OperatorReport>>,
}

/// Reads a partition raw (after the rows `probed` holds of it, when given) and runs
/// the prefix here.
async fn local_prefix(
    src: Source,
    job: FeatureJob,
    model: Arc<dyn StagedModel>,
    stats: Arc<FeatureStats>,
    probed: Option<&Probed>,
) -> Result<BoxStream<'static, Result<Boundary>>> {
    let (first, skip) = match probed {
        Some(p) => (p.pieces(), p.rows.num_rows() as u64),
        None => (Vec::new(), 0),
    };
    let rest = src
        .client
        .scan_rows(
            &job.dataset,
            Some(&src.partition),
            &[dataset::ID, dataset::LABEL, dataset::DATA],
            skip,
            None,
        )
        .await?
        .map_err(|e| Error::Client(node_client::Error::from(e)));
    let raw = futures::stream::iter(first.into_iter().map(Ok)).chain(rest);
    let mut left = job.limit.unwrap_or(u64::MAX);
    let s = raw
        .try_take_while(move |_| futures::future::ready(Ok(left > 0)))
        .map_ok(move |b: RecordBatch| {
            let take = (b.num_rows() as u64).min(left);
            left -= take;
            b.slice(0, take as usize)
        })
        .and_then(move |b| {
            let (model, stats, split) = (model.clone(), stats.clone(), job.split);
            let (pool, skip) = (job.pool.clone(), job.skip_bad_samples);
            async move {
                blocking(pool, move || {
                    let t = std::time::Instant::now();
                    tracing::debug!(rows = b.num_rows(), "local batch start");
                    let s = Samples::from_batch(&b)?;
                    let raw: u64 = s.bytes()?.iter().map(|d| d.len() as u64).sum();
                    stats.bytes_received.fetch_add(raw, Ordering::Relaxed);
                    let (s, x, bad) = decodable(model.as_ref(), s, skip)?;
                    stats.skipped.fetch_add(bad, Ordering::Relaxed);
                    let Some(x) = x else { return Ok(None) };
                    let x = forward_range_chunked(model.as_ref(), &x, 0, split)?;
                    tracing::debug!(secs = t.elapsed().as_secs_f64(), "local batch done");
                    Ok(Some(Boundary {
                        ids: s.ids,
                        labels: s.labels,
                        x,
                    }))
                })
                .await
            }
        })
        .try_filter_map(|b| futures::future::ready(Ok(b)));
    Ok(s.boxed())
}

fn features_tensor(b: &RecordBatch, shape: &[usize]) -> Result<Tensor> {
    let col = b
        .column_by_name("features")
        .ok_or_else(|| Error::InvalidArgument("node answer lacks the features column".into()))?;
    let list = col
        .as_fixed_size_list_opt()
        .ok_or_else(|| Error::InvalidArgument("features are not a fixed-size list".into()))?;
    let n = list.len();
    let values = list.values();
    let mut dims = vec![n];
    dims.extend_from_slice(shape);
    if values.len() != dims.iter().product::<usize>() {
        return Err(Error::InvalidArgument(format!(
            "node sent {} feature values for {n} rows of shape {shape:?}",
            values.len()
        )));
    }
    let t = match values.data_type() {
        DataType::Float32 => Tensor::from_slice(
            values.as_primitive::<Float32Type>().values(),
            dims,
            &Device::Cpu,
        )?,
        DataType::Float16 => Tensor::from_slice(
            values.as_primitive::<Float16Type>().values(),
            dims,
            &Device::Cpu,
        )?
        .to_dtype(candle_core::DType::F32)?,
        other => return Err(Error::InvalidArgument(format!("features are {other}"))),
    };
    Ok(t)
}

/// Asks the node for a partition's rows at the split. A push-back fails it (see
/// `super::copies`: another copy's node, or this side, takes the partition).
async fn partition(
    src: Source,
    job: FeatureJob,
    model: Arc<dyn StagedModel>,
    stats: Arc<FeatureStats>,
) -> Result<Rows> {
    let req = FeatureRequest {
        dataset: job.dataset.clone(),
        partition: src.partition.clone(),
        model: job.arch,
        weights: job.weights.clone(),
        split: job.node_split.unwrap_or(job.split),
        dtype: job.dtype,
        max_batch: job.max_node_batch,
        limit: job.limit,
        mode: Mode::Features,
        skip_bad_samples: job.skip_bad_samples,
        pixels: job.pixels,
    };
    let asked = match &job.keep {
        None => {
            src.client
                .operator_with(
                    OPERATOR_NAME,
                    req.encode(),
                    job.compression,
                    job.patient,
                    if job.patient { 1.0 } else { 0.0 },
                )
                .await
        }
        Some(k) => {
            let key = format!(
                "{}/{}/{}/{}/{:?}",
                src.client.url(),
                src.partition,
                job.dataset,
                job.split,
                job.dtype
            );
            let kept = match k.get(&key) {
                Some(r) => Ok(r),
                // Kept uncompressed: it never crosses the link as it is kept.
                None => src
                    .client
                    .keep(OPERATOR_NAME, req.encode(), Compression::None, k.ttl, None)
                    .await
                    .map(|kept| {
                        k.put(key, src.client.clone(), kept.reference.clone());
                        kept.reference
                    }),
            };
            match kept {
                Ok(r) => src.client.resolve_counted(&r).await,
                Err(e) => Err(e),
            }
        }
    };
    let reply = asked?;
    let shape = model.shape_before(job.split);
    let reply_stats = reply.stats.clone();
    let counted = Arc::new(AtomicU64::new(0));
    let count = {
        let (reply_stats, stats, counted) = (reply_stats.clone(), stats.clone(), counted.clone());
        move || {
            let got = reply_stats.bytes_received.load(Ordering::Relaxed);
            let before = counted.swap(got, Ordering::Relaxed);
            stats
                .bytes_received
                .fetch_add(got.saturating_sub(before), Ordering::Relaxed);
        }
    };
    let batches = reply.batches.map_err(Error::from).map({
        let count = count.clone();
        move |b| {
            count();
            let b = b?;
            // A node batch whose samples were all skipped.
            if b.num_rows() == 0 {
                return Ok(None);
            }
            tracing::debug!(rows = b.num_rows(), "node batch");
            let x = features_tensor(&b, &shape)?;
            let (ids, labels) = dataset::ids_labels(&b)?;
            Ok(Some(Boundary { ids, labels, x }))
        }
    });
    // After the last batch: the node's report, and the bytes of its message.
    let tail = futures::stream::once(async move {
        count();
        if let Some(r) = reply_stats.report()
            && let Ok(mut v) = stats.reports.lock()
        {
            if let Some(n) = r.details::<MlDetails>().and_then(|d| d.skipped_samples) {
                stats.skipped.fetch_add(n, Ordering::Relaxed);
            }
            v.push(r);
        }
        Ok(None)
    });
    let s = batches
        .chain(tail)
        .try_filter_map(|b| futures::future::ready(Ok(b)));
    Ok(s.boxed())
}

/// Opens the feature stream over `sources`; `model` runs the stages kept here.
pub fn open(
    sources: Vec<Source>,
    job: FeatureJob,
    model: Arc<dyn StagedModel>,
) -> Result<(BoxStream<'static, Result<TrainBatch>>, Arc<FeatureStats>)> {
    let n = model.stages().len();
    if job.split > n {
        return Err(Error::InvalidArgument(format!(
            "split {} is out of range for {} (0..={n})",
            job.split, job.arch
        )));
    }
    if job.train_batch == 0 {
        return Err(Error::InvalidArgument(
            "training batch size must be positive".into(),
        ));
    }
    let stats = Arc::new(FeatureStats::default());
    if let Some(i) = job.here.iter().find(|&&i| i >= sources.len()) {
        return Err(Error::InvalidArgument(format!(
            "partition {i} to run here is past the {} partitions of {}",
            sources.len(),
            job.dataset
        )));
    }
    let parts = futures::stream::iter(sources.into_iter().enumerate().map({
        let (job, model, stats) = (job.clone(), model.clone(), stats.clone());
        move |(i, src)| {
            let (job, model, stats) = (job.clone(), model.clone(), stats.clone());
            let partition_name = src.partition.clone();
            let ask = {
                let (job, model, stats) = (job.clone(), model.clone(), stats.clone());
                let partition_name = partition_name.clone();
                move |client: NodeClient| {
                    let src = Source::new(client, partition_name.clone());
                    let (job, model, stats) = (job.clone(), model.clone(), stats.clone());
                    async move {
                        if job.split == 0 || job.here.contains(&i) {
                            let probed = job.probed.clone().filter(|p| p.part == i);
                            local_prefix(src, job, model, stats, probed.as_ref()).await
                        } else {
                            partition(src, job, model, stats).await
                        }
                    }
                    .boxed()
                }
            };
            // Every copy's node busy, or one judged the prefix should run here: it
            // runs here over one's rows.
            let here = move |client: NodeClient| {
                let src = Source::new(client, partition_name.clone());
                let (job, model, stats) = (job.clone(), model.clone(), stats.clone());
                async move {
                    stats.pushed_back.fetch_add(1, Ordering::Relaxed);
                    let probed = job.probed.clone().filter(|p| p.part == i);
                    local_prefix(src, job, model, stats, probed.as_ref()).await
                }
                .boxed()
            };
            let nodes = std::iter::once(src.client).chain(src.replicas).collect();
            let copies = super::copies::from_copies(src.partition, nodes, ask, here);
            futures::future::ready(Ok::<_, Error>(copies))
        }
    }))
    .buffer_unordered(usize::MAX)
    .try_flatten_unordered(None)
    .boxed();
    struct State {
        input: BoxStream<'static, Result<Boundary>>,
        pending: VecDeque<Boundary>,
        rows: usize,
        done: bool,
    }
    let train = job.train_batch;
    let split = job.split;
    let out_stats = stats.clone();
    let pool = job.pool.clone();
    let s = futures::stream::try_unfold(
        State {
            input: parts,
            pending: VecDeque::new(),
            rows: 0,
            done: false,
        },
        move |mut st| {
            let (model, stats, pool) = (model.clone(), out_stats.clone(), pool.clone());
            async move {
                loop {
                    if st.rows >= train || (st.done && st.rows > 0) {
                        let take = st.rows.min(train);
                        let (ids, labels, parts) = cut(&mut st.pending, take)?;
                        st.rows -= take;
                        let model = model.clone();
                        let features = blocking(pool.clone(), move || {
                            let x = if parts.len() == 1 {
                                parts.into_iter().next().unwrap_or_else(|| unreachable!())
                            } else {
                                Tensor::cat(&parts, 0)?
                            };
                            let y = forward_range_chunked(model.as_ref(), &x, split, n)?;
                            Ok(y.flatten_from(1)?)
                        })
                        .await?;
                        stats.samples.fetch_add(ids.len() as u64, Ordering::Relaxed);
                        return Ok(Some((
                            TrainBatch {
                                ids,
                                labels,
                                features,
                            },
                            st,
                        )));
                    }
                    if st.done {
                        return Ok(None);
                    }
                    match st.input.try_next().await? {
                        Some(b) => {
                            st.rows += b.ids.len();
                            if !b.ids.is_empty() {
                                st.pending.push_back(b);
                            }
                        }
                        None => st.done = true,
                    }
                }
            }
        },
    );
    Ok((s.boxed(), stats))
}

/// Takes the first `take` rows off the queue (splitting a chunk if needed).
fn cut(
    pending: &mut VecDeque<Boundary>,
    mut take: usize,
) -> Result<(Vec<u64>, Vec<i64>, Vec<Tensor>)> {
    let (mut ids, mut labels, mut parts) = (Vec::new(), Vec::new(), Vec::new());
    while take > 0 {
        let Some(mut b) = pending.pop_front() else {
            break;
        };
        let n = b.ids.len();
        if n <= take {
            ids.append(&mut b.ids);
            labels.append(&mut b.labels);
            parts.push(b.x);
            take -= n;
        } else {
            ids.extend(b.ids.drain(..take));
            labels.extend(b.labels.drain(..take));
            parts.push(b.x.narrow(0, 0, take)?);
            let rest = b.x.narrow(0, take, n - take)?;
            pending.push_front(Boundary {
                ids: b.ids,
                labels: b.labels,
                x: rest,
            });
            take = 0;
        }
    }
    Ok((ids, labels, parts))
}
