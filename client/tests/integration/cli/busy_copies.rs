//! Two copies of every partition, on a node that hands every fragment back (its
//! admission policy `never`: the busiest a node can answer) and on one that runs
//! what it is asked: each fragment the first hands back runs at the other copy, not
//! here; with both handing back, this tier runs them. Every answer equals the same
//! query without pushdown.

use super::processes::{on_all, spawn_listening_with};
use super::replicas::{PARTS, QUERIES, put_part};
use super::*;

/// `csd serve` on an in-memory device with admission `policy`.
pub(super) fn serve_with(policy: &str) -> (Kill, String) {
    let (child, url) = spawn_listening_with(
        &[
            "serve",
            "--device",
            "emulated:mem",
            "--capacity",
            "256MiB",
            "--listen",
            "127.0.0.1:0",
        ],
        &[("CSD_POLICY", policy)],
    );
    (Kill(child), url)
}

/// Each query's answer over `urls`, checked against the same query without
/// pushdown, with `csd sql`'s stderr.
async fn answers(urls: &[String]) -> Vec<String> {
    let mut said = Vec::new();
    for q in QUERIES {
        let pushed = csd(on_all(&["sql", "--format", "csv", q], urls)).await;
        let (out, err) = text(&pushed);
        assert!(pushed.status.success(), "{q}: {err}");
        let here = csd(on_all(
            &["sql", "--no-pushdown", "--format", "csv", q],
            urls,
        ))
        .await;
        assert!(here.status.success(), "{q}: {:?}", text(&here));
        assert_eq!(text(&here).0, out, "{q}: pushed and not pushed differ");
        said.push(err);
    }
    said
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fragment_a_busy_node_hands_back_runs_at_the_other_copy() {
    let dir = tempfile::tempdir().unwrap();
    let (busy, calm) = (serve_with("never"), serve_with("adaptive"));
    let urls = [busy.1.clone(), calm.1.clone()];
    for p in 0..PARTS {
        put_part(dir.path(), p, &urls).await;
    }
    // Each partition's fragments go first to one copy by the partition's name, in
    // the order the nodes are given: in one of the two orders, to the busy node.
    let handed_back = format!("{}/p", busy.1);
    let mut moved = 0;
    for urls in [
        [busy.1.clone(), calm.1.clone()],
        [calm.1.clone(), busy.1.clone()],
    ] {
        for (q, err) in QUERIES.iter().zip(answers(&urls).await) {
            assert!(err.contains(" 0 handed back"), "{q}: {err}");
            assert!(!err.contains("returned its fragment"), "{q}: {err}");
            for line in err.lines().filter(|l| l.contains(": ran it, after")) {
                assert!(line.starts_with(&format!("{}/p", calm.1)), "{q}: {line}");
                assert!(line.contains(&handed_back), "{q}: {line}");
                assert!(line.contains("policy never"), "{q}: {line}");
                moved += 1;
            }
        }
    }
    assert!(
        moved >= QUERIES.len(),
        "{moved} fragments moved to the other copy"
    );

    // Both nodes busy: every fragment is handed back by both and runs here.
    drop((busy, calm));
    let both = [serve_with("never"), serve_with("never")];
    let urls = both.each_ref().map(|(_, u)| u.clone());
    for p in 0..PARTS {
        put_part(dir.path(), p, &urls).await;
    }
    for (q, err) in QUERIES.iter().zip(answers(&urls).await) {
        // "…; N fragments, …": one per partition, or one per node's partitions.
        let fragments = err
            .split(" fragments,")
            .next()
            .and_then(|head| head.rsplit(' ').next()?.parse::<usize>().ok())
            .unwrap_or_else(|| panic!("{q}: {err}"));
        assert!(fragments > 0, "{q}: {err}");
        let said = format!(" {fragments} handed back");
        assert!(err.contains(&said), "{q}: {err}");
        let twice = err
            .lines()
            .filter(|l| l.contains(": none of its copies ran it, after"));
        assert_eq!(twice.count(), fragments, "{q}: {err}");
    }
}
