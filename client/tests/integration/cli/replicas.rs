//! `csd put --replicas`, and `csd sql` with a node killed (SIGKILL) before and
//! during its queries: every answer the same as with every node up.

use std::collections::BTreeMap;

use super::processes::{on_all, serve_on_drive, spawn_serve};
use super::*;

pub(super) const PARTS: usize = 4;

/// Partition `p`'s CSV: 60,000 rows of `id,k,city,v`.
fn write_part(path: &Path, p: usize) {
    let mut csv = String::from("id,k,city,v\n");
    for i in 0..60_000i64 {
        let id = p as i64 * 60_000 + i;
        let city = ["oslo", "lima", "pune", "kobe"][(id % 4) as usize];
        writeln!(csv, "{id},{},{city},{}", id % 1_009, (id * 31) % 997).unwrap();
    }
    std::fs::write(path, csv).unwrap();
}

fn serve() -> (Kill, String) {
    let (child, url) = spawn_serve("emulated:mem");
    (Kill(child), url)
}

/// `csd put FILE --table t --partition PARTITION --replicas N` over every node of `urls`.
async fn put(file: &str, partition: &str, replicas: u32, urls: &[String]) -> Output {
    let n = replicas.to_string();
    csd(on_all(
        &[
            "put",
            file,
            "--table",
            "t",
            "--partition",
            partition,
            "--replicas",
            &n,
        ],
        urls,
    ))
    .await
}

/// Partition `p` (written under `dir`) put with 2 copies over `urls`, stored.
pub(super) async fn put_part(dir: &Path, p: usize, urls: &[String]) -> Output {
    let f = dir.join(format!("p{p}.csv"));
    write_part(&f, p);
    let stored = put(f.to_str().unwrap(), &format!("p{p}"), 2, urls).await;
    assert!(stored.status.success(), "{:?}", text(&stored));
    stored
}

pub(super) const QUERIES: &[&str] = &[
    "SELECT k % 10 AS g, count(*) AS n, sum(v) AS s FROM t GROUP BY k % 10 ORDER BY g",
    "SELECT id, v FROM t WHERE city = 'lima' AND v > 990 ORDER BY id",
    "SELECT count(*) AS n, max(id) AS m, sum(v) AS s FROM t",
    "SELECT city, count(DISTINCT k) AS d FROM t GROUP BY city ORDER BY city",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_mid_query_costs_no_answer() {
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<(Kill, String)> = (0..3).map(|_| serve()).collect();
    let urls: Vec<String> = nodes.iter().map(|(_, u)| u.clone()).collect();
    for p in 0..PARTS {
        let stored = put_part(dir.path(), p, &urls).await;
        assert!(
            text(&stored).0.contains("2 copies of t/p"),
            "{:?}",
            text(&stored)
        );
    }
    // More copies than nodes, or a partition that exists: refused, nothing stored.
    let f0 = dir.path().join("p0.csv");
    let f0 = f0.to_str().unwrap();
    let four = put(f0, "x", 4, &urls).await;
    assert!(
        !four.status.success() && text(&four).1.contains("4 copies"),
        "{:?}",
        text(&four)
    );
    let again = put(f0, "p0", 2, &urls).await;
    assert!(
        !again.status.success() && text(&again).1.contains("already exists"),
        "{:?}",
        text(&again)
    );
    // A file found bad after 60,000 good rows: every copy's upload (written at the
    // same time) stops and none is kept (the counts below stay at four partitions).
    let bad = dir.path().join("bad.csv");
    let mut rows = std::fs::read_to_string(f0).unwrap();
    rows.push_str("1,2,oslo,not-a-number\n");
    std::fs::write(&bad, rows).unwrap();
    let stored = put(bad.to_str().unwrap(), "bad", 3, &urls).await;
    assert!(
        !stored.status.success() && text(&stored).1.contains("bad.csv"),
        "{:?}",
        text(&stored)
    );

    let sql = |q: &str| on_all(&["sql", "--format", "csv", q], &urls);
    let mut expected = Vec::new();
    for q in QUERIES {
        let o = csd(sql(q)).await;
        assert!(o.status.success(), "{q}: {:?}", text(&o));
        expected.push(text(&o).0);
    }
    assert!(expected[2].contains("240000"), "{}", expected[2]);

    // Node 0 is killed while the queries run (each its own process), then stays dead.
    let queries: Vec<_> = QUERIES
        .iter()
        .map(|q| {
            let a = sql(q);
            tokio::task::spawn_blocking(move || {
                Command::new(env!("CARGO_BIN_EXE_csd"))
                    .args(&a)
                    .output()
                    .unwrap()
            })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    let (mut killed, _) = nodes.remove(0);
    killed.0.kill().unwrap(); // SIGKILL
    let _ = killed.0.wait();
    for (i, q) in queries.into_iter().enumerate() {
        let o = q.await.unwrap();
        assert!(o.status.success(), "{}: {:?}", QUERIES[i], text(&o));
        assert_eq!(text(&o).0, expected[i], "{}", QUERIES[i]);
    }
    for (i, q) in QUERIES.iter().enumerate() {
        let o = csd(sql(q)).await;
        assert!(o.status.success(), "{q} with node 0 dead: {:?}", text(&o));
        assert_eq!(text(&o).0, expected[i], "{q} with node 0 dead");
    }
    // A new replicated put that needs the dead node fails and leaves no copy.
    let needs_dead = (0..100)
        .map(|i| format!("n{i}"))
        .find(|p| {
            csd_client::placement::nodes_for("t", p, &urls, 2)
                .unwrap()
                .contains(&&urls[0])
        })
        .unwrap();
    let stored = put(f0, &needs_dead, 2, &urls).await;
    assert!(!stored.status.success(), "{:?}", text(&stored));
    assert!(text(&stored).1.contains(&urls[0]), "{:?}", text(&stored));
    let o = csd(sql("SELECT count(*) AS n FROM t")).await;
    assert!(text(&o).0.contains("240000"), "{:?}", text(&o));
    // A delete made while node 0 is dead deletes the live copies and is remembered
    // for node 0's (`a_delete_made_while_a_node_is_down_stays_deleted` goes on).
    let rm = csd(on_all(&["rm", "t/p1"], &urls)).await;
    assert!(rm.status.success(), "{:?}", text(&rm));
    assert!(
        text(&rm).0.contains(&format!("not reached: {}", urls[0])),
        "{:?}",
        text(&rm)
    );
    let o = csd(sql("SELECT count(*) AS n FROM t")).await;
    assert!(text(&o).0.contains("180000"), "{:?}", text(&o));
    // Over the live nodes it deletes both copies of a partition kept on them (one
    // placed there, put now: node 0 is not among its nodes).
    let live = &urls[1..];
    let both = (0..100)
        .map(|i| format!("m{i}"))
        .find(|p| {
            csd_client::placement::nodes_for("t", p, &urls, 2)
                .unwrap()
                .iter()
                .all(|n| live.contains(n))
        })
        .expect("a partition placed on nodes 1 and 2");
    let stored = put(f0, &both, 2, &urls).await;
    assert!(stored.status.success(), "{:?}", text(&stored));
    let o = csd(sql("SELECT count(*) AS n FROM t")).await;
    assert!(text(&o).0.contains("240000"), "{:?}", text(&o));
    let rm = csd(on_all(&["rm", &format!("t/{both}")], live)).await;
    assert!(rm.status.success(), "{:?}", text(&rm));
    assert_eq!(
        text(&rm).0.matches("deleted t/").count(),
        2,
        "{:?}",
        text(&rm)
    );
    let o = csd(sql("SELECT count(*) AS n FROM t")).await;
    assert!(text(&o).0.contains("180000"), "{:?}", text(&o));
    drop(nodes);
}

/// Where in its node's device file (4 KiB blocks) the first object of a partition
/// that node `on` shares with node `with` starts, and the partition.
async fn shared_object_offset(on: &str, with: &str) -> Option<(u64, String)> {
    use csd_protocol::node_client::NodeClient;
    let on = NodeClient::connect(on).await.unwrap();
    let with = NodeClient::connect(with).await.unwrap();
    // Placement by URL may leave a node without any partition of the table.
    let theirs = with.table("t").await.ok()?.description.partitions;
    for o in on.objects("t/").await.unwrap() {
        let partition = o.name.split('/').nth(1).unwrap().to_string();
        if theirs.iter().any(|p| p.name == partition) {
            return Some((o.extents[0].lba * 4096, partition));
        }
    }
    None
}

/// Partitions (table/partition) each node of `urls` holds, and whether a scrub of it
/// found any damage.
async fn holdings(urls: &[String]) -> (BTreeMap<String, usize>, bool) {
    let mut held = BTreeMap::new();
    let mut damaged = false;
    for u in urls {
        let c = csd_protocol::node_client::NodeClient::connect(u)
            .await
            .unwrap();
        for t in c.list_tables("").await.unwrap() {
            for p in t.description.partitions {
                *held.entry(format!("{}/{}", t.name, p.name)).or_insert(0) += 1;
            }
        }
        damaged |= c.scrub("").await.unwrap().damaged_count > 0;
    }
    (held, damaged)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_gives_every_partition_its_copies_back() {
    let dir = tempfile::tempdir().unwrap();
    let device = |name: &str| dir.path().join(name);
    let on = |name: &str| serve_on_drive(dir.path(), name);
    // Placement hashes the nodes' URLs (random ports): in about one try in 27 it
    // leaves a node without a partition, whose drive the test could not replace to
    // any effect; such a layout is made again on fresh drives and ports.
    let (nodes, urls) = loop {
        let nodes: Vec<(Kill, String)> = ["a.img", "b.img", "c.img"].map(on).into();
        let urls: Vec<String> = nodes.iter().map(|(_, u)| u.clone()).collect();
        for p in 0..PARTS {
            put_part(dir.path(), p, &urls).await;
        }
        let mut every_node_holds_one = true;
        for u in &urls {
            let c = csd_protocol::node_client::NodeClient::connect(u)
                .await
                .unwrap();
            every_node_holds_one &= c.table("t").await.is_ok();
        }
        if every_node_holds_one {
            break (nodes, urls);
        }
        drop(nodes);
        for d in ["a.img", "b.img", "c.img"] {
            std::fs::remove_file(device(d)).unwrap();
        }
    };
    let sql = |q: &str, urls: &[String]| on_all(&["sql", "--format", "csv", q], urls);
    let mut expected = Vec::new();
    for q in QUERIES {
        let o = csd(sql(q, &urls)).await;
        assert!(o.status.success(), "{q}: {:?}", text(&o));
        expected.push(text(&o).0);
    }
    // One node's drive is damaged at rest (in a partition whose other copy is on a
    // second node); the third node's drive is replaced by an empty one.
    let mut shared = None;
    for (x, y) in [(0, 1), (1, 2), (2, 0), (1, 0), (2, 1), (0, 2)] {
        if let Some((at, p)) = shared_object_offset(&urls[x], &urls[y]).await {
            shared = Some((x, 3 - x - y, at, p));
            break;
        }
    }
    let (x, z, at, damaged_partition) = shared.expect("two nodes share a partition");
    drop(nodes);
    let mut drives = ["a.img", "b.img", "c.img"];
    crate::patch_at(&device(drives[x]), at + 200, 1, |b| b[0] ^= 0x10);
    drives[z] = "new.img";
    let mut nodes: Vec<(Kill, String)> = drives.map(on).into();
    let urls: Vec<String> = nodes.iter().map(|(_, u)| u.clone()).collect();
    let (held, damaged) = holdings(&urls).await;
    assert!(
        damaged && held.values().sum::<usize>() < 2 * PARTS,
        "{held:?}"
    );

    let repair = csd(on_all(&["repair"], &urls)).await;
    let (out, err) = text(&repair);
    assert!(repair.status.success(), "{out}\n{err}");
    assert!(
        out.contains(&format!(
            "t/{damaged_partition} on {}: damaged copy deleted",
            urls[x]
        )),
        "{out}"
    );
    assert!(out.contains(" 1 damaged copies replaced"), "{out}");
    let (held, damaged) = holdings(&urls).await;
    assert!(!damaged, "{out}");
    assert_eq!(held.len(), PARTS, "{held:?}");
    assert!(held.values().all(|n| *n == 2), "{held:?}");
    // Nothing left to do: a second run changes nothing.
    let again = csd(on_all(&["repair"], &urls)).await;
    assert!(again.status.success(), "{:?}", text(&again));
    assert!(
        text(&again)
            .0
            .contains("0 copied, 0 damaged copies replaced"),
        "{:?}",
        text(&again)
    );
    // The copies made are replicas: every answer the same, with any one node dead.
    let mut urls = urls;
    for dead in 0..3 {
        let (mut gone, _) = nodes.remove(dead);
        gone.0.kill().unwrap(); // SIGKILL
        let _ = gone.0.wait();
        for (i, q) in QUERIES.iter().enumerate() {
            let o = csd(sql(q, &urls)).await;
            assert!(
                o.status.success(),
                "{q} with node {dead} dead: {:?}",
                text(&o)
            );
            assert_eq!(text(&o).0, expected[i], "{q} with node {dead} dead");
        }
        let back = on(drives[dead]);
        urls[dead] = back.1.clone();
        nodes.insert(dead, back);
    }
}

/// `csd sql` over `urls`: the one CSV answer of `q`.
async fn answer(q: &str, urls: &[String]) -> String {
    let o = csd(on_all(&["sql", "--format", "csv", q], urls)).await;
    assert!(o.status.success(), "{q}: {:?}", text(&o));
    text(&o).0
}

/// The rows of partition p0 (ids below 60,000) and of the whole table, as `csd sql`
/// over `urls` answers them, pushed and not.
async fn p0_and_all(urls: &[String]) -> (String, String) {
    let q = "SELECT count(*) FILTER (WHERE id < 60000) AS p0, count(*) AS n FROM t";
    let pushed = answer(q, urls).await;
    let o = csd(on_all(
        &["sql", "--no-pushdown", "--format", "csv", q],
        urls,
    ))
    .await;
    assert!(o.status.success(), "{:?}", text(&o));
    assert_eq!(text(&o).0, pushed, "pushed and not pushed differ");
    let row = pushed.lines().nth(1).unwrap_or_default().to_string();
    let (p0, n) = row.split_once(',').unwrap();
    (p0.to_string(), n.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_made_while_a_node_is_down_stays_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let drives = ["a.img", "b.img", "c.img"];
    let on = |name: &str| serve_on_drive(dir.path(), name);
    let mut nodes: Vec<(Kill, String)> = drives.map(on).into();
    let mut urls: Vec<String> = nodes.iter().map(|(_, u)| u.clone()).collect();
    for p in 0..PARTS {
        put_part(dir.path(), p, &urls).await;
    }
    let all = (PARTS * 60_000).to_string();
    assert_eq!(p0_and_all(&urls).await, ("60000".into(), all.clone()));
    let mut holders = Vec::new();
    for (i, u) in urls.iter().enumerate() {
        let c = csd_protocol::node_client::NodeClient::connect(u)
            .await
            .unwrap();
        // A node placement gave no partition has no table t.
        if let Ok(t) = c.table("t").await
            && t.description.partitions.iter().any(|p| p.name == "p0")
        {
            holders.push(i);
        }
    }
    assert_eq!(holders.len(), 2, "p0 is kept in two copies");
    let (down, up) = (holders[0], holders[1]);
    let third = 3 - down - up;

    // A node holding p0 is dead; p0 is deleted without it.
    let (mut gone, _) = nodes.remove(down);
    gone.0.kill().unwrap(); // SIGKILL
    let _ = gone.0.wait();
    let rm = csd(on_all(&["rm", "t/p0"], &urls)).await;
    let (out, err) = text(&rm);
    assert!(rm.status.success(), "{out}\n{err}");
    assert!(
        out.contains(&format!("not reached: {}", urls[down])),
        "{out}"
    );
    let rest: Vec<String> = (0..3)
        .filter(|i| *i != down)
        .map(|i| urls[i].clone())
        .collect();
    let without_p0 = ((PARTS - 1) * 60_000).to_string();
    assert_eq!(p0_and_all(&rest).await, ("0".into(), without_p0.clone()));

    // Every node restarts (the remembered delete is on the drives), the dead one
    // with its copy of p0 still on its drive: no reader reads that copy, whichever
    // one node it cannot reach.
    drop(nodes);
    let mut nodes: Vec<(Kill, String)> = drives.map(on).into();
    urls = nodes.iter().map(|(_, u)| u.clone()).collect();
    let listed = csd(vec!["ls".into(), "--node".into(), urls[down].clone()]).await;
    assert!(text(&listed).0.contains("t "), "{:?}", text(&listed));
    assert_eq!(p0_and_all(&urls).await, ("0".into(), without_p0.clone()));
    for dead in [up, third] {
        let (mut gone, _) = nodes.remove(dead);
        gone.0.kill().unwrap();
        let _ = gone.0.wait();
        let reached: Vec<String> = (0..3)
            .filter(|i| *i != dead)
            .map(|i| urls[i].clone())
            .collect();
        assert_eq!(
            p0_and_all(&reached).await,
            ("0".into(), without_p0.clone()),
            "with {} dead",
            urls[dead]
        );
        let back = on(drives[dead]);
        urls[dead] = back.1.clone();
        nodes.insert(dead, back);
    }

    // Repair removes the copy the delete missed, once; the other partitions keep
    // their two copies.
    let repair = csd(on_all(&["repair"], &urls)).await;
    let (out, err) = text(&repair);
    assert!(repair.status.success(), "{out}\n{err}");
    assert!(
        out.contains(&format!("t/p0 on {}: deleted", urls[down]))
            && out.contains(" 1 deleted copies removed"),
        "{out}"
    );
    let (held, damaged) = holdings(&urls).await;
    assert!(!damaged && !held.contains_key("t/p0"), "{held:?}");
    assert!(
        held.len() == PARTS - 1 && held.values().all(|n| *n == 2),
        "{held:?}"
    );
    let again = csd(on_all(&["repair"], &urls)).await;
    assert!(
        text(&again).0.contains(" 0 deleted copies removed"),
        "{:?}",
        text(&again)
    );

    // The same rows put again as p0 are a new put, not the deleted one.
    let f = dir.path().join("p0.csv");
    let stored = put(f.to_str().unwrap(), "p0", 2, &urls).await;
    assert!(stored.status.success(), "{:?}", text(&stored));
    assert_eq!(p0_and_all(&urls).await, ("60000".into(), all));

    // Two of three nodes dead: a partition in two copies may be on them alone, so
    // nothing is deleted.
    for _ in 0..2 {
        let (mut gone, _) = nodes.pop().unwrap();
        gone.0.kill().unwrap();
        let _ = gone.0.wait();
    }
    let before = holdings(&urls[..1]).await.0;
    let rm = csd(on_all(&["rm", "t/p1"], &urls)).await;
    let (out, err) = text(&rm);
    assert_eq!(rm.status.code(), Some(3), "{out}\n{err}");
    assert!(err.contains("nothing was deleted"), "{err}");
    assert_eq!(holdings(&urls[..1]).await.0, before);
}

/// With a node out of reach, a partition whose only copy in reach has lost an object
/// cannot be told by its digests, so it is not deleted (exit 3, nothing deleted):
/// the copy out of reach could not be remembered as deleted. (A copy whose one
/// object lost its footer cannot say how many copies it was put with either, and is
/// refused as a partition kept in one copy.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_with_no_whole_copy_in_reach_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let drives = ["a.img", "b.img", "c.img"];
    let on = |name: &str| serve_on_drive(dir.path(), name);
    let nodes: Vec<(Kill, String)> = drives.map(on).into();
    let urls: Vec<String> = nodes.iter().map(|(_, u)| u.clone()).collect();
    for p in 0..PARTS {
        put_part(dir.path(), p, &urls).await;
    }
    // p0's copy on one holder: garbage over its object's last block (the footer).
    let mut holders = Vec::new();
    let mut footer_at = None;
    for (i, u) in urls.iter().enumerate() {
        let c = csd_protocol::node_client::NodeClient::connect(u)
            .await
            .unwrap();
        if let Some(o) = c.objects("t/p0/").await.unwrap().first() {
            holders.push(i);
            let mut last = (o.len - 1) / 4096;
            for e in &o.extents {
                if last < e.blocks {
                    footer_at.get_or_insert((i, (e.lba + last) * 4096));
                    break;
                }
                last -= e.blocks;
            }
        }
    }
    assert_eq!(holders.len(), 2, "p0 is kept in two copies");
    let (damaged, at) = footer_at.unwrap();
    let whole = holders.into_iter().find(|i| *i != damaged).unwrap();
    drop(nodes);
    crate::patch_at(&dir.path().join(drives[damaged]), at, 4096, |b| {
        b.fill(0xA5)
    });
    let mut nodes: Vec<(Kill, String)> = drives.map(on).into();
    let urls: Vec<String> = nodes.iter().map(|(_, u)| u.clone()).collect();

    let (mut gone, _) = nodes.remove(whole);
    gone.0.kill().unwrap(); // SIGKILL
    let _ = gone.0.wait();
    let before = holdings(&[urls[damaged].clone()]).await.0;
    assert!(before.contains_key("t/p0"), "{before:?}");
    let rm = csd(on_all(&["rm", "t/p0"], &urls)).await;
    let (out, err) = text(&rm);
    assert_eq!(rm.status.code(), Some(3), "{out}\n{err}");
    assert!(err.contains("nothing was deleted"), "{err}");
    assert_eq!(holdings(&[urls[damaged].clone()]).await.0, before);
}
