//! The keys of a hash join's build side, collected as its partitions run
//! ([`KeyCollectExec`] passes the rows through unchanged), for the probe side's
//! [`CsdScanExec`](crate::compute::scan::CsdScanExec) to wait on and send to the
//! nodes as a [`Bloom`]. Where such filters apply is decided by
//! [`KeyFilterRule`](crate::compute::key_filter_rule::KeyFilterRule).

use std::collections::HashMap;
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use arrow::array::ArrayRef;
use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use async_trait::async_trait;
use datafusion::common::Result;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PhysicalExpr,
    PlanProperties, RecordBatchStream, ReplaceChildrenOptions, SendableRecordBatchStream,
};
use datafusion_distributed::DistributedTaskContext;
use futures::Stream;
use tokio::sync::{OnceCell, watch};

use crate::compute::no_filter::NoFilter;
use crate::wire::keyfilter::{Bloom, MAX_FILTER_BYTES, hash_rows, int_values};
use csd_protocol::ModuleDigest;
use csd_protocol::node_client::NodeClient;

/// Where one collector's keys meet when its build side and a scan it filters run
/// in different stages: a key board's worker and the set's name there.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub(crate) struct RemoteKeys {
    /// The worker holding the board (`http://host:port`).
    #[prost(string, tag = "1")]
    pub(crate) home: String,
    /// The set's name: unique per planned query and collector.
    #[prost(string, tag = "2")]
    pub(crate) key: String,
    /// How long a scan waits for the set, in milliseconds.
    #[prost(uint64, tag = "3")]
    pub(crate) wait_ms: u64,
}

impl RemoteKeys {
    pub(crate) fn wait(&self) -> Duration {
        Duration::from_millis(self.wait_ms)
    }
}

/// How keys reach a [`RemoteKeys`] set and come back as a filter: the compute
/// tier's distributed part (`compute::distributed::keys`, a board on a worker)
/// implements it; the collector knows it by this trait only.
#[async_trait]
pub(crate) trait KeyMeeting: Send + Sync + fmt::Debug {
    /// Publishes one build task (`task` of `tasks`) keys to `at` (`Ok`: row
    /// hashes, `Err`: why it has none).
    async fn publish(
        &self,
        at: &RemoteKeys,
        task: (usize, usize),
        bits_per_key: usize,
        keys: std::result::Result<Vec<u64>, NoFilter>,
    ) -> std::result::Result<(), NoFilter>;

    /// The set's filter and its key count once complete, or why there is none
    /// (also when it is not complete within `wait`).
    async fn fetch(
        &self,
        at: &RemoteKeys,
        wait: Duration,
    ) -> std::result::Result<(Bloom, usize), NoFilter>;
}

/// A set the keys meet at, and the way there.
#[derive(Debug)]
struct Meeting {
    at: RemoteKeys,
    via: Arc<dyn KeyMeeting>,
}

/// A filter's digest at one node, once sent (`None`: it travels inline there).
type SentOnce = Arc<OnceCell<Option<ModuleDigest>>>;

/// A filter cut to some key ranges, and the keys it holds.
type CutFilter = (Arc<Bloom>, usize);

/// The keys of one hash join's build side, collected as its partitions run.
#[derive(Debug)]
pub(crate) struct KeyCollector {
    /// Names it within a plan (how a scan finds it again in a decoded plan).
    id: u64,
    exprs: Vec<Arc<dyn PhysicalExpr>>,
    /// Build partitions: those of [`KeyCollectExec`]'s input, set when it is built.
    parts: AtomicUsize,
    wait: Duration,
    bits_per_key: usize,
    state: Mutex<Collect>,
    done: watch::Sender<bool>,
    built: OnceLock<Option<Arc<Bloom>>>,
    /// Set when the build side and a scan it filters run in different stages: the
    /// build side's tasks publish their keys there, and scans fetch the union.
    remote: OnceLock<Meeting>,
    /// This build task's index and its stage's task count (one task outside a
    /// distributed plan).
    task: OnceLock<(usize, usize)>,
    published: AtomicBool,
    fetched: OnceCell<Option<Arc<Bloom>>>,
    /// The filter's digest at each node it was sent to by attachment (by the node's
    /// URL and the filter sent, several when nodes hold different key ranges;
    /// `None`: that node would not keep it, so it travels inline).
    attached: Mutex<HashMap<(String, usize), SentOnce>>,
    /// A single integer or date key's distinct values and their hashes, sorted by
    /// value, once built (see [`within`](Self::within)).
    by_key: OnceLock<Vec<(i64, u64)>>,
    /// The filters cut to key ranges and their key counts, by the ranges.
    cut: Mutex<HashMap<Vec<[i64; 2]>, CutFilter>>,
}

#[derive(Debug)]
struct Collect {
    hashes: Vec<u64>,
    /// The key of each of `hashes` while the key is one integer or date column
    /// (`None` once it is not, or once `hashes` were deduplicated).
    values: Option<Vec<i64>>,
    finished: usize,
    abandoned: Option<NoFilter>,
    keys: usize,
}

impl KeyCollector {
    /// Collects `exprs` (the join's build-side keys) from `parts` partitions, for a
    /// filter of `bits_per_key`; a scan waits at most `wait` for it.
    pub(crate) fn new(
        exprs: Vec<Arc<dyn PhysicalExpr>>,
        parts: usize,
        wait: Duration,
        bits_per_key: usize,
    ) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self::with_id(
            NEXT.fetch_add(1, Ordering::Relaxed),
            exprs,
            parts,
            wait,
            bits_per_key,
        )
    }

    /// [`new`](Self::new) with a given id (a plan decoded elsewhere).
    pub(crate) fn with_id(
        id: u64,
        exprs: Vec<Arc<dyn PhysicalExpr>>,
        parts: usize,
        wait: Duration,
        bits_per_key: usize,
    ) -> Self {
        KeyCollector {
            id,
            exprs,
            parts: AtomicUsize::new(parts),
            wait,
            bits_per_key: bits_per_key.max(1),
            state: Mutex::new(Collect {
                hashes: Vec::new(),
                values: Some(Vec::new()),
                finished: 0,
                abandoned: None,
                keys: 0,
            }),
            done: watch::channel(false).0,
            built: OnceLock::new(),
            remote: OnceLock::new(),
            task: OnceLock::new(),
            published: AtomicBool::new(false),
            fetched: OnceCell::new(),
            attached: Mutex::new(HashMap::new()),
            by_key: OnceLock::new(),
            cut: Mutex::new(HashMap::new()),
        }
    }

    /// A scan's view of collector `id`, whose build side runs in another stage: it
    /// only fetches the keys from `remote`.
    pub(crate) fn remote_only(
        id: u64,
        remote: RemoteKeys,
        via: Arc<dyn KeyMeeting>,
        bits_per_key: usize,
    ) -> Self {
        let c = Self::with_id(id, Vec::new(), 0, remote.wait(), bits_per_key);
        c.published.store(true, Ordering::Relaxed);
        c.set_remote(remote, via);
        c
    }

    /// Its keys meet across stages at `remote`, reached `via` (set once, when the
    /// plan is cut into stages).
    pub(crate) fn set_remote(&self, remote: RemoteKeys, via: Arc<dyn KeyMeeting>) {
        let _ = self.remote.set(Meeting { at: remote, via });
    }

    /// Where its keys meet across stages, if they do.
    pub(crate) fn remote(&self) -> Option<&RemoteKeys> {
        self.remote.get().map(|m| &m.at)
    }

    /// Publishes this task's keys (or why it has none) to its remote set, once.
    fn publish(&self) {
        let Some(meeting) = self.remote.get() else {
            return;
        };
        if self.published.swap(true, Ordering::AcqRel) {
            return;
        }
        let keys = match self.state.lock() {
            Ok(mut s) => match &s.abandoned {
                Some(why) => Err(why.clone()),
                None => {
                    let mut h = std::mem::take(&mut s.hashes);
                    h.sort_unstable();
                    h.dedup();
                    s.keys = h.len();
                    Ok(h)
                }
            },
            Err(_) => Err(NoFilter::Poisoned),
        };
        let task = self.task.get().copied().unwrap_or((0, 1));
        let (remote, via, bits) = (meeting.at.clone(), meeting.via.clone(), self.bits_per_key);
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::debug!("join keys not published: no runtime");
            return;
        };
        rt.spawn(async move {
            if let Err(e) = via.publish(&remote, task, bits, keys).await {
                tracing::warn!(
                    "join keys not published (scans waiting on them run unfiltered): {e}"
                );
            }
        });
    }

    /// The filter from the remote set: its build tasks' keys together.
    async fn fetch(&self, meeting: &Meeting) -> Option<Arc<Bloom>> {
        self.fetched
            .get_or_init(|| async {
                match meeting.via.fetch(&meeting.at, self.wait).await {
                    Ok((bloom, n)) => {
                        if let Ok(mut s) = self.state.lock() {
                            s.keys = n;
                        }
                        Some(Arc::new(bloom))
                    }
                    Err(why) => {
                        if let Ok(mut s) = self.state.lock() {
                            s.abandoned = Some(why);
                        }
                        None
                    }
                }
            })
            .await
            .clone()
    }

    fn add(&self, batch: &RecordBatch) -> std::result::Result<(), NoFilter> {
        let cols: Vec<ArrayRef> = self
            .exprs
            .iter()
            .map(|e| {
                e.evaluate(batch)
                    .and_then(|v| v.into_array(batch.num_rows()))
                    .map_err(|e| NoFilter::Unhashable(e.to_string()))
            })
            .collect::<std::result::Result<_, _>>()?;
        let (hashes, valid) =
            hash_rows(&cols, batch.num_rows()).map_err(|e| NoFilter::Unhashable(e.to_string()))?;
        let values = match &cols[..] {
            [c] => int_values(c),
            _ => None,
        };
        let mut s = self.state.lock().map_err(|_| NoFilter::Poisoned)?;
        if s.abandoned.is_some() {
            return Ok(());
        }
        match (s.values.as_mut(), values) {
            (Some(kept), Some(v)) => kept.extend(
                v.into_iter()
                    .zip(&valid)
                    .filter_map(|(k, ok)| ok.then_some(k)),
            ),
            _ => s.values = None,
        }
        s.hashes.extend(
            hashes
                .into_iter()
                .zip(valid)
                .filter_map(|(h, v)| v.then_some(h)),
        );
        let max_keys = self.max_keys();
        if s.hashes.len() > 2 * max_keys {
            // Duplicates may still bring it under; check before giving up.
            s.values = None;
            s.hashes.sort_unstable();
            s.hashes.dedup();
            if s.hashes.len() > max_keys {
                drop(s);
                self.abandon(NoFilter::TooManyKeys {
                    max: max_keys as u64,
                });
            }
        }
        Ok(())
    }

    /// Most distinct keys a filter is built for: `bits_per_key` each, within
    /// [`MAX_FILTER_BYTES`].
    fn max_keys(&self) -> usize {
        MAX_FILTER_BYTES * 8 / self.bits_per_key
    }

    fn finish_part(&self) {
        let all = match self.state.lock() {
            Ok(mut s) => {
                s.finished += 1;
                s.finished >= self.parts.load(Ordering::Relaxed)
            }
            Err(_) => true,
        };
        if all {
            self.done.send_replace(true);
            self.publish();
        }
    }

    fn abandon(&self, why: NoFilter) {
        if let Ok(mut s) = self.state.lock()
            && s.abandoned.is_none()
        {
            tracing::debug!("join-key filter abandoned: {why}");
            s.abandoned = Some(why);
            s.hashes = Vec::new();
            s.values = None;
        }
        self.done.send_replace(true);
        self.publish();
    }

    /// The filter, once every build partition has ended (`None`: no filter, see the
    /// module docs). Built once, shared by every endpoint of the scan.
    pub(crate) async fn wait(&self) -> Option<Arc<Bloom>> {
        if let Some(remote) = self.remote.get() {
            return self.fetch(remote).await;
        }
        let mut rx = self.done.subscribe();
        if tokio::time::timeout(self.wait, rx.wait_for(|d| *d))
            .await
            .is_err()
        {
            self.abandon(NoFilter::BuildLate(self.wait));
        }
        self.built
            .get_or_init(|| {
                let mut s = self.state.lock().ok()?;
                if s.abandoned.is_some() {
                    return None;
                }
                let mut h = std::mem::take(&mut s.hashes);
                match s.values.take() {
                    // One sort: the distinct keys give the distinct hashes.
                    Some(values) => {
                        let mut pairs: Vec<(i64, u64)> = values.into_iter().zip(h).collect();
                        pairs.sort_unstable();
                        pairs.dedup();
                        h = pairs.iter().map(|(_, hash)| *hash).collect();
                        let _ = self.by_key.set(pairs);
                    }
                    None => {
                        h.sort_unstable();
                        h.dedup();
                    }
                }
                s.keys = h.len();
                Bloom::with_bits_per_key(&h, self.bits_per_key).map(Arc::new)
            })
            .clone()
    }

    /// [`wait`](Self::wait)'s filter, holding only the keys inside `ranges` (sorted
    /// `[min, max]` ranges of the key, inclusive), and whether it was cut so: what a
    /// node whose listed rows all have their key in `ranges` needs, smaller where
    /// the table's partitions hold key ranges (TPC-H's orders, lineitem and partsupp
    /// in their files' order). The whole filter when the key is not one integer or
    /// date column, when the keys met across stages, or when every key is inside.
    pub(crate) async fn within(&self, ranges: Option<&[[i64; 2]]>) -> Option<(Arc<Bloom>, bool)> {
        let whole = self.wait().await?;
        let (Some(ranges), Some(keys)) = (ranges, self.by_key.get()) else {
            return Some((whole, false));
        };
        let mut cut = self.cut.lock().ok()?;
        if let Some((b, _)) = cut.get(ranges) {
            return Some((b.clone(), true));
        }
        let mut hashes: Vec<u64> = Vec::new();
        for &[lo, hi] in ranges {
            let start = keys.partition_point(|(k, _)| *k < lo);
            let end = keys.partition_point(|(k, _)| *k <= hi);
            hashes.extend(keys[start..end.max(start)].iter().map(|(_, h)| *h));
        }
        // `keys` holds each distinct key once, so `hashes` are distinct too.
        if hashes.len() == keys.len() {
            return Some((whole, false));
        }
        let bloom = Arc::new(Bloom::with_bits_per_key(&hashes, self.bits_per_key)?);
        cut.insert(ranges.to_vec(), (bloom.clone(), hashes.len()));
        Some((bloom, true))
    }

    /// The key counts of the filters [`within`](Self::within) cut, smallest first.
    pub(crate) fn cut_keys(&self) -> Vec<usize> {
        let mut k: Vec<usize> = match self.cut.lock() {
            Ok(c) => c.values().map(|(_, n)| *n).collect(),
            Err(_) => Vec::new(),
        };
        k.sort_unstable();
        k
    }

    /// The digest by which the node `client` talks to keeps this filter's `blocks`
    /// (the wire form of [`wait`](Self::wait)'s filter), sent there once per query
    /// however many of the scan's fragments that node runs; `None` if the node
    /// would not keep it (an earlier node, or one short of memory): then the
    /// filter travels inline in each fragment, as it always did.
    pub(crate) async fn attachment_at(
        &self,
        client: &NodeClient,
        bloom: &Arc<Bloom>,
        blocks: &[u8],
    ) -> Option<ModuleDigest> {
        // The filter by its address: [`within`](Self::within) keeps each one for
        // the collector's life, so no two filters share one.
        let key = (client.url().to_string(), Arc::as_ptr(bloom) as usize);
        let cell = match self.attached.lock() {
            Ok(mut m) => m.entry(key).or_default().clone(),
            Err(_) => return None,
        };
        *cell
            .get_or_init(|| async {
                // The node names it by the digest it computed of what it received.
                let put = client.put_attachment(blocks).await;
                match put.map(|r| ModuleDigest::parse(r.digest.as_bytes())) {
                    Ok(Ok(digest)) => Some(digest),
                    Ok(Err(e)) => {
                        tracing::warn!("{} named a key filter badly: {e}", client.url());
                        None
                    }
                    Err(e) => {
                        tracing::debug!("key filter sent inline to {}: {e}", client.url());
                        None
                    }
                }
            })
            .await
    }

    /// Its id within the plan.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The build side's key expressions.
    pub(crate) fn exprs(&self) -> &[Arc<dyn PhysicalExpr>] {
        &self.exprs
    }

    /// How long a scan waits for it.
    pub(crate) fn wait_for(&self) -> Duration {
        self.wait
    }

    /// Filter bits per key.
    pub(crate) fn bits_per_key(&self) -> usize {
        self.bits_per_key
    }

    /// Distinct keys in the built filter (0 before it is built).
    pub(crate) fn keys(&self) -> usize {
        self.state.lock().map(|s| s.keys).unwrap_or(0)
    }

    /// Why there is no filter, if there is none.
    pub(crate) fn abandoned(&self) -> Option<NoFilter> {
        self.state.lock().ok().and_then(|s| s.abandoned.clone())
    }
}

/// Passes a hash join's build side through unchanged, collecting its keys.
#[derive(Debug)]
pub(crate) struct KeyCollectExec {
    input: Arc<dyn ExecutionPlan>,
    collector: Arc<KeyCollector>,
}

impl KeyCollectExec {
    /// Wraps `input`, feeding `collector` (which then waits for all of `input`'s
    /// partitions: a distributed planner may have changed their number).
    pub(crate) fn new(input: Arc<dyn ExecutionPlan>, collector: Arc<KeyCollector>) -> Self {
        collector.parts.store(
            input.output_partitioning().partition_count(),
            Ordering::Relaxed,
        );
        KeyCollectExec { input, collector }
    }

    /// The build side it wraps.
    pub(crate) fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }

    /// Its collector.
    pub(crate) fn collector(&self) -> &Arc<KeyCollector> {
        &self.collector
    }
}

impl DisplayAs for KeyCollectExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "KeyCollectExec: join keys for the storage nodes")?;
        let keys = self.collector.keys();
        if keys > 0 {
            write!(f, ", keys={keys}")?;
        }
        if let Some(why) = self.collector.abandoned() {
            write!(f, ", no filter ({why})")?;
        }
        Ok(())
    }
}

impl ExecutionPlan for KeyCollectExec {
    fn name(&self) -> &str {
        "KeyCollectExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        for e in &self.collector.exprs {
            if f(e)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
        _: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        match children.pop() {
            Some(input) if children.is_empty() => {
                Ok(Arc::new(KeyCollectExec::new(input, self.collector.clone())))
            }
            _ => Err(datafusion::common::DataFusionError::Internal(
                "KeyCollectExec takes one child".into(),
            )),
        }
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(
                datafusion::physical_plan::ChildrenPropertiesMode::Recompute,
            ),
        )
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let task = DistributedTaskContext::from_ctx(&context);
        let _ = self
            .collector
            .task
            .set((task.task_index, task.task_count.max(1)));
        let inner = self.input.execute(partition, context)?;
        Ok(Box::pin(CollectStream {
            inner,
            collector: self.collector.clone(),
            ended: false,
        }))
    }
}

struct CollectStream {
    inner: SendableRecordBatchStream,
    collector: Arc<KeyCollector>,
    ended: bool,
}

impl Stream for CollectStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = self.inner.as_mut().poll_next(cx);
        match &polled {
            Poll::Ready(Some(Ok(b))) => {
                if let Err(e) = self.collector.add(b) {
                    self.collector.abandon(e);
                }
            }
            Poll::Ready(Some(Err(e))) => {
                self.collector.abandon(NoFilter::BuildFailed(e.to_string()));
            }
            Poll::Ready(None) if !self.ended => {
                self.ended = true;
                self.collector.finish_part();
            }
            _ => {}
        }
        polled
    }
}

impl RecordBatchStream for CollectStream {
    fn schema(&self) -> SchemaRef {
        self.inner.schema()
    }
}

impl Drop for CollectStream {
    fn drop(&mut self) {
        if !self.ended {
            self.collector.abandon(NoFilter::BuildStopped);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use datafusion::physical_expr::expressions::Column;

    fn collected(keys: ArrayRef) -> KeyCollector {
        let c = KeyCollector::new(
            vec![Arc::new(Column::new("k", 0))],
            1,
            Duration::from_secs(5),
            12,
        );
        c.add(&RecordBatch::try_from_iter([("k", keys)]).unwrap())
            .unwrap();
        c.finish_part();
        c
    }

    #[tokio::test]
    async fn a_filter_cut_to_key_ranges_holds_just_their_keys() {
        let c = collected(Arc::new(Int64Array::from_iter_values(
            (0..30_000).map(|i| i * 3).chain(0..10),
        )));
        let (whole, cut) = c.within(None).await.unwrap();
        assert!(!cut);
        let ranges = [[0, 29_999], [60_000, 60_299]];
        let (part, cut) = c.within(Some(&ranges)).await.unwrap();
        assert!(cut);
        // 10,000 + 100 multiples of three, and the ten small keys already among them
        // but 1, 2, 4, 5, 7, 8.
        assert_eq!(c.cut_keys(), [10_100 + 6]);
        assert!(part.to_msg(&[0]).blocks.len() * 2 < whole.to_msg(&[0]).blocks.len());
        let again = c.within(Some(&ranges)).await.unwrap().0;
        assert!(Arc::ptr_eq(&part, &again), "cut once per set of ranges");
        // Every key inside: the whole filter, not cut.
        let (all, cut) = c.within(Some(&[[-5, 100_000]])).await.unwrap();
        assert!(!cut && Arc::ptr_eq(&all, &whole));
        // No key inside: a filter that keeps nothing.
        let (none, cut) = c.within(Some(&[[200_000, 300_000]])).await.unwrap();
        assert!(
            cut && !none.contains(
                hash_rows(&[Arc::new(Int64Array::from(vec![3])) as ArrayRef], 1)
                    .unwrap()
                    .0[0]
            )
        );
    }

    #[tokio::test]
    async fn string_keys_are_never_cut() {
        let c = collected(Arc::new(StringArray::from(vec!["a", "b"])));
        let (_, cut) = c.within(Some(&[[0, 1]])).await.unwrap();
        assert!(!cut);
        assert!(c.cut_keys().is_empty());
    }
}
