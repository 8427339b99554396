//! The compute side of shipped code: run a WebAssembly module over a table at the
//! nodes that hold it ([`CsdSession::run_wasm`]).
//!
//! The input (`SELECT columns FROM table WHERE filter`) is planned by the session like
//! any query, so it must push whole: the module sees exactly the rows the nodes
//! return. Each partition's fragment travels in a `"wasm"` request naming the module
//! by digest (its bytes ride along when small); a node that lacks the module says so
//! and gets its bytes once (`put_module`). A request the node hands back (or a node
//! without the operator) runs here: the same fragment over byte-range reads, then
//! the same module in this process's sandbox, with host reads going to the node by
//! range. An aggregate's partial outputs are merged here by the module itself
//! (`csd.phase=merge`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use arrow::record_batch::RecordBatch;
use bytes::Bytes;
use csd_protocol::node_client::{Copies, Declined, Error as ClientError, Next, NodeClient, Tried};
use csd_protocol::{ModuleDigest, OperatorReport};
use csd_sandbox::{GuestKind, GuestReader};
use datafusion::common::{DataFusionError, Result};
use datafusion::physical_plan::ExecutionPlan;
use futures::{StreamExt, TryStreamExt};

use crate::compute::endpoints::{Endpoint, TableEndpoints};
use crate::compute::provider::CsdTable;
use crate::compute::sandbox::local_sandbox;
use crate::compute::scan::only_scan;
use crate::compute::session::CsdSession;
use crate::error::{to_datafusion, to_runtime};
use crate::eval::wasm::{GuestFigures, guest_args, run_guest};
use crate::eval::wasm_fn::WasmScalarUdf;
use crate::options::CsdOptions;
use crate::wire::details::{WasmDetails, WasmKind};
use crate::wire::shipped::ShippedFunction;
use crate::wire::shipped::{MAX_INLINE_MODULE, WasmFunctionMsg};
use crate::wire::wasm::{OPERATOR_NAME, WasmRequest};
use datafusion::execution::FunctionRegistry;
use datafusion::logical_expr::ScalarUDF;

/// A module to run over a table.
#[derive(Debug, Clone)]
pub struct WasmJob {
    /// The module's bytes.
    pub module: Bytes,
    /// The table it runs over.
    pub table: String,
    /// The columns it receives (empty: all).
    pub columns: Vec<String>,
    /// A SQL filter on the rows it receives (pushed to the nodes).
    pub filter: Option<String>,
    /// Its arguments (`--arg KEY=VALUE`).
    pub args: BTreeMap<String, String>,
    /// Whether the module receives the table's rows. `false`: it runs over no rows
    /// at each partition and only reads objects (`csd::read`: a traversal, a
    /// pointer chase); nothing is planned or scanned, and `columns` and `filter`
    /// must be empty.
    pub rows: bool,
}

/// What one partition did.
#[derive(Debug, Clone, Default)]
pub struct WasmEndpointRun {
    /// `node-url/partition`.
    pub endpoint: String,
    /// Why the copy asked last did not run it (it ran here), if it did not.
    pub pushed_back: Option<Declined>,
    /// The node's report, when it ran there.
    pub report: Option<OperatorReport>,
    /// Bytes received from the node for it.
    pub bytes_received: u64,
    /// Whether the module's bytes had to be sent to the node.
    pub module_sent: bool,
    /// The partition's copies asked that did not run it, each with why (its node
    /// lost, see `crate::compute::replicas`, or busy): those before the one that
    /// ran it, or all when it ran here (not a lone copy's hand-back, which
    /// `pushed_back` says).
    pub failed_over: Vec<Tried>,
}

/// A module's answer over a table.
#[derive(Debug)]
pub struct WasmRun {
    /// The module.
    pub digest: ModuleDigest,
    /// Rows or a merged aggregate.
    pub kind: GuestKind,
    /// The answer.
    pub batches: Vec<RecordBatch>,
    /// Per partition.
    pub endpoints: Vec<WasmEndpointRun>,
}

fn external(e: csd_protocol::Error) -> DataFusionError {
    DataFusionError::External(Box::new(e))
}

/// The SHA-256 of `module`, remembered for the last few modules: hashing a 1.3 MB
/// module takes 0.75 ms, most of a short pushed request. A remembered module is
/// recognised by its allocation (the memo holds it, so it cannot have been freed and
/// reused) or, for a new copy of the same bytes, by comparing them (a tenth of the
/// cost of hashing).
fn digest_of(module: &Bytes) -> ModuleDigest {
    const KEPT: usize = 8;
    static MEMO: Mutex<Vec<(Bytes, ModuleDigest)>> = Mutex::new(Vec::new());
    let Ok(mut memo) = MEMO.lock() else {
        return ModuleDigest::of(module);
    };
    let same_allocation = |b: &Bytes| b.as_ptr() == module.as_ptr() && b.len() == module.len();
    if let Some(i) = memo
        .iter()
        .position(|(b, _)| same_allocation(b) || b == module)
    {
        let hit = memo.remove(i);
        let digest = hit.1;
        memo.push(hit);
        return digest;
    }
    let digest = ModuleDigest::of(module);
    if memo.len() >= KEPT {
        memo.remove(0);
    }
    memo.push((module.clone(), digest));
    digest
}

/// Host reads of a guest running here: byte ranges from the node.
struct RangeReader {
    client: NodeClient,
}

impl GuestReader for RangeReader {
    fn read(&self, object: &str, offset: u64, len: usize) -> csd_protocol::Result<Vec<u8>> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            csd_protocol::Error::Internal("a guest's read ran outside a runtime".into())
        })?;
        handle
            .block_on(self.client.read_range(object, offset, len as u64))
            .map(|b| b.to_vec())
            .map_err(|e| match e {
                ClientError::Runtime(e) => e,
                e => csd_protocol::Error::external(e.status_code(), "a guest's range read", e),
            })
    }
}

fn quote(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

impl CsdSession {
    /// Registers the SQL function `name`, computed by the export `export` of the
    /// WebAssembly module `module` (the guest ABI's SQL functions): its signature
    /// comes from the module. Queries may then call it like a built-in, and filters,
    /// projections and aggregate arguments that call it are pushed to the nodes with
    /// the module's digest (the bytes follow to a node that lacks them); a fragment
    /// a node hands back runs the same module here.
    pub async fn register_wasm_udf(&self, name: &str, module: &[u8], export: &str) -> Result<()> {
        crate::wire::shipped::check_function_name(name).map_err(external)?;
        let most = csd_protocol::MAX_MESSAGE_BYTES - (64 << 10);
        if module.len() > most {
            return Err(external(csd_protocol::Error::ResourcesExhausted(format!(
                "the module is {} bytes; a module travels in one message of at most {most} bytes",
                module.len()
            ))));
        }
        if self.ctx.udf(name).is_ok() {
            return Err(external(csd_protocol::Error::InvalidArgument(format!(
                "a function called {name} is already registered on this session"
            ))));
        }
        let sandbox = local_sandbox()?;
        let compiled = sandbox.compile(module).await.map_err(external)?;
        let shipped = ShippedFunction {
            name: name.to_string(),
            export: export.to_string(),
            digest: compiled.digest,
            bytes: Some(Arc::from(module)),
        };
        let check = WasmFunctionMsg {
            module: None,
            ..shipped.to_msg()
        };
        crate::wire::shipped::check_functions(std::slice::from_ref(&check)).map_err(external)?;
        let listed = shipped.clone();
        let udf = WasmScalarUdf::load(
            sandbox,
            compiled,
            shipped,
            Arc::new(std::sync::atomic::AtomicBool::new(false)),
        )
        .map_err(external)?;
        if !self.workers().is_empty() {
            // The workers run the function wherever the plan calls it above the
            // scans: each gets the module now, and each task's session the function.
            for w in self.workers() {
                let home = crate::compute::distributed::worker_url(w)?;
                crate::compute::distributed::actions::put_module(
                    home.as_str().trim_end_matches('/'),
                    module,
                )
                .await
                .map_err(|e| {
                    DataFusionError::Execution(format!(
                        "wasm function {name}: the module could not be sent to the worker {w} \
                         (is it up? run the query again once it is): {e}"
                    ))
                })?;
            }
            let state = self.ctx.state_ref();
            let mut state = state.write();
            let options = state
                .config_mut()
                .options_mut()
                .extensions
                .get_mut::<CsdOptions>()
                .ok_or_else(|| DataFusionError::Internal("a session without csd options".into()))?;
            options.wasm_functions.push(listed);
        }
        self.ctx.register_udf(ScalarUDF::new_from_impl(udf));
        Ok(())
    }

    /// Runs `job`'s module over its table at the nodes (see the module docs).
    pub async fn run_wasm(&self, job: &WasmJob) -> Result<WasmRun> {
        // A module travels in one message (a request or a put_module action).
        let most = csd_protocol::MAX_MESSAGE_BYTES - (64 << 10);
        if job.module.len() > most {
            return Err(DataFusionError::External(Box::new(
                csd_protocol::Error::ResourcesExhausted(format!(
                    "the module is {} bytes; a module travels in one message of at most {most} bytes",
                    job.module.len()
                )),
            )));
        }
        let digest = digest_of(&job.module);
        let runs: Vec<_> = if job.rows {
            let plan = self.wasm_input(job).await?;
            let scan = only_scan(&plan).map_err(|left| DataFusionError::Plan(left.0))?;
            let task = self.ctx.task_ctx();
            scan.table()
                .endpoints()
                .iter()
                .map(|endpoint| {
                    let opener = scan.opener(endpoint.clone(), task.clone());
                    let table = opener.table.clone();
                    run_endpoint(job, digest, endpoint.clone(), table, Some(opener))
                })
                .collect()
        } else {
            if !job.columns.is_empty() || job.filter.is_some() {
                return Err(DataFusionError::Plan(
                    "a module that receives no rows takes no columns or filter".into(),
                ));
            }
            let provider = self.ctx.table_provider(job.table.as_str()).await?;
            let table = provider
                .downcast_ref::<CsdTable>()
                .ok_or_else(|| {
                    DataFusionError::Plan(format!(
                        "{} is not a table of the storage nodes",
                        job.table
                    ))
                })?
                .at()
                .clone();
            table
                .endpoints()
                .iter()
                .map(|endpoint| run_endpoint(job, digest, endpoint.clone(), table.clone(), None))
                .collect()
        };
        let done: Vec<(Vec<RecordBatch>, WasmEndpointRun, GuestKind)> =
            futures::future::try_join_all(runs).await?;
        let kind = if done.iter().any(|d| d.2 == GuestKind::Aggregate) {
            GuestKind::Aggregate
        } else {
            GuestKind::Rows
        };
        let mut batches = Vec::new();
        let mut endpoints = Vec::new();
        for (b, run, _) in done {
            batches.extend(b);
            endpoints.push(run);
        }
        if kind == GuestKind::Aggregate {
            batches = merge(job, digest, batches).await?;
        }
        Ok(WasmRun {
            digest,
            kind,
            batches,
            endpoints,
        })
    }
}

impl CsdSession {
    /// The scan a module's rows come from (`SELECT columns FROM table WHERE filter`),
    /// planned here; it must push whole.
    async fn wasm_input(&self, job: &WasmJob) -> Result<Arc<dyn ExecutionPlan>> {
        let columns = if job.columns.is_empty() {
            "*".to_string()
        } else {
            job.columns
                .iter()
                .map(|c| quote(c))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let filter = job
            .filter
            .as_deref()
            .map(|f| format!(" WHERE {f}"))
            .unwrap_or_default();
        let sql = format!("SELECT {columns} FROM {}{filter}", quote(&job.table));
        let df = self.ctx.sql(&sql).await?;
        let plan = df.create_physical_plan().await?;
        only_scan(&plan).map_err(|left| {
            DataFusionError::Plan(format!(
                "the module's input ({sql}) does not push whole to the nodes (a {left} stays here): \
                 use only filters a node evaluates (see EXPLAIN), so the module sees exactly the rows the nodes return"
            ))
        })?;
        Ok(plan)
    }
}

/// What asking one copy's node gave.
enum Asked {
    /// It ran there: its answer, and what kind of guest it was.
    Ran(Vec<RecordBatch>, GuestKind),
    /// It did not run it (never [`Declined::Lost`]: a lost node fails the asking).
    Declined(Declined),
}

/// Runs the module over `endpoint`'s partition: at its node, or at the next copy's
/// when that node is lost (the answer is whole before it is used, so nothing is
/// passed on twice) or hands it back for its load; here when every copy asked
/// hands it back (as [`Copies`] decides).
async fn run_endpoint(
    job: &WasmJob,
    digest: ModuleDigest,
    endpoint: Endpoint,
    table: Arc<TableEndpoints>,
    opener: Option<crate::compute::scan::opener::EndpointOpener>,
) -> Result<(Vec<RecordBatch>, WasmEndpointRun, GuestKind)> {
    let label = |e: &Endpoint| format!("{}/{}", e.client.url(), e.partition);
    let mut run = WasmEndpointRun::default();
    let mut copies = Copies::new(endpoint.replicas.iter().cloned());
    let mut copy = endpoint.clone();
    // The copy whose objects the guest reads when it runs here.
    let reader = loop {
        run.endpoint = label(&copy);
        let at = opener.as_ref().map(|o| o.at_copy(&copy));
        let why = match ask_copy(job, digest, &copy, &table, at.as_ref(), &mut run).await {
            Ok(Asked::Ran(batches, kind)) => {
                run.failed_over = copies.tried().to_vec();
                return Ok((batches, run, kind));
            }
            Ok(Asked::Declined(why)) => why,
            Err(e) if crate::error::node_lost(&e) => Declined::Lost(e.to_string()),
            Err(e) => return Err(e),
        };
        match copies.declined(copy, run.endpoint.clone(), why) {
            Next::Ask(next) => copy = next,
            Next::Here(reader) => break reader,
            Next::NoneLeft => break endpoint.clone(),
        }
    };
    (run.failed_over, run.pushed_back) = copies.ended_here();
    run_here(job, digest, &reader, opener.as_ref(), run).await
}

/// Asks `copy`'s node to run the module (sending the module once if the node lacks
/// it), over the fragment `opener` plans there, or over no rows.
async fn ask_copy(
    job: &WasmJob,
    digest: ModuleDigest,
    copy: &Endpoint,
    table: &TableEndpoints,
    opener: Option<&crate::compute::scan::opener::EndpointOpener>,
    run: &mut WasmEndpointRun,
) -> Result<Asked> {
    let input = opener.map(|o| o.fragment.to_bytes()).unwrap_or_default();
    let mut request = WasmRequest {
        module_digest: digest.0.to_vec(),
        module: (job.module.len() <= MAX_INLINE_MODULE).then(|| job.module.to_vec()),
        input,
        args: job.args.clone(),
        table: if opener.is_none() {
            job.table.clone()
        } else {
            String::new()
        },
        partition: opener.is_none().then(|| copy.partition.clone()),
    };
    let compression = table.compression();
    let mut sent = false;
    let reply = loop {
        let r = copy
            .client
            .operator_with(
                OPERATOR_NAME,
                request.to_bytes(),
                compression,
                false,
                table.local_gate().load(),
            )
            .await;
        match r {
            Err(ClientError::ModuleMissing(d)) if !sent && d == digest => {
                copy.client
                    .put_module(&job.module)
                    .await
                    .map_err(to_datafusion)?;
                (sent, run.module_sent) = (true, true);
                request.module = None;
            }
            r => break r,
        }
    };
    match reply {
        Ok(reply) => {
            let batches: Vec<RecordBatch> =
                reply.batches.try_collect().await.map_err(to_datafusion)?;
            run.report = reply.stats.report();
            run.bytes_received += reply
                .stats
                .bytes_received
                .load(std::sync::atomic::Ordering::Relaxed);
            let kind = match run
                .report
                .as_ref()
                .and_then(|r| r.details::<WasmDetails>())
                .map(|d| d.wasm_kind)
            {
                Some(WasmKind::Aggregate) => GuestKind::Aggregate,
                _ => GuestKind::Rows,
            };
            Ok(Asked::Ran(batches, kind))
        }
        Err(e) => match Declined::of(&e) {
            Some(d) if d.handed_back_work() => Ok(Asked::Declined(d)),
            _ => Err(to_datafusion(e)),
        },
    }
}

/// Runs the module here over `endpoint`'s partition: the fragment `opener` plans,
/// evaluated here over byte-range reads, or no rows; the guest reads objects from
/// `endpoint`'s node.
async fn run_here(
    job: &WasmJob,
    digest: ModuleDigest,
    endpoint: &Endpoint,
    opener: Option<&crate::compute::scan::opener::EndpointOpener>,
    run: WasmEndpointRun,
) -> Result<(Vec<RecordBatch>, WasmEndpointRun, GuestKind)> {
    let scanned = match opener {
        Some(o) => o.evaluate_here(&o.fragment.to_bytes(), true).await?,
        None => Box::pin(
            datafusion::physical_plan::stream::RecordBatchStreamAdapter::new(
                Arc::new(arrow::datatypes::Schema::empty()),
                futures::stream::empty(),
            ),
        ),
    };
    let sandbox = local_sandbox()?;
    let module = sandbox
        .module(&digest, Some(&job.module))
        .await
        .map_err(external)?;
    let objects: Vec<String> = endpoint.objects.iter().map(|o| o.name.clone()).collect();
    let args = guest_args(
        &job.args,
        "map",
        &[
            ("csd.table", job.table.clone()),
            ("csd.objects", objects.join(",")),
        ],
    );
    let figures = Arc::new(GuestFigures::default());
    let out = run_guest(
        sandbox,
        module,
        args,
        Some(Arc::new(RangeReader {
            client: endpoint.client.clone(),
        })),
        scanned.map(|b| b.map_err(to_runtime)).boxed(),
        figures.clone(),
    );
    let batches: Vec<RecordBatch> = out.try_collect().await.map_err(external)?;
    Ok((batches, run, figures.kind()))
}

/// An aggregate's partial states merged by the module itself.
async fn merge(
    job: &WasmJob,
    digest: ModuleDigest,
    partials: Vec<RecordBatch>,
) -> Result<Vec<RecordBatch>> {
    let sandbox = local_sandbox()?;
    let module = sandbox
        .module(&digest, Some(&job.module))
        .await
        .map_err(external)?;
    let args = guest_args(&job.args, "merge", &[("csd.table", job.table.clone())]);
    let input = futures::stream::iter(partials.into_iter().map(Ok)).boxed();
    run_guest(
        sandbox,
        module,
        args,
        None,
        input,
        Arc::new(GuestFigures::default()),
    )
    .try_collect()
    .await
    .map_err(external)
}

#[cfg(test)]
mod digest_tests {
    use super::*;

    #[test]
    fn remembered_digests_are_the_digests() {
        let bytes: Vec<Vec<u8>> = (0..12u8).map(|i| vec![i; 1000 + usize::from(i)]).collect();
        for round in 0..2 {
            for b in &bytes {
                // A new copy each time, and the same allocation twice.
                let copy = Bytes::from(b.clone());
                assert_eq!(digest_of(&copy), ModuleDigest::of(b), "round {round}");
                assert_eq!(digest_of(&copy), ModuleDigest::of(b), "round {round}");
            }
        }
        let mut flipped = bytes[3].clone();
        flipped[500] ^= 1;
        assert_eq!(
            digest_of(&Bytes::from(flipped.clone())),
            ModuleDigest::of(&flipped)
        );
        assert_ne!(ModuleDigest::of(&flipped), ModuleDigest::of(&bytes[3]));
    }
}
