//! A filter and a map: keeps the rows of lineitem whose `l_shipmode` is `--arg
//! mode=…` (default `AIR`) and returns `l_orderkey` and the discounted price
//! `l_extendedprice * (1 - l_discount)` as a double — what
//! `SELECT l_orderkey, CAST(l_extendedprice AS DOUBLE) * (1 - CAST(l_discount AS DOUBLE))
//!  FROM lineitem WHERE l_shipmode = 'AIR'` returns.

use std::sync::Arc;

use csd_guest::arrow_array::{Float64Array, Int64Array};
use csd_guest::{Args, DataType, Field, Operator, RecordBatch, Schema, SchemaRef};

use csd_guest::columns::{Strings, floats_at, ints_at};

struct FilterMap {
    mode: String,
    schema: SchemaRef,
}

impl Operator for FilterMap {
    fn new(args: &Args) -> Result<Self, String> {
        Ok(FilterMap {
            mode: args.get("mode").unwrap_or("AIR").to_string(),
            schema: Arc::new(Schema::new(vec![
                Field::new("l_orderkey", DataType::Int64, true),
                Field::new("revenue", DataType::Float64, true),
            ])),
        })
    }

    fn batch(&mut self, b: RecordBatch) -> Result<Option<RecordBatch>, String> {
        let col = |n: &str| {
            b.column_by_name(n)
                .ok_or_else(|| format!("filter_map needs the column {n}"))
        };
        let (key, price, disc, mode) = (
            col("l_orderkey")?,
            col("l_extendedprice")?,
            col("l_discount")?,
            col("l_shipmode")?,
        );
        // Select first, then convert only the selected rows (about one in seven):
        // each column's type is dispatched once per batch, not once per value.
        let mode = Strings::of(mode.as_ref())?;
        let rows: Vec<usize> = (0..b.num_rows())
            .filter(|&i| mode.get(i) == Some(self.mode.as_str()))
            .collect();
        if rows.is_empty() {
            return Ok(None);
        }
        let keys = ints_at(key.as_ref(), &rows)?;
        let revenue: Vec<Option<f64>> = floats_at(price.as_ref(), &rows)?
            .into_iter()
            .zip(floats_at(disc.as_ref(), &rows)?)
            .map(|(p, d)| Some(p? * (1.0 - d?)))
            .collect();
        RecordBatch::try_new(
            self.schema.clone(),
            vec![
                Arc::new(Int64Array::from(keys)),
                Arc::new(Float64Array::from(revenue)),
            ],
        )
        .map(Some)
        .map_err(|e| e.to_string())
    }
}

csd_guest::export_operator!(FilterMap);
