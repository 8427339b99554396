//! The `groups` workload's tables, generated from a fixed seed: `facts` (10M rows
//! at scale 1, rows in random order) with keys of 10 to 10^7 distinct values —
//! uniform, skewed (Zipf-like), nullable, integer and string — and `dims`, 100,000
//! rows keyed by `facts.k100k`. Its queries are `benches/queries/groups/qN.sql`.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, Date32Array, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// The tables.
pub(crate) const TABLES: [&str; 2] = ["dims", "facts"];

/// Tables kept in one file in every layout.
pub(crate) const ONE_FILE: [&str; 1] = ["dims"];

/// Queries `q1.sql` … `qN.sql`.
pub(crate) const QUERIES: u32 = 17;

/// Rows of `facts` at `scale`.
pub(crate) fn rows(scale: f64) -> usize {
    (10_000_000.0 * scale).round().max(1.0) as usize
}

/// Rows of `dims` (the distinct values of `facts.k100k`).
const DIMS: i64 = 100_000;

/// Rows per generated batch.
const BATCH: usize = 65_536;

fn facts_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        // A permutation of 0..rows: unique, in random order.
        Field::new("id", DataType::Int64, false),
        Field::new("k10", DataType::Int32, false),
        Field::new("k1k", DataType::Int32, false),
        Field::new("k100k", DataType::Int64, false),
        Field::new("k1m", DataType::Int64, false),
        // P(k) ∝ 1/(k+1) over 0..10^6: a few keys hold most rows.
        Field::new("kz", DataType::Int32, false),
        Field::new("s10", DataType::Utf8, false),
        Field::new("s100k", DataType::Utf8, false),
        // 1,000 values and 10% NULL.
        Field::new("n1k", DataType::Int32, true),
        Field::new("day", DataType::Date32, false),
        Field::new("q", DataType::Int64, false),
        Field::new("v", DataType::Float64, false),
    ]))
}

fn dims_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k100k", DataType::Int64, false),
        Field::new("name", DataType::Utf8, false),
        Field::new("region", DataType::Int32, false),
        Field::new("weight", DataType::Float64, false),
    ]))
}

/// `table` at `scale` in `parts` files of about equal rows.
pub(crate) fn generate(
    table: &str,
    scale: f64,
    parts: usize,
) -> Vec<(SchemaRef, Vec<RecordBatch>)> {
    match table {
        "facts" => facts(rows(scale), parts),
        "dims" => vec![(dims_schema(), dims())],
        other => panic!("groups has no table {other}"),
    }
}

fn facts(n: usize, parts: usize) -> Vec<(SchemaRef, Vec<RecordBatch>)> {
    let schema = facts_schema();
    let mut ids: Vec<i64> = (0..n as i64).collect();
    ids.shuffle(&mut StdRng::seed_from_u64(65));
    // 2024-01-01 as days since the epoch.
    const DAY0: i32 = 19_723;
    let ln_zipf = (1_000_000f64).ln();
    (0..parts)
        .map(|p| {
            let mut rng = StdRng::seed_from_u64(1000 + p as u64);
            let (from, to) = (p * n / parts, (p + 1) * n / parts);
            let batches = (from..to)
                .step_by(BATCH)
                .map(|start| {
                    let len = BATCH.min(to - start);
                    let mut int = |hi: i64| -> Vec<i64> {
                        (0..len).map(|_| rng.random_range(0..hi)).collect()
                    };
                    let k10 = int(10);
                    let k1k = int(1000);
                    let k100k = int(DIMS);
                    let k1m = int(1_000_000);
                    let s10 = int(10);
                    let s100k = int(100_000);
                    let n1k = int(10_000);
                    let day = int(1096);
                    let q = int(100);
                    let kz: Vec<i32> = (0..len)
                        .map(|_| ((rng.random::<f64>() * ln_zipf).exp() as i32 - 1).max(0))
                        .collect();
                    let v: Vec<f64> = (0..len)
                        .map(|_| (rng.random::<f64>() * 100_000.0).round() / 100.0)
                        .collect();
                    let i32s =
                        |v: &[i64]| Int32Array::from_iter_values(v.iter().map(|x| *x as i32));
                    let columns: Vec<ArrayRef> = vec![
                        Arc::new(Int64Array::from(ids[start..start + len].to_vec())),
                        Arc::new(i32s(&k10)),
                        Arc::new(i32s(&k1k)),
                        Arc::new(Int64Array::from(k100k)),
                        Arc::new(Int64Array::from(k1m)),
                        Arc::new(Int32Array::from(kz)),
                        Arc::new(StringArray::from_iter_values(
                            s10.iter().map(|x| format!("c{x}")),
                        )),
                        Arc::new(StringArray::from_iter_values(
                            s100k.iter().map(|x| format!("user{x:06}")),
                        )),
                        Arc::new(Int32Array::from_iter(
                            n1k.iter()
                                .map(|x| (*x >= 1000).then_some((*x % 1000) as i32)),
                        )),
                        Arc::new(Date32Array::from_iter_values(
                            day.iter().map(|d| DAY0 + *d as i32),
                        )),
                        Arc::new(Int64Array::from_iter_values(q.iter().map(|x| x + 1))),
                        Arc::new(Float64Array::from(v)),
                    ];
                    RecordBatch::try_new(schema.clone(), columns).expect("facts batch")
                })
                .collect();
            (schema.clone(), batches)
        })
        .collect()
}

fn dims() -> Vec<RecordBatch> {
    let mut rng = StdRng::seed_from_u64(66);
    let mut keys: Vec<i64> = (0..DIMS).collect();
    keys.shuffle(&mut rng);
    let region: Vec<i32> = (0..DIMS).map(|_| rng.random_range(0..10)).collect();
    let weight: Vec<f64> = (0..DIMS).map(|_| rng.random::<f64>()).collect();
    let names = StringArray::from_iter_values(keys.iter().map(|k| format!("name{k}")));
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(keys)),
        Arc::new(names),
        Arc::new(Int32Array::from(region)),
        Arc::new(Float64Array::from(weight)),
    ];
    vec![RecordBatch::try_new(dims_schema(), columns).expect("dims batch")]
}
