//! A partial aggregate: per `l_returnflag`, the sum of `l_extendedprice * (1 -
//! l_discount)` and the row count — what `SELECT l_returnflag, SUM(CAST(l_extendedprice
//! AS DOUBLE) * (1 - CAST(l_discount AS DOUBLE))), COUNT(*) FROM lineitem GROUP BY 1`
//! returns. Each node emits its partial sums; the compute side merges them by running
//! the same module in its merge phase.

use std::collections::BTreeMap;
use std::sync::Arc;

use csd_guest::arrow_array::{Array, Float64Array, Int64Array, StringArray};
use csd_guest::{Args, DataType, Field, Operator, Phase, RecordBatch, Schema, SchemaRef};

use csd_guest::columns::{float_at, int_at, str_at};

struct PartialAgg {
    phase: Phase,
    groups: BTreeMap<String, (f64, i64)>,
    schema: SchemaRef,
}

impl Operator for PartialAgg {
    const AGGREGATE: bool = true;

    fn new(args: &Args) -> Result<Self, String> {
        Ok(PartialAgg {
            phase: args.phase(),
            groups: BTreeMap::new(),
            schema: Arc::new(Schema::new(vec![
                Field::new("l_returnflag", DataType::Utf8, false),
                Field::new("revenue", DataType::Float64, false),
                Field::new("rows", DataType::Int64, false),
            ])),
        })
    }

    fn batch(&mut self, b: RecordBatch) -> Result<Option<RecordBatch>, String> {
        let col = |n: &str| {
            b.column_by_name(n)
                .ok_or_else(|| format!("partial_agg needs the column {n}"))
        };
        let flag = col("l_returnflag")?;
        match self.phase {
            Phase::Map => {
                let (price, disc) = (col("l_extendedprice")?, col("l_discount")?);
                for i in 0..b.num_rows() {
                    let g = self
                        .groups
                        .entry(str_at(flag.as_ref(), i)?.to_string())
                        .or_default();
                    if let (Some(p), Some(d)) =
                        (float_at(price.as_ref(), i)?, float_at(disc.as_ref(), i)?)
                    {
                        g.0 += p * (1.0 - d);
                    }
                    g.1 += 1;
                }
            }
            Phase::Merge => {
                let (rev, rows) = (col("revenue")?, col("rows")?);
                for i in 0..b.num_rows() {
                    let g = self
                        .groups
                        .entry(str_at(flag.as_ref(), i)?.to_string())
                        .or_default();
                    g.0 += float_at(rev.as_ref(), i)?.unwrap_or(0.0);
                    g.1 += int_at(rows.as_ref(), i)?.unwrap_or(0);
                }
            }
        }
        Ok(None)
    }

    fn finish(&mut self) -> Result<Option<RecordBatch>, String> {
        let flags: StringArray = self.groups.keys().map(|k| Some(k.as_str())).collect();
        let rev: Float64Array = self.groups.values().map(|v| Some(v.0)).collect();
        let rows: Int64Array = self.groups.values().map(|v| Some(v.1)).collect();
        let _ = flags.len();
        RecordBatch::try_new(
            self.schema.clone(),
            vec![Arc::new(flags), Arc::new(rev), Arc::new(rows)],
        )
        .map(Some)
        .map_err(|e| e.to_string())
    }
}

csd_guest::export_operator!(PartialAgg);
