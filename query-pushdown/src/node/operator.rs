//! The `"sql"` operator's settings and state at a node, and the objects a fragment
//! reads.

use std::sync::{Arc, OnceLock};

use arrow::datatypes::SchemaRef;
use csd_protocol::{ByteSize, Error, Result};
use csd_runtime::memory::MemoryLedger;
use csd_runtime::operator::OperatorContext;
use csd_runtime::table::ParquetObject;
use datafusion::execution::memory_pool::{MemoryPool, TrackConsumersPool};
use serde::Deserialize;

use super::memory::LedgerPool;
use crate::eval::Parallelism;
use crate::wire::fragment::SqlFragment;
use crate::wire::functions::node_evaluates;

/// The `"sql"` operator's settings at a node: `[operators.sql]` in its settings
/// file, or `csd serve --set sql.KEY=VALUE`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SqlNodeOptions {
    /// Streams one fragment's scan is split into (see [`Parallelism`]).
    pub streams: usize,
    /// Objects smaller than this are not split.
    pub split_min_bytes: ByteSize,
    /// Rows of a direct scan's first batches its join-key filters are judged on
    /// before the node decides to run it or hand it back.
    pub judge_rows: usize,
    /// Rows of each stream of a partial aggregate the compute tier could not judge
    /// (no distinct-count sketches) over which the node counts its groups before it
    /// decides to aggregate or hand the fragment back (DataFusion's
    /// `skip_partial_aggregation_probe_rows_threshold`).
    pub shrink_probe_rows: usize,
    /// Functions this node will not run (e.g. `["regexp_like"]` on a drive with weak
    /// cores): a fragment calling one is refused as `UNIMPLEMENTED`, and the compute
    /// tier evaluates it itself, as it does a fragment handed back.
    pub refuse_functions: Vec<String>,
}

impl Default for SqlNodeOptions {
    fn default() -> Self {
        SqlNodeOptions {
            streams: Parallelism::NODE.streams,
            split_min_bytes: ByteSize(Parallelism::NODE.split_min_bytes),
            judge_rows: 8192,
            shrink_probe_rows: 100_000,
            refuse_functions: Vec::new(),
        }
    }
}

/// The `"sql"` operator.
#[derive(Default)]
pub struct SqlOperator {
    memory: OnceLock<Arc<dyn MemoryPool>>,
    pub(super) options: SqlNodeOptions,
}

impl SqlOperator {
    /// A new operator with the default settings (its memory pool draws on the node's
    /// memory ledger from first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// This operator with `options`.
    pub fn with_options(self, options: SqlNodeOptions) -> Self {
        SqlOperator { options, ..self }
    }

    /// This operator with fragments split into `parallel` streams.
    pub fn with_parallelism(self, parallel: Parallelism) -> Self {
        let options = SqlNodeOptions {
            streams: parallel.streams,
            split_min_bytes: ByteSize(parallel.split_min_bytes),
            ..self.options.clone()
        };
        self.with_options(options)
    }

    /// Whether this node runs the Substrait function `name`: one the node evaluates
    /// exactly ([`node_evaluates`]) that its settings do not refuse.
    pub(super) fn runs(&self, name: &str) -> bool {
        node_evaluates(name)
            && !self
                .options
                .refuse_functions
                .iter()
                .any(|r| r.eq_ignore_ascii_case(name))
    }

    pub(super) fn parallel(&self) -> Parallelism {
        Parallelism {
            streams: self.options.streams.max(1),
            split_min_bytes: self.options.split_min_bytes.bytes(),
        }
    }

    /// Bytes its memory pool holds now.
    pub(super) fn memory_reserved(&self) -> u64 {
        self.memory.get().map(|p| p.reserved() as u64).unwrap_or(0)
    }

    pub(super) fn pool(&self, ledger: &Arc<MemoryLedger>) -> Arc<dyn MemoryPool> {
        self.memory
            .get_or_init(|| {
                Arc::new(TrackConsumersPool::new(
                    LedgerPool::new(ledger.clone()),
                    std::num::NonZeroUsize::new(3).unwrap_or(std::num::NonZeroUsize::MIN),
                ))
            })
            .clone()
    }
}

/// The objects of `table` at this node: of the named `partitions` (each must be
/// there), or of all of them when none is named.
pub(super) fn objects_in(
    ctx: &OperatorContext,
    table: &str,
    partitions: &[&str],
) -> Result<(SchemaRef, Vec<ParquetObject>)> {
    let t = ctx.node.tables.table(table)?;
    let objects = t.objects_of(partitions)?;
    Ok((t.schema.clone(), objects))
}

/// The objects of `frag`'s table (its partition, its partitions, or all) at this
/// node.
pub(super) fn objects_of(
    ctx: &OperatorContext,
    frag: &SqlFragment,
) -> Result<(SchemaRef, Vec<ParquetObject>)> {
    let named: Vec<&str> = match &frag.partition {
        Some(p) => vec![p.as_str()],
        None => frag.partitions.iter().map(String::as_str).collect(),
    };
    let (schema, objects) = objects_in(ctx, &frag.table, &named)?;
    if !frag.objects.is_empty() {
        let mut have: Vec<&str> = objects.iter().map(|o| o.object.name.as_str()).collect();
        let mut want: Vec<&str> = frag.objects.iter().map(String::as_str).collect();
        have.sort_unstable();
        want.sort_unstable();
        if have != want {
            return Err(Error::FailedPrecondition(format!(
                "table {} changed since the query was planned ({} objects now, {} then); \
                 plan the query again",
                frag.table,
                have.len(),
                want.len()
            )));
        }
    }
    Ok((schema, objects))
}
