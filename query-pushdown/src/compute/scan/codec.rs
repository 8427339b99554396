//! A [`CsdScanExec`] as bytes, for a plan that runs on other machines
//! (`datafusion-distributed` workers).
//!
//! Everything the scan needs travels: its table's name, schema and endpoints (node
//! URL, partition, objects), the pushed Substrait plan and mode, estimates, the
//! join-key filters it waits on (by collector id), the Wasm functions its fragments
//! call (with their modules), answer compression. Credentials never do: the process
//! that decodes it connects with its own (see [`WorkerEnv`](crate::WorkerEnv)).

use std::sync::Arc;

use arrow::datatypes::Schema;
use csd_protocol::ModuleDigest;
use csd_protocol::{Compression, ObjectDescription};
use datafusion::common::{DataFusionError, Result};
use datafusion_proto::protobuf;

use csd_protocol::node_client::NodeClient;

use super::CsdScanExec;
use crate::compute::endpoints::{Endpoint, TableEndpoints};
use crate::compute::gate::LocalGate;
use crate::compute::key_collector::{KeyCollector, KeyMeeting, RemoteKeys};
use crate::compute::range_read::NodeRangeStore;

/// What decoding a scan needs of the process it lands in: its connections, its
/// byte-range store and gate, and the collectors of the plan being decoded. A
/// worker's decoding scope (`compute::distributed`) provides it; the scan knows it
/// by this trait only.
pub(crate) trait ScanDecoding {
    /// The byte-range store handed-back fragments read through.
    fn ranges(&self) -> Arc<NodeRangeStore>;
    /// The client of the node at `url` and its index in [`Self::ranges`].
    fn node(&self, url: &str) -> Result<(NodeClient, usize)>;
    /// The gate handed-back fragments run under.
    fn local(&self) -> Arc<LocalGate>;
    /// Collector `id` of the plan being decoded, if it is in the same plan.
    fn collector(&self, id: u64) -> Option<Arc<KeyCollector>>;
    /// How a collector whose build side runs in another stage is reached.
    fn key_meeting(&self) -> Arc<dyn KeyMeeting>;
}
use crate::wire::fragment::Mode;
use crate::wire::shipped::ShippedFunction;

/// A [`CsdScanExec`] on the wire.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ScanMsg {
    /// Table name.
    #[prost(string, tag = "1")]
    pub(crate) table: String,
    /// Table schema.
    #[prost(message, optional, tag = "2")]
    pub(crate) schema: Option<protobuf::Schema>,
    /// The scan's output schema.
    #[prost(message, optional, tag = "3")]
    pub(crate) output: Option<protobuf::Schema>,
    /// Where the table's partitions are.
    #[prost(message, repeated, tag = "4")]
    pub(crate) endpoints: Vec<EndpointMsg>,
    /// Answer compression.
    #[prost(enumeration = "Compression", tag = "5")]
    pub(crate) compression: i32,
    /// The pushed Substrait plan.
    #[prost(bytes = "vec", tag = "6")]
    pub(crate) plan: Vec<u8>,
    /// What the nodes return.
    #[prost(enumeration = "Mode", tag = "7")]
    pub(crate) mode: i32,
    /// What EXPLAIN shows as pushed.
    #[prost(string, tag = "8")]
    pub(crate) describe: String,
    /// Estimated fraction of rows returned.
    #[prost(double, optional, tag = "9")]
    pub(crate) row_fraction: Option<f64>,
    /// Most rows per endpoint.
    #[prost(uint64, optional, tag = "10")]
    pub(crate) limit: Option<u64>,
    /// Join-key filters it waits on.
    #[prost(message, repeated, tag = "11")]
    pub(crate) key_filters: Vec<KeyFilterMsg>,
    /// Reads by byte range unless a key filter applies.
    #[prost(bool, tag = "12")]
    pub(crate) direct: bool,
    /// Fragments name their partition's objects as planned.
    #[prost(bool, tag = "13")]
    pub(crate) pinned: bool,
    /// Wasm SQL functions its fragments call.
    #[prost(message, repeated, tag = "14")]
    pub(crate) functions: Vec<FunctionMsg>,
    /// Output partitions (at least the endpoints; the rest are empty).
    #[prost(uint32, tag = "15")]
    pub(crate) partitions: u32,
    /// A partial aggregate judged at the nodes: their threshold.
    #[prost(float, optional, tag = "16")]
    pub(crate) shrink_above: Option<f32>,
    /// Its fragments filter while decoding.
    #[prost(bool, tag = "17")]
    pub(crate) late_filters: bool,
    /// State its fragments hold at the node.
    #[prost(uint64, optional, tag = "18")]
    pub(crate) state_bytes: Option<u64>,
}

/// One partition of a table on one node.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct EndpointMsg {
    /// The node's URL.
    #[prost(string, tag = "1")]
    pub(crate) url: String,
    /// Partition name.
    #[prost(string, tag = "2")]
    pub(crate) partition: String,
    /// Rows.
    #[prost(uint64, tag = "3")]
    pub(crate) rows: u64,
    /// Stored bytes.
    #[prost(uint64, tag = "4")]
    pub(crate) bytes: u64,
    /// Its Parquet objects (`ObjectDescription`s as JSON, as the node lists them).
    #[prost(string, tag = "5")]
    pub(crate) objects: String,
    /// The partitions it stands for when several (see `Endpoint::merged`).
    #[prost(string, repeated, tag = "6")]
    pub(crate) merged: Vec<String>,
    /// The partition's other copies (see `Endpoint::replicas`), each without
    /// replicas of its own: a worker fails over to them as the planner would.
    #[prost(message, repeated, tag = "7")]
    pub(crate) replicas: Vec<EndpointMsg>,
    /// Copies of its objects on other nodes, read by byte range when its node is
    /// lost (also where no other node holds all of a merged endpoint's partitions).
    #[prost(message, repeated, tag = "8")]
    pub(crate) copies: Vec<CopyMsg>,
}

/// Another node's copy of one of an endpoint's objects.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct CopyMsg {
    /// The object, as the endpoint names it.
    #[prost(string, tag = "1")]
    pub(crate) object: String,
    /// The node holding the copy.
    #[prost(string, tag = "2")]
    pub(crate) url: String,
    /// The copy's name there.
    #[prost(string, tag = "3")]
    pub(crate) name: String,
    /// Its length (the same as the object's: copies are byte for byte alike).
    #[prost(uint64, tag = "4")]
    pub(crate) len: u64,
}

/// A join-key filter a scan waits on.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct KeyFilterMsg {
    /// The collector's id in the plan.
    #[prost(uint64, tag = "1")]
    pub(crate) collector: u64,
    /// The scan's output columns it filters.
    #[prost(uint32, repeated, tag = "2")]
    pub(crate) columns: Vec<u32>,
    /// Where the collector's keys meet when it runs in another stage.
    #[prost(message, optional, tag = "3")]
    pub(crate) remote: Option<RemoteKeys>,
}

/// A Wasm SQL function.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct FunctionMsg {
    /// SQL name.
    #[prost(string, tag = "1")]
    pub(crate) name: String,
    /// The export that computes it.
    #[prost(string, tag = "2")]
    pub(crate) export: String,
    /// SHA-256 of the module.
    #[prost(bytes = "vec", tag = "3")]
    pub(crate) digest: Vec<u8>,
    /// The module.
    #[prost(bytes = "vec", optional, tag = "4")]
    pub(crate) module: Option<Vec<u8>>,
}

/// `e` as a message, with the copies `ranges` knows of its objects and without
/// its replicas.
fn endpoint_msg(e: &Endpoint, ranges: &NodeRangeStore) -> Result<EndpointMsg> {
    let copies = (e.objects.iter())
        .flat_map(|o| {
            let copies = ranges.copies_of(e.node, &o.name);
            copies.into_iter().map(|(client, name, len)| CopyMsg {
                object: o.name.clone(),
                url: client.url().to_string(),
                name,
                len,
            })
        })
        .collect();
    Ok(EndpointMsg {
        url: e.client.url().to_string(),
        partition: e.partition.clone(),
        rows: e.rows,
        bytes: e.bytes,
        objects: serde_json::to_string(&e.objects)
            .map_err(|e| DataFusionError::External(Box::new(e)))?,
        merged: e.merged.clone(),
        replicas: vec![],
        copies,
    })
}

/// The endpoint `e` describes (its replicas left to the caller), its objects made
/// readable by byte range.
fn endpoint_of(e: EndpointMsg, cx: &dyn ScanDecoding) -> Result<Endpoint> {
    let objects: Vec<ObjectDescription> = serde_json::from_str(&e.objects)
        .map_err(|err| bad(format!("objects of {}/{}: {err}", e.url, e.partition)))?;
    let (client, node) = cx.node(&e.url)?;
    let ranges = cx.ranges();
    ranges.add_objects(node, objects.iter().map(|o| (o.name.as_str(), o.len)));
    for o in &objects {
        let copies = (e.copies.iter())
            .filter(|c| c.object == o.name)
            .map(|c| Ok((cx.node(&c.url)?.1, c.name.clone(), c.len)))
            .collect::<Result<Vec<_>>>()?;
        ranges.add_object_copies(node, &o.name, &copies);
    }
    Ok(Endpoint {
        client,
        partition: e.partition,
        rows: e.rows,
        bytes: e.bytes,
        objects,
        node,
        merged: e.merged,
        // Pushdown was decided where the plan was made.
        distinct: vec![],
        node_distinct: Default::default(),
        replicas: vec![],
    })
}

fn bad(what: impl std::fmt::Display) -> DataFusionError {
    DataFusionError::Plan(format!(
        "a CsdScanExec in the plan cannot be decoded: {what}"
    ))
}

impl CsdScanExec {
    /// The scan as a message.
    pub(crate) fn to_msg(&self) -> Result<ScanMsg> {
        let endpoints = self
            .table
            .endpoints()
            .iter()
            .map(|e| {
                let ranges = self.table.ranges();
                let mut msg = endpoint_msg(e, ranges)?;
                msg.replicas = (e.replicas.iter())
                    .map(|r| endpoint_msg(r, ranges))
                    .collect::<Result<_>>()?;
                Ok(msg)
            })
            .collect::<Result<_>>()?;
        Ok(ScanMsg {
            table: self.table.name().to_string(),
            schema: Some(self.table.schema().as_ref().try_into()?),
            output: Some(self.schema.as_ref().try_into()?),
            endpoints,
            compression: self.table.compression() as i32,
            plan: self.plan.as_ref().clone(),
            mode: self.mode as i32,
            describe: self.describe.clone(),
            row_fraction: self.row_fraction,
            limit: self.limit.map(|l| l as u64),
            key_filters: self
                .key_filters
                .iter()
                .map(|(c, cols)| KeyFilterMsg {
                    collector: c.id(),
                    columns: cols.iter().map(|&c| c as u32).collect(),
                    remote: c.remote().cloned(),
                })
                .collect(),
            direct: self.direct,
            pinned: self.pinned,
            functions: self
                .functions
                .iter()
                .map(|f| FunctionMsg {
                    name: f.name.clone(),
                    export: f.export.clone(),
                    digest: f.digest.0.to_vec(),
                    module: f.bytes.as_ref().map(|b| b.to_vec()),
                })
                .collect(),
            partitions: self.props.output_partitioning().partition_count() as u32,
            shrink_above: self.shrink_above,
            late_filters: self.late_filters,
            state_bytes: self.state_bytes,
        })
    }

    /// The scan `msg` describes, connected through `cx`. A join-key filter whose
    /// collector is not in the same decoded plan (it runs in another stage) is
    /// fetched from where that stage's tasks publish their keys, or, without such a
    /// place, dropped: the filter only ever spares rows, the join above decides.
    pub(crate) fn from_msg(msg: ScanMsg, cx: &dyn ScanDecoding) -> Result<CsdScanExec> {
        let schema = |s: &Option<protobuf::Schema>, what: &str| -> Result<Arc<Schema>> {
            let s = s.as_ref().ok_or_else(|| bad(format!("no {what}")))?;
            Ok(Arc::new(s.try_into()?))
        };
        let table_schema = schema(&msg.schema, "table schema")?;
        let output = schema(&msg.output, "output schema")?;
        let ranges = cx.ranges();
        let mut endpoints = Vec::with_capacity(msg.endpoints.len());
        for mut e in msg.endpoints {
            let replicas = std::mem::take(&mut e.replicas);
            let mut endpoint = endpoint_of(e, cx)?;
            for r in replicas {
                endpoint.replicas.push(endpoint_of(r, cx)?);
            }
            endpoints.push(endpoint);
        }
        let compression =
            Compression::try_from(msg.compression).map_err(|_| bad("unknown compression"))?;
        let mode = Mode::try_from(msg.mode).map_err(|_| bad("unknown mode"))?;
        let table = TableEndpoints::new(
            msg.table,
            table_schema,
            endpoints,
            compression,
            ranges,
            cx.local(),
        );
        let functions =
            msg.functions
                .into_iter()
                .map(|f| {
                    let digest: [u8; 32] =
                        f.digest.as_slice().try_into().map_err(|_| {
                            bad(format!("function {}: a digest of 32 bytes", f.name))
                        })?;
                    Ok(Arc::new(ShippedFunction {
                        name: f.name,
                        export: f.export,
                        digest: ModuleDigest(digest),
                        bytes: f.module.map(Arc::from),
                    }))
                })
                .collect::<Result<Vec<_>>>()?;
        let width = output.fields().len();
        let mut scan = CsdScanExec::new(Arc::new(table), output, msg.plan, mode, msg.describe)
            .with_estimate(msg.row_fraction, msg.limit.map(|l| l as usize))
            .with_functions(functions)
            .with_partitions(msg.partitions as usize);
        scan.direct = msg.direct;
        scan.pinned = msg.pinned;
        scan.shrink_above = msg.shrink_above;
        scan.late_filters = msg.late_filters;
        scan.state_bytes = msg.state_bytes;
        for k in msg.key_filters {
            let columns: Vec<usize> = k.columns.iter().map(|&c| c as usize).collect();
            if columns.iter().any(|&c| c >= width) {
                return Err(bad("a key filter on a column the scan does not return"));
            }
            if let Some(c) = cx.collector(k.collector) {
                scan.key_filters.push((c, columns));
            } else if let Some(remote) = k.remote {
                let c = KeyCollector::remote_only(k.collector, remote, cx.key_meeting(), 1);
                scan.key_filters.push((Arc::new(c), columns));
            }
        }
        Ok(scan)
    }
}
