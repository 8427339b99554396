//! `median_weighted(value, count)`: the median of a multiset given as (value, count)
//! pairs, each value counted `count` times. It is the final step of an exact median
//! whose partial state comes from the nodes as a `GROUP BY …, value` with `count(value)`
//! (`holistic_down.rs`); it gives exactly what DataFusion's `median` gives over the
//! rows themselves: the same total order, and for an even number of values the same
//! midpoint of the two middle ones.
//!
//! NULL values and pairs with a NULL or non-positive count are not counted; with
//! none left the answer is NULL, as `median`'s over no rows.

use std::fmt::Debug;
use std::mem::size_of;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, ArrowNativeTypeOp, ArrowNumericType, AsArray, Int64Array, ListArray,
    PrimitiveArray,
};
use arrow::buffer::{OffsetBuffer, ScalarBuffer};
use arrow::compute::cast;
use arrow::datatypes::{
    ArrowNativeType, DataType, Decimal32Type, Decimal64Type, Decimal128Type, Decimal256Type, Field,
    FieldRef, Float32Type, Float64Type, Int64Type,
};
use datafusion::common::{Result, ScalarValue, exec_err, not_impl_err};
use datafusion::logical_expr::function::{AccumulatorArgs, StateFieldsArgs};
use datafusion::logical_expr::utils::format_state_name;
use datafusion::logical_expr::{
    Accumulator, AggregateUDF, AggregateUDFImpl, Signature, Volatility,
};

/// The function's name in SQL and in plans.
pub(crate) const NAME: &str = "median_weighted";

/// The value types it takes: those `median` gives an answer of the same type for
/// (integers reach `median` cast to `Float64`).
pub(crate) fn supports(t: &DataType) -> bool {
    matches!(
        t,
        DataType::Float32
            | DataType::Float64
            | DataType::Decimal32(..)
            | DataType::Decimal64(..)
            | DataType::Decimal128(..)
            | DataType::Decimal256(..)
    )
}

/// The function, to register in a session or use in a plan.
pub(crate) fn median_weighted_udaf() -> Arc<AggregateUDF> {
    Arc::new(AggregateUDF::new_from_impl(MedianWeighted::default()))
}

/// See the module.
#[derive(Debug, PartialEq, Eq, Hash)]
struct MedianWeighted {
    signature: Signature,
}

impl Default for MedianWeighted {
    fn default() -> Self {
        Self {
            signature: Signature::any(2, Volatility::Immutable),
        }
    }
}

impl AggregateUDFImpl for MedianWeighted {
    fn name(&self) -> &str {
        NAME
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        if !supports(&arg_types[0]) {
            return not_impl_err!(
                "{NAME} takes float or decimal values (cast integers to DOUBLE), not {}",
                arg_types[0]
            );
        }
        if !arg_types[1].is_integer() {
            return exec_err!("{NAME}'s count must be an integer, not {}", arg_types[1]);
        }
        Ok(arg_types[0].clone())
    }

    fn state_fields(&self, args: StateFieldsArgs) -> Result<Vec<FieldRef>> {
        let value = args.input_fields[0].data_type().clone();
        let list = |t: DataType| DataType::List(Arc::new(Field::new_list_field(t, true)));
        Ok(vec![
            Field::new(format_state_name(args.name, "values"), list(value), true).into(),
            Field::new(
                format_state_name(args.name, "counts"),
                list(DataType::Int64),
                true,
            )
            .into(),
        ])
    }

    fn accumulator(&self, acc_args: AccumulatorArgs) -> Result<Box<dyn Accumulator>> {
        let t = acc_args.expr_fields[0].data_type().clone();
        macro_rules! of {
            ($p:ty) => {
                Ok(Box::new(Pairs::<$p> {
                    data_type: t,
                    values: Vec::new(),
                    counts: Vec::new(),
                }))
            };
        }
        match t {
            DataType::Float32 => of!(Float32Type),
            DataType::Float64 => of!(Float64Type),
            DataType::Decimal32(..) => of!(Decimal32Type),
            DataType::Decimal64(..) => of!(Decimal64Type),
            DataType::Decimal128(..) => of!(Decimal128Type),
            DataType::Decimal256(..) => of!(Decimal256Type),
            other => not_impl_err!("{NAME} does not take {other} values"),
        }
    }
}

/// The (value, count) pairs of one group.
struct Pairs<T: ArrowNumericType> {
    data_type: DataType,
    values: Vec<T::Native>,
    counts: Vec<u64>,
}

impl<T: ArrowNumericType> Debug for Pairs<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{NAME}({}, {} pairs)", self.data_type, self.values.len())
    }
}

impl<T: ArrowNumericType> Pairs<T> {
    fn add(&mut self, values: &PrimitiveArray<T>, counts: &Int64Array) {
        for i in 0..values.len() {
            if values.is_valid(i) && counts.is_valid(i) && counts.value(i) > 0 {
                self.values.push(values.value(i));
                self.counts.push(counts.value(i) as u64);
            }
        }
    }

    fn list<P: ArrowNumericType>(data_type: DataType, items: Vec<P::Native>) -> ScalarValue {
        let n = items.len() as i32;
        let values = PrimitiveArray::<P>::new(ScalarBuffer::from(items), None)
            .with_data_type(data_type.clone());
        ScalarValue::List(Arc::new(ListArray::new(
            Arc::new(Field::new_list_field(data_type, true)),
            OffsetBuffer::new(ScalarBuffer::from(vec![0, n])),
            Arc::new(values),
            None,
        )))
    }
}

/// The value at 0-based position `at` of the multiset, `order` being the pairs'
/// indices sorted by value.
fn nth<N: Copy>(values: &[N], counts: &[u64], order: &[usize], at: u64) -> N {
    let mut seen = 0;
    for &i in order {
        seen += counts[i];
        if at < seen {
            return values[i];
        }
    }
    values[*order.last().expect("a non-empty multiset")]
}

impl<T: ArrowNumericType> Accumulator for Pairs<T> {
    fn update_batch(&mut self, args: &[ArrayRef]) -> Result<()> {
        let counts = cast(&args[1], &DataType::Int64)?;
        self.add(
            args[0].as_primitive::<T>(),
            counts.as_primitive::<Int64Type>(),
        );
        Ok(())
    }

    fn merge_batch(&mut self, states: &[ArrayRef]) -> Result<()> {
        let (values, counts) = (states[0].as_list::<i32>(), states[1].as_list::<i32>());
        for (v, c) in values.iter().zip(counts.iter()) {
            if let (Some(v), Some(c)) = (v, c) {
                self.add(v.as_primitive::<T>(), c.as_primitive::<Int64Type>());
            }
        }
        Ok(())
    }

    fn state(&mut self) -> Result<Vec<ScalarValue>> {
        let counts = std::mem::take(&mut self.counts)
            .into_iter()
            .map(|c| c as i64)
            .collect();
        Ok(vec![
            Self::list::<T>(self.data_type.clone(), std::mem::take(&mut self.values)),
            Self::list::<Int64Type>(DataType::Int64, counts),
        ])
    }

    fn evaluate(&mut self) -> Result<ScalarValue> {
        let total: u64 = self.counts.iter().sum();
        if total == 0 {
            return ScalarValue::new_primitive::<T>(None, &self.data_type);
        }
        let mut order: Vec<usize> = (0..self.values.len()).collect();
        order.sort_unstable_by(|a, b| self.values[*a].compare(self.values[*b]));
        let at = |i| nth(&self.values, &self.counts, &order, i);
        let median = if total % 2 == 1 {
            at(total / 2)
        } else {
            // As `median` computes it from the two middle values.
            let (low, high) = (at(total / 2 - 1), at(total / 2));
            let two = T::Native::usize_as(2);
            match low.add_checked(high) {
                Ok(sum) => sum.div_wrapping(two),
                Err(_) => {
                    let correction = low
                        .mod_wrapping(two)
                        .add_wrapping(high.mod_wrapping(two))
                        .div_wrapping(two);
                    low.div_wrapping(two)
                        .add_wrapping(high.div_wrapping(two))
                        .add_wrapping(correction)
                }
            }
        };
        ScalarValue::new_primitive::<T>(Some(median), &self.data_type)
    }

    fn size(&self) -> usize {
        size_of::<Self>()
            + self.values.capacity() * size_of::<T::Native>()
            + self.counts.capacity() * size_of::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{Decimal128Array, Float64Array};
    use arrow::datatypes::Schema;
    use datafusion::functions_aggregate::median::median_udaf;
    use datafusion::logical_expr::function::AccumulatorArgs;
    use datafusion::physical_expr::expressions::col;
    use datafusion::physical_plan::PhysicalExpr;
    use rand::{Rng, SeedableRng};

    use super::*;

    fn accumulator(udaf: &AggregateUDF, t: &DataType) -> Box<dyn Accumulator> {
        let schema = Schema::new(vec![
            Field::new("v", t.clone(), true),
            Field::new("n", DataType::Int64, true),
        ]);
        let exprs: Vec<Arc<dyn PhysicalExpr>> = vec![col("v", &schema).unwrap()];
        let fields: Vec<FieldRef> = vec![Arc::new(schema.field(0).clone())];
        let ret = Arc::new(Field::new("r", t.clone(), true));
        udaf.accumulator(AccumulatorArgs {
            return_field: ret,
            schema: &schema,
            expr_fields: &fields,
            ignore_nulls: false,
            order_bys: &[],
            is_reversed: false,
            name: "m",
            is_distinct: false,
            exprs: &exprs,
        })
        .unwrap()
    }

    /// The rows, grouped into (value, count) pairs and fed in two partial states
    /// merged, give `median`'s answer over the rows, for odd and even counts, ties,
    /// NULLs, and decimals near overflow.
    fn same_as_median(t: DataType, rows: ArrayRef) {
        let mut want = accumulator(&median_udaf(), &t);
        want.update_batch(std::slice::from_ref(&rows)).unwrap();
        let want = want.evaluate().unwrap();
        // Group equal values (as the nodes' GROUP BY does), NULLs as one pair.
        let sorted = arrow::compute::sort(&rows, None).unwrap();
        let mut values: Vec<ArrayRef> = Vec::new();
        let mut counts: Vec<i64> = Vec::new();
        for i in 0..sorted.len() {
            let here = sorted.slice(i, 1);
            if let Some(last) = values.last()
                && arrow::compute::kernels::cmp::not_distinct(last, &here)
                    .unwrap()
                    .value(0)
            {
                *counts.last_mut().unwrap() += i64::from(here.is_valid(0));
                continue;
            }
            counts.push(i64::from(here.is_valid(0)));
            values.push(here);
        }
        let refs: Vec<&dyn Array> = values.iter().map(|a| a.as_ref()).collect();
        let values = match refs.is_empty() {
            true => arrow::array::new_empty_array(&t),
            false => arrow::compute::concat(&refs).unwrap(),
        };
        let counts: ArrayRef = Arc::new(Int64Array::from(counts));
        let half = values.len() / 2;
        let udaf = median_weighted_udaf();
        let mut parts = [accumulator(&udaf, &t), accumulator(&udaf, &t)];
        parts[0]
            .update_batch(&[values.slice(0, half), counts.slice(0, half)])
            .unwrap();
        parts[1]
            .update_batch(&[
                values.slice(half, values.len() - half),
                counts.slice(half, values.len() - half),
            ])
            .unwrap();
        let mut merged = accumulator(&udaf, &t);
        for p in &mut parts {
            let state: Vec<ArrayRef> = p
                .state()
                .unwrap()
                .into_iter()
                .map(|s| s.to_array().unwrap())
                .collect();
            merged.merge_batch(&state).unwrap();
        }
        assert_eq!(merged.evaluate().unwrap(), want, "{t}: {rows:?}");
    }

    #[test]
    fn the_median_of_counted_values_is_medians() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for n in [0usize, 1, 2, 3, 10, 11, 1000, 1001] {
            let floats: Float64Array = (0..n)
                .map(|_| {
                    rng.random_ratio(9, 10)
                        .then(|| f64::from(rng.random_range(-20..20)) / 4.0)
                })
                .collect();
            same_as_median(DataType::Float64, Arc::new(floats));
            let t = DataType::Decimal128(38, 2);
            let decimals: Decimal128Array = (0..n)
                .map(|_| {
                    rng.random_ratio(9, 10)
                        .then(|| i128::from(rng.random_range(-30..30)))
                })
                .collect();
            same_as_median(t.clone(), Arc::new(decimals.with_data_type(t.clone())));
            // Two middle values whose sum overflows: `median`'s safe midpoint.
            let big = Decimal128Array::from(vec![i128::MAX - 1, i128::MAX - 3, 5, i128::MAX])
                .with_data_type(t.clone());
            same_as_median(t.clone(), Arc::new(big));
        }
    }

    #[test]
    fn bad_pairs_are_not_counted_and_none_is_null() {
        let udaf = median_weighted_udaf();
        let mut a = accumulator(&udaf, &DataType::Float64);
        let values: ArrayRef = Arc::new(Float64Array::from(vec![
            Some(1.0),
            None,
            Some(9.0),
            Some(4.0),
        ]));
        let counts: ArrayRef = Arc::new(Int64Array::from(vec![Some(0), Some(3), None, Some(-2)]));
        a.update_batch(&[values, counts]).unwrap();
        assert_eq!(a.evaluate().unwrap(), ScalarValue::Float64(None));
        let values: ArrayRef = Arc::new(Float64Array::from(vec![2.0, 8.0]));
        let counts: ArrayRef = Arc::new(Int64Array::from(vec![3, 2]));
        a.update_batch(&[values, counts]).unwrap();
        assert_eq!(a.evaluate().unwrap(), ScalarValue::Float64(Some(2.0)));
        assert!(
            udaf.return_type(&[DataType::Int64, DataType::Int64])
                .is_err()
        );
        assert!(
            udaf.return_type(&[DataType::Float64, DataType::Utf8])
                .is_err()
        );
    }
}
