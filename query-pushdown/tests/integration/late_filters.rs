//! A filter the objects' min/max say keeps very few rows, in a read of many more
//! columns than the filter's, is evaluated while decoding at the nodes (Parquet late
//! materialization); other filters are evaluated on decoded batches. Either way the
//! answer is the one without pushdown.

use crate::assert_same;
use crate::explain::explain;
use crate::shrink::setup;

const LATE: &str = "late_filters=filtered while decoding";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_needle_in_a_wide_read_is_filtered_while_decoding() {
    let (nodes, on, off, local) = setup().await;
    // `id` is unique over 24,000 rows: one row of its range.
    for sql in [
        "SELECT * FROM g WHERE id = 4242",
        "SELECT id, k, s, v FROM g WHERE id BETWEEN 100 AND 101",
    ] {
        let plan = explain(&on, sql).await;
        assert!(plan.contains(LATE), "{sql}\n{plan}");
        assert_same(&local, &on, sql).await;
        assert_same(&local, &off, sql).await;
    }
    for sql in [
        // `m` has 3,000 values: a third of a thousandth of the rows each.
        "SELECT * FROM g WHERE m = 17",
        // Narrow: one column beside the filter's.
        "SELECT id, k FROM g WHERE id = 4242",
        // The string's range is not known: no estimate.
        "SELECT * FROM g WHERE s = 's17'",
    ] {
        let plan = explain(&on, sql).await;
        assert!(!plan.contains(LATE), "{sql}\n{plan}");
        assert_same(&local, &on, sql).await;
    }
    // The setting moves the line: 0 never.
    on.ctx
        .sql("SET csd.late_filters_below = 0")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let sql = "SELECT * FROM g WHERE id = 4242";
    assert!(!explain(&on, sql).await.contains(LATE));
    assert_same(&local, &on, sql).await;
    drop(nodes);
}
