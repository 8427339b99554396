//! Running totals over a window (`sum`/`count`/`min`/`max` from the partition's first
//! row to the current one) are computed a batch at a time on the compute tier, over
//! rows the nodes read; the answer is DataFusion's over the same rows, with pushdown
//! and without.

use crate::assert_same;
use crate::explain::explain;
use crate::shrink::setup;

const RUNNING: &str = "RunningWindowExec";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn running_totals_equal_datafusions_window() {
    let (nodes, on, off, local) = setup().await;
    let rows = "ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW";
    for sql in [
        // The groups workload's q16: the largest running total of each of 7 groups.
        format!(
            "SELECT k, max(run) AS m FROM (SELECT k, sum(m) OVER (PARTITION BY k ORDER BY id \
             {rows}) AS run FROM g) t GROUP BY k ORDER BY k"
        ),
        // Every row's totals, with NULLs in the values and the partition key.
        format!(
            "SELECT id, sum(n) OVER (PARTITION BY k ORDER BY id {rows}) a, \
             count(n) OVER (PARTITION BY k ORDER BY id {rows}) b, \
             max(m) OVER (PARTITION BY k ORDER BY id {rows}) c, \
             sum(v) OVER (PARTITION BY n ORDER BY id {rows}) d FROM g"
        ),
        // The default frame: peers (ties in `v`) share the total at their last row.
        "SELECT id, sum(m) OVER (PARTITION BY s ORDER BY v) a, \
         count(*) OVER (PARTITION BY s ORDER BY v) b, \
         min(n) OVER (PARTITION BY s ORDER BY v) c FROM g"
            .to_string(),
    ] {
        let plan = explain(&on, &sql).await;
        assert!(plan.contains(RUNNING), "{sql}\n{plan}");
        assert_same(&local, &on, &sql).await;
        assert_same(&local, &off, &sql).await;
    }
    // An average over a sliding frame stays DataFusion's.
    let sql = "SELECT id, avg(m) OVER (PARTITION BY k ORDER BY id ROWS BETWEEN 3 PRECEDING AND CURRENT ROW) a FROM g";
    assert!(!explain(&on, sql).await.contains(RUNNING));
    assert_same(&local, &on, sql).await;
    drop(nodes);
}
