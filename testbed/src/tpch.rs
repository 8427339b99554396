//! TPC-H as a workload: data generated in-process (tpchgen), loaded into storage nodes
//! partition by partition, and the 22 queries (`queries/tpch/qN.sql`).

use arrow::datatypes::SchemaRef;
use arrow::error::ArrowError;
use arrow::record_batch::RecordBatch;
use arrow::record_batch::RecordBatchReader;
use csd_runtime::node_client::NodeClient;
use tpchgen::generators::{
    CustomerGenerator, LineItemGenerator, NationGenerator, OrderGenerator, PartGenerator,
    PartSuppGenerator, RegionGenerator, SupplierGenerator,
};
use tpchgen_arrow::{
    CustomerArrow, LineItemArrow, NationArrow, OrderArrow, PartArrow, PartSuppArrow, RegionArrow,
    SupplierArrow,
};

/// The eight TPC-H tables.
pub const TABLES: [&str; 8] = [
    "nation", "region", "part", "supplier", "partsupp", "customer", "orders", "lineitem",
];

/// The 22 queries, `(number, SQL)`.
pub const QUERIES: [(u32, &str); 22] = [
    (1, include_str!("../queries/tpch/q1.sql")),
    (2, include_str!("../queries/tpch/q2.sql")),
    (3, include_str!("../queries/tpch/q3.sql")),
    (4, include_str!("../queries/tpch/q4.sql")),
    (5, include_str!("../queries/tpch/q5.sql")),
    (6, include_str!("../queries/tpch/q6.sql")),
    (7, include_str!("../queries/tpch/q7.sql")),
    (8, include_str!("../queries/tpch/q8.sql")),
    (9, include_str!("../queries/tpch/q9.sql")),
    (10, include_str!("../queries/tpch/q10.sql")),
    (11, include_str!("../queries/tpch/q11.sql")),
    (12, include_str!("../queries/tpch/q12.sql")),
    (13, include_str!("../queries/tpch/q13.sql")),
    (14, include_str!("../queries/tpch/q14.sql")),
    (15, include_str!("../queries/tpch/q15.sql")),
    (16, include_str!("../queries/tpch/q16.sql")),
    (17, include_str!("../queries/tpch/q17.sql")),
    (18, include_str!("../queries/tpch/q18.sql")),
    (19, include_str!("../queries/tpch/q19.sql")),
    (20, include_str!("../queries/tpch/q20.sql")),
    (21, include_str!("../queries/tpch/q21.sql")),
    (22, include_str!("../queries/tpch/q22.sql")),
];

/// The SQL of query `n` (1–22).
pub fn query(n: u32) -> Option<&'static str> {
    QUERIES.iter().find(|(q, _)| *q == n).map(|(_, s)| *s)
}

fn collect<I: RecordBatchReader>(it: I) -> Result<(SchemaRef, Vec<RecordBatch>), ArrowError> {
    let schema = it.schema();
    Ok((schema, it.collect::<Result<_, _>>()?))
}

/// Generates part `part` (1-based) of `parts` of `table` at `scale`. `nation` and
/// `region` are tiny and not partitioned: only part 1 has rows.
pub fn generate(
    table: &str,
    scale: f64,
    part: i32,
    parts: i32,
) -> Result<(SchemaRef, Vec<RecordBatch>), ArrowError> {
    const B: usize = 8192;
    let (schema, batches) = match table {
        "nation" => collect(NationArrow::new(NationGenerator::new(scale, 1, 1)).with_batch_size(B)),
        "region" => collect(RegionArrow::new(RegionGenerator::new(scale, 1, 1)).with_batch_size(B)),
        "part" => {
            collect(PartArrow::new(PartGenerator::new(scale, part, parts)).with_batch_size(B))
        }
        "supplier" => collect(
            SupplierArrow::new(SupplierGenerator::new(scale, part, parts)).with_batch_size(B),
        ),
        "partsupp" => collect(
            PartSuppArrow::new(PartSuppGenerator::new(scale, part, parts)).with_batch_size(B),
        ),
        "customer" => collect(
            CustomerArrow::new(CustomerGenerator::new(scale, part, parts)).with_batch_size(B),
        ),
        "orders" => {
            collect(OrderArrow::new(OrderGenerator::new(scale, part, parts)).with_batch_size(B))
        }
        "lineitem" => collect(
            LineItemArrow::new(LineItemGenerator::new(scale, part, parts)).with_batch_size(B),
        ),
        other => {
            return Err(ArrowError::InvalidArgumentError(format!(
                "{other} is not a TPC-H table"
            )));
        }
    }?;
    if matches!(table, "nation" | "region") && part != 1 {
        return Ok((schema, vec![]));
    }
    Ok((schema, batches))
}

/// Loads TPC-H at `scale` into `nodes`: every table in `parts_per_node × nodes`
/// partitions (`p0`, `p1`, …), partition `i` on node `i % nodes` (nation and region:
/// one partition on the first node). `progress(table, rows)` is called after each
/// partition is stored.
pub async fn load(
    nodes: &[NodeClient],
    scale: f64,
    parts_per_node: usize,
    progress: impl FnMut(&str, u64),
) -> Result<(), csd_runtime::node_client::Error> {
    let parts = parts_per_node.max(1) * nodes.len().max(1);
    load_parts(nodes, scale, parts, progress).await
}

/// Like [`load`], with `parts` partitions per table in all, whatever the node count:
/// the same data on 1 node or 8.
pub(crate) async fn load_parts(
    nodes: &[NodeClient],
    scale: f64,
    parts: usize,
    mut progress: impl FnMut(&str, u64),
) -> Result<(), csd_runtime::node_client::Error> {
    if nodes.is_empty() {
        return Err(csd_runtime::node_client::Error::InvalidInput(
            "no storage nodes to load TPC-H into".into(),
        ));
    }
    let n = nodes.len();
    for table in TABLES {
        let parts = if matches!(table, "nation" | "region") {
            1
        } else {
            parts.max(1) as i32
        };
        for p in 0..parts {
            let (schema, batches) = generate(table, scale, p + 1, parts)?;
            let rows: u64 = batches.iter().map(|b| b.num_rows() as u64).sum();
            let node = &nodes[p as usize % n];
            node.put(
                table,
                &format!("p{p}"),
                schema,
                futures::stream::iter(batches.into_iter().map(Ok)),
            )
            .await?;
            progress(table, rows);
        }
    }
    Ok(())
}
