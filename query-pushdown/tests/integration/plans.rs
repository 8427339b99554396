//! Golden plans: the physical plan of every TPC-H query and of every pushdown shape
//! is kept in `tests/plans/` and compared whole, so that a plan change is a reviewed
//! diff. `CSD_UPDATE_PLANS=1 cargo test -p csd-query-pushdown --test integration
//! plans` rewrites the files from what the code plans now.
//!
//! - `tests/plans/tpch/qN.plan`: the plan of `testbed/queries/tpch/qN.sql`.
//! - `tests/plans/shapes/NAME.slt`: a query, a `----` line, its plan.
//!
//! Plans are made on two nodes with the TPC-H tables (SF 0.002, one partition each)
//! and two target partitions, so they do not depend on the machine; node addresses
//! are written `NODE0`, `NODE1`.

use std::path::{Path, PathBuf};

use csd_query_pushdown::{Cluster, CsdSession, SessionOptions};
use csd_testbed::tpch;
use datafusion::physical_plan::displayable;

use crate::nodes;

fn plans_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/plans")
}

fn updating() -> bool {
    std::env::var_os("CSD_UPDATE_PLANS").is_some_and(|v| v != "0")
}

/// The physical plan of `sql` in `session`, addresses replaced by node names.
async fn plan(session: &CsdSession, urls: &[String], sql: &str) -> String {
    let df = session
        .ctx
        .sql(sql)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{sql}"));
    let physical = df.create_physical_plan().await.unwrap();
    let mut text = displayable(physical.as_ref()).indent(true).to_string();
    for (i, u) in urls.iter().enumerate() {
        text = text.replace(u.as_str(), &format!("NODE{i}"));
    }
    text
}

/// Compares `got` with the golden file `path` (whose plan follows `prefix`), or
/// rewrites the file when updating. Returns a description of a difference.
fn check(path: &Path, prefix: &str, got: &str) -> Option<String> {
    let want_file = format!("{prefix}{got}");
    if updating() {
        std::fs::write(path, &want_file).unwrap();
        return None;
    }
    let have = std::fs::read_to_string(path).unwrap_or_default();
    if have == want_file {
        return None;
    }
    let want = have.strip_prefix(prefix).unwrap_or(&have);
    let first = want
        .lines()
        .zip(got.lines())
        .position(|(a, b)| a != b)
        .unwrap_or(want.lines().count().min(got.lines().count()));
    Some(format!(
        "{}: differs from line {} on\n--- golden\n{}\n--- planned now\n{}",
        path.display(),
        first + 1,
        want,
        got
    ))
}

async fn session(urls: &[String]) -> CsdSession {
    Cluster::connect(urls)
        .await
        .unwrap()
        .session(SessionOptions {
            target_partitions: Some(2),
            local_slots: Some(2),
            ..SessionOptions::default()
        })
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_plans() {
    let (nodes, clients) = nodes(2).await;
    tpch::load(&clients, 0.002, 1, |_, _| {}).await.unwrap();
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let s = session(&urls).await;
    let mut diffs = Vec::new();
    for (n, sql) in tpch::QUERIES {
        let got = plan(&s, &urls, sql).await;
        let path = plans_dir().join(format!("tpch/q{n}.plan"));
        let prefix = format!("-- the plan of testbed/queries/tpch/q{n}.sql\n");
        diffs.extend(check(&path, &prefix, &got));
    }
    let mut shapes: Vec<PathBuf> = std::fs::read_dir(plans_dir().join("shapes"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "slt"))
        .collect();
    shapes.sort();
    assert!(shapes.len() >= 8, "the shapes are missing: {shapes:?}");
    for path in shapes {
        let text = std::fs::read_to_string(&path).unwrap();
        let (sql, _) = text
            .split_once("\n----\n")
            .unwrap_or_else(|| panic!("{}: no ---- line after the query", path.display()));
        let got = plan(&s, &urls, sql).await;
        diffs.extend(check(&path, &format!("{sql}\n----\n"), &got));
    }
    assert!(
        diffs.is_empty(),
        "{} plans changed (review, then CSD_UPDATE_PLANS=1 to accept):\n{}",
        diffs.len(),
        diffs.join("\n")
    );
}
