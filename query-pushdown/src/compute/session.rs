//! A SQL session over a cluster's tables, with or without pushdown.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use csd_protocol::node_client::{Credentials, NodeClient};
use csd_protocol::{Compression, DeletedCopy};
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::SessionStateBuilder;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ExecutionPlan, SendableRecordBatchStream, collect, displayable, execute_stream,
};
use datafusion::prelude::{SessionConfig, SessionContext};

use crate::compute::dimension_join_down::DimensionJoinDown;
use crate::compute::distributed::Workers;
use crate::compute::endpoints::{Endpoint, TableEndpoints};
use crate::compute::gate::LocalGate;
use crate::compute::key_filter_rule::KeyFilterRule;
use crate::compute::lost::{LostTable, UnknownSchemas};
use crate::compute::median_weighted::median_weighted_udaf;
use crate::compute::provider::CsdTable;
use crate::compute::pushdown::{CsdQueryPlanner, PushdownRule};
use crate::compute::range_read::{CLUSTER_URL, NodeRangeStore, RangeReadTable};
use crate::compute::replicas;
use crate::compute::scan::{CsdScanExec, EndpointRun, ScanCounter};
use crate::compute::semijoin_down::SemiJoinDown;
use crate::compute::worker_failure::on_workers;
use crate::error::to_datafusion;
use crate::eval::running_window::RunningWindow;
use crate::eval::scan;
use crate::options::CsdOptions;

/// How deep the SQL parser of a [`Cluster::session`] may nest (DataFusion's
/// `datafusion.sql_parser.recursion_limit`, 50 by default).
pub const SQL_RECURSION_LIMIT: usize = 10_000;

/// How a session reads the cluster.
#[derive(Debug, Clone, Copy)]
pub struct SessionOptions {
    /// Push work to the nodes (else: the range-read baseline).
    pub pushdown: bool,
    /// Compression of pushed-down answers.
    pub compression: Compression,
    /// DataFusion partitions on the compute tier (default: its cores).
    pub target_partitions: Option<usize>,
    /// With pushdown: read scans that reduce nothing (no filter, no limit) as Parquet
    /// byte ranges instead of asking the node (the default of `csd.direct_unfiltered`; see [`CsdTable::new`]).
    pub direct_unfiltered: bool,
    /// Fragments a node hands back that this session evaluates at once (default:
    /// this process's cores); the oldest goes first.
    pub local_slots: Option<usize>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            pushdown: true,
            compression: Compression::Auto,
            target_partitions: None,
            direct_unfiltered: true,
            local_slots: None,
        }
    }
}

/// Storage nodes to query together.
#[derive(Clone)]
pub struct Cluster {
    nodes: Vec<NodeClient>,
    /// Nodes that could not be reached when connecting (URL, why); their clients in
    /// `nodes` connect on first use.
    unreachable: Vec<(String, String)>,
}

/// A table as found on the cluster.
#[derive(Debug, Clone)]
pub struct ClusterTable {
    /// Schema (the same on every node).
    pub schema: SchemaRef,
    /// Its partitions, each once: a partition kept on several nodes is one endpoint
    /// with the other copies as its replicas (see [`crate::compute::replicas`]).
    pub endpoints: Vec<Endpoint>,
    /// Why the table cannot be read whole, each message naming what and where:
    /// objects the nodes have lost, copies that differ, nodes out of reach that may
    /// hold partitions nobody else does. A table with any is registered as
    /// [`LostTable`], whose reads fail with them.
    pub lost: Vec<String>,
}

impl Cluster {
    /// Connects to every node.
    pub async fn connect(urls: &[String]) -> Result<Self> {
        Self::connect_with(urls, &Credentials::default()).await
    }

    /// Connects to every node with a token and TLS settings.
    /// A node out of reach is noted, not fatal: the tables whose partitions all
    /// have copies on the others stay readable (see [`Cluster::tables`]); when no
    /// node can be reached, the first one's error.
    pub async fn connect_with(urls: &[String], credentials: &Credentials) -> Result<Self> {
        if urls.is_empty() {
            return Err(DataFusionError::Plan("no storage nodes given".into()));
        }
        let (mut nodes, mut unreachable, mut first_error) = (Vec::new(), Vec::new(), None);
        for u in urls {
            match NodeClient::connect_with(u, credentials).await {
                Ok(c) => nodes.push(c),
                Err(e) if e.node_lost() => {
                    tracing::warn!(node = %u, "storage node out of reach: {e}");
                    nodes.push(
                        NodeClient::connect_lazy_with(u, credentials).map_err(to_datafusion)?,
                    );
                    unreachable.push((u.clone(), e.to_string()));
                    first_error.get_or_insert(e);
                }
                Err(e) => return Err(to_datafusion(e)),
            }
        }
        match first_error {
            Some(e) if unreachable.len() == urls.len() => Err(to_datafusion(e)),
            _ => Ok(Cluster { nodes, unreachable }),
        }
    }

    /// A cluster of nodes already connected (e.g. with a tenant named for admission).
    pub fn from_clients(nodes: Vec<NodeClient>) -> Self {
        Cluster {
            nodes,
            unreachable: vec![],
        }
    }

    /// The nodes.
    pub fn nodes(&self) -> &[NodeClient] {
        &self.nodes
    }

    /// All tables, merged across nodes (a table's schema must agree everywhere; a
    /// partition on several nodes is one partition with replicas). Nodes out of
    /// reach are left out; a table is readable without them only while fewer are
    /// out than its partitions have copies.
    pub async fn tables(&self) -> Result<BTreeMap<String, ClusterTable>> {
        let mut out: BTreeMap<String, ClusterTable> = BTreeMap::new();
        // Per table: its copies by partition, and the fewest copies any asked for.
        let mut by_table: BTreeMap<String, (BTreeMap<String, Vec<Endpoint>>, u32)> =
            BTreeMap::new();
        let mut damaged: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
        // Per table: copies deleted while a node holding one may have been out.
        let mut deleted: BTreeMap<String, Vec<DeletedCopy>> = BTreeMap::new();
        let mut unreachable = self.unreachable.clone();
        for (i, n) in self.nodes.iter().enumerate() {
            if unreachable.iter().any(|(u, _)| u == n.url()) {
                continue;
            }
            let listed = match n.list_tables("").await {
                Ok(l) => l,
                Err(e) if e.node_lost() && unreachable.len() + 1 < self.nodes.len() => {
                    tracing::warn!(node = %n.url(), "storage node out of reach: {e}");
                    unreachable.push((n.url().to_string(), e.to_string()));
                    continue;
                }
                Err(e) => return Err(to_datafusion(e)),
            };
            for t in listed {
                let entry = out.entry(t.name.clone()).or_insert_with(|| ClusterTable {
                    schema: t.schema.clone(),
                    endpoints: vec![],
                    lost: vec![],
                });
                let (parts, fewest) = by_table
                    .entry(t.name.clone())
                    .or_insert_with(|| (BTreeMap::new(), u32::MAX));
                // A node whose every object of the table is lost cannot tell its
                // schema (it lists none): another node's tells it.
                if entry.schema.fields().is_empty() {
                    entry.schema = t.schema.clone();
                }
                if !t.schema.fields().is_empty() && entry.schema.fields() != t.schema.fields() {
                    return Err(DataFusionError::Plan(format!(
                        "table {} has different schemas on {} and another node",
                        t.name,
                        n.url()
                    )));
                }
                deleted
                    .entry(t.name.clone())
                    .or_default()
                    .extend(t.description.deleted.iter().cloned());
                let node_distinct = Arc::new(t.description.distinct.clone());
                for p in &t.description.partitions {
                    *fewest = (*fewest).min(p.copies.max(1));
                    if !p.lost.is_empty() {
                        // A damaged copy serves nothing; another copy may.
                        let at =
                            |why: &String| format!("{why} (partition {} at {})", p.name, n.url());
                        damaged
                            .entry((t.name.clone(), p.name.clone()))
                            .or_default()
                            .extend(p.lost.iter().map(at));
                        continue;
                    }
                    parts.entry(p.name.clone()).or_default().push(Endpoint {
                        client: n.clone(),
                        partition: p.name.clone(),
                        rows: p.rows,
                        bytes: p.bytes,
                        objects: p.objects.clone(),
                        node: i,
                        merged: vec![],
                        distinct: p.distinct.clone(),
                        node_distinct: node_distinct.clone(),
                        replicas: vec![],
                    });
                }
            }
        }
        for ((name, partition), why) in damaged {
            let intact = by_table
                .get(&name)
                .is_some_and(|(p, _)| p.contains_key(&partition));
            match out.get_mut(&name) {
                Some(_) if intact => {
                    tracing::warn!(table = %name, %partition, "read from another copy: {}", why.join("; "));
                }
                Some(entry) => entry.lost.extend(why),
                None => {}
            }
        }
        for (name, (parts, fewest)) in by_table {
            let Some(entry) = out.get_mut(&name) else {
                continue;
            };
            entry
                .lost
                .extend(replicas::unreachable_loses(&name, fewest, &unreachable));
            let deleted = deleted.remove(&name).unwrap_or_default();
            for (_, copies) in parts {
                let copies = replicas::without_deleted(copies, &deleted);
                if copies.is_empty() {
                    continue;
                }
                match replicas::merge_copies(&name, copies) {
                    Ok(e) => entry.endpoints.extend(e),
                    Err(differ) => entry.lost.push(differ.to_string()),
                }
            }
            // Node order, as listed before copies were merged.
            entry.endpoints.sort_by_key(|e| e.node);
        }
        // A table every copy of which is deleted is gone.
        out.retain(|_, t| !t.endpoints.is_empty() || !t.lost.is_empty());
        Ok(out)
    }

    /// A session with every table of the cluster registered.
    pub async fn session(&self, opts: SessionOptions) -> Result<CsdSession> {
        self.session_on(opts, None).await
    }

    /// A session whose queries run on `workers` (`csd worker`s; see
    /// [`crate::compute::distributed`]): this process plans and merges, the workers
    /// run the stages. Pushdown only (the baseline's byte-range reads name the nodes
    /// by this process's numbering).
    pub async fn distributed_session(
        &self,
        opts: SessionOptions,
        workers: &Workers,
    ) -> Result<CsdSession> {
        if !opts.pushdown {
            return Err(DataFusionError::Plan(
                "workers run pushdown plans only: without pushdown, query here".into(),
            ));
        }
        self.session_on(opts, Some(workers)).await
    }

    async fn session_on(
        &self,
        opts: SessionOptions,
        workers: Option<&Workers>,
    ) -> Result<CsdSession> {
        let mut config = SessionConfig::new().with_information_schema(true);
        if let Some(p) = opts.target_partitions {
            config = config.with_target_partitions(p);
        }
        // The parser's default depth (50) refuses machine-written SQL that
        // DataFusion plans fine; its `recursive` protection grows the stack instead.
        config.options_mut().set(
            "datafusion.sql_parser.recursion_limit",
            &SQL_RECURSION_LIMIT.to_string(),
        )?;
        let csd_options = CsdOptions {
            direct_unfiltered: opts.direct_unfiltered,
            ..CsdOptions::default()
        };
        let config = scan::configure(config).with_option_extension(csd_options.clone());
        let runtime = RuntimeEnvBuilder::new().build_arc()?;
        let tables = self.tables().await?;
        // Byte-range reads of the nodes' objects: the whole baseline, and with
        // pushdown the scans that would reduce nothing.
        let objects: Vec<(usize, String, u64)> = tables
            .values()
            .flat_map(|t| {
                t.endpoints
                    .iter()
                    .flat_map(|e| std::iter::once(e).chain(&e.replicas))
            })
            .flat_map(|e| e.objects.iter().map(|o| (e.node, o.name.clone(), o.len)))
            .collect();
        let ranges = Arc::new(
            NodeRangeStore::new(self.nodes.clone(), &objects).with_compression(opts.compression),
        );
        for e in tables.values().flat_map(|t| &t.endpoints) {
            let replicas: Vec<(usize, &[_])> = e
                .replicas
                .iter()
                .map(|r| (r.node, &r.objects[..]))
                .collect();
            ranges.add_copies(e.node, &e.objects, &replicas);
        }
        let url = datafusion::execution::object_store::ObjectStoreUrl::parse(CLUSTER_URL)?;
        runtime.register_object_store(url.as_ref(), ranges.clone());
        let mut builder = SessionStateBuilder::new()
            .with_default_features()
            .with_config(config)
            .with_runtime_env(runtime);
        if opts.pushdown {
            builder = builder
                .with_query_planner(Arc::new(CsdQueryPlanner))
                .with_optimizer_rule(Arc::new(SemiJoinDown))
                .with_optimizer_rule(Arc::new(DimensionJoinDown))
                .with_optimizer_rule(Arc::new(PushdownRule))
                .with_physical_optimizer_rule(Arc::new(KeyFilterRule));
            if workers.is_none() {
                // Workers decode plans with `CsdCodec`, which knows no
                // `RunningWindowExec`: distributed plans keep DataFusion's window.
                builder = builder.with_physical_optimizer_rule(Arc::new(RunningWindow));
            }
        }
        if let Some(w) = workers {
            builder = w.configure(builder, csd_options)?;
        }
        let ctx = SessionContext::new_with_state(builder.build());
        // The final step of medians split by `holistic_down.rs` (and callable in SQL).
        ctx.register_udaf(median_weighted_udaf().as_ref().clone());
        let local = opts
            .local_slots
            .map_or_else(LocalGate::per_core, LocalGate::new);
        let mut unknown = BTreeMap::new();
        for (name, t) in tables {
            if !t.lost.is_empty() && t.schema.fields().is_empty() {
                unknown.insert(name, t.lost);
                continue;
            }
            if !t.lost.is_empty() {
                let lost = LostTable::new(&name, t.schema.clone(), t.lost.clone());
                ctx.register_table(name.as_str(), Arc::new(lost))?;
                continue;
            }
            if opts.pushdown {
                let at = TableEndpoints::new(
                    name.clone(),
                    t.schema.clone(),
                    t.endpoints.clone(),
                    opts.compression,
                    ranges.clone(),
                    local.clone(),
                );
                let table = CsdTable::new(at);
                ctx.register_table(name.as_str(), Arc::new(table))?;
            } else {
                let files = t
                    .endpoints
                    .iter()
                    .flat_map(|e| {
                        e.objects.iter().map(|o| {
                            (
                                NodeRangeStore::path(e.node, &o.name).to_string(),
                                o.len,
                                o.rows,
                            )
                        })
                    })
                    .collect();
                let direct = RangeReadTable::new(t.schema.clone(), files, ranges.clone());
                ctx.register_table(name.as_str(), Arc::new(direct))?;
            }
        }
        if !unknown.is_empty() {
            let catalog = ctx
                .catalog("datafusion")
                .ok_or_else(|| DataFusionError::Internal("no default catalog".into()))?;
            let public = catalog
                .schema("public")
                .ok_or_else(|| DataFusionError::Internal("no default schema".into()))?;
            catalog.register_schema("public", Arc::new(UnknownSchemas::new(public, unknown)))?;
        }
        Ok(CsdSession {
            ctx,
            ranges,
            pushdown: opts.pushdown,
            workers: workers.map(|w| w.urls.clone()).unwrap_or_default(),
        })
    }
}

/// A DataFusion session over a cluster.
pub struct CsdSession {
    /// The DataFusion context (register more tables, run `sql`, …).
    pub ctx: SessionContext,
    ranges: Arc<NodeRangeStore>,
    pushdown: bool,
    /// Where its stages run (empty: here).
    workers: Vec<String>,
}

/// One query's answer and what it cost.
#[derive(Debug)]
pub struct QueryRun {
    /// Result batches.
    pub batches: Vec<RecordBatch>,
    /// Result schema.
    pub schema: SchemaRef,
    /// Wall time.
    pub elapsed: Duration,
    /// Bytes that crossed the network from the nodes (pushed-down answers plus
    /// Parquet byte ranges; when several queries run at once, theirs are mixed in).
    pub bytes_moved: u64,
    /// Whether `bytes_moved` and the plan's metrics cover every task. `false` only
    /// on workers, when a planned task never ran and so sent no metrics: then
    /// `bytes_moved` counts this process's scans only (a lower bound).
    pub metrics_complete: bool,
    /// Per endpoint, what the nodes did (pushdown only).
    pub node_runs: Vec<EndpointRun>,
    /// The physical plan that ran, with metrics.
    pub plan: Arc<dyn ExecutionPlan>,
}

impl QueryRun {
    /// Result rows.
    pub fn rows(&self) -> usize {
        self.batches.iter().map(RecordBatch::num_rows).sum()
    }

    /// The executed plan with its metrics (as EXPLAIN ANALYZE shows it).
    pub fn plan_with_metrics(&self) -> String {
        displayable(self.plan.as_ref()).indent(true).to_string()
    }
}

impl CsdSession {
    /// The workers its stages run on (empty: this process).
    pub fn workers(&self) -> &[String] {
        &self.workers
    }

    /// Whether this session pushes work down.
    pub fn pushdown(&self) -> bool {
        self.pushdown
    }

    /// Runs one SQL statement to completion.
    pub async fn run(&self, sql: &str) -> Result<QueryRun> {
        let started = Instant::now();
        let before = self.ranges.bytes_read();
        let df = self.ctx.sql(sql).await?;
        let plan = df.create_physical_plan().await?;
        let batches = match collect(plan.clone(), self.ctx.task_ctx()).await {
            Ok(b) => b,
            Err(e) => return Err(on_workers(&self.workers, e).await),
        };
        let elapsed = started.elapsed();
        let schema = plan.schema();
        let node_runs = scans_of(&plan);
        let (plan, bytes_moved, metrics_complete) = if let Some(d) =
            plan.downcast_ref::<datafusion_distributed::DistributedExec>()
        {
            // Scans ran on workers (and any in this process's stage too): every
            // scan's counters come back with the workers' metrics, its answers from
            // the nodes and what it read by byte range. Every task that ran has
            // reported by the time the answer is complete; a planned task that never
            // ran (its consumer stopped early: an empty build side, a limit) never
            // reports, and the engine would wait for it forever
            // (datafusion-distributed#739), so the wait is bounded and the workers'
            // counters are then left out.
            let complete = tokio::time::timeout(WORKER_METRICS_WAIT, d.wait_for_metrics())
                .await
                .is_ok();
            let plan = if complete {
                datafusion_distributed::rewrite_distributed_plan_with_metrics(
                    plan,
                    datafusion_distributed::DistributedMetricsFormat::Aggregated,
                )
                .await?
            } else {
                tracing::debug!(
                    "some planned worker tasks never ran: the query's worker metrics are left out"
                );
                plan
            };
            let bytes = metric_sum(&plan, ScanCounter::BytesReceived)
                + metric_sum(&plan, ScanCounter::RangeBytes);
            (plan, bytes, complete)
        } else {
            let bytes = node_runs.iter().map(|r| r.bytes_received).sum::<u64>()
                + self.ranges.bytes_read()
                - before;
            (plan, bytes, true)
        };
        Ok(QueryRun {
            batches,
            schema,
            elapsed,
            bytes_moved,
            metrics_complete,
            node_runs,
            plan,
        })
    }

    /// Runs one SQL statement and streams its answer as it is computed, batch by
    /// batch; dropping the stream stops the work (the nodes' calls included). It
    /// carries no figures: [`CsdSession::run`] collects the answer with them.
    pub async fn stream(&self, sql: &str) -> Result<SendableRecordBatchStream> {
        use futures::StreamExt;
        let df = self.ctx.sql(sql).await?;
        let plan = df.create_physical_plan().await?;
        let schema = plan.schema();
        let stream = match execute_stream(plan, self.ctx.task_ctx()) {
            Ok(s) => s,
            Err(e) => return Err(on_workers(&self.workers, e).await),
        };
        let workers: Arc<[String]> = self.workers.clone().into();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            schema,
            stream.then(move |b| {
                let workers = workers.clone();
                async move {
                    match b {
                        Ok(b) => Ok(b),
                        Err(e) => Err(on_workers(&workers, e).await),
                    }
                }
            }),
        )))
    }
}

/// How long a distributed query's answer waits for its workers' metrics once it is
/// complete (they are in this process by then, unless a task never ran).
const WORKER_METRICS_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// The sum of `counter` over the scans of `plan` (here, or on workers).
fn metric_sum(plan: &Arc<dyn ExecutionPlan>, counter: ScanCounter) -> u64 {
    let own =
        if plan.downcast_ref::<CsdScanExec>().is_some() || plan.name() == "DistributedLeafExec" {
            plan.metrics()
                .and_then(|m| m.sum_by_name(counter.name()))
                .map_or(0, |v| v.as_usize() as u64)
        } else {
            0
        };
    own + plan
        .children()
        .into_iter()
        .map(|c| metric_sum(c, counter))
        .sum::<u64>()
}

/// What every `CsdScanExec` in `plan` did.
fn scans_of(plan: &Arc<dyn ExecutionPlan>) -> Vec<EndpointRun> {
    let mut out = Vec::new();
    if let Some(s) = plan.downcast_ref::<CsdScanExec>() {
        out.extend(s.runs());
    }
    for c in plan.children() {
        out.extend(scans_of(c));
    }
    out
}
