//! Work that does not shrink at a node stays here; work that does goes down.
//!
//! Table `g` (rows in random order over two nodes, two partitions each) has a unique
//! key, keys of 7 and 3,000 values, a nullable key and tie-heavy values. An aggregate
//! over the unique key is kept on the compute tier (the nodes' distinct-count
//! sketches say it would not shrink), one over a small key is pushed, and a per-group
//! top-k under a ranking window is cut at the nodes; every answer equals DataFusion's
//! over the same rows.

use std::sync::Arc;

use arrow::array::{ArrayRef, Float64Array, Int32Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use csd_protocol::node_client::Declined;
use csd_query_pushdown::CsdSession;
use datafusion::prelude::SessionContext;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::explain::explain;
use crate::{assert_same, nodes, register_local, sessions};

pub(crate) const ROWS: i64 = 24_000;

pub(crate) fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("k", DataType::Int32, false),
        Field::new("m", DataType::Int64, false),
        Field::new("s", DataType::Utf8, false),
        Field::new("n", DataType::Int32, true),
        Field::new("v", DataType::Float64, true),
    ]))
}

/// Every row, in random order: `k` 7 values, `m` 3,000, `s` 200 strings, `n` 50
/// values and a NULL in a tenth of the rows, `v` a tenth NULL and full of ties.
pub(crate) fn rows() -> RecordBatch {
    let mut rng = rand::rngs::StdRng::seed_from_u64(65);
    let mut ids: Vec<i64> = (0..ROWS).collect();
    ids.shuffle(&mut rng);
    let k: Vec<i32> = ids.iter().map(|_| rng.random_range(0..7)).collect();
    let m: Vec<i64> = ids.iter().map(|_| rng.random_range(0..3_000)).collect();
    let s: Vec<String> = ids
        .iter()
        .map(|_| format!("s{}", rng.random_range(0..200)))
        .collect();
    let n: Vec<Option<i32>> = ids
        .iter()
        .map(|_| rng.random_ratio(9, 10).then(|| rng.random_range(0..50)))
        .collect();
    let v: Vec<Option<f64>> = ids
        .iter()
        .map(|_| {
            rng.random_ratio(9, 10)
                .then(|| f64::from(rng.random_range(0..40)))
        })
        .collect();
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(ids)),
        Arc::new(Int32Array::from(k)),
        Arc::new(Int64Array::from(m)),
        Arc::new(StringArray::from(s)),
        Arc::new(Int32Array::from(n)),
        Arc::new(Float64Array::from(v)),
    ];
    RecordBatch::try_new(schema(), columns).unwrap()
}

/// Two nodes holding `g` in four partitions, sessions with pushdown on and off, and
/// the same rows locally.
pub(crate) async fn setup() -> (
    Vec<csd_runtime::node::RunningNode>,
    CsdSession,
    CsdSession,
    SessionContext,
) {
    let (nodes, clients) = nodes(2).await;
    let all = rows();
    let quarter = (ROWS / 4) as usize;
    for p in 0..4 {
        let part = all.slice(p * quarter, quarter);
        clients[p % 2]
            .put(
                "g",
                &format!("p{p}"),
                schema(),
                futures::stream::iter([Ok(part)]),
            )
            .await
            .unwrap();
    }
    let local = SessionContext::new();
    register_local(&local, "g", schema(), vec![all]);
    let (on, off) = sessions(&nodes).await;
    (nodes, on, off, local)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_nodes_list_distinct_counts_from_their_sketches() {
    let (nodes, clients) = nodes(1).await;
    let all = rows();
    clients[0]
        .put(
            "g",
            "p0",
            schema(),
            futures::stream::iter([Ok(all.clone())]),
        )
        .await
        .unwrap();
    let half = all.slice(0, (ROWS / 2) as usize);
    clients[0]
        .put("g", "p1", schema(), futures::stream::iter([Ok(half)]))
        .await
        .unwrap();
    let t = clients[0].table("g").await.unwrap();
    let node: Vec<u64> = t.description.distinct.iter().map(|d| d.unwrap()).collect();
    // id, k, m, s, n (without its NULL), v (without its NULL): the union over both
    // partitions is the first partition's.
    let truth = [ROWS as u64, 7, 3_000, 200, 50, 40];
    for (i, (got, want)) in node.iter().zip(truth).enumerate() {
        let off = (*got as f64 - want as f64).abs() / want as f64;
        assert!(off <= 0.05, "column {i}: estimated {got}, truly {want}");
    }
    let p1 = &t.description.partitions[1].distinct;
    assert!(
        p1[0].unwrap() < node[0] * 3 / 4,
        "a partition is described by its own objects: {p1:?}"
    );
    drop(nodes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn aggregates_that_would_not_shrink_stay_here() {
    let (_nodes, on, off, local) = setup().await;
    for sql in [
        "SELECT id, sum(v) AS s FROM g GROUP BY id",
        "SELECT k, m, n, count(*) AS c FROM g GROUP BY k, m, n",
        "SELECT count(*) FROM (SELECT id % 20000 AS x, max(v) FROM g GROUP BY id % 20000)",
        // 200 × 51 key pairs over 12,000 rows a node: most rows their own group.
        "SELECT s, n, min(v) AS lo FROM g GROUP BY s, n",
        // DISTINCT's inner aggregate: 7 × 3,000 pairs.
        "SELECT k, count(DISTINCT m) AS d FROM g GROUP BY k",
    ] {
        let plan = explain(&on, sql).await;
        assert!(
            plan.contains("aggregate kept here") && !plan.contains("partial aggregate at"),
            "{sql}\n{plan}"
        );
        assert_same(&local, &on, sql).await;
        assert_same(&local, &off, sql).await;
    }
    for sql in [
        "SELECT k, count(*) AS c, sum(v) AS s, avg(m) AS a FROM g GROUP BY k",
        "SELECT s, min(v) AS lo FROM g GROUP BY s",
        "SELECT k, count(DISTINCT s) AS d FROM g GROUP BY k",
        "SELECT count(*) FROM (SELECT DISTINCT s, k FROM g)",
    ] {
        let plan = explain(&on, sql).await;
        assert!(plan.contains("partial aggregate at"), "{sql}\n{plan}");
        assert_same(&local, &on, sql).await;
    }
    // The setting moves the line: 1 pushes every aggregate again.
    on.ctx
        .sql("SET csd.max_group_fraction = 1")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let sql = "SELECT id, sum(v) AS s FROM g GROUP BY id";
    assert!(explain(&on, sql).await.contains("partial aggregate at"));
    assert_same(&local, &on, sql).await;
}

/// A pushed partial aggregate says how many rows it will send (its groups, by the
/// sketches), so a join above builds from the smaller side: here the few keys the
/// `HAVING` keeps, not every row of `g` (TPC-H Q18's `IN` over a key spread across
/// files built from all of `orders` before).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_join_builds_from_the_pushed_aggregates_few_groups() {
    let (_nodes, on, _off, local) = setup().await;
    let sql = "SELECT id, v FROM g WHERE m IN \
               (SELECT m FROM g GROUP BY m HAVING count(*) > 14)";
    let plan = explain(&on, sql).await;
    let join = plan
        .lines()
        .find(|l| l.contains("HashJoinExec"))
        .unwrap_or_else(|| panic!("no hash join:\n{plan}"));
    assert!(
        plan.contains("partial aggregate at") && join.contains("join_type=RightSemi"),
        "the aggregate's side should build:\n{plan}"
    );
    assert_same(&local, &on, sql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_top_k_per_group_is_cut_at_the_nodes() {
    let (_nodes, on, off, local) = setup().await;
    let ranked = |f: &str, order: &str, keep: &str| {
        format!(
            "SELECT id, k, n, v FROM (SELECT id, k, n, v, {f}() OVER (PARTITION BY k, n ORDER BY {order}) AS r FROM g) t WHERE {keep}"
        )
    };
    let queries = [
        // A total order: the answer is one set of rows.
        ranked("row_number", "v DESC NULLS LAST, id", "r <= 3"),
        ranked("row_number", "v, id DESC", "r = 1"),
        ranked("row_number", "v DESC, id", "r < 3 AND id % 2 = 0"),
        // Ties: every tied row at the boundary is kept.
        ranked("rank", "v DESC", "r <= 2"),
        ranked("dense_rank", "v", "2 >= r"),
        format!(
            "SELECT k, count(*), sum(v) FROM ({}) x GROUP BY k",
            ranked("rank", "v NULLS FIRST", "r <= 4")
        ),
    ];
    for sql in &queries {
        let plan = explain(&on, sql).await;
        assert!(
            plan.contains("rows of every group at each"),
            "{sql}\n{plan}"
        );
        assert_same(&local, &on, sql).await;
        assert_same(&local, &off, sql).await;
    }
    // What crossed: at most a few rows per group and node, not the table.
    let run = on.run(&queries[0]).await.unwrap();
    let returned: u64 = run.node_runs.iter().map(|e| e.report.rows_returned).sum();
    assert!(
        returned > 0 && returned <= 2 * 7 * 51 * 3,
        "{returned} rows came from the nodes\n{}",
        run.plan_with_metrics()
    );
    // Not a ranking filter: the window runs here over every row.
    let sql = "SELECT id, k FROM (SELECT id, k, row_number() OVER (PARTITION BY k ORDER BY id) AS r FROM g) t WHERE r > 3";
    assert!(!explain(&on, sql).await.contains("rows of every group"));
    assert_same(&local, &on, sql).await;
    // A top-k over the unique key keeps every row (the sketches say one row a group):
    // ranked here, not at the nodes and then again here.
    let sql = "SELECT id, v FROM (SELECT id, v, rank() OVER (PARTITION BY id ORDER BY v DESC) AS r FROM g) t WHERE r <= 1";
    assert!(!explain(&on, sql).await.contains("rows of every group"));
    assert_same(&local, &on, sql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_sketches_the_nodes_judge_while_running() {
    use csd_runtime::config::NodeConfig;
    use csd_runtime::table::ParquetOptions;
    // Objects stored without sketches, and a probe over the stream's first rows
    // (the default's 100,000 is more than this table).
    let mut config = NodeConfig {
        cpus: 2,
        parquet: ParquetOptions {
            distinct_sketches: false,
            ..ParquetOptions::default()
        },
        ..NodeConfig::default()
    };
    // One stream: the probe judges after its first batch of 8,192 rows and skips
    // the rest, which the guard sees.
    config.set = vec!["sql.shrink_probe_rows=2000".into(), "sql.streams=1".into()];
    let node = crate::sql_node_with(config).await;
    let client = csd_protocol::node_client::NodeClient::connect(&node.url)
        .await
        .unwrap();
    let all = rows();
    // Two partitions whose ids interleave: a partial aggregate at the node.
    let half = (ROWS / 2) as usize;
    for (p, part) in [all.slice(0, half), all.slice(half, half)]
        .into_iter()
        .enumerate()
    {
        client
            .put(
                "g",
                &format!("p{p}"),
                schema(),
                futures::stream::iter([Ok(part)]),
            )
            .await
            .unwrap();
    }
    assert!(
        client
            .table("g")
            .await
            .unwrap()
            .description
            .distinct
            .iter()
            .all(Option::is_none),
        "no sketches listed"
    );
    let local = SessionContext::new();
    register_local(&local, "g", schema(), vec![all]);
    let (on, _off) = sessions(std::slice::from_ref(&node)).await;
    // In two phases, as over several nodes (one node holding the whole table runs
    // its aggregates whole otherwise).
    on.ctx
        .sql("SET csd.whole_at_node = false")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();

    // Unique keys: the node hands it back before sending anything.
    let sql = "SELECT id, sum(v) AS s FROM g GROUP BY id";
    let plan = explain(&on, sql).await;
    assert!(plan.contains("unless it does not shrink there"), "{plan}");
    assert_same(&local, &on, sql).await;
    let run = on.run(sql).await.unwrap();
    let back: Vec<&Declined> = run
        .node_runs
        .iter()
        .filter_map(|r| r.pushed_back.as_ref())
        .collect();
    assert!(
        !back.is_empty()
            && back
                .iter()
                .all(|r| matches!(r, Declined::Judged(w) if w.contains("does not shrink"))),
        "{back:?}\n{}",
        run.plan_with_metrics()
    );
    // Seven groups: the node aggregates.
    let sql = "SELECT k, count(*) AS c, sum(v) AS s FROM g GROUP BY k";
    let run = on.run(sql).await.unwrap();
    assert!(run.node_runs.iter().all(|r| r.pushed_back.is_none()));
    assert_same(&local, &on, sql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mergeable_aggregates_are_pushed() {
    let (_nodes, on, off, local) = setup().await;
    for sql in [
        "SELECT k, stddev(v) AS a, stddev_pop(v) AS b, var(m) AS c, var_pop(m) AS d FROM g GROUP BY k",
        "SELECT n, bool_and(v > 3) AS a, bool_or(m < 10) AS b, count(*) AS c FROM g GROUP BY n",
        "SELECT k, approx_distinct(m) AS d FROM g GROUP BY k",
    ] {
        let plan = explain(&on, sql).await;
        assert!(plan.contains("partial aggregate at"), "{sql}\n{plan}");
        assert_same(&local, &on, sql).await;
        assert_same(&local, &off, sql).await;
    }
}

/// A median's partial state is every value; over a value of few distinct values the
/// nodes send (value, count) pairs instead (`v`: 40 values and NULL; `n`: 50 and
/// NULL), and the median is taken here from them: the same answer, from at most a
/// pair per key and value and partition. A median over a value of many values per
/// group (`m`) is read here as before, as are medians of two values or beside an
/// aggregate that does not merge over finer groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn medians_of_few_values_come_from_counted_values() {
    let (nodes, on, off, local) = setup().await;
    let pushed = [
        "SELECT k, median(v) AS m FROM g GROUP BY k",
        "SELECT n, median(v) AS md, count(*) AS c, count(v) AS cv, sum(m) AS s, \
         sum(v) AS sv, min(s) AS lo, max(v) AS hi FROM g GROUP BY n",
        "SELECT k, median(n) AS m, median(n) * 2 AS twice FROM g WHERE id % 3 <> 0 GROUP BY k",
        "SELECT k, median(CAST(v AS DECIMAL(10, 2))) AS m, sum(CAST(v AS DECIMAL(10, 2))) AS s \
         FROM g GROUP BY k",
        "SELECT k FROM g GROUP BY k HAVING median(v) > 19",
        "SELECT median(v) AS m, count(*) AS c FROM g",
        "SELECT median(v) AS m, count(*) AS c, sum(m) AS s FROM g WHERE id < 0",
    ];
    for sql in pushed {
        let plan = explain(&on, sql).await;
        assert!(
            plan.contains("partial aggregate at") && plan.contains("median_weighted"),
            "{sql}\n{plan}"
        );
        assert_same(&local, &on, sql).await;
        assert_same(&local, &off, sql).await;
    }
    let run = on.run(pushed[0]).await.unwrap();
    let returned: u64 = run.node_runs.iter().map(|e| e.report.rows_returned).sum();
    assert!(
        returned > 0 && returned <= 4 * 7 * 41,
        "{returned} rows came from the nodes\n{}",
        run.plan_with_metrics()
    );
    for sql in [
        // 7 keys × 3,000 values: more pairs than rows.
        "SELECT k, median(m) AS md FROM g GROUP BY k",
        "SELECT k, median(v) AS a, median(n) AS b FROM g GROUP BY k",
        "SELECT k, median(v) AS a, avg(v) AS b FROM g GROUP BY k",
        "SELECT k, median(DISTINCT v) AS a FROM g GROUP BY k",
    ] {
        let plan = explain(&on, sql).await;
        assert!(!plan.contains("median_weighted"), "{sql}\n{plan}");
        assert_same(&local, &on, sql).await;
    }
    // On workers, whose sessions have the final step's function too.
    let (urls, _stop) = crate::distributed::workers(2).await;
    let on_workers = crate::distributed::session_on(&nodes, &urls).await;
    for sql in &pushed[..3] {
        assert_same(&local, &on_workers, sql).await;
    }
}
