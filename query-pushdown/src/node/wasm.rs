//! The node side of shipped code: the `"wasm"` operator runs a tenant's module over
//! the rows of a pushed scan (see [`crate::wire::wasm`]).

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use csd_runtime::Result;
use csd_runtime::operator::{Estimate, Operator, OperatorContext, OperatorStream};
use csd_runtime::sandbox::{GuestKind, GuestReader, NodeObjectReader};
use futures::StreamExt;

use super::{SqlOperator, objects_in, objects_of};
use crate::eval::wasm::{GuestFigures, guest_args, peek_schema, run_guest, run_guest_here};
use crate::wire::wasm::{OPERATOR_NAME, WasmRequest};

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

#[async_trait]
impl Operator for WasmOperator {
    fn name(&self) -> &'static str {
        OPERATOR_NAME
    }

    fn tables(&self, args: &Bytes) -> Result<Vec<String>> {
        let (_, _, input) = WasmRequest::decode_checked(args)?;
        Ok(vec![input.table])
    }

    fn ships_code(&self, _args: &Bytes) -> bool {
        true
    }

    fn cost_key(&self, args: &Bytes) -> Option<String> {
        let (_, digest, _) = WasmRequest::decode_checked(args).ok()?;
        Some(format!("wasm:{}", digest.short()))
    }

    /// The input scan's estimate, plus the memory an instance may grow to.
    async fn estimate(&self, ctx: &OperatorContext, args: &Bytes) -> Result<Estimate> {
        let (r, _, input) = WasmRequest::decode_checked(args)?;
        let scan = match input.scan {
            Some(_) => self.sql.estimate(ctx, &Bytes::from(r.input)).await?,
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

    async fn open(&self, ctx: OperatorContext, args: Bytes) -> Result<OperatorStream> {
        let (r, digest, input) = WasmRequest::decode_checked(&args)?;
        let sandbox = ctx.node.sandbox.clone();
        let module = sandbox.module(&digest, r.module.as_deref()).await?;
        let (_, objects) = match &input.scan {
            Some(frag) => objects_of(&ctx, frag)?,
            None => objects_in(&ctx, &input.table, input.partition.as_deref())?,
        };
        let objects: Vec<String> = objects.iter().map(|o| o.object.name.clone()).collect();
        let rows = match input.scan {
            Some(_) => {
                self.sql
                    .open(ctx.clone(), Bytes::from(r.input))
                    .await?
                    .batches
            }
            None => futures::stream::empty().boxed(),
        };
        let reader = Arc::new(NodeObjectReader {
            store: ctx.node.tables.object_store().clone(),
            principal: ctx.principal.clone(),
            bytes_read: ctx.metrics.bytes_read.clone(),
        });
        let figures = Arc::new(GuestFigures::default());
        let args = guest_args(
            &r.args,
            "map",
            &[
                ("csd.table", input.table.clone()),
                ("csd.objects", objects.join(",")),
            ],
        );
        let reader: Arc<dyn GuestReader> = reader;
        // A guest without input rows (a traversal) runs to its end right here.
        let here = match input.scan {
            Some(_) => None,
            None => run_guest_here(
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
            let kind = match figures.kind() {
                GuestKind::Rows => "rows",
                GuestKind::Aggregate => "aggregate",
            };
            metrics.set_detail("wasm_kind", kind);
            metrics.set_detail("wasm_cpu_ms", format!("{:.3}", figures.cpu_ms()));
            None
        })
        .filter_map(futures::future::ready);
        Ok(OperatorStream {
            schema,
            batches: batches.chain(done).boxed(),
        })
    }
}
