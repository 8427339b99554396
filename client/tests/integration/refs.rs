//! Results kept by reference: a query's answer kept at the node, resolved later by
//! other clients (a plain arrow-flight client, as pyarrow would), renewed, released,
//! expired, and surviving a restart. Kept answers are compared with the same query
//! run without pushdown.

use std::time::Duration;

use arrow::record_batch::RecordBatch;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{CancelFlightInfoRequest, CancelStatus, FlightClient, FlightInfo};
use csd_client::demo::lineitem;
use csd_query_pushdown::{Cluster, CsdSession, SessionOptions};
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node::{self, RunningNode};
use csd_runtime::node_client::NodeClient;
use csd_runtime::refs::Reference;
use futures::TryStreamExt;
use tonic::Code;

const QUERY: &str = "SELECT l_orderkey, l_partkey, l_quantity, l_shipmode FROM lineitem \
                     WHERE l_quantity < 5 AND l_shipmode <> 'AIR'";

async fn node_on(device: &str) -> RunningNode {
    let config = NodeConfig {
        device: device.into(),
        capacity: ByteSize::mib(256),
        listen: "127.0.0.1:0".into(),
        cpus: 2,
        ref_max_ttl_s: 3600,
        ..NodeConfig::default()
    };
    let operators = csd_query_pushdown::registry_with(&config).unwrap();
    node::start_with(&config, operators).await.unwrap()
}

/// lineitem SF 0.005, one partition per batch; returns the partitions.
async fn load(url: &str) -> usize {
    let c = NodeClient::connect(url).await.unwrap();
    let batches = lineitem(0.005, 2, 1).unwrap();
    let parts = batches.len();
    for (i, batch) in batches.into_iter().enumerate() {
        c.put(
            "lineitem",
            &i.to_string(),
            batch.schema(),
            futures::stream::iter([Ok(batch)]),
        )
        .await
        .unwrap();
    }
    parts
}

async fn session(url: &str, pushdown: bool) -> CsdSession {
    Cluster::connect(&[url.to_string()])
        .await
        .unwrap()
        .session(SessionOptions {
            pushdown,
            ..Default::default()
        })
        .await
        .unwrap()
}

/// Rows as sorted strings.
fn canonical(batches: &[RecordBatch]) -> Vec<String> {
    let mut rows = Vec::new();
    for b in batches {
        let cols: Vec<_> = b
            .columns()
            .iter()
            .map(|c| {
                arrow::util::display::ArrayFormatter::try_new(c.as_ref(), &Default::default())
                    .unwrap()
            })
            .collect();
        for i in 0..b.num_rows() {
            rows.push(
                cols.iter()
                    .map(|c| c.value(i).to_string())
                    .collect::<Vec<_>>()
                    .join("|"),
            );
        }
    }
    rows.sort();
    rows
}

/// A raw arrow-flight client (what pyarrow's `flight.connect(...)` is).
async fn flight(url: &str) -> FlightClient {
    let ch = tonic::transport::Endpoint::from_shared(url.replace("grpc://", "http://"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    FlightClient::new_from_inner(FlightServiceClient::new(ch))
}

async fn resolve(r: &Reference) -> Result<Vec<RecordBatch>, (Code, String)> {
    let mut c = flight(&r.location).await;
    let ticket = arrow_flight::Ticket::new(r.ticket_bytes().unwrap());
    let code = |e: arrow_flight::error::FlightError| match e {
        arrow_flight::error::FlightError::Tonic(s) => (s.code(), s.message().to_string()),
        other => (Code::Unknown, other.to_string()),
    };
    c.do_get(ticket)
        .await
        .map_err(code)?
        .try_collect()
        .await
        .map_err(code)
}

async fn resolve_all(refs: &[Reference]) -> Vec<RecordBatch> {
    let mut out = Vec::new();
    for r in refs {
        out.extend(resolve(r).await.unwrap());
    }
    out
}

async fn ref_objects(url: &str) -> usize {
    NodeClient::connect(url)
        .await
        .unwrap()
        .objects(csd_runtime::refs::REF_PREFIX)
        .await
        .unwrap()
        .len()
}

async fn kept_tables(url: &str) -> Vec<String> {
    NodeClient::connect(url)
        .await
        .unwrap()
        .list_tables(csd_runtime::refs::REF_TABLE_PREFIX)
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_query_reads_a_kept_answer_at_the_node() {
    let node = node_on("emulated:mem").await;
    load(&node.url).await;
    let kept = session(&node.url, true)
        .await
        .keep(QUERY, Duration::from_secs(60))
        .await
        .unwrap();
    let table = kept[0].reference.table.clone();
    assert!(table.starts_with("csd_ref_"), "{table}");
    assert!(
        kept.iter().all(|k| k.reference.table == table),
        "one table per kept query"
    );
    assert_eq!(kept_tables(&node.url).await, vec![table.clone()]);

    // Step 2 over the kept rows, pushed to the node, vs the same from the base table
    // without keeping and without pushdown.
    let step2 = |from: &str| {
        format!(
            "SELECT l_shipmode, count(*) AS n, sum(l_quantity) AS q FROM {from} \
             WHERE l_partkey % 3 = 0 GROUP BY l_shipmode ORDER BY l_shipmode"
        )
    };
    let next = session(&node.url, true).await;
    let chained = next.run(&step2(&table)).await.unwrap();
    assert!(!chained.node_runs.is_empty(), "step 2 ran at the node");
    let direct = session(&node.url, false)
        .await
        .run(&step2(&format!("({QUERY}) AS t")))
        .await
        .unwrap();
    assert_eq!(canonical(&chained.batches), canonical(&direct.batches));
    assert!(!canonical(&direct.batches).is_empty());

    // Step 2 kept too: a pipeline that moves only its last answer.
    let step2_rows = format!("SELECT l_orderkey, l_quantity FROM {table} WHERE l_partkey % 3 = 0");
    let kept2 = next
        .keep(&step2_rows, Duration::from_secs(60))
        .await
        .unwrap();
    let got: Vec<Reference> = kept2.iter().map(|k| k.reference.clone()).collect();
    let expected = session(&node.url, false)
        .await
        .run(&format!(
            "SELECT l_orderkey, l_quantity FROM ({QUERY}) AS t WHERE l_partkey % 3 = 0"
        ))
        .await
        .unwrap();
    assert_eq!(
        canonical(&resolve_all(&got).await),
        canonical(&expected.batches)
    );
    // Kept tables are read-only.
    let c = NodeClient::connect(&node.url).await.unwrap();
    let e = c.delete(&table, None).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::PermissionDenied), "{e}");
    let b = lineitem(0.001, 1, 1).unwrap();
    let e = c
        .put(
            &table,
            "x",
            b[0].schema(),
            futures::stream::iter([Ok(b[0].clone())]),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::PermissionDenied), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_answer_resolves_elsewhere_renews_and_is_released() {
    let node = node_on("emulated:mem").await;
    let parts = load(&node.url).await;
    assert!(parts > 1);
    let expected = canonical(
        &session(&node.url, false)
            .await
            .run(QUERY)
            .await
            .unwrap()
            .batches,
    );
    assert!(!expected.is_empty());

    // The producer keeps the answer and goes away.
    let kept = {
        let s = session(&node.url, true).await;
        s.keep(QUERY, Duration::from_secs(60)).await.unwrap()
    };
    assert_eq!(kept.len(), parts, "one reference per partition");
    let refs: Vec<Reference> = kept.iter().map(|k| k.reference.clone()).collect();
    assert_eq!(
        kept.iter().map(|k| k.rows as usize).sum::<usize>(),
        expected.len()
    );
    // Printed and parsed back as a user passes it on.
    let printed: Vec<String> = refs
        .iter()
        .map(|r| serde_json::to_string(r).unwrap())
        .collect();
    let parsed: Vec<Reference> = printed
        .iter()
        .map(|p| Reference::parse(p).unwrap())
        .collect();
    assert_eq!(parsed, refs);
    assert!(refs[0].expires.ends_with('Z'), "{}", refs[0].expires);

    // Resolved by a plain Flight client: the same rows as the query without pushdown.
    assert_eq!(canonical(&resolve_all(&parsed).await), expected);
    // And by NodeClient, twice (resolving does not consume it).
    let c = NodeClient::connect(&node.url).await.unwrap();
    for _ in 0..2 {
        let b: Vec<RecordBatch> = c
            .resolve(&refs[0])
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        assert_eq!(
            b.iter().map(|b| b.num_rows() as u64).sum::<u64>(),
            kept[0].rows
        );
    }

    // Listed, renewed (the old ticket still works: the seal follows the reference).
    let listed = c.refs().await.unwrap();
    assert_eq!(listed.len(), parts);
    let renewed = c.renew(&refs[0], Duration::from_secs(600)).await.unwrap();
    assert!(renewed.expires_unix_ms() > refs[0].expires_unix_ms() + 300_000);
    assert!(resolve(&refs[0]).await.is_ok());
    let e = c
        .renew(&refs[0], Duration::from_secs(7200))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("at most 3600 s"), "{e}");

    // Released with the csd action, and with Flight's CancelFlightInfo.
    c.release(&refs[0]).await.unwrap();
    let (code, msg) = resolve(&refs[0]).await.unwrap_err();
    assert_eq!(code, Code::NotFound, "{msg}");
    assert!(msg.contains("expired, was released"), "{msg}");
    let mut raw = flight(&node.url).await;
    let info = FlightInfo::new().with_endpoint(refs[1].endpoint().unwrap());
    let r = raw
        .cancel_flight_info(CancelFlightInfoRequest::new(info.clone()))
        .await
        .unwrap();
    assert_eq!(r.status(), CancelStatus::Cancelled);
    assert_eq!(resolve(&refs[1]).await.unwrap_err().0, Code::NotFound);
    let r = raw
        .cancel_flight_info(CancelFlightInfoRequest::new(info))
        .await
        .unwrap_err();
    assert!(r.to_string().contains("not kept here"), "{r}");
    // The rest, with `csd release`'s call.
    for r in &refs[2..] {
        c.release(r).await.unwrap();
    }
    assert_eq!(ref_objects(&node.url).await, 0, "the space is freed");
    assert!(c.refs().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_answers_expire_and_bad_requests_say_why() {
    let node = node_on("emulated:mem").await;
    let parts = load(&node.url).await;
    let s = session(&node.url, true).await;
    let kept = s.keep(QUERY, Duration::from_secs(1)).await.unwrap();
    assert_eq!(
        ref_objects(&node.url).await,
        parts,
        "a record per reference"
    );
    tokio::time::sleep(Duration::from_millis(2600)).await;
    for k in &kept {
        assert_eq!(resolve(&k.reference).await.unwrap_err().0, Code::NotFound);
    }
    assert_eq!(
        ref_objects(&node.url).await,
        0,
        "expired references are freed"
    );
    let stats = NodeClient::connect(&node.url)
        .await
        .unwrap()
        .stats()
        .await
        .unwrap();
    assert_eq!(stats.refs.live, 0);
    assert_eq!(stats.refs.freed_expired, parts as u64, "{:?}", stats.refs);

    // Steps that run at the compute tier: nothing to keep at a node.
    for q in [
        "SELECT count(*) FROM lineitem a JOIN lineitem b ON a.l_orderkey = b.l_orderkey",
        "SELECT l_orderkey FROM lineitem ORDER BY l_orderkey LIMIT 3",
    ] {
        let e = s
            .keep(q, Duration::from_secs(60))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not push whole"), "{q}: {e}");
    }
    // Past the node's longest lifetime.
    let e = s
        .keep(QUERY, Duration::from_secs(7200))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("at most 3600 s"), "{e}");
    // A Ref ticket that names nothing, and a keep ticket sent to DoGet.
    let as_ref = |t: csd_runtime::protocol::Ticket| Reference {
        location: node.url.clone(),
        ticket: {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.encode(t.encode())
        },
        expires: String::new(),
        table: String::new(),
    };
    let missing = as_ref(csd_runtime::protocol::Ticket::Ref {
        id: "0123456789abcdef0123456789abcdef".into(),
    });
    assert_eq!(resolve(&missing).await.unwrap_err().0, Code::NotFound);
    let keep_to_do_get = as_ref(csd_runtime::protocol::Ticket::Operator {
        name: "sql".into(),
        args: vec![],
        compression: csd_runtime::protocol::Compression::None,
        patient: false,
        asker: None,
        keep_ms: Some(1000),
        keep_group: None,
    });
    let (code, msg) = resolve(&keep_to_do_get).await.unwrap_err();
    assert_eq!(code, Code::InvalidArgument, "{msg}");
    assert!(msg.contains("GetFlightInfo"), "{msg}");
    assert_eq!(
        ref_objects(&node.url).await,
        0,
        "nothing was kept by refusals"
    );
    // An aggregate over a table on one node runs whole there: its answer is kept.
    let kept = s
        .keep(
            "SELECT count(*) AS n FROM lineitem",
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(kept.iter().map(|k| k.rows).sum::<u64>(), 1, "{kept:?}");
    assert_eq!(ref_objects(&node.url).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unexpired_references_survive_a_restart_and_expired_ones_are_freed() {
    let dir = tempfile::tempdir().unwrap();
    let device = format!("emulated:file={}", dir.path().join("dev").display());
    let node = node_on(&device).await;
    let parts = load(&node.url).await;
    let expected = canonical(
        &session(&node.url, false)
            .await
            .run(QUERY)
            .await
            .unwrap()
            .batches,
    );
    let s = session(&node.url, true).await;
    let long = s.keep(QUERY, Duration::from_secs(600)).await.unwrap();
    let short = s.keep(QUERY, Duration::from_secs(1)).await.unwrap();
    drop(s);
    node.shutdown().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let node = node_on(&device).await;
    // The references name the old address; the same tickets work at the new one.
    let at = |r: &Reference| Reference {
        location: node.url.clone(),
        ..r.clone()
    };
    let longs: Vec<Reference> = long.iter().map(|k| at(&k.reference)).collect();
    assert_eq!(canonical(&resolve_all(&longs).await), expected);
    for k in &short {
        assert_eq!(
            resolve(&at(&k.reference)).await.unwrap_err().0,
            Code::NotFound
        );
    }
    assert_eq!(
        ref_objects(&node.url).await,
        parts,
        "only the unexpired ones are left"
    );
    let stats = NodeClient::connect(&node.url)
        .await
        .unwrap()
        .stats()
        .await
        .unwrap();
    assert_eq!(stats.refs.live, parts as u64);
    assert_eq!(
        stats.refs.bytes,
        long.iter().map(|k| k.bytes).sum::<u64>(),
        "space accounting balances"
    );
    // A flipped byte in one reference's record: the node still starts, that
    // reference is freed, the others still resolve.
    let records = NodeClient::connect(&node.url)
        .await
        .unwrap()
        .objects(csd_runtime::refs::REF_PREFIX)
        .await
        .unwrap();
    let damaged = records.first().expect("a reference's record").clone();
    node.shutdown().await.unwrap();
    let at = damaged.extents[0].lba * 4096 + damaged.len / 2;
    crate::patch_at(&dir.path().join("dev"), at, 1, |b| b[0] ^= 0x5a);
    let node = node_on(&device).await;
    let at = |r: &Reference| Reference {
        location: node.url.clone(),
        ..r.clone()
    };
    let mut gone = 0;
    for k in &long {
        match resolve(&at(&k.reference)).await {
            Ok(_) => {}
            Err((c, m)) => {
                assert_eq!(c, Code::NotFound, "{m}");
                gone += 1;
            }
        }
    }
    assert_eq!(gone, 1, "only the damaged reference is gone");
    assert_eq!(ref_objects(&node.url).await, parts - 1);
    node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyarrow_resolves_a_printed_reference() {
    let Some(python) = super::pyarrow_python() else {
        return;
    };
    let node = node_on("emulated:mem").await;
    load(&node.url).await;
    let kept = session(&node.url, true)
        .await
        .keep(QUERY, Duration::from_secs(60))
        .await
        .unwrap();
    let lines: Vec<String> = kept
        .iter()
        .map(|k| serde_json::to_string(&k.reference).unwrap())
        .collect();
    let script = r#"
import base64, json, sys
import pyarrow.flight as fl
rows = 0
for line in sys.argv[1:]:
    ref = json.loads(line)
    c = fl.connect(ref["location"])
    rows += c.do_get(fl.Ticket(base64.b64decode(ref["ticket"]))).read_all().num_rows
print(rows)
"#;
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .arg("-c")
            .arg(script)
            .args(&lines)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.trim().parse::<u64>().unwrap(),
        kept.iter().map(|k| k.rows).sum::<u64>()
    );
}
