//! The node side of shipped code: the `"wasm"` operator runs a tenant's module over
//! the rows of a pushed scan, or over none (see [`crate::wire::wasm`]).

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use csd_protocol::{ModuleDigest, Result};
use csd_runtime::operator::{
    CostKey, Estimate, Operator, OperatorContext, OperatorRequest, OperatorStream,
};
use csd_runtime::sandbox::{GuestKind, GuestReader, NodeObjectReader};
use futures::StreamExt;

use super::operator::{SqlOperator, objects_in, objects_of};
use super::sql::SqlRequest;
use crate::eval::wasm::{GuestFigures, guest_args, peek_schema, run_guest, run_guest_here};
use crate::wire::details::{WasmDetails, WasmKind};
use crate::wire::wasm::{OPERATOR_NAME, WasmInput, WasmRequest};

/// The `"wasm"` operator: its input scans run by the node's `"sql"` operator.
pub struct WasmOperator {
    sql: Arc<SqlOperator>,
}

impl WasmOperator {
    /// Runs its input scans with `sql` (the node's SQL settings).
    pub fn new(sql: Arc<SqlOperator>) -> Self {
        WasmOperator { sql }
    }
}

impl Operator for WasmOperator {
    fn name(&self) -> &'static str {
        OPERATOR_NAME
    }

    fn parse(self: Arc<Self>, args: Bytes) -> Result<Box<dyn OperatorRequest>> {
        let (request, digest, input) = WasmRequest::decode_checked(&args)?;
        let WasmInput {
            table,
            partition,
            scan,
        } = input;
        let scan = scan.map(|checked| SqlRequest::of(self.sql.clone(), checked));
        Ok(Box::new(WasmCall {
            request,
            digest,
            table,
            partition,
            scan,
        }))
    }
}

/// A `"wasm"` request, decoded and checked once: the module, its arguments, and
/// its input (a parsed SQL request whose rows it receives, or a table it reads by
/// itself).
struct WasmCall {
    request: WasmRequest,
    digest: ModuleDigest,
    table: String,
    partition: Option<String>,
    scan: Option<SqlRequest>,
}

#[async_trait]
impl OperatorRequest for WasmCall {
    fn tables(&self) -> Vec<String> {
        vec![self.table.clone()]
    }

    fn ships_code(&self) -> bool {
        true
    }

    fn cost_key(&self) -> Option<CostKey> {
        Some(CostKey::Module {
            operator: OPERATOR_NAME.to_string(),
            module: self.digest,
        })
    }

    /// The input scan's estimate, plus the memory an instance may grow to.
    async fn estimate(&self, ctx: &OperatorContext) -> Result<Estimate> {
        let scan = match &self.scan {
            Some(scan) => scan.estimate(ctx).await?,
            None => Estimate {
                bytes: 0,
                memory: 0,
                shape: None,
            },
        };
        Ok(Estimate {
            bytes: scan.bytes,
            memory: scan.memory + ctx.node.sandbox.limits().memory,
            shape: None,
        })
    }

    async fn open(self: Box<Self>, ctx: OperatorContext) -> Result<OperatorStream> {
        let WasmCall {
            request,
            digest,
            table,
            partition,
            scan,
        } = *self;
        let sandbox = ctx.node.sandbox.clone();
        let module = sandbox.module(&digest, request.module.as_deref()).await?;
        let (_, objects) = match &scan {
            Some(s) => objects_of(&ctx, s.fragment())?,
            None => objects_in(&ctx, &table, partition.as_deref().as_slice())?,
        };
        let objects: Vec<String> = objects.iter().map(|o| o.object.name.clone()).collect();
        let has_rows = scan.is_some();
        let rows = match scan {
            Some(s) => Box::new(s).open(ctx.clone()).await?.batches,
            None => futures::stream::empty().boxed(),
        };
        let reader: Arc<dyn GuestReader> = Arc::new(NodeObjectReader {
            store: ctx.node.tables.object_store().clone(),
            principal: ctx.principal.clone(),
            bytes_read: ctx.metrics.bytes_read.clone(),
        });
        let figures = Arc::new(GuestFigures::default());
        let args = guest_args(
            &request.args,
            "map",
            &[("csd.table", table), ("csd.objects", objects.join(","))],
        );
        // A guest without input rows (a traversal) runs to its end right here.
        let here = match has_rows {
            true => None,
            false => run_guest_here(
                &sandbox,
                &module,
                &args,
                Some(reader.clone()),
                ctx.cancelled.clone(),
                &figures,
            ),
        };
        let (schema, batches) = match here {
            Some(outputs) => {
                let outputs = outputs?;
                let schema = outputs
                    .first()
                    .map(|b| b.schema())
                    .unwrap_or_else(|| Arc::new(arrow::datatypes::Schema::empty()));
                (
                    schema,
                    futures::stream::iter(outputs.into_iter().map(Ok)).boxed(),
                )
            }
            None => {
                let out = run_guest(sandbox, module, args, Some(reader), rows, figures.clone());
                peek_schema(out).await?
            }
        };
        let metrics = ctx.metrics.clone();
        let done = futures::stream::once(async move {
            metrics.set_details(&WasmDetails {
                wasm_kind: match figures.kind() {
                    GuestKind::Rows => WasmKind::Rows,
                    GuestKind::Aggregate => WasmKind::Aggregate,
                },
                wasm_cpu_ms: figures.cpu_ms(),
            });
            None
        })
        .filter_map(futures::future::ready);
        Ok(OperatorStream {
            schema,
            batches: batches.chain(done).boxed(),
        })
    }
}
