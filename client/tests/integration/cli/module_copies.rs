//! `csd run` over a table kept in two copies, one on a node that hands every run
//! back (admission policy `never`): the module runs at the other copy's node, not
//! here; with both nodes busy, here. The answer equals the same computation in SQL
//! without pushdown.

use super::busy_copies::serve_with;
use super::processes::on_all;
use super::*;

/// `(l_orderkey, revenue)` rows of a CSV answer, sorted.
fn rows(csv: &str) -> Vec<(i64, f64)> {
    let mut v: Vec<(i64, f64)> = csv
        .lines()
        .skip(1)
        .map(|l| {
            let (k, r) = l.split_once(',').unwrap();
            (k.parse().unwrap(), r.parse::<f64>().unwrap())
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    v
}

/// `filter_map` over lineitem at `urls` (its rows and `csd run`'s stderr),
/// checked against SQL without pushdown.
async fn run_module(urls: &[String]) -> String {
    let module = crate::wasm::guest_path("filter_map");
    let run = csd(on_all(
        &[
            "run",
            "--wasm",
            module.to_str().unwrap(),
            "--table",
            "lineitem",
            "--columns",
            "l_orderkey,l_extendedprice,l_discount,l_shipmode",
            "--where",
            "l_quantity < 5",
            "--arg",
            "mode=MAIL",
            "--format",
            "csv",
        ],
        urls,
    ))
    .await;
    let (out, err) = text(&run);
    assert!(run.status.success(), "{out}\n{err}");
    let sql = csd(on_all(
        &[
            "sql",
            "--no-pushdown",
            "--format",
            "csv",
            "SELECT l_orderkey, ROUND(CAST(l_extendedprice AS DOUBLE) * (1 - CAST(l_discount AS DOUBLE)), 4) AS revenue \
             FROM lineitem WHERE l_quantity < 5 AND l_shipmode = 'MAIL' ORDER BY 1, 2",
        ],
        urls,
    ))
    .await;
    assert!(sql.status.success(), "{:?}", text(&sql));
    let (got, want) = (rows(&out), rows(&text(&sql).0));
    assert!(!want.is_empty());
    assert_eq!(got.len(), want.len(), "{err}");
    // SQL rounded to 4 places; the module's doubles are not.
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.0, w.0);
        assert!((g.1 - w.1).abs() < 1e-3, "{g:?} vs {w:?}");
    }
    err
}

/// lineitem at SF 0.01 in two partitions, each put with 2 copies over `urls`.
async fn put_lineitem(dir: &Path, urls: &[String]) {
    for part in 1..=2 {
        let batches = csd_client::demo::lineitem(0.01, part, 2).unwrap();
        let file = dir.join(format!("lineitem{part}.parquet"));
        let f = std::fs::File::create(&file).unwrap();
        let mut w = parquet::arrow::ArrowWriter::try_new(f, batches[0].schema(), None).unwrap();
        for b in &batches {
            w.write(b).unwrap();
        }
        w.close().unwrap();
        let name = format!("p{part}");
        let put = csd(on_all(
            &[
                "put",
                file.to_str().unwrap(),
                "--table",
                "lineitem",
                "--partition",
                &name,
                "--replicas",
                "2",
            ],
            urls,
        ))
        .await;
        assert!(put.status.success(), "{:?}", text(&put));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_a_busy_node_hands_back_runs_at_the_other_copy() {
    let dir = tempfile::tempdir().unwrap();
    let (busy, calm) = (serve_with("never"), serve_with("adaptive"));
    put_lineitem(dir.path(), &[busy.1.clone(), calm.1.clone()]).await;
    // In one of the two node orders each partition is asked of the busy node first.
    let mut moved = 0;
    for urls in [
        [busy.1.clone(), calm.1.clone()],
        [calm.1.clone(), busy.1.clone()],
    ] {
        let err = run_module(&urls).await;
        assert!(!err.contains("handed back and run here"), "{err}");
        for line in err.lines().filter(|l| l.contains(": ran it, after")) {
            assert!(line.starts_with(&format!("{}/p", calm.1)), "{line}");
            assert!(line.contains(&format!("{}/p", busy.1)), "{line}");
            assert!(line.contains("policy never"), "{line}");
            moved += 1;
        }
    }
    assert_eq!(moved, 2, "each partition once asked of the busy node first");

    // Both nodes busy: each run is handed back by both copies and runs here.
    drop((busy, calm));
    let both = [serve_with("never"), serve_with("never")];
    let urls = both.each_ref().map(|(_, u)| u.clone());
    put_lineitem(dir.path(), &urls).await;
    let err = run_module(&urls).await;
    assert!(err.contains("; 2 handed back and run here"), "{err}");
    let twice = err
        .lines()
        .filter(|l| l.contains(": none of its copies ran it, after"));
    assert_eq!(twice.count(), 2, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_whose_node_is_lost_runs_at_the_other_copy() {
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = vec![sql_node().await, sql_node().await];
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    put_lineitem(dir.path(), &urls).await;
    let cluster = csd_query_pushdown::Cluster::connect(&urls).await.unwrap();
    let session = cluster
        .session(csd_query_pushdown::SessionOptions::default())
        .await
        .unwrap();
    let job = crate::wasm::job(
        "filter_map",
        &["l_orderkey", "l_extendedprice", "l_discount", "l_shipmode"],
        Some("l_quantity < 5"),
        &[("mode", "MAIL")],
    );
    let before = session.run_wasm(&job).await.unwrap();
    assert!(!before.batches.is_empty());
    // The node that ran the first partition goes away after the session listed
    // the copies: what it was asked first runs at the other node, none here.
    let gone = urls
        .iter()
        .position(|u| before.endpoints[0].endpoint.starts_with(u.as_str()))
        .unwrap();
    nodes.remove(gone).shutdown().await.unwrap();
    let (gone, left) = (&urls[gone], &urls[1 - gone]);
    let after = session.run_wasm(&job).await.unwrap();
    assert_eq!(
        crate::wasm::pairs(&after.batches),
        crate::wasm::pairs(&before.batches)
    );
    for e in &after.endpoints {
        assert!(e.pushed_back.is_none(), "{e:?}");
        assert!(e.endpoint.starts_with(left.as_str()), "{e:?}");
    }
    let lost: Vec<String> = after
        .endpoints
        .iter()
        .flat_map(|e| &e.failed_over)
        .map(ToString::to_string)
        .collect();
    assert!(
        lost.iter()
            .any(|f| f.starts_with(gone.as_str()) && f.contains("node lost")),
        "{:?}",
        after.endpoints
    );
}
