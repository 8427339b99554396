//! Running aggregates over a window computed a batch at a time.
//!
//! `sum`, `count`, `min` and `max OVER (PARTITION BY p ORDER BY o ROWS BETWEEN
//! UNBOUNDED PRECEDING AND CURRENT ROW)` (and the `RANGE` frame that is the default
//! with an `ORDER BY`, whose peers share the value at their last row) is one pass over
//! rows already sorted by `(p, o)`: a total carried from row to row, reset where `p`
//! changes. DataFusion's `BoundedWindowAggExec` computes it row by row through an
//! accumulator and a `ScalarValue` per row. [`RunningWindowExec`] replaces it for
//! these functions over integer (and, for `ROWS` frames, floating-point) arguments
//! with a loop over the column, and gives the same values: sums wrap as DataFusion's
//! do, NULLs are skipped, and a total is NULL until its partition's first non-NULL
//! value. Every other window stays DataFusion's. [`RunningWindow`] is the physical
//! rule that places it.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Int64Array, PrimitiveArray, RecordBatch};
use arrow::compute::cast;
use arrow::compute::kernels::partition::partition;
use arrow::datatypes::{ArrowPrimitiveType, DataType, Float64Type, Int64Type, UInt64Type};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{DataFusionError, Result, ScalarValue};
use datafusion::execution::TaskContext;
use datafusion::logical_expr::{WindowFrameBound, WindowFrameUnits};
use datafusion::physical_expr::window::{PlainAggregateWindowExpr, WindowExpr};
use datafusion::physical_expr::{OrderingRequirements, PhysicalExpr};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::execution_plan::{ChildrenPropertiesMode, ReplaceChildrenOptions};
use datafusion::physical_plan::metrics::{BaselineMetrics, ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::windows::BoundedWindowAggExec;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, InputOrderMode, PlanProperties,
    SendableRecordBatchStream, apply_expression_roots,
};
use futures::StreamExt;

/// Physical rule: a [`RunningWindowExec`] for every sorted window whose functions
/// are all running aggregates it computes.
#[derive(Debug, Default)]
pub(crate) struct RunningWindow;

impl PhysicalOptimizerRule for RunningWindow {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|p| {
            let Some(window) = p.downcast_ref::<BoundedWindowAggExec>() else {
                return Ok(Transformed::no(p));
            };
            Ok(match RunningWindowExec::try_new(window, p.clone())? {
                Some(exec) => Transformed::yes(Arc::new(exec) as Arc<dyn ExecutionPlan>),
                None => Transformed::no(p),
            })
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "RunningWindow"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// What one window function computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Sum,
    Count,
    Min,
    Max,
}

/// The native type a function runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Native {
    I64,
    U64,
    F64,
}

/// One window function: its kind, its argument, the type it runs in and the type
/// DataFusion planned for its column.
#[derive(Debug, Clone)]
struct Running {
    kind: Kind,
    arg: Arc<dyn PhysicalExpr>,
    native: Native,
    out: DataType,
    display: String,
}

impl Running {
    /// `w` as a running aggregate, if it is one this operator computes with the
    /// frame units `units`.
    fn of(w: &Arc<dyn WindowExpr>, input: &arrow::datatypes::Schema) -> Result<Option<Self>> {
        let Some(plain) = w.as_any().downcast_ref::<PlainAggregateWindowExpr>() else {
            return Ok(None);
        };
        let agg = plain.get_aggregate_expr();
        // DataFusion 55 keeps a `FILTER (WHERE …)` where nothing public reads it
        // (`AggregateWindowExpr` is private); its `Debug` shows it. Anything but a
        // plain `filter: None` keeps DataFusion's window.
        let unfiltered = format!("{plain:?}").contains("filter: None");
        if agg.is_distinct() || !agg.order_bys().is_empty() || !unfiltered {
            return Ok(None);
        }
        let [arg] = &agg.expressions()[..] else {
            return Ok(None);
        };
        let kind = match agg.fun().name() {
            "sum" => Kind::Sum,
            "count" => Kind::Count,
            "min" => Kind::Min,
            "max" => Kind::Max,
            _ => return Ok(None),
        };
        let out = agg.field().data_type().clone();
        let arg_type = arg.data_type(input)?;
        let signed = matches!(
            arg_type,
            DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64
        );
        let unsigned = matches!(
            arg_type,
            DataType::UInt8 | DataType::UInt16 | DataType::UInt32 | DataType::UInt64
        );
        let float = matches!(arg_type, DataType::Float32 | DataType::Float64);
        let native = match (kind, &out) {
            (Kind::Count, DataType::Int64) => Native::I64,
            (Kind::Sum, DataType::Int64) if signed => Native::I64,
            (Kind::Sum, DataType::UInt64) if unsigned => Native::U64,
            (Kind::Sum, DataType::Float64) if float => Native::F64,
            (Kind::Min | Kind::Max, t) if signed && *t == arg_type => Native::I64,
            _ => return Ok(None),
        };
        Ok(Some(Running {
            kind,
            arg: arg.clone(),
            native,
            out,
            display: w.name().to_string(),
        }))
    }
}

impl Running {
    /// The total of no rows: NULL, or 0 for a count.
    fn empty(&self) -> Result<ScalarValue> {
        Ok(match self.kind {
            Kind::Count => ScalarValue::Int64(Some(0)),
            _ => ScalarValue::try_from(&native_type(self.native))?,
        })
    }
}

/// The frame: `ROWS` (every row its own value) or `RANGE` (peers, rows equal in the
/// order keys, share the value at the last of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frame {
    Rows,
    Range,
}

/// Running aggregates over input sorted by their partition and order keys (see the
/// module docs). It keeps the replaced `BoundedWindowAggExec` for its schema,
/// properties and what it requires of its input.
#[derive(Debug)]
pub(crate) struct RunningWindowExec {
    window: Arc<dyn ExecutionPlan>,
    input: Arc<dyn ExecutionPlan>,
    partition_by: Vec<Arc<dyn PhysicalExpr>>,
    order_by: Vec<Arc<dyn PhysicalExpr>>,
    frame: Frame,
    functions: Vec<Running>,
    metrics: ExecutionPlanMetricsSet,
}

impl RunningWindowExec {
    /// `window` (whose plan node is `plan`) as a running window, if every function of
    /// it is a running aggregate this operator computes over sorted input.
    fn try_new(
        window: &BoundedWindowAggExec,
        plan: Arc<dyn ExecutionPlan>,
    ) -> Result<Option<Self>> {
        if window.input_order_mode != InputOrderMode::Sorted {
            return Ok(None);
        }
        let exprs = window.window_expr();
        let Some(first) = exprs.first() else {
            return Ok(None);
        };
        let frame = first.get_window_frame();
        let units = match frame.units {
            WindowFrameUnits::Rows => Frame::Rows,
            WindowFrameUnits::Range if !first.order_by().is_empty() => Frame::Range,
            _ => return Ok(None),
        };
        let running_frame = matches!(frame.start_bound, WindowFrameBound::Preceding(ref v) if v.is_null())
            && frame.end_bound == WindowFrameBound::CurrentRow;
        if !running_frame {
            return Ok(None);
        }
        let input_schema = window.input().schema();
        let mut functions = Vec::with_capacity(exprs.len());
        for w in exprs {
            let same = w.get_window_frame() == frame
                && w.partition_by().len() == first.partition_by().len()
                && w.partition_by()
                    .iter()
                    .zip(first.partition_by())
                    .all(|(a, b)| a.eq(b))
                && w.order_by() == first.order_by();
            let Some(f) = Running::of(w, &input_schema)?.filter(|_| same) else {
                return Ok(None);
            };
            // Floating-point sums over peers would add in another order than
            // DataFusion's (a slice at a time): only row by row.
            if units == Frame::Range && f.native == Native::F64 {
                return Ok(None);
            }
            functions.push(f);
        }
        Ok(Some(RunningWindowExec {
            window: plan,
            input: window.input().clone(),
            partition_by: first.partition_by().to_vec(),
            order_by: first.order_by().iter().map(|s| s.expr.clone()).collect(),
            frame: units,
            functions,
            metrics: ExecutionPlanMetricsSet::new(),
        }))
    }
}

impl DisplayAs for RunningWindowExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let names: Vec<&str> = self.functions.iter().map(|f| f.display.as_str()).collect();
        write!(
            f,
            "RunningWindowExec: frame={}, wdw=[{}]",
            match self.frame {
                Frame::Rows => "rows",
                Frame::Range => "range",
            },
            names.join(", ")
        )
    }
}

impl ExecutionPlan for RunningWindowExec {
    fn name(&self) -> &str {
        "RunningWindowExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.window.properties()
    }

    fn input_distribution_requirements(
        &self,
    ) -> datafusion::physical_plan::InputDistributionRequirements {
        self.window.input_distribution_requirements()
    }

    fn required_input_ordering(&self) -> Vec<Option<OrderingRequirements>> {
        self.window.required_input_ordering()
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        self.window.benefits_from_input_partitioning()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        apply_expression_roots(
            self.functions
                .iter()
                .map(|r| &r.arg)
                .chain(&self.partition_by)
                .chain(&self.order_by),
            f,
        )
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let window = self.window.clone().replace_children(children, options)?;
        let bounded = window
            .downcast_ref::<BoundedWindowAggExec>()
            .ok_or_else(|| DataFusionError::Internal("RunningWindowExec lost its window".into()))?;
        match RunningWindowExec::try_new(bounded, window.clone())? {
            Some(exec) => Ok(Arc::new(exec)),
            None => Ok(window),
        }
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let input = self.input.execute(partition, context)?;
        let schema = self.window.schema();
        let state = Totals {
            exec: Arc::new(Shape {
                partition_by: self.partition_by.clone(),
                order_by: self.order_by.clone(),
                frame: self.frame,
                functions: self.functions.clone(),
                schema: schema.clone(),
            }),
            accs: self
                .functions
                .iter()
                .map(Running::empty)
                .collect::<Result<_>>()?,
            last_partition: None,
            last_peer: None,
            held: Vec::new(),
            metrics: BaselineMetrics::new(&self.metrics, partition),
        };
        let stream = futures::stream::unfold(
            (input, state, std::collections::VecDeque::new(), false),
            |(mut input, mut state, mut out, mut ended)| async move {
                loop {
                    if let Some(b) = out.pop_front() {
                        return Some((Ok(b), (input, state, out, ended)));
                    }
                    if ended {
                        return None;
                    }
                    let step = match input.next().await {
                        Some(Ok(batch)) => state.push(&batch),
                        Some(Err(e)) => Err(e),
                        None => {
                            ended = true;
                            state.finish()
                        }
                    };
                    match step {
                        Ok(batches) => out.extend(batches),
                        Err(e) => {
                            ended = true;
                            return Some((Err(e), (input, state, out, ended)));
                        }
                    }
                }
            },
        );
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, stream)))
    }
}

/// What a stream needs of its plan node.
struct Shape {
    partition_by: Vec<Arc<dyn PhysicalExpr>>,
    order_by: Vec<Arc<dyn PhysicalExpr>>,
    frame: Frame,
    functions: Vec<Running>,
    schema: arrow::datatypes::SchemaRef,
}

/// One stream's totals, carried from batch to batch.
struct Totals {
    exec: Arc<Shape>,
    /// Each function's total so far in the current partition, in its native type
    /// (NULL: nothing summed yet; a count starts at 0).
    accs: Vec<ScalarValue>,
    /// The partition keys of the last row read.
    last_partition: Option<Vec<ScalarValue>>,
    /// The order keys of the last row read (`RANGE` frames).
    last_peer: Option<Vec<ScalarValue>>,
    /// `RANGE`: rows of the last peer group read, whose value waits for its end.
    held: Vec<RecordBatch>,
    metrics: BaselineMetrics,
}

fn keys_at(columns: &[ArrayRef], row: usize) -> Result<Vec<ScalarValue>> {
    columns
        .iter()
        .map(|c| ScalarValue::try_from_array(c, row))
        .collect()
}

fn evaluate(exprs: &[Arc<dyn PhysicalExpr>], batch: &RecordBatch) -> Result<Vec<ArrayRef>> {
    exprs
        .iter()
        .map(|e| e.evaluate(batch)?.into_array(batch.num_rows()))
        .collect()
}

impl Totals {
    /// The output for `batch`: every row whose value is known.
    fn push(&mut self, batch: &RecordBatch) -> Result<Vec<RecordBatch>> {
        let elapsed = self.metrics.elapsed_compute().clone();
        let timer = elapsed.timer();
        let n = batch.num_rows();
        if n == 0 {
            return Ok(Vec::new());
        }
        let shape = self.exec.clone();
        let parts = evaluate(&shape.partition_by, batch)?;
        let continues = match &self.last_partition {
            Some(last) => *last == keys_at(&parts, 0)?,
            None => false,
        };
        let partitions = partition_ranges(&parts, n)?;
        // The runs of rows that share a value: each partition's rows one by one
        // (`ROWS`), or its peer groups (`RANGE`).
        let (segments, peer_cols) = match shape.frame {
            Frame::Rows => (partitions.clone(), Vec::new()),
            Frame::Range => {
                let orders = evaluate(&shape.order_by, batch)?;
                let mut all = parts.clone();
                all.extend(orders.iter().cloned());
                (partition(&all)?.ranges(), orders)
            }
        };
        let resets = segment_resets(&partitions, &segments, continues);
        let first_peer_continues = shape.frame == Frame::Range
            && continues
            && self.last_peer.as_ref() == Some(&keys_at(&peer_cols, 0)?);
        let mut out = Vec::new();
        if !first_peer_continues {
            out.extend(self.flush_held()?);
        }
        let inputs = shape
            .functions
            .iter()
            .map(|f| f.arg.evaluate(batch)?.into_array(n))
            .collect::<Result<Vec<_>>>()?;
        let mut columns = Vec::with_capacity(shape.functions.len());
        let mut after_first = Vec::with_capacity(shape.functions.len());
        for (i, f) in shape.functions.iter().enumerate() {
            let (col, first) = run(
                f,
                &inputs[i],
                &segments,
                &resets,
                shape.frame,
                &mut self.accs[i],
            )?;
            columns.push(col);
            after_first.push(first);
        }
        self.last_partition = Some(keys_at(&parts, n - 1)?);
        if shape.frame == Frame::Range {
            self.last_peer = Some(keys_at(&peer_cols, n - 1)?);
        }
        // `RANGE`: the held group ends inside this batch when its continuation is
        // not the batch's last segment.
        let last = segments.last().map_or(0..n, |s| s.clone());
        if first_peer_continues && segments.len() > 1 {
            let values = after_first;
            for held in std::mem::take(&mut self.held) {
                out.push(with_constants(&shape, &held, &values)?);
            }
        }
        let emit_to = match shape.frame {
            Frame::Rows => n,
            Frame::Range => last.start,
        };
        if emit_to > 0 {
            let mut cols = batch.slice(0, emit_to).columns().to_vec();
            cols.extend(columns.iter().map(|c| c.slice(0, emit_to)));
            out.push(RecordBatch::try_new(shape.schema.clone(), cols)?);
        }
        if emit_to < n {
            self.held.push(batch.slice(emit_to, n - emit_to));
        }
        timer.done();
        let rows: usize = out.iter().map(|b| b.num_rows()).sum();
        self.metrics.record_output(rows);
        Ok(out)
    }

    /// The rows still held at the end of the input.
    fn finish(&mut self) -> Result<Vec<RecordBatch>> {
        let out = self.flush_held()?;
        let rows: usize = out.iter().map(|b| b.num_rows()).sum();
        self.metrics.record_output(rows);
        Ok(out)
    }

    /// The held peer group, valued at the totals so far (its end).
    fn flush_held(&mut self) -> Result<Vec<RecordBatch>> {
        let values = self.accs.clone();
        std::mem::take(&mut self.held)
            .iter()
            .map(|b| with_constants(&self.exec, b, &values))
            .collect()
    }
}

/// `batch` with every function's column the one value of `values`.
fn with_constants(
    shape: &Shape,
    batch: &RecordBatch,
    values: &[ScalarValue],
) -> Result<RecordBatch> {
    let n = batch.num_rows();
    let mut cols = batch.columns().to_vec();
    for (f, v) in shape.functions.iter().zip(values) {
        cols.push(v.cast_to(&f.out)?.to_array_of_size(n)?);
    }
    Ok(RecordBatch::try_new(shape.schema.clone(), cols)?)
}

fn native_type(n: Native) -> DataType {
    match n {
        Native::I64 => DataType::Int64,
        Native::U64 => DataType::UInt64,
        Native::F64 => DataType::Float64,
    }
}

/// The batch's runs of rows with equal partition keys (one run without keys).
fn partition_ranges(parts: &[ArrayRef], n: usize) -> Result<Vec<Range<usize>>> {
    if parts.is_empty() {
        return Ok(std::iter::once(0..n).collect());
    }
    Ok(partition(parts)?.ranges())
}

/// For each segment (each within one partition run), whether it starts a partition:
/// its run's first, unless that is the batch's first and continues the last batch's.
fn segment_resets(
    partitions: &[Range<usize>],
    segments: &[Range<usize>],
    continues: bool,
) -> Vec<bool> {
    let mut next = partitions.iter().map(|r| r.start).peekable();
    segments
        .iter()
        .map(|s| {
            while next.peek().is_some_and(|&st| st < s.start) {
                next.next();
            }
            let starts_partition = next.peek() == Some(&s.start);
            starts_partition && !(s.start == 0 && continues)
        })
        .collect()
}

/// One function over one batch: its column and its total after the first segment.
fn run(
    f: &Running,
    input: &ArrayRef,
    segments: &[Range<usize>],
    resets: &[bool],
    frame: Frame,
    acc: &mut ScalarValue,
) -> Result<(ArrayRef, ScalarValue)> {
    let per_row = frame == Frame::Rows;
    let (col, first) = match (f.kind, f.native) {
        (Kind::Count, _) => {
            let ScalarValue::Int64(Some(mut count)) = *acc else {
                return Err(DataFusionError::Internal(format!(
                    "RunningWindowExec: a count's total is {acc:?}"
                )));
            };
            let (col, first) = count_loop(input.as_ref(), segments, resets, per_row, &mut count);
            *acc = ScalarValue::Int64(Some(count));
            (Arc::new(col) as ArrayRef, ScalarValue::Int64(first))
        }
        (Kind::Sum, Native::I64) => {
            fold_as::<Int64Type>(input, segments, resets, per_row, acc, i64::wrapping_add)?
        }
        (Kind::Min, _) => fold_as::<Int64Type>(input, segments, resets, per_row, acc, i64::min)?,
        (Kind::Max, _) => fold_as::<Int64Type>(input, segments, resets, per_row, acc, i64::max)?,
        (Kind::Sum, Native::U64) => {
            fold_as::<UInt64Type>(input, segments, resets, per_row, acc, u64::wrapping_add)?
        }
        (Kind::Sum, Native::F64) => {
            fold_as::<Float64Type>(input, segments, resets, per_row, acc, |a, b| a + b)?
        }
    };
    let col = if col.data_type() == &f.out {
        col
    } else {
        cast(&col, &f.out)?
    };
    Ok((col, first))
}

/// [`fold_loop`] over `input` cast to `T`, the total carried in `acc` (a `T`
/// scalar): the column and the total after the first segment.
fn fold_as<T: ArrowPrimitiveType>(
    input: &ArrayRef,
    segments: &[Range<usize>],
    resets: &[bool],
    per_row: bool,
    acc: &mut ScalarValue,
    op: impl Fn(T::Native, T::Native) -> T::Native,
) -> Result<(ArrayRef, ScalarValue)> {
    let carried = acc.to_array()?;
    let carried = carried.as_primitive::<T>();
    let mut state = carried.is_valid(0).then(|| carried.value(0));
    let arr = cast(input, &T::DATA_TYPE)?;
    let (col, first) = fold_loop(
        arr.as_primitive::<T>(),
        segments,
        resets,
        per_row,
        &mut state,
        op,
    );
    *acc = ScalarValue::new_primitive::<T>(state, &T::DATA_TYPE)?;
    let first = ScalarValue::new_primitive::<T>(first, &T::DATA_TYPE)?;
    Ok((Arc::new(col), first))
}

/// A running fold of `values` over `segments` (reset where `resets` says), NULLs
/// skipped; each row takes the total after itself (`per_row`) or after its segment.
/// Returns the column and the total after the first segment.
fn fold_loop<T: ArrowPrimitiveType>(
    values: &PrimitiveArray<T>,
    segments: &[Range<usize>],
    resets: &[bool],
    per_row: bool,
    state: &mut Option<T::Native>,
    op: impl Fn(T::Native, T::Native) -> T::Native,
) -> (PrimitiveArray<T>, Option<T::Native>) {
    let n = values.len();
    let raw = values.values();
    let mut out = vec![T::Native::default(); n];
    let mut valid = vec![false; n];
    let mut first = None;
    let step = |state: &mut Option<T::Native>, i: usize| {
        if values.is_valid(i) {
            *state = Some(match *state {
                Some(s) => op(s, raw[i]),
                None => raw[i],
            });
        }
    };
    for (k, seg) in segments.iter().enumerate() {
        if resets[k] {
            *state = None;
        }
        for i in seg.clone() {
            step(state, i);
            if per_row && let Some(s) = *state {
                out[i] = s;
                valid[i] = true;
            }
        }
        if !per_row && let Some(s) = *state {
            out[seg.clone()].fill(s);
            valid[seg.clone()].fill(true);
        }
        if k == 0 {
            first = *state;
        }
    }
    let nulls = valid
        .iter()
        .all(|v| *v)
        .then_some(())
        .map_or_else(|| Some(arrow::buffer::NullBuffer::from(valid)), |_| None);
    (PrimitiveArray::<T>::new(out.into(), nulls), first)
}

/// A running count of `values`' non-NULL rows (see [`fold_loop`]).
fn count_loop(
    values: &dyn Array,
    segments: &[Range<usize>],
    resets: &[bool],
    per_row: bool,
    count: &mut i64,
) -> (Int64Array, Option<i64>) {
    let n = values.len();
    let mut out = vec![0i64; n];
    let mut first = None;
    for (k, seg) in segments.iter().enumerate() {
        if resets[k] {
            *count = 0;
        }
        for i in seg.clone() {
            if values.is_valid(i) {
                *count += 1;
            }
            if per_row {
                out[i] = *count;
            }
        }
        if !per_row {
            out[seg.clone()].fill(*count);
        }
        if k == 0 {
            first = Some(*count);
        }
    }
    (Int64Array::from(out), first)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{
        ArrayRef, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray, UInt32Array,
    };
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::util::pretty::pretty_format_batches;
    use datafusion::datasource::MemTable;
    use datafusion::execution::SessionStateBuilder;
    use datafusion::physical_plan::displayable;
    use datafusion::prelude::{SessionConfig, SessionContext};
    use rand::{Rng, SeedableRng};

    use super::RunningWindow;

    /// 3,000 rows in batches of random sizes: `k` 5 partition values and NULL, `s`
    /// 3 strings, `o` 40 order values (ties), `x`/`f` with NULLs, `u` unsigned.
    fn table(seed: u64) -> MemTable {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("k", DataType::Int32, true),
            Field::new("s", DataType::Utf8, false),
            Field::new("o", DataType::Int64, false),
            Field::new("x", DataType::Int32, true),
            Field::new("u", DataType::UInt32, false),
            Field::new("f", DataType::Float64, true),
        ]));
        let rows = 3_000usize;
        let mut ids: Vec<i64> = (0..rows as i64).collect();
        rand::seq::SliceRandom::shuffle(&mut ids[..], &mut rng);
        let mut batches = Vec::new();
        let mut at = 0;
        while at < rows {
            let n = rng.random_range(1..400).min(rows - at);
            let id = &ids[at..at + n];
            let columns: Vec<ArrayRef> = vec![
                Arc::new(Int64Array::from(id.to_vec())),
                Arc::new(Int32Array::from_iter((0..n).map(|_| {
                    rng.random_ratio(9, 10).then(|| rng.random_range(0..5))
                }))),
                Arc::new(StringArray::from_iter_values(
                    (0..n).map(|_| format!("s{}", rng.random_range(0..3))),
                )),
                Arc::new(Int64Array::from_iter_values(
                    (0..n).map(|_| rng.random_range(0..40)),
                )),
                Arc::new(Int32Array::from_iter((0..n).map(|_| {
                    rng.random_ratio(4, 5)
                        .then(|| rng.random_range(-1_000_000..1_000_000))
                }))),
                Arc::new(UInt32Array::from_iter_values(
                    (0..n).map(|_| rng.random_range(0..u32::MAX)),
                )),
                Arc::new(Float64Array::from_iter((0..n).map(|_| {
                    rng.random_ratio(4, 5)
                        .then(|| f64::from(rng.random_range(-500..500)) / 7.0)
                }))),
            ];
            batches.push(RecordBatch::try_new(schema.clone(), columns).unwrap());
            at += n;
        }
        MemTable::try_new(schema, vec![batches]).unwrap()
    }

    fn session(seed: u64, running: bool) -> SessionContext {
        // Batches of 7 rows: partitions and peer groups cross batches everywhere.
        let config = SessionConfig::new()
            .with_batch_size(7)
            .with_target_partitions(2);
        let mut builder = SessionStateBuilder::new()
            .with_default_features()
            .with_config(config);
        if running {
            builder = builder.with_physical_optimizer_rule(Arc::new(RunningWindow));
        }
        let ctx = SessionContext::new_with_state(builder.build());
        ctx.register_table("t", Arc::new(table(seed))).unwrap();
        ctx
    }

    /// The answer with and without the rule, and the plan with it.
    async fn both(seed: u64, sql: &str) -> (String, String, String) {
        let mut out = Vec::new();
        for running in [false, true] {
            let df = session(seed, running).sql(sql).await.unwrap();
            let plan = df.clone().create_physical_plan().await.unwrap();
            let text = displayable(plan.as_ref()).indent(false).to_string();
            let batches = df.collect().await.unwrap();
            out.push((pretty_format_batches(&batches).unwrap().to_string(), text));
        }
        let (with, plan) = out.pop().unwrap();
        let (without, _) = out.pop().unwrap();
        (without, with, plan)
    }

    const ROWS_FRAME: &str = "ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW";

    #[tokio::test]
    async fn running_totals_equal_datafusions_window() {
        let rows = |over: &str| {
            format!(
                "SELECT id, sum(x) OVER ({over}) a, count(x) OVER ({over}) b, \
                 min(x) OVER ({over}) c, max(x) OVER ({over}) d, sum(u) OVER ({over}) e, \
                 count(*) OVER ({over}) g FROM t ORDER BY id"
            )
        };
        let queries = [
            // Rows one by one, floats included.
            format!(
                "SELECT id, sum(f) OVER (PARTITION BY k ORDER BY o, id {ROWS_FRAME}) a, \
                 sum(x) OVER (PARTITION BY k ORDER BY o, id {ROWS_FRAME}) b FROM t ORDER BY id"
            ),
            rows(&format!("PARTITION BY k ORDER BY id {ROWS_FRAME}")),
            rows(&format!(
                "PARTITION BY s, k ORDER BY o DESC, id {ROWS_FRAME}"
            )),
            rows(&format!("ORDER BY id {ROWS_FRAME}")),
            // The default frame with an ORDER BY: peers (equal `o`) share a value.
            rows("PARTITION BY k ORDER BY o"),
            rows("PARTITION BY s ORDER BY o DESC NULLS FIRST"),
            rows("ORDER BY o"),
            rows("PARTITION BY s, k ORDER BY x"),
        ];
        for seed in [1, 2, 3] {
            for sql in &queries {
                let (without, with, plan) = both(seed, sql).await;
                assert!(plan.contains("RunningWindowExec"), "{sql}\n{plan}");
                assert_eq!(without, with, "seed {seed}: {sql}\n{plan}");
            }
        }
    }

    #[tokio::test]
    async fn other_windows_stay_datafusions() {
        for sql in [
            // A sliding frame, an average, a filtered aggregate, floats over peers.
            "SELECT id, sum(x) OVER (PARTITION BY k ORDER BY id ROWS BETWEEN 2 PRECEDING AND CURRENT ROW) a FROM t ORDER BY id",
            "SELECT id, avg(x) OVER (PARTITION BY k ORDER BY id) a FROM t ORDER BY id",
            "SELECT id, sum(x) FILTER (WHERE o > 3) OVER (PARTITION BY k ORDER BY id) a FROM t ORDER BY id",
            "SELECT id, sum(f) OVER (PARTITION BY k ORDER BY o) a FROM t ORDER BY id",
            "SELECT id, sum(x) OVER (PARTITION BY k) a FROM t ORDER BY id",
        ] {
            let (without, with, plan) = both(7, sql).await;
            assert!(!plan.contains("RunningWindowExec"), "{sql}\n{plan}");
            assert_eq!(without, with, "{sql}");
        }
    }
}
