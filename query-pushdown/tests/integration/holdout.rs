//! Queries written the way users write them, not the way the rules were: functions
//! in GROUP BY keys, concatenation, long AND/OR chains, big IN lists, deep nesting,
//! and nodes that refuse functions. Every one answers through pushdown exactly as
//! DataFusion does locally; what a node cannot take stays on the compute tier.

use std::fmt::Write as _;

use csd_protocol::node_client::{Declined, NodeClient};
use csd_query_pushdown::{Cluster, CsdSession, SQL_RECURSION_LIMIT, SessionOptions};
use csd_runtime::config::NodeConfig;
use datafusion::prelude::SessionContext;

use crate::edge::{put_t, schema};
use crate::{assert_same, register_local, sql_node_with};

/// Two nodes (the given settings) holding table `t` of the edge tests, 12k rows,
/// and the same table locally.
async fn setup(config: NodeConfig) -> (Vec<csd_runtime::node::RunningNode>, SessionContext) {
    let mut nodes = Vec::new();
    for _ in 0..2 {
        nodes.push(sql_node_with(config.clone()).await);
    }
    let mut local_config = datafusion::prelude::SessionConfig::new();
    local_config
        .options_mut()
        .set(
            "datafusion.sql_parser.recursion_limit",
            &SQL_RECURSION_LIMIT.to_string(),
        )
        .unwrap();
    let local = SessionContext::new_with_config(local_config);
    let mut clients = Vec::new();
    for n in &nodes {
        clients.push(NodeClient::connect(&n.url).await.unwrap());
    }
    let all = put_t(&clients, 3, 1000).await;
    register_local(&local, "t", schema(), all);
    (nodes, local)
}

async fn session(nodes: &[csd_runtime::node::RunningNode]) -> CsdSession {
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    Cluster::connect(&urls)
        .await
        .unwrap()
        .session(SessionOptions::default())
        .await
        .unwrap()
}

fn chain(n: usize, op: &str, term: impl Fn(usize) -> String) -> String {
    (0..n)
        .map(term)
        .collect::<Vec<_>>()
        .join(&format!(" {op} "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unseen_queries_answer_as_locally() {
    let (nodes, local) = setup(NodeConfig::default()).await;
    let on = session(&nodes).await;
    let ands = |n| {
        format!(
            "select count(*), sum(score) from t where {}",
            chain(n, "and", |i| format!("id <> {}", i * 7))
        )
    };
    let ors = |n| {
        format!(
            "select id, name from t where {}",
            chain(n, "or", |i| format!("id = {}", i * 13))
        )
    };
    let in_list = |n: usize| {
        let mut q = String::from("select count(*), min(id) from t where id in (");
        for i in 0..n {
            write!(q, "{}{}", if i > 0 { "," } else { "" }, i * 3).unwrap();
        }
        q.push(')');
        q
    };
    // An IN list of long strings: a plan over 1 MiB.
    let big_plan = {
        let mut q = String::from("select count(*) from t where name in (");
        for i in 0..12_000 {
            write!(q, "{}'{:0>90}'", if i > 0 { "," } else { "" }, i).unwrap();
        }
        q.push_str(", 'abc')");
        q
    };
    let queries: Vec<String> = vec![
        "select name || '-' || cast(flag as varchar) as k, count(*) from t group by 1".into(),
        "select concat(name, '/', id % 3) as k, sum(score) from t group by k".into(),
        "select upper(name) as u, count(*), max(day) from t group by u".into(),
        "select date_trunc('month', day) as m, count(*) from t group by 1".into(),
        "select coalesce(name, '?') as n, avg(price) from t group by 1".into(),
        "select starts_with(name, 'a') as s, count(*) from t group by 1".into(),
        "select md5(name) as h, count(*) from t where id < 100 group by 1".into(),
        "select regexp_replace(name, 'a', 'b') as r, count(*) from t group by 1".into(),
        "select id from t where name || 'x' = 'abcx'".into(),
        "select left(name, 1) as l, count(*) from t where flag group by 1 order by 2 desc, 1 limit 3".into(),
        ands(40),
        ands(300),
        ors(60),
        format!("select count(*) from t where ({}) and ({})", chain(20, "or", |i| format!("id = {i}")), chain(20, "and", |i| format!("id <> {}", i + 100))),
        in_list(20_000),
        big_plan,
        format!(
            "select count(*) from t where {}id > 5{}",
            "(".repeat(5000),
            ")".repeat(5000)
        ),
        format!("select count(*) from t where {}", chain(400, "and", |i| format!("({}id <> {i}{})", "(".repeat(i % 9), ")".repeat(i % 9)))),
    ];
    for q in &queries {
        assert_same(&local, &on, q).await;
    }
}

/// A node that refuses a function (its settings, or an older node) answers
/// UNIMPLEMENTED, and the compute tier evaluates the fragment itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_refusing_a_function_leaves_it_to_the_compute_tier() {
    let mut config = NodeConfig::default();
    config.operators.insert(
        "sql".into(),
        toml::from_str("refuse_functions = [\"upper\", \"character_length\"]").unwrap(),
    );
    let (nodes, local) = setup(config).await;
    let on = session(&nodes).await;
    for q in [
        "select id from t where upper(name) = 'ABC'",
        "select upper(name) as u, count(*) from t group by u",
        "select count(*) from t where length(name) > 2 and flag",
    ] {
        assert_same(&local, &on, q).await;
        let run = on.run(q).await.unwrap();
        let refused = |r: &csd_query_pushdown::EndpointRun| matches!(&r.pushed_back, Some(Declined::Unable(why)) if why.contains("cannot run at this storage node"));
        assert!(
            !run.node_runs.is_empty() && run.node_runs.iter().all(refused),
            "not refused and run here:\n{}",
            run.plan_with_metrics()
        );
    }
    // Other fragments still run at the nodes.
    let run = on.run("select count(*) from t where id > 5").await.unwrap();
    assert!(!run.plan_with_metrics().contains("cannot evaluate"));
}
