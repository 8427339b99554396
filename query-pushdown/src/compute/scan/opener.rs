//! Opening one endpoint's share of a scan: wait for the join keys, ask the node (as
//! a patient request when this tier is saturated), and say why when the node hands
//! the fragment back or runs out of memory before its first batch; or evaluate the
//! fragment here. Which copy of a partition is asked next, and when the fragment
//! runs here instead, the scan's stream decides with the partition's
//! [`Copies`](csd_protocol::node_client::Copies), as ML and Wasm runs do.

use std::sync::Arc;

use arrow::record_batch::RecordBatch;
use csd_protocol::node_client::{Declined, Error as ClientError, ReplyStats};
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::SendableRecordBatchStream;
use futures::StreamExt;
use futures::stream::BoxStream;

use crate::compute::endpoints::{Endpoint, TableEndpoints};
use crate::compute::key_collector::KeyCollector;
use crate::compute::sandbox::{guarded, register_here};
use crate::error::to_datafusion;
use crate::eval::keyfilter::filter_stream;
use crate::eval::{Parallelism, fragment_session, key_filtered, plan_fragment};
use crate::wire::fragment::{CheckedFragment, OPERATOR_NAME, SqlFragment};
use crate::wire::keyfilter::MAX_RANGES;
use crate::wire::shipped::ShippedFunction;
use csd_protocol::ModuleDigest;

/// What opening an endpoint gave.
pub(crate) enum Opened {
    /// A node runs the fragment: its batches, and what it reports at their end.
    Node {
        batches: BoxStream<'static, csd_protocol::node_client::Result<RecordBatch>>,
        stats: Arc<ReplyStats>,
    },
    /// The node handed the fragment back (never [`Declined::Lost`]: a lost node
    /// fails the opening).
    Declined(Declined),
    /// The fragment runs here over byte-range reads of the endpoint's objects
    /// (asked for with [`EndpointOpener::here`], or a direct scan never asked).
    Here(SendableRecordBatchStream),
}

/// Everything needed to open one endpoint of a scan.
#[derive(Clone)]
pub(crate) struct EndpointOpener {
    pub table: Arc<TableEndpoints>,
    pub endpoint: Endpoint,
    /// The fragment as planned, without join-key filters.
    pub fragment: SqlFragment,
    pub key_filters: Vec<(Arc<KeyCollector>, Vec<usize>)>,
    /// For each output column, the table column it is (see
    /// `CsdScanExec::with_table_columns`).
    pub table_columns: Option<Arc<Vec<usize>>>,
    /// A scan that reduces nothing by itself (see `CsdScanExec::direct`).
    pub direct: bool,
    /// Evaluate here without asking the node: `Some(why)` once the partition's
    /// copies declined it (see the stream's `Copies`); when they were lost, its
    /// objects are read from their copies.
    pub here: Option<Declined>,
    /// The Wasm SQL functions the fragment calls (with their modules' bytes).
    pub functions: Arc<Vec<Arc<ShippedFunction>>>,
    pub context: Arc<TaskContext>,
}

impl EndpointOpener {
    /// Opens the endpoint (see the module docs).
    pub(super) async fn open(self) -> Result<Opened> {
        let mut frag = self.fragment.clone();
        let mut collectors = Vec::new();
        for (collector, cols) in &self.key_filters {
            let ranges = self.key_ranges(cols);
            if let Some((bloom, cut)) = collector.within(ranges.as_deref()).await {
                frag.key_filters.push(match (&ranges, &cols[..]) {
                    (Some(r), [c]) if cut => bloom.to_cut_msg(*c, r),
                    _ => bloom.to_msg(cols),
                });
                collectors.push((collector, bloom));
            }
        }
        let args = frag.to_bytes();
        // A direct scan handed back reads as it would have without a filter: not
        // one of the fragments the gate orders.
        if self.here.is_some() {
            return Ok(Opened::Here(self.evaluate_here(&args, !self.direct).await?));
        }
        if self.direct && frag.key_filters.is_empty() {
            return Ok(Opened::Here(self.evaluate_here(&args, false).await?));
        }
        // Filters the node's other fragments of this scan apply too go there once.
        let mut attached = Vec::new();
        let node_args = match self.shares_node() && !collectors.is_empty() {
            false => args.clone(),
            true => {
                let mut to_node = frag.clone();
                for (msg, (collector, bloom)) in to_node.key_filters.iter_mut().zip(&collectors) {
                    let client = &self.endpoint.client;
                    if let Some(d) = collector.attachment_at(client, bloom, &msg.blocks).await {
                        attached.push((d, std::mem::take(&mut msg.blocks)));
                        *msg = msg.by_attachment(&d);
                    }
                }
                to_node.to_bytes()
            }
        };
        self.ask_node(&node_args, &args, &attached).await
    }

    /// This opener for another copy of its partition: the copy's node, and the
    /// copy's object names where the fragment is pinned to objects.
    pub(crate) fn at_copy(&self, copy: &Endpoint) -> EndpointOpener {
        let mut at = self.clone();
        if !at.fragment.objects.is_empty() {
            at.fragment.objects = copy.objects.iter().map(|o| o.name.clone()).collect();
        }
        at.endpoint = Endpoint {
            replicas: vec![],
            ..copy.clone()
        };
        at
    }

    /// `node-url/partition`, as `EXPLAIN ANALYZE` names an endpoint.
    pub(crate) fn label(&self) -> String {
        format!("{}/{}", self.endpoint.client.url(), self.endpoint.partition)
    }

    /// The key ranges of the rows this endpoint's node was listed with, for a
    /// filter on `cols`: sorted and merged `[min, max]` of the one key column over
    /// every object of the table at the node, when the fragment passes that column
    /// through from the table and every object's range is known (`None`: the
    /// filter is not cut).
    fn key_ranges(&self, cols: &[usize]) -> Option<Vec<[i64; 2]>> {
        let [c] = cols else {
            return None;
        };
        let column = *self.table_columns.as_ref()?.get(*c)?;
        let node = self.endpoint.node;
        let mut ranges = Vec::new();
        // This endpoint's own objects too: a copy asked after its partition's node
        // was lost is at a node that serves other partitions.
        let at_node = self.table.endpoints().iter().filter(|e| e.node == node);
        for e in at_node.chain(std::iter::once(&self.endpoint)) {
            for o in e.objects.iter().filter(|o| o.rows > 0) {
                ranges.push((*o.int_ranges.get(column)?)?);
            }
        }
        ranges.sort_unstable();
        let mut merged: Vec<[i64; 2]> = Vec::new();
        for r in ranges {
            match merged.last_mut() {
                Some(m) if r[0] <= m[1].saturating_add(1) => m[1] = m[1].max(r[1]),
                _ => merged.push(r),
            }
        }
        (!merged.is_empty() && merged.len() <= MAX_RANGES).then_some(merged)
    }

    /// Whether another endpoint of the table is at this endpoint's node.
    fn shares_node(&self) -> bool {
        let node = self.endpoint.node;
        self.table
            .endpoints()
            .iter()
            .filter(|e| e.node == node)
            .nth(1)
            .is_some()
    }

    /// Sends the fragment to the node: its answer, or why it handed the fragment
    /// back (pushed back, or out of memory before its first batch). `attached`:
    /// the key filters' blocks `args` names by digest, to send again if the node
    /// no longer keeps them; `inline`: the same fragment carrying them, sent
    /// instead if the node cannot keep them.
    async fn ask_node(
        &self,
        args: &[u8],
        inline: &[u8],
        attached: &[(ModuleDigest, Vec<u8>)],
    ) -> Result<Opened> {
        let (mut args, mut inline_now) = (args, false);
        let client = &self.endpoint.client;
        let compression = self.table.compression();
        // Saturated here too: ask the node to queue it instead of handing it back
        // (once more if it was handed back and this tier filled up since).
        let gate = self.table.local_gate();
        let mut patient = gate.saturated() && !self.direct;
        let mut sent: Vec<ModuleDigest> = Vec::new();
        let reply = loop {
            let r = client
                .operator_with(
                    OPERATOR_NAME,
                    args.to_vec(),
                    compression,
                    patient,
                    gate.load(),
                )
                .await;
            match r {
                Err(ClientError::PushedBack(_)) if !patient && !self.direct && gate.saturated() => {
                    patient = true;
                }
                // A node without a Wasm function's module: send it once, ask again.
                Err(ClientError::ModuleMissing(d)) => {
                    let bytes = self
                        .functions
                        .iter()
                        .find(|f| f.digest == d && !sent.contains(&d))
                        .and_then(|f| f.bytes.clone());
                    let Some(bytes) = bytes else {
                        break Err(ClientError::ModuleMissing(d));
                    };
                    client.put_module(&bytes).await.map_err(to_datafusion)?;
                    sent.push(d);
                }
                // A node that let go of a key filter sent by attachment (its memory
                // ran short, or it restarted): send it again, once; if it will not
                // keep it, send the fragment with its filters inline.
                Err(ClientError::AttachmentMissing(d)) if !inline_now => {
                    let again = attached
                        .iter()
                        .find(|(a, _)| *a == d)
                        .filter(|_| !sent.contains(&d));
                    match again {
                        Some((_, blocks)) if client.put_attachment(blocks).await.is_ok() => {
                            sent.push(d);
                        }
                        _ => (args, inline_now) = (inline, true),
                    }
                }
                r => break r,
            }
        };
        // Pushed back, unable to evaluate it (a function it lacks or refuses, an
        // older node), or out of memory: declined, not a failed query. A lost node
        // fails the opening (the stream asks another copy).
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => {
                return match Declined::of(&e).filter(Declined::handed_back_work) {
                    Some(d) => Ok(Opened::Declined(d)),
                    None => Err(to_datafusion(e)),
                };
            }
        };
        // A node that runs out of memory fails before its first batch, and one that
        // judged the fragment while running it (an aggregate that does not shrink)
        // hands it back there.
        let mut batches = reply.batches;
        let first = batches.next().await;
        if let Some(Err(e)) = &first
            && let Some(d) = Declined::of(e).filter(Declined::handed_back_work)
        {
            return Ok(Opened::Declined(d));
        }
        Ok(Opened::Node {
            batches: futures::stream::iter(first).chain(batches).boxed(),
            stats: reply.stats,
        })
    }

    /// Evaluates the fragment here: the same plan, run by DataFusion over the
    /// endpoint's Parquet objects read by byte range (the query's runtime: its
    /// memory pool, object stores and footer cache); under the local gate when
    /// `gated`.
    pub(crate) async fn evaluate_here(
        &self,
        args: &[u8],
        gated: bool,
    ) -> Result<SendableRecordBatchStream> {
        let external = |e: csd_protocol::Error| DataFusionError::External(Box::new(e));
        let CheckedFragment {
            frag,
            mode,
            plan,
            digests,
        } = SqlFragment::decode_checked(args).map_err(external)?;
        let provider = Arc::new(self.table.range_table(std::slice::from_ref(&self.endpoint)));
        // A fragment over one partition runs in one stream (the scan's other
        // partitions take the other cores); one standing for a node's several
        // partitions (a per-node top-k) is the scan's only work from that node, and
        // in one stream it would sort all of the node's rows on one core. Under the
        // gate, it runs in parallel only while the gate is idle: parallel streams are
        // tasks the gate cannot hold back, and under load they would share the
        // cores with every other handed-back fragment until none finishes in time.
        let parallel = match (self.endpoint.merged.len() > 1, gated) {
            (false, _) => Parallelism::ONE,
            (true, false) => Parallelism::NODE,
            (true, true) => Parallelism {
                streams: self.table.local_gate().streams(Parallelism::NODE.streams),
                ..Parallelism::NODE
            },
        };
        let session = fragment_session(
            self.context.runtime_env(),
            &frag.table,
            provider,
            parallel,
            frag.late_filters,
        )
        .map_err(external)?;
        // The same modules the node would run, from this process's sandbox (which
        // compiled them when they were registered).
        let guard = match frag.functions.is_empty() {
            true => None,
            false => {
                Some(register_here(&session, &self.functions, &frag.functions, &digests).await?)
            }
        };
        // Here the compute tier's own registry decides: a function a node refused
        // runs here if DataFusion has it.
        let physical = plan_fragment(&session, &frag.table, &plan, mode, &|_| true)
            .await
            .map_err(external)?;
        let (physical, filters) = key_filtered(&frag, physical).map_err(external)?;
        let stream = filter_stream(physical.execute(0, session.task_ctx())?, filters);
        let stream = match guard {
            Some(g) => guarded(stream, g),
            None => stream,
        };
        Ok(if gated {
            self.table.local_gate().run(stream)
        } else {
            stream
        })
    }
}
