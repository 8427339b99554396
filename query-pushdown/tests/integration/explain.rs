//! What EXPLAIN says was pushed, and what EXPLAIN ANALYZE reports per node.

use arrow::util::pretty::pretty_format_batches;
use std::sync::Arc;

use csd_query_pushdown::{CsdScanExec, EndpointRun};
use csd_query_pushdown::{CsdSession, Mode, QueryRun};
use csd_testbed::tpch;
use datafusion::physical_plan::ExecutionPlan;

use crate::{nodes, sessions};

pub(crate) async fn explain(s: &CsdSession, sql: &str) -> String {
    let b = s
        .ctx
        .sql(&format!("explain {sql}"))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    pretty_format_batches(&b).unwrap().to_string()
}

/// Runs `sql` with pushdown on and off, checks that the answers are the same, and
/// returns the pushdown run.
async fn same_answer(on: &CsdSession, off: &CsdSession, sql: &str) -> QueryRun {
    let run = on.run(sql).await.unwrap();
    let base = off.run(sql).await.unwrap();
    assert_eq!(
        crate::canonical(&run.batches),
        crate::canonical(&base.batches)
    );
    run
}

/// The physical `CsdScanExec` lines of an EXPLAIN.
fn scans(plan: &str) -> Vec<&str> {
    plan.lines()
        .filter(|l| l.contains("CsdScanExec:"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn explain_shows_what_is_pushed() {
    let (nodes, clients) = nodes(2).await;
    tpch::load(&clients, 0.002, 1, |_, _| {}).await.unwrap();
    let (on, off) = sessions(&nodes).await;

    // Q1: filter, projection and the partial aggregate go to both nodes.
    let q1 = explain(&on, tpch::query(1).unwrap()).await;
    assert!(q1.contains("CsdPushdown: partial aggregate"), "{q1}");
    let s = scans(&q1);
    assert_eq!(s.len(), 1, "{q1}");
    assert!(s[0].contains("returns=partial aggregate"), "{q1}");
    assert!(
        s[0].contains("Aggregate: groupBy=[[lineitem.l_returnflag, lineitem.l_linestatus]]"),
        "{q1}"
    );
    assert!(
        s[0].contains("l_shipdate <= Date32(\"1998-09-02\")"),
        "{q1}"
    );
    for n in &nodes {
        assert!(
            s[0].contains(&format!("{}/p", n.url)),
            "endpoint of {} missing: {q1}",
            n.url
        );
    }
    // DataFusion's final aggregate stays on the compute tier.
    assert!(q1.contains("AggregateExec: mode=Final"), "{q1}");

    // Q6: the whole filter is pushed, only the final sum is left here.
    let q6 = explain(&on, tpch::query(6).unwrap()).await;
    let s = scans(&q6);
    assert!(s[0].contains("l_discount >= Decimal128(0.05,15,2)"), "{q6}");
    assert!(s[0].contains("l_quantity < Decimal128(24.00,15,2)"), "{q6}");
    assert!(s[0].contains("returns=partial aggregate"), "{q6}");
    assert!(
        !q6.contains("FilterExec"),
        "no filter should remain here: {q6}"
    );

    // Top-k: sorted and cut at the nodes, merged here.
    let topk = explain(
        &on,
        "select l_orderkey, l_extendedprice from lineitem order by l_extendedprice desc limit 5",
    )
    .await;
    assert!(topk.contains("CsdPushdown: top-k"), "{topk}");
    assert!(
        scans(&topk)[0].contains("Sort: lineitem.l_extendedprice DESC NULLS FIRST, fetch=5"),
        "{topk}"
    );

    // LIMIT alone: each node stops after 3 rows.
    let lim = explain(&on, "select l_comment from lineitem limit 3").await;
    assert!(scans(&lim)[0].contains("Limit: skip=0, fetch=3"), "{lim}");
    assert!(scans(&lim)[0].contains("projection=[l_comment]"), "{lim}");

    // A volatile filter stays here; the exact one goes to the nodes.
    let vol = explain(
        &on,
        "select count(*) from lineitem where random() < 0.5 and l_quantity < 10",
    )
    .await;
    assert!(vol.contains("FilterExec: random()"), "{vol}");
    assert!(!scans(&vol)[0].contains("random"), "{vol}");
    assert!(scans(&vol)[0].contains("l_quantity <"), "{vol}");
    assert!(
        !vol.contains("CsdPushdown"),
        "no aggregate push above a local filter: {vol}"
    );

    // Joins stay here; the filtered side pushes its filters and projection. The side
    // that would reduce nothing by itself (orders, no filter) is the probe side of
    // the join: it waits for the build side's keys and asks the nodes for the
    // matching rows only (without a filter it reads Parquet byte ranges).
    let q12 = explain(&on, tpch::query(12).unwrap()).await;
    let s = scans(&q12);
    assert_eq!(s.len(), 2, "{q12}");
    assert!(
        s[0].contains("table=lineitem") && s[0].contains("l_shipmode"),
        "{q12}"
    );
    assert!(!s[0].contains("key_filter"), "{q12}");
    assert!(
        s[1].contains("table=orders")
            && s[1].contains("direct=byte ranges")
            && s[1].contains("key_filter=[o_orderkey]"),
        "{q12}"
    );
    assert!(q12.contains("KeyCollectExec"), "{q12}");
    assert!(q12.contains("HashJoinExec"), "{q12}");

    // Scalar subqueries are planned like the rest: both of Q15's `revenue0` (the
    // one joined and the one under `max`) and Q22's average balance are partial
    // aggregates at the nodes.
    for (q, table, want) in [(15, "lineitem", 2), (22, "customer", 1)] {
        let plan = explain(&on, tpch::query(q).unwrap()).await;
        let aggregated = scans(&plan)
            .iter()
            .filter(|l| l.contains(&format!("table={table}")))
            .filter(|l| l.contains("returns=partial aggregate"))
            .count();
        assert_eq!(aggregated, want, "Q{q}: {plan}");
        same_answer(&on, &off, tpch::query(q).unwrap()).await;
    }

    // Without pushdown nothing is pushed: DataFusion reads Parquet by range.
    let base = explain(&off, tpch::query(1).unwrap()).await;
    assert!(
        !base.contains("CsdScanExec") && base.contains("DataSourceExec"),
        "{base}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn explain_analyze_reports_each_node() {
    let (nodes, clients) = nodes(2).await;
    tpch::load(&clients, 0.002, 1, |_, _| {}).await.unwrap();
    let (on, _) = sessions(&nodes).await;
    let b = on
        .ctx
        .sql(&format!("explain analyze {}", tpch::query(6).unwrap()))
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let text = pretty_format_batches(&b).unwrap().to_string();
    let line = text.lines().find(|l| l.contains("CsdScanExec:")).unwrap();
    assert!(line.contains("at_nodes=["), "{text}");
    for n in &nodes {
        let at = line
            .split(&format!("{}/p", n.url))
            .nth(2)
            .unwrap_or_else(|| panic!("{} missing in {line}", n.url));
        let read: u64 = at
            .split("device_read=")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let scanned: u64 = at
            .split("rows_scanned=")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(read > 0 && scanned > 0, "{line}");
    }
    // The same figures through the API: pushdown moved far fewer bytes than it read.
    let run = on.run(tpch::query(6).unwrap()).await.unwrap();
    let read: u64 = run.node_runs.iter().map(|r| r.report.bytes_read).sum();
    assert_eq!(run.node_runs.len(), 2);
    assert!(
        run.bytes_moved * 10 < read,
        "moved {} of {read} read",
        run.bytes_moved
    );
    assert_eq!(run.rows(), 1);
}

/// Join-key filters: the probe side of a join gets only rows whose key the build
/// side has, when the filter is selective; a filter that keeps most rows is handed
/// back and the scan reads Parquet instead; joins that keep unmatched probe rows get
/// no filter. Answers always equal the same query without pushdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn join_key_filters_shrink_the_probe_side() {
    let (nodes, clients) = nodes(2).await;
    tpch::load(&clients, 0.01, 1, |_, _| {}).await.unwrap();
    let (on, off) = sessions(&nodes).await;
    let orders_rows: u64 = 15_000;
    let check = async |sql: &str| {
        let a = on.run(sql).await.unwrap();
        let b = off.run(sql).await.unwrap();
        assert_eq!(
            crate::canonical(&a.batches),
            crate::canonical(&b.batches),
            "{sql}"
        );
        a
    };

    // Selective: a few hundred orders' keys out of 15,000.
    let sel = "select o_orderpriority, count(*) from lineitem join orders on l_orderkey = o_orderkey \
               where l_shipmode = 'MAIL' and l_quantity > 49 group by o_orderpriority";
    let run = check(sel).await;
    let text = run.plan_with_metrics();
    let line = text.lines().find(|l| l.contains("table=orders")).unwrap();
    assert!(line.contains("key_filter=[o_orderkey]"), "{text}");
    // Each node holds one contiguous range of order keys (TPC-H's generator writes
    // orders in key order), so each got only the keys of its range: together all
    // of them, each fewer.
    let count = |after: &str| -> Vec<usize> {
        let from = line
            .find(after)
            .map(|i| &line[i + after.len()..])
            .unwrap_or_default();
        let to = from.find(" keys)").unwrap_or(0);
        from[..to]
            .split(", ")
            .filter_map(|n| n.parse().ok())
            .collect()
    };
    let whole = count("from a hash join's build side (");
    let cut = count("cut to nodes' key ranges (");
    assert!(whole.len() == 1 && cut.len() == 2, "{text}");
    assert_eq!(cut.iter().sum::<usize>(), whole[0], "{text}");
    assert!(cut.iter().all(|&k| k > 0 && k < whole[0]), "{text}");
    let orders = runs_of(&run.plan, "orders");
    assert_eq!(orders.len(), 2, "{text}");
    let returned: u64 = orders.iter().map(|r| r.report.rows_returned).sum();
    assert!(
        orders.iter().all(|r| !r.direct && r.pushed_back.is_none()),
        "orders was not filtered at the nodes: {text}"
    );
    assert!(
        returned > 0 && returned < orders_rows / 10,
        "the key filter kept {returned} of {orders_rows} orders: {text}"
    );

    // Not selective: every order of a year's worth of lineitems; handed back, read here.
    let wide = "select count(*) from lineitem join orders on l_orderkey = o_orderkey \
                where l_quantity > 0";
    let run = check(wide).await;
    let orders = runs_of(&run.plan, "orders");
    assert!(
        !orders.is_empty()
            && orders.iter().all(|r| r.direct
                && r.pushed_back
                    .as_ref()
                    .is_some_and(|w| w.reason().contains("join-key filter keeps"))),
        "{}",
        run.plan_with_metrics()
    );

    // A right join keeps unmatched probe rows: no filter; nor for a full join.
    for sql in [
        "select count(*), count(l_orderkey) from (select * from lineitem where l_quantity > 49) l \
         right join orders on l_orderkey = o_orderkey",
        "select count(*), count(o_orderkey) from (select * from lineitem where l_quantity > 49) l \
         full join orders on l_orderkey = o_orderkey",
    ] {
        let run = check(sql).await;
        let text = run.plan_with_metrics();
        assert!(!text.contains("key_filter="), "{text}");
    }
    // A whole, unfiltered table on the build side (Q13: every customer) holds every
    // key its probe side refers to: no filter.
    let run = check(tpch::query(13).unwrap()).await;
    let text = run.plan_with_metrics();
    assert!(
        !text.contains("KeyCollectExec") && !text.contains("key_filter="),
        "{text}"
    );
    // Through inner joins, on the key columns one table provides: in Q5 the suppliers
    // of one region (joined on supplier and nation keys) filter lineitem below its
    // join with orders, besides the orders of one year.
    let run = check(tpch::query(5).unwrap()).await;
    let text = run.plan_with_metrics();
    let line = text.lines().find(|l| l.contains("table=lineitem")).unwrap();
    assert!(
        line.contains("key_filter=[l_orderkey]") && line.contains("key_filter=[l_suppkey]"),
        "{text}"
    );
    let lineitem = runs_of(&run.plan, "lineitem");
    let sent: u64 = lineitem.iter().map(|r| r.report.rows_returned).sum();
    assert!(
        lineitem.iter().all(|r| !r.direct) && sent > 0 && sent < 60_175 / 20,
        "lineitem sent {sent} rows: {text}"
    );
    // A build side filtered only by a join above it: in Q11's subquery nation filters
    // supplier, whose keys then filter partsupp (a second pass of the rule).
    let run = check(tpch::query(11).unwrap()).await;
    let text = run.plan_with_metrics();
    let partsupp: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("table=partsupp"))
        .collect();
    assert!(
        partsupp.len() == 2
            && partsupp
                .iter()
                .all(|l| l.contains("key_filter=[ps_suppkey]")),
        "{text}"
    );
    // Through an aggregate, on its group column: Q17's few parts filter the per-part
    // partial averages lineitem sends (2,000 groups a partition unfiltered).
    let run = check(tpch::query(17).unwrap()).await;
    let text = run.plan_with_metrics();
    let line = text
        .lines()
        .find(|l| l.contains("table=lineitem") && l.contains("returns=partial aggregate"))
        .unwrap();
    assert!(line.contains("key_filter=[l_partkey]"), "{text}");
    let groups: u64 = scans_of(&run.plan, "lineitem")
        .iter()
        .filter(|s| s.mode() == Mode::PartialAggregate)
        .flat_map(|s| s.runs())
        .map(|r| r.report.rows_returned)
        .sum();
    assert!(
        groups < 200,
        "lineitem sent {groups} partial groups: {text}"
    );
    // Estimated filter selectivity from the footers' ranges orders the joins: Q10's
    // quarter of orders (about 570 of 15,000) builds the join, and its customer keys
    // filter customer, rather than all 1,500 customers building it.
    let run = check(tpch::query(10).unwrap()).await;
    let text = run.plan_with_metrics();
    let line = text.lines().find(|l| l.contains("table=customer")).unwrap();
    assert!(line.contains("key_filter=[c_custkey]"), "{text}");
    // Anti and semi joins (NOT EXISTS / IN) are filtered and stay exact.
    check(
        "select count(*) from orders where not exists \
         (select 1 from lineitem where l_orderkey = o_orderkey and l_quantity > 49)",
    )
    .await;
    check(
        "select count(*) from orders where o_orderkey in \
         (select l_orderkey from lineitem where l_quantity > 49)",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn whole_aggregates_run_where_partitions_hold_disjoint_keys() {
    // tpchgen's parts hold disjoint order-key ranges: one per node here.
    let (nodes, clients) = nodes(2).await;
    tpch::load(&clients, 0.005, 1, |_, _| {}).await.unwrap();
    let (on, off) = sessions(&nodes).await;
    let heavy = "select l_orderkey, sum(l_quantity) as q from lineitem \
                 group by l_orderkey having sum(l_quantity) > 250 order by l_orderkey";
    let a = on.run(heavy).await.unwrap();
    let b = off.run(heavy).await.unwrap();
    assert_eq!(crate::canonical(&a.batches), crate::canonical(&b.batches));
    assert!(a.rows() > 0 && a.rows() < 100, "{} heavy orders", a.rows());
    let text = a.plan_with_metrics();
    assert!(text.contains("pinned=objects as planned"), "{text}");
    let logical = explain(&on, heavy).await;
    assert!(
        logical.contains(
            "CsdPushdown: whole aggregate at every storage-node partition \
             (partitions hold disjoint ranges of l_orderkey)"
        ),
        "{logical}"
    );
    assert!(
        !text.contains("AggregateExec"),
        "no aggregate left here: {text}"
    );
    // The nodes send only the groups HAVING keeps, not one row per order.
    let runs = runs_of(&a.plan, "lineitem");
    assert_eq!(runs.len(), 2, "{text}");
    let returned: u64 = runs.iter().map(|r| r.report.rows_returned).sum();
    assert_eq!(returned, a.rows() as u64, "{text}");

    // Q18: its IN subquery is such an aggregate, and its semi join moves below the
    // other joins to orders (`SemiJoinDown`), so the few heavy orders' keys filter
    // orders and then lineitem at the nodes.
    let q18 = explain(&on, tpch::query(18).unwrap()).await;
    assert!(q18.contains("CsdPushdown: whole aggregate"), "{q18}");
    let run = same_answer(&on, &off, tpch::query(18).unwrap()).await;
    let text = run.plan_with_metrics();
    assert!(
        text.lines()
            .any(|l| l.contains("table=orders") && l.contains("key_filter=[o_orderkey]")),
        "{text}"
    );
    let orders = runs_of(&run.plan, "orders");
    let kept: u64 = orders.iter().map(|r| r.report.rows_returned).sum();
    assert!(
        !orders.is_empty() && orders.iter().all(|r| !r.direct) && kept < 100,
        "orders sent {kept} rows: {text}"
    );
    let top = "select l_orderkey, count(*) as n from lineitem group by l_orderkey \
               order by n desc, l_orderkey limit 3";
    let t = explain(&on, top).await;
    assert!(
        t.contains("CsdPushdown: top-k") && t.contains("disjoint ranges of l_orderkey"),
        "{t}"
    );
    same_answer(&on, &off, top).await;

    // Suppliers span both parts: partial aggregates, merged here.
    let by_supp = explain(
        &on,
        "select l_suppkey, count(*) from lineitem group by l_suppkey",
    )
    .await;
    assert!(
        by_supp.contains("CsdPushdown: partial aggregate"),
        "{by_supp}"
    );
    assert!(!by_supp.contains("disjoint"), "{by_supp}");

    // Node 0 gains order keys inside node 1's range: the ranges overlap now. The
    // session planned with the old objects, and the node refuses its fragment
    // rather than answer with a group split over two partitions.
    let first = futures::TryStreamExt::try_next(
        &mut clients[1]
            .scan_limit("lineitem", None, &[], Some(1))
            .await
            .unwrap(),
    )
    .await
    .unwrap()
    .unwrap();
    let one = first.slice(0, 1);
    let stray_key = one
        .column(0)
        .as_any()
        .downcast_ref::<arrow::array::Int64Array>()
        .unwrap()
        .value(0);
    clients[0]
        .put(
            "lineitem",
            "p0",
            one.schema(),
            futures::stream::iter([Ok(one.clone())]),
        )
        .await
        .unwrap();
    let err = on.run(heavy).await.unwrap_err().to_string();
    assert!(err.contains("changed since the query was planned"), "{err}");
    // Planned afresh, the aggregate is partial again and the answer still exact
    // (the stray row's order now has its quantity counted twice, in both modes).
    let (on, off) = sessions(&nodes).await;
    let sql = format!(
        "select l_orderkey, sum(l_quantity), count(*) from lineitem \
         where l_orderkey = {stray_key} group by l_orderkey"
    );
    let text = explain(&on, &sql).await;
    assert!(
        text.contains("partial aggregate") && !text.contains("disjoint"),
        "{text}"
    );
    let a = on.run(&sql).await.unwrap();
    let b = off.run(&sql).await.unwrap();
    assert_eq!(crate::canonical(&a.batches), crate::canonical(&b.batches));
    let x = on.run(heavy).await.unwrap();
    let y = off.run(heavy).await.unwrap();
    assert_eq!(crate::canonical(&x.batches), crate::canonical(&y.batches));
}

/// What the endpoints of `table`'s scans in `plan` did.
/// The key count of the first key filter on `column` in a plan with metrics.
fn filter_keys(plan: &str, column: &str) -> Option<u64> {
    let at = plan.find(&format!("key_filter=[{column}]"))?;
    let rest = &plan[at..];
    let open = rest.find('(')?;
    let n: String = rest[open + 1..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    n.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn filtered_dimension_joins_move_down_to_their_table() {
    let (nodes, clients) = nodes(2).await;
    tpch::load(&clients, 0.01, 1, |_, _| {}).await.unwrap();
    let (on, off) = sessions(&nodes).await;
    let suppliers = 100; // SF 0.01

    // Q21 joins nation (`n_name = 'SAUDI ARABIA'`) last; moved down to supplier, its
    // few suppliers' keys filter lineitem at the nodes.
    let run = same_answer(&on, &off, tpch::query(21).unwrap()).await;
    let text = run.plan_with_metrics();
    let keys = filter_keys(&text, "l_suppkey").unwrap_or(u64::MAX);
    assert!(keys < suppliers / 10, "{keys} supplier keys: {text}");
    let lineitem = 60_175; // SF 0.01
    let sent: u64 = runs_of(&run.plan, "lineitem")
        .iter()
        .map(|r| r.report.rows_returned)
        .sum();
    assert!(sent < lineitem / 5, "lineitem sent {sent} rows: {text}");

    // Q7: both nation joins move, one to supplier and one to customer; the join
    // filter that needs both nations stays above them.
    let run = same_answer(&on, &off, tpch::query(7).unwrap()).await;
    let text = run.plan_with_metrics();
    assert!(
        filter_keys(&text, "l_suppkey").is_some_and(|k| k < suppliers / 5),
        "{text}"
    );
    assert!(filter_keys(&text, "c_nationkey") == Some(2), "{text}");

    // A filtered input bigger than the join it would pass stays where it is: Q3's
    // lineitem still waits for the keys of `customer ⋈ orders`.
    let run = same_answer(&on, &off, tpch::query(3).unwrap()).await;
    let text = run.plan_with_metrics();
    assert!(filter_keys(&text, "l_orderkey").is_some(), "{text}");
    assert!(filter_keys(&text, "o_orderkey").is_none(), "{text}");

    // Through projections and with a join filter on other columns: results match.
    let sql = "select s.s_name, count(*) as n \
               from lineitem l join orders o on l.l_orderkey = o.o_orderkey \
               join supplier s on l.l_suppkey = s.s_suppkey \
               join nation n on s.s_nationkey = n.n_nationkey \
               and o.o_orderpriority <> n.n_comment \
               where n.n_name in ('GERMANY', 'PERU') \
               group by s.s_name order by n desc, s.s_name limit 5";
    let x = same_answer(&on, &off, sql).await;
    assert!(x.rows() > 0);
}

fn runs_of(plan: &Arc<dyn ExecutionPlan>, table: &str) -> Vec<EndpointRun> {
    scans_of(plan, table)
        .iter()
        .flat_map(|s| s.runs())
        .collect()
}

/// The scans of `table` in `plan`.
fn scans_of<'a>(plan: &'a Arc<dyn ExecutionPlan>, table: &str) -> Vec<&'a CsdScanExec> {
    let mut out = Vec::new();
    if let Some(s) = plan.downcast_ref::<CsdScanExec>()
        && s.table().name() == table
    {
        out.push(s);
    }
    for c in plan.children() {
        out.extend(scans_of(c, table));
    }
    out
}

/// Prints EXPLAIN for TPC-H query `CSD_EXPLAIN_Q` (a debugging aid):
/// `CSD_EXPLAIN_Q=22 cargo test -p csd-query-pushdown --test integration print_explain -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore]
async fn print_explain() {
    let q: u32 = std::env::var("CSD_EXPLAIN_Q").unwrap().parse().unwrap();
    let sf: f64 = std::env::var("CSD_EXPLAIN_SF")
        .map(|s| s.parse().unwrap())
        .unwrap_or(0.01);
    let (nodes, clients) = nodes(1).await;
    tpch::load(&clients, sf, 2, |_, _| {}).await.unwrap();
    let (on, _) = sessions(&nodes).await;
    println!("{}", explain(&on, tpch::query(q).unwrap()).await);
    let r = on.run(tpch::query(q).unwrap()).await.unwrap();
    println!("moved {} bytes", r.bytes_moved);
    for n in &r.node_runs {
        println!("{n:?}");
    }
}
