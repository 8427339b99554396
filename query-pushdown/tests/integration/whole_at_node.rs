//! A table all of whose partitions live on one node: its aggregates, the filters
//! over them and the aggregates over those run whole at that node, which answers
//! the query's rows; over two nodes they stay in two phases. Every answer equals
//! DataFusion's over the same rows and the same query without pushdown.

use csd_query_pushdown::CsdSession;
use csd_runtime::admission::Policy;
use csd_runtime::config::NodeConfig;
use datafusion::prelude::SessionContext;

use crate::explain::explain;
use crate::shrink::{ROWS, rows, schema, setup};
use crate::{assert_same, register_local, sessions, sql_node_with};

const WHOLE: &str = "whole at the one storage node";

/// Queries whose work does not shrink in two phases (a group per row, a median of
/// every value, groups of groups), and ones that do.
const QUERIES: &[&str] = &[
    "SELECT count(*) AS n FROM (SELECT id, sum(v) AS s FROM g GROUP BY id HAVING sum(v) > 20) x",
    "SELECT k, s, median(m) AS med, stddev(v) AS sd, count(*) AS c FROM g GROUP BY k, s ORDER BY k, s",
    "SELECT count(*) AS groups, sum(c) AS rows FROM (SELECT k, m, n, count(*) AS c FROM g GROUP BY k, m, n) t",
    "SELECT k, median(v) AS med FROM g WHERE n IS NULL GROUP BY k ORDER BY med DESC, k LIMIT 3",
    "SELECT k, count(DISTINCT s) AS d, avg(v) AS a FROM g GROUP BY k",
    "SELECT max(s) AS top FROM (SELECT k, n, sum(m) AS s FROM g GROUP BY k, n) t WHERE n IS NOT NULL",
    "SELECT median(m) AS med FROM g WHERE m < 0",
    // Windows under an aggregate: running totals, the default RANGE frame over ties,
    // a frame to the partition's end, a ranked filter.
    "SELECT k, max(run) AS top FROM (SELECT k, sum(m) OVER (PARTITION BY k ORDER BY id ROWS UNBOUNDED PRECEDING) AS run FROM g) t GROUP BY k ORDER BY k",
    "SELECT k, min(c) AS lo, max(c) AS hi, sum(r) AS s FROM (SELECT k, count(*) OVER (PARTITION BY k ORDER BY n) AS c, \
     sum(v) OVER (PARTITION BY k ORDER BY n, id ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING) AS r FROM g) t GROUP BY k",
    "SELECT k, count(*) AS n, sum(v) AS s FROM (SELECT k, v, row_number() OVER (PARTITION BY m ORDER BY v DESC NULLS LAST, id) AS rn FROM g) t \
     WHERE rn <= 2 GROUP BY k ORDER BY k",
];

/// Windows whose Substrait form would not read back the same stay here.
const NOT_WHOLE: &[&str] = &[
    "SELECT k, max(w) AS top FROM (SELECT k, sum(m) OVER (PARTITION BY k ORDER BY id ROWS BETWEEN 2 PRECEDING AND CURRENT ROW) AS w FROM g) t GROUP BY k",
    "SELECT k, max(d) AS top FROM (SELECT k, m - lag(m) OVER (PARTITION BY k ORDER BY id) AS d FROM g) t GROUP BY k",
    "SELECT k, max(w) AS top FROM (SELECT k, count(*) FILTER (WHERE n > 3) OVER (PARTITION BY k ORDER BY id) AS w FROM g) t GROUP BY k",
];

/// `g` in three uneven partitions of one node.
async fn one_node(config: NodeConfig) -> (csd_runtime::node::RunningNode, SessionContext) {
    let node = sql_node_with(config).await;
    let client = csd_protocol::node_client::NodeClient::connect(&node.url)
        .await
        .unwrap();
    let all = rows();
    let cuts = [0, ROWS as usize / 6, ROWS as usize / 2, ROWS as usize];
    for (p, w) in cuts.windows(2).enumerate() {
        client
            .put(
                "g",
                &format!("p{p}"),
                schema(),
                futures::stream::iter([Ok(all.slice(w[0], w[1] - w[0]))]),
            )
            .await
            .unwrap();
    }
    let local = SessionContext::new();
    register_local(&local, "g", schema(), vec![all]);
    (node, local)
}

async fn set(session: &CsdSession, sql: &str) {
    session.ctx.sql(sql).await.unwrap().collect().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_nodes_table_is_aggregated_whole_there() {
    let (node, local) = one_node(NodeConfig::default()).await;
    let (on, off) = sessions(std::slice::from_ref(&node)).await;
    for sql in QUERIES {
        let plan = explain(&on, sql).await;
        assert!(plan.contains(WHOLE), "{sql}\n{plan}");
        assert_same(&local, &on, sql).await;
        assert_same(&local, &off, sql).await;
        let run = on.run(sql).await.unwrap();
        assert!(
            run.node_runs.len() == 1 && !run.node_runs[0].work_pushed_back(),
            "{sql}: {:?}",
            run.node_runs
        );
        // The answer's rows, not the table's: the group per row stays at the node
        // (a one-row answer's IPC message may be more than a read the footers' min
        // and max pruned away).
        let read = off.run(sql).await.unwrap().bytes_moved;
        assert!(
            run.bytes_moved * 2 < read.max(1_000),
            "{sql}: {} bytes against {read} read here",
            run.bytes_moved
        );
    }
    // A window's sort is counted as state, through the window to the table's keys.
    let plan = explain(&on, QUERIES[7]).await;
    assert!(plan.contains("MiB of state there"), "{plan}");
    for sql in NOT_WHOLE {
        assert!(!explain(&on, sql).await.contains(WHOLE), "{sql}");
        assert_same(&local, &on, sql).await;
    }
    // A scan alone is not an aggregate: its filters and projection go down as before.
    let sql = "SELECT id, v FROM g WHERE m = 5";
    assert!(!explain(&on, sql).await.contains(WHOLE));
    assert_same(&local, &on, sql).await;
    // A part whose state the sketches put above the bound stays in two phases: the
    // group per row is kept here, the seven groups' aggregate is pushed.
    set(&on, "SET csd.whole_at_node_max_state = 100000").await;
    let plan = explain(&on, QUERIES[0]).await;
    assert!(
        !plan.contains(WHOLE) && plan.contains("kept here"),
        "{plan}"
    );
    assert_same(&local, &on, QUERIES[0]).await;
    let sql = "SELECT k, count(*) AS c FROM g GROUP BY k";
    let plan = explain(&on, sql).await;
    assert!(
        plan.contains(WHOLE) && plan.contains("MiB of state there"),
        "{plan}"
    );
    assert_same(&local, &on, sql).await;
    // The setting puts two phases back.
    set(&on, "SET csd.whole_at_node = false").await;
    let plan = explain(&on, QUERIES[0]).await;
    assert!(
        !plan.contains(WHOLE) && plan.contains("kept here"),
        "{plan}"
    );
    assert_same(&local, &on, QUERIES[0]).await;
}

/// A node that admits nothing hands the part back, and the compute tier runs it
/// over the Parquet read by byte range: the same answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_part_handed_back_is_run_here() {
    let (node, local) = one_node(NodeConfig {
        policy: Policy::Never,
        ..NodeConfig::default()
    })
    .await;
    let (on, _off) = sessions(std::slice::from_ref(&node)).await;
    for sql in QUERIES {
        assert!(explain(&on, sql).await.contains(WHOLE), "{sql}");
        assert_same(&local, &on, sql).await;
        let run = on.run(sql).await.unwrap();
        assert!(
            run.node_runs.iter().all(|r| r.work_pushed_back()),
            "{sql}: {:?}",
            run.node_runs
        );
    }
}

/// Over two nodes no node holds the whole table: two phases, or kept here.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_tables_stay_in_two_phases() {
    let (_nodes, on, off, local) = setup().await;
    for sql in QUERIES {
        assert!(!explain(&on, sql).await.contains(WHOLE), "{sql}");
        assert_same(&local, &on, sql).await;
        assert_same(&local, &off, sql).await;
    }
}
