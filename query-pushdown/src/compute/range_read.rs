//! The no-pushdown baseline, as strong as we can make it: DataFusion on the compute
//! tier reads the nodes' Parquet objects by byte range (an `object_store` over the
//! nodes' `Range` tickets) with all of its own Parquet pruning on (row-group
//! statistics, page index; the same scan options as the node's, see
//! [`crate::eval::scan::configure`]) and footers cached across queries.
//! Nothing runs at the node but reads.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use csd_protocol::node_client::NodeClient;
use csd_protocol::{Compression, ObjectDescription, StatusCode};
use datafusion::catalog::Session;
use datafusion::common::Result;
use datafusion::datasource::physical_plan::parquet::CachedParquetFileReaderFactory;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown};
use datafusion::physical_plan::ExecutionPlan;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetRange, GetResult, GetResultPayload, ListResult, MultipartUpload,
    ObjectMeta, ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

use crate::compute::typed_footers::{Failures, TypedFooters};
use crate::eval::scan;

/// The pieces a range is read in when every copy of an object is damaged somewhere
/// in it: the nodes' checksum chunk.
const PIECE: u64 = 64 << 10;

/// The URL the baseline's object store is registered under.
pub(crate) const CLUSTER_URL: &str = "csd-cluster://nodes";

/// Reads objects of several nodes by range. Paths are `n{node}/{object name}`.
pub struct NodeRangeStore {
    nodes: RwLock<Vec<NodeClient>>,
    objects: RwLock<HashMap<Path, u64>>,
    /// For an object of a partition kept on several nodes, the same object's paths
    /// on the others (byte for byte the same: see `compute::replicas`), read when
    /// its node is lost.
    copies: RwLock<HashMap<Path, Vec<Path>>>,
    /// The kind of each object's last failed read (see `typed_footers`).
    failures: RwLock<HashMap<Path, StatusCode>>,
    /// How the nodes send the pieces (the nodes store column chunks uncompressed).
    compression: Compression,
    /// Bytes received (compressed where they came compressed).
    bytes: AtomicU64,
    requests: AtomicU64,
}

impl fmt::Debug for NodeRangeStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NodeRangeStore({} nodes, {} objects)",
            read(&self.nodes).len(),
            read(&self.objects).len()
        )
    }
}

impl fmt::Display for NodeRangeStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl NodeRangeStore {
    /// A store over `nodes`; `objects` are (node index, object name, length).
    pub fn new(nodes: Vec<NodeClient>, objects: &[(usize, String, u64)]) -> Self {
        NodeRangeStore {
            nodes: RwLock::new(nodes),
            objects: RwLock::new(
                objects
                    .iter()
                    .map(|(n, name, len)| (Self::path(*n, name), *len))
                    .collect(),
            ),
            copies: RwLock::new(HashMap::new()),
            failures: RwLock::new(HashMap::new()),
            compression: Compression::None,
            bytes: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        }
    }

    /// The same store, asking the nodes to send what shrinks with `compression`
    /// (see `csd_protocol::bodies`).
    pub fn with_compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// The store path of `object` on node `node`.
    pub fn path(node: usize, object: &str) -> Path {
        Path::from(format!("n{node}/{object}"))
    }

    /// Adds a node; returns its index (a worker learns the nodes from the plans it
    /// runs).
    pub(crate) fn add_node(&self, client: NodeClient) -> usize {
        let mut nodes = write(&self.nodes);
        nodes.push(client);
        nodes.len() - 1
    }

    /// Makes `objects` (name, length) of node `node` readable.
    pub(crate) fn add_objects<'a>(
        &self,
        node: usize,
        objects: impl IntoIterator<Item = (&'a str, u64)>,
    ) {
        let mut known = write(&self.objects);
        for (name, len) in objects {
            known.insert(Self::path(node, name), len);
        }
    }

    /// Makes the objects of a partition's `replicas` (node, objects) stand in for
    /// its `objects` on `node` when that node is lost (object by object, in listing
    /// order: replicas agree on them).
    pub(crate) fn add_copies(
        &self,
        node: usize,
        objects: &[ObjectDescription],
        replicas: &[(usize, &[ObjectDescription])],
    ) {
        if replicas.is_empty() {
            return;
        }
        let mut copies = write(&self.copies);
        for (i, o) in objects.iter().enumerate() {
            let others = replicas
                .iter()
                .filter_map(|(n, r)| r.get(i).map(|c| Self::path(*n, &c.name)))
                .collect();
            copies.insert(Self::path(node, &o.name), others);
        }
    }

    /// The copies standing in for `object` of node `node` (see [`Self::add_copies`]),
    /// each as its node's client, its name there and its length.
    pub(crate) fn copies_of(&self, node: usize, object: &str) -> Vec<(NodeClient, String, u64)> {
        let copies = read(&self.copies)
            .get(&Self::path(node, object))
            .cloned()
            .unwrap_or_default();
        copies.iter().filter_map(|p| self.locate(p).ok()).collect()
    }

    /// Makes `copies` (node, name, length) readable and stand in for `object` of
    /// node `node` when that node is lost.
    pub(crate) fn add_object_copies(
        &self,
        node: usize,
        object: &str,
        copies: &[(usize, String, u64)],
    ) {
        if copies.is_empty() {
            return;
        }
        for (n, name, len) in copies {
            self.add_objects(*n, [(name.as_str(), *len)]);
        }
        let paths = copies
            .iter()
            .map(|(n, name, _)| Self::path(*n, name))
            .collect();
        write(&self.copies).insert(Self::path(node, object), paths);
    }

    /// Whether the object at `location` is kept on another node too.
    pub(crate) fn has_copies(&self, location: &Path) -> bool {
        read(&self.copies)
            .get(location)
            .is_some_and(|c| !c.is_empty())
    }

    /// `source`, of kind `code`, as a failed read of `location` (and remembered).
    fn failed(
        &self,
        location: &Path,
        code: StatusCode,
        source: Box<dyn std::error::Error + Send + Sync>,
    ) -> object_store::Error {
        write(&self.failures).insert(location.clone(), code);
        object_store::Error::Generic {
            store: "csd-node",
            source,
        }
    }

    /// Bytes read so far (what crossed the network).
    pub fn bytes_read(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Range requests so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    pub(crate) fn locate(
        &self,
        location: &Path,
    ) -> object_store::Result<(NodeClient, String, u64)> {
        let not_found = || object_store::Error::NotFound {
            path: location.to_string(),
            source: "no such object on the storage nodes".into(),
        };
        let len = *read(&self.objects).get(location).ok_or_else(not_found)?;
        let s = location.as_ref();
        let (node, name) = s.split_once('/').ok_or_else(not_found)?;
        let i: usize = node
            .trim_start_matches('n')
            .parse()
            .map_err(|_| not_found())?;
        let client = read(&self.nodes).get(i).cloned().ok_or_else(not_found)?;
        Ok((client, name.to_string(), len))
    }

    fn meta(location: &Path, len: u64) -> ObjectMeta {
        ObjectMeta {
            location: location.clone(),
            last_modified: DateTime::<Utc>::UNIX_EPOCH,
            size: len,
            e_tag: None,
            version: None,
        }
    }

    /// Reads `r` of the object at `location`, or of a copy of it on another node
    /// when its node is lost; every node's error when none answers.
    async fn read(&self, location: &Path, r: Range<u64>) -> object_store::Result<Bytes> {
        let e = match self.read_at(location, &r).await? {
            Ok(b) => return Ok(b),
            Err(e) if e.node_lost() => e,
            Err(e) => return Err(self.failed(location, e.status_code(), Box::new(e))),
        };
        // Only now: the copies are looked up when a node is lost, not on every read.
        let copies = read(&self.copies)
            .get(location)
            .cloned()
            .unwrap_or_default();
        if copies.is_empty() {
            return Err(self.failed(location, e.status_code(), Box::new(e)));
        }
        let mut code = e.status_code();
        let mut tried = vec![format!("{location}: {e}")];
        for at in &copies {
            tracing::warn!(from = %location, to = %at, "reading a copy instead: {e}");
            match self.read_at(at, &r).await? {
                Ok(b) => return Ok(b),
                Err(e) => {
                    tried.push(format!("{at}: {e}"));
                    code = e.status_code();
                    if !e.node_lost() {
                        break;
                    }
                }
            }
        }
        // Every copy damaged somewhere in `r`: copies damaged in different places
        // still make one good object, piece by piece (the nodes check 64 KiB chunks).
        if code == StatusCode::DataLoss
            && r.end - r.start > PIECE
            && let Some(b) = self.read_by_pieces(location, &copies, &r).await?
        {
            return Ok(b);
        }
        // Typed with the last copy's kind, so that a query failing here fails as
        // data loss (or a lost node), not as an untyped store error.
        let why = csd_protocol::Error::external(
            code,
            format!("no copy of {location} could be read"),
            tried.join("; "),
        );
        Err(self.failed(location, code, Box::new(why)))
    }

    /// `r` of the object at `location` read in the pieces of [`PIECE`] it spans, each
    /// from the first of `location` and its `copies` that gives it; `None` when a
    /// piece is good on none of them.
    async fn read_by_pieces(
        &self,
        location: &Path,
        copies: &[Path],
        r: &Range<u64>,
    ) -> object_store::Result<Option<Bytes>> {
        let mut out = bytes::BytesMut::with_capacity((r.end - r.start) as usize);
        let mut at = r.start;
        while at < r.end {
            let piece = at..((at / PIECE + 1) * PIECE).min(r.end);
            let mut got = None;
            for from in std::iter::once(location).chain(copies) {
                if let Ok(b) = self.read_at(from, &piece).await? {
                    got = Some(b);
                    break;
                }
            }
            let Some(b) = got else {
                return Ok(None);
            };
            out.extend_from_slice(&b);
            at = piece.end;
        }
        tracing::warn!(object = %location, "read piece by piece from its copies: each is damaged elsewhere");
        Ok(Some(out.freeze()))
    }

    /// Reads `r` of the object at `location` from its node: the node's error as it
    /// came (the outer error: no such object here).
    async fn read_at(
        &self,
        location: &Path,
        r: &Range<u64>,
    ) -> object_store::Result<csd_protocol::node_client::Result<Bytes>> {
        let (client, name, _) = self.locate(location)?;
        Ok(client
            .read_range_with(&name, r.start, r.end - r.start, self.compression)
            .await
            .map(|(b, wire)| self.received(b, wire)))
    }

    /// Counts `b`, which took `wire` bytes on the network.
    fn received(&self, b: Bytes, wire: u64) -> Bytes {
        self.bytes.fetch_add(wire, Ordering::Relaxed);
        self.requests.fetch_add(1, Ordering::Relaxed);
        let _ = READ_FOR.try_with(|c| c.fetch_add(wire, Ordering::Relaxed));
        b
    }
}

tokio::task_local! {
    /// Where the reads made while it is set are also counted (a scan's own bytes).
    static READ_FOR: Arc<AtomicU64>;
}

/// Runs `f` counting the bytes the range stores read meanwhile (on this task) into
/// `counter`: a scan's own byte-range reads, wherever its process is.
pub(crate) fn counting_reads<R>(counter: &Arc<AtomicU64>, f: impl FnOnce() -> R) -> R {
    READ_FOR.sync_scope(counter.clone(), f)
}

/// The lock's value; a panic elsewhere while it was held left it consistent (every
/// write is one insert or push).
fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn read_only() -> object_store::Error {
    object_store::Error::NotImplemented {
        operation: "writing".into(),
        implementer: "NodeRangeStore (read-only)".into(),
    }
}

#[async_trait]
impl ObjectStore for NodeRangeStore {
    async fn put_opts(
        &self,
        _: &Path,
        _: PutPayload,
        _: PutOptions,
    ) -> object_store::Result<PutResult> {
        Err(read_only())
    }

    async fn put_multipart_opts(
        &self,
        _: &Path,
        _: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        Err(read_only())
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let (_, _, len) = self.locate(location)?;
        let range = match options.range {
            None => 0..len,
            Some(GetRange::Bounded(r)) => r.start..r.end.min(len),
            Some(GetRange::Offset(o)) => o..len,
            Some(GetRange::Suffix(n)) => len.saturating_sub(n)..len,
        };
        let meta = Self::meta(location, len);
        if options.head {
            return Ok(GetResult {
                payload: GetResultPayload::Stream(futures::stream::empty().boxed()),
                meta,
                range: 0..0,
                attributes: Default::default(),
            });
        }
        let bytes = self.read(location, range.clone()).await?;
        Ok(GetResult {
            payload: GetResultPayload::Stream(
                futures::stream::once(async move { Ok(bytes) }).boxed(),
            ),
            meta,
            range,
            attributes: Default::default(),
        })
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        futures::stream::iter(ranges.iter().cloned())
            .map(|r| self.read(location, r))
            .buffered(8)
            .try_collect()
            .await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        locations.map(|_| Err(read_only())).boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let prefix = prefix.map(|p| p.to_string()).unwrap_or_default();
        let mut out: Vec<_> = read(&self.objects)
            .iter()
            .filter(|(p, _)| p.as_ref().starts_with(&prefix))
            .map(|(p, len)| Ok(Self::meta(p, *len)))
            .collect();
        out.sort_by(|a, b| match (a, b) {
            (Ok(a), Ok(b)) => a.location.cmp(&b.location),
            _ => std::cmp::Ordering::Equal,
        });
        futures::stream::iter(out).boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        let objects = self.list(prefix).try_collect().await?;
        Ok(ListResult {
            common_prefixes: vec![],
            objects,
        })
    }

    async fn copy_opts(&self, _: &Path, _: &Path, _: CopyOptions) -> object_store::Result<()> {
        Err(read_only())
    }
}

impl Failures for NodeRangeStore {
    /// The kind of the last read of `location` that failed, if one did.
    fn failure(&self, location: &Path) -> Option<StatusCode> {
        read(&self.failures).get(location).copied()
    }
}

/// A table read by the baseline: its objects on all nodes, scanned by DataFusion here.
#[derive(Debug, Clone)]
pub(crate) struct RangeReadTable {
    schema: SchemaRef,
    files: Vec<(String, u64, u64)>,
    store: Arc<NodeRangeStore>,
}

impl RangeReadTable {
    /// `files` are store paths (see [`NodeRangeStore::path`]), lengths and rows.
    pub(crate) fn new(
        schema: SchemaRef,
        files: Vec<(String, u64, u64)>,
        store: Arc<NodeRangeStore>,
    ) -> Self {
        RangeReadTable {
            schema,
            files,
            store,
        }
    }
}

#[async_trait]
impl TableProvider for RangeReadTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }
    fn table_type(&self) -> TableType {
        TableType::Base
    }
    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        Ok(scan::exact(filters))
    }
    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let cache = state.runtime_env().cache_manager.get_file_metadata_cache();
        let reader = Arc::new(TypedFooters::new(
            CachedParquetFileReaderFactory::new(self.store.clone(), cache),
            self.store.clone(),
        ));
        scan::parquet_scan(
            state,
            &ObjectStoreUrl::parse(CLUSTER_URL)?,
            &self.schema,
            self.files.clone(),
            projection,
            filters,
            limit,
            Some(reader),
        )
    }
}
