//! Join-key filters applied to a fragment's rows: on its output
//! ([`filter_stream`]), or under its partial aggregate when they filter plain group
//! columns ([`below_aggregate`], [`KeyFilterExec`]). The node runs these; so does the
//! compute tier for a fragment a node handed back. The filter itself and its wire
//! form are in [`crate::wire::keyfilter`].

use std::sync::Arc;

use arrow::compute::BatchCoalescer;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DataFusionError, Result as DfResult};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties, SendableRecordBatchStream,
};
use futures::StreamExt;

use crate::wire::keyfilter::{KeyFilter, KeyFilterError, mask_all};
/// Rows per batch of a filtered stream: DataFusion's default batch size.
pub(crate) const BATCH_ROWS: usize = 8192;

/// `input` without the rows `filters` rule out, the survivors gathered into batches
/// of up to [`BATCH_ROWS`] rows: a selective filter would otherwise pass on many
/// small batches, each costing an IPC message, a compression frame and a hash-join
/// probe of its own.
pub(crate) fn filter_stream(
    input: SendableRecordBatchStream,
    filters: Vec<KeyFilter>,
) -> SendableRecordBatchStream {
    if filters.is_empty() {
        return input;
    }
    let schema = input.schema();
    // Batches that keep at least half their rows go on as they are, uncopied.
    let coalescer = BatchCoalescer::new(schema.clone(), BATCH_ROWS)
        .with_biggest_coalesce_batch_size(Some(BATCH_ROWS / 2));
    // Of its kind (`error::status_code` finds the node error among the causes).
    let err = |e: KeyFilterError| DataFusionError::External(Box::new(csd_protocol::Error::from(e)));
    let state = (input, coalescer, filters, false);
    let out = futures::stream::unfold(
        state,
        move |(mut input, mut c, filters, mut ended)| async move {
            loop {
                if let Some(b) = c.next_completed_batch() {
                    return Some((Ok(b), (input, c, filters, ended)));
                }
                if ended {
                    return None;
                }
                let pushed = match input.next().await {
                    Some(Ok(b)) => mask_all(&filters, &b)
                        .map_err(err)
                        .and_then(|m| Ok(c.push_batch_with_filter(b, &m)?)),
                    Some(Err(e)) => Err(e),
                    None => {
                        ended = true;
                        c.finish_buffered_batch().map_err(DataFusionError::from)
                    }
                };
                if let Err(e) = pushed {
                    // The error ends the stream.
                    return Some((Err(e), (input, c, filters, true)));
                }
            }
        },
    );
    Box::pin(RecordBatchStreamAdapter::new(schema, out))
}

/// Applies every filter of `filters` to `batch`, batch by batch: what
/// [`filter_stream`] is checked against.
#[cfg(test)]
pub(crate) fn apply_all(
    filters: &[KeyFilter],
    batch: arrow::array::RecordBatch,
) -> Result<arrow::array::RecordBatch, KeyFilterError> {
    let mask = mask_all(filters, &batch)?;
    arrow::compute::filter_record_batch(&batch, &mask).map_err(KeyFilterError::Arrow)
}

/// Moves `filters` (over the output of `plan`, a planned fragment) below its
/// aggregate when they filter plain group columns: a group's rows all share its key,
/// so dropping rows before aggregating leaves exactly the groups the filters would
/// keep, with the same states, and the node aggregates only the rows that can
/// match (Q17 aggregates 1 in 100 `lineitem` rows). A filter follows its columns
/// down through projections that pass them on unchanged, partitioning and
/// coalescing, and a final aggregate to its partial one (whose group columns come
/// first, in the same order), so a whole aggregate (a `COMPLETE` fragment under a
/// projection) is filtered before it aggregates as a partial one is. Returns the
/// plan and the filters still to apply to its output.
pub(crate) fn below_aggregate(
    mut plan: Arc<dyn ExecutionPlan>,
    filters: Vec<KeyFilter>,
) -> DfResult<(Arc<dyn ExecutionPlan>, Vec<KeyFilter>)> {
    let mut rest = Vec::new();
    for f in filters {
        match place(&plan, &f.columns, &f)? {
            Some(p) => plan = p,
            None => rest.push(f),
        }
    }
    Ok((plan, rest))
}

/// `plan` with `filter` applied under its aggregate to the input columns that
/// `columns` (of `plan`'s output) come from; `None` where it cannot go there.
fn place(
    plan: &Arc<dyn ExecutionPlan>,
    columns: &[usize],
    filter: &KeyFilter,
) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
    let below = |child: &Arc<dyn ExecutionPlan>, columns: &[usize]| -> DfResult<_> {
        Ok(match place(child, columns, filter)? {
            Some(c) => Some(plan.clone().replace_children(vec![c], recompute())?),
            None => None,
        })
    };
    if let Some(p) = plan.downcast_ref::<ProjectionExec>() {
        return match plain(columns, |c| p.expr().get(c).map(|e| &e.expr)) {
            Some(inner) => below(p.input(), &inner),
            None => Ok(None),
        };
    }
    if plan.downcast_ref::<CoalescePartitionsExec>().is_some()
        || plan.downcast_ref::<RepartitionExec>().is_some()
    {
        let [child] = plan.children()[..] else {
            return Ok(None);
        };
        return below(child, columns);
    }
    let Some(agg) = plan.downcast_ref::<AggregateExec>() else {
        return Ok(None);
    };
    if !agg.group_expr().is_single() {
        return Ok(None);
    }
    match agg.mode() {
        // Merging states: the group columns of its input (partial states) are the
        // same columns, in the same order.
        AggregateMode::Final | AggregateMode::FinalPartitioned | AggregateMode::PartialReduce => {
            below(agg.input(), columns)
        }
        AggregateMode::Partial | AggregateMode::Single | AggregateMode::SinglePartitioned => {
            let groups = agg.group_expr().expr();
            let Some(inputs) = plain(columns, |c| groups.get(c).map(|(e, _)| e)) else {
                return Ok(None);
            };
            let filter = filter.on(inputs);
            // Filters under one aggregate share one node: one pass over each batch.
            let input = match agg.input().downcast_ref::<KeyFilterExec>() {
                Some(k) => {
                    let mut filters = k.filters.clone();
                    filters.push(filter);
                    KeyFilterExec::new(k.input.clone(), filters)
                }
                None => KeyFilterExec::new(agg.input().clone(), vec![filter]),
            };
            Ok(Some(
                plan.clone()
                    .replace_children(vec![Arc::new(input)], recompute())?,
            ))
        }
    }
}

/// The input columns `columns` are, where each is a plain column reference
/// (`expr_at(c)`: what computes output column `c`); `None` if any is computed.
fn plain<'a>(
    columns: &[usize],
    expr_at: impl Fn(usize) -> Option<&'a Arc<dyn PhysicalExpr>>,
) -> Option<Vec<usize>> {
    columns
        .iter()
        .map(|&c| expr_at(c)?.downcast_ref::<Column>().map(Column::index))
        .collect()
}

fn recompute() -> ReplaceChildrenOptions {
    ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute)
}

/// A plan node dropping the rows of its input that [`KeyFilter`]s rule out.
#[derive(Debug)]
pub(crate) struct KeyFilterExec {
    input: Arc<dyn ExecutionPlan>,
    filters: Vec<KeyFilter>,
    props: Arc<PlanProperties>,
}

impl KeyFilterExec {
    /// `input` filtered by `filters` (over `input`'s columns).
    pub(crate) fn new(input: Arc<dyn ExecutionPlan>, filters: Vec<KeyFilter>) -> Self {
        let props = input.properties().clone();
        KeyFilterExec {
            input,
            filters,
            props,
        }
    }
}

impl DisplayAs for KeyFilterExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let columns: Vec<String> = self
            .filters
            .iter()
            .map(|k| format!("{:?}", k.columns))
            .collect();
        write!(f, "KeyFilterExec: columns={}", columns.join(","))
    }
}

impl ExecutionPlan for KeyFilterExec {
    fn name(&self) -> &str {
        "KeyFilterExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.props
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _: ReplaceChildrenOptions,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let [input] = &children[..] else {
            return Err(DataFusionError::Internal(
                "KeyFilterExec takes one input".into(),
            ));
        };
        Ok(Arc::new(KeyFilterExec::new(
            input.clone(),
            self.filters.clone(),
        )))
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        self.replace_children(children, recompute())
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        Ok(filter_stream(input, self.filters.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::keyfilter::{Bloom, hash_rows};
    use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray};

    fn h(cols: &[ArrayRef]) -> Vec<u64> {
        hash_rows(cols, cols[0].len()).unwrap().0
    }

    #[test]
    fn filtered_streams_gather_survivors_into_full_batches() {
        // Keys 0, 10, 20, ... pass: a tenth of each 1,000-row batch (plus the
        // filter's rare false positives, the same either way).
        let keys: ArrayRef = Arc::new(Int64Array::from(
            (0..20_000).map(|i| i * 10).collect::<Vec<i64>>(),
        ));
        let f = KeyFilter::new(vec![0], Bloom::with_keys(&h(&[keys])).unwrap());
        let batches: Vec<RecordBatch> = (0..200)
            .map(|b| {
                let k: ArrayRef = Arc::new(Int64Array::from(
                    (0..1_000).map(|i| b * 1_000 + i).collect::<Vec<i64>>(),
                ));
                let v: ArrayRef = Arc::new(StringArray::from(
                    (0..1_000)
                        .map(|i| format!("row {}", b * 1_000 + i))
                        .collect::<Vec<_>>(),
                ));
                RecordBatch::try_from_iter([("k", k), ("v", v)]).unwrap()
            })
            .collect();
        let expected: Vec<RecordBatch> = batches
            .iter()
            .map(|b| apply_all(std::slice::from_ref(&f), b.clone()).unwrap())
            .collect();
        let schema = batches[0].schema();
        let input = RecordBatchStreamAdapter::new(
            schema.clone(),
            futures::stream::iter(batches.into_iter().map(Ok)),
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let out: Vec<RecordBatch> = rt.block_on(
            filter_stream(Box::pin(input), vec![f])
                .map(|b| b.unwrap())
                .collect(),
        );
        let rows: usize = expected.iter().map(|b| b.num_rows()).sum();
        assert!(rows >= 20_000, "{rows}");
        // Same rows in the same order, in full batches but the last.
        let concat = |b: &[RecordBatch]| arrow::compute::concat_batches(&schema, b).unwrap();
        assert_eq!(concat(&out), concat(&expected));
        assert_eq!(
            out.len(),
            rows.div_ceil(BATCH_ROWS),
            "{} batches",
            out.len()
        );
        assert!(
            out[..out.len() - 1]
                .iter()
                .all(|b| b.num_rows() == BATCH_ROWS)
        );
    }
}
