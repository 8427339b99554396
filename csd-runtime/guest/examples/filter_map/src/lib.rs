//! A filter and a map: keeps the rows of lineitem whose `l_shipmode` is `--arg
//! mode=…` (default `AIR`) and returns `l_orderkey` and the discounted price
//! `l_extendedprice * (1 - l_discount)` as a double — what
//! `SELECT l_orderkey, CAST(l_extendedprice AS DOUBLE) * (1 - CAST(l_discount AS DOUBLE))
//!  FROM lineitem WHERE l_shipmode = 'AIR'` returns.

use std::sync::Arc;

use csd_guest::arrow_array::{Float64Array, Int64Array};
use csd_guest::{Args, DataType, Field, Operator, RecordBatch, Schema, SchemaRef};

use csd_guest::columns::{Strings, floats, ints};

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
        // Each column's type is dispatched once per batch, not once per value.
        let (key, price, disc) = (
            ints(key.as_ref())?,
            floats(price.as_ref())?,
            floats(disc.as_ref())?,
        );
        let mode = Strings::of(mode.as_ref())?;
        let mut keys = Vec::new();
        let mut revenue = Vec::new();
        for i in 0..b.num_rows() {
            if mode.get(i) != Some(self.mode.as_str()) {
                continue;
            }
            keys.push(key[i]);
            revenue.push(match (price[i], disc[i]) {
                (Some(p), Some(d)) => Some(p * (1.0 - d)),
                _ => None,
            });
        }
        if keys.is_empty() {
            return Ok(None);
        }
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
