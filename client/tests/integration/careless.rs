//! Careless and hostile clients: mangled DoPut streams, uploads abandoned half way,
//! a device that fills up, names far too long, thousands of invented tenants. Each
//! gets a clear status, nothing acknowledged is lost and no space leaks.

use std::sync::Arc;
use std::time::Duration;

use arrow::array::{BinaryArray, Int64Array};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{FlightData, FlightDescriptor};
use csd_client::NodeClient;
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node::{self, RunningNode};
use futures::{StreamExt, TryStreamExt};
use tonic::Code;

async fn node_of(capacity: ByteSize) -> RunningNode {
    node::start(&NodeConfig {
        device: "emulated:mem".into(),
        capacity,
        listen: "127.0.0.1:0".into(),
        cpus: 2,
        ..NodeConfig::default()
    })
    .await
    .unwrap()
}

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("blob", DataType::Binary, false),
    ]))
}

/// `rows` rows of `width` incompressible bytes each (xorshift noise).
fn noise(seed: u64, rows: usize, width: usize) -> RecordBatch {
    let mut x = seed | 1;
    let blobs: Vec<Vec<u8>> = (0..rows)
        .map(|_| {
            (0..width)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect()
        })
        .collect();
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from_iter_values(0..rows as i64)),
            Arc::new(BinaryArray::from_iter_values(blobs.iter())),
        ],
    )
    .unwrap()
}

async fn raw(node: &RunningNode) -> FlightServiceClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(node.url.replace("grpc://", "http://"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    FlightServiceClient::new(channel)
}

/// The Flight messages of a put of `batch` to `t/0`.
async fn put_messages(batch: RecordBatch) -> Vec<FlightData> {
    FlightDataEncoderBuilder::new()
        .with_flight_descriptor(Some(FlightDescriptor::new_path(vec![
            "t".into(),
            "0".into(),
        ])))
        .build(futures::stream::iter([Ok(batch)]))
        .try_collect()
        .await
        .unwrap()
}

async fn free_blocks(c: &NodeClient) -> u64 {
    c.stats().await.unwrap().store.free_blocks
}

/// Mangled IPC bodies and headers are refused as INVALID_ARGUMENT (never a decoder
/// panic surfacing as CANCELLED), and leave neither a table nor taken space.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mangled_put_streams_are_invalid_argument() {
    let node = node_of(ByteSize::mib(64)).await;
    let c = NodeClient::connect(&node.url).await.unwrap();
    let mut raw = raw(&node).await;
    let good = put_messages(noise(7, 64, 100)).await;
    let free = free_blocks(&c).await;
    let mut x = 0x9e3779b97f4a7c15u64;
    let mut refused = 0;
    for round in 0..300 {
        let mut msgs = good.clone();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let at = 1 + (x as usize % (msgs.len() - 1));
        let m = &mut msgs[at];
        match round % 3 {
            // A body shorter than its header says.
            0 => {
                m.data_body = m
                    .data_body
                    .slice(0..(x as usize >> 8) % m.data_body.len().max(1))
            }
            // A flipped header byte.
            1 if !m.data_header.is_empty() => {
                let mut h = m.data_header.to_vec();
                let i = (x as usize >> 8) % h.len();
                h[i] ^= 1 << (x % 8);
                m.data_header = h.into();
            }
            // A flipped body byte.
            _ => {
                let mut b = m.data_body.to_vec();
                if !b.is_empty() {
                    let i = (x as usize >> 8) % b.len();
                    b[i] ^= 0xff;
                }
                m.data_body = b.into();
            }
        }
        let r = raw.do_put(futures::stream::iter(msgs)).await;
        let r = match r {
            Ok(resp) => resp.into_inner().try_collect::<Vec<_>>().await.map(|_| ()),
            Err(s) => Err(s),
        };
        match r {
            Ok(()) => {
                // A flip the data survives (inside a blob): a valid append.
                c.delete("t", None).await.unwrap();
            }
            Err(s) => {
                refused += 1;
                assert_eq!(s.code(), Code::InvalidArgument, "round {round}: {s:?}");
                assert!(!s.message().is_empty());
            }
        }
    }
    assert!(
        refused > 100,
        "only {refused} of 300 mangled streams refused"
    );
    assert!(c.table("t").await.is_err(), "a refused put left a table");
    // Space comes back once the refused writers are cleaned up.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(free_blocks(&c).await, free);
}

/// Clients killed mid-put (`csd put` of a large file, SIGKILL) leave no space
/// taken: the next put that needs nearly the whole device succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_uploads_free_their_space() {
    let node = node_of(ByteSize::mib(64)).await;
    let c = NodeClient::connect(&node.url).await.unwrap();
    let free = free_blocks(&c).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("big.parquet");
    {
        let f = std::fs::File::create(&file).unwrap();
        let mut w = parquet::arrow::ArrowWriter::try_new(f, schema(), None).unwrap();
        for i in 0..40 {
            w.write(&noise(i, 1024, 1024)).unwrap();
        }
        w.close().unwrap();
    }
    for (k, after_ms) in [100u64, 200, 300, 400, 500].into_iter().enumerate() {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_csd"))
            .args(["put", file.to_str().unwrap(), "--table", "t"])
            .args(["--partition", &format!("p{k}"), "--node", &node.url])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(after_ms)).await;
        child.kill().unwrap();
        let _ = child.wait();
        // A put that finished before the kill is a stored table: not a leak.
        let _ = c.delete("t", None).await;
    }
    let mut waited = 0;
    while free_blocks(&c).await < free && waited < 50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let _ = c.delete("t", None).await;
        waited += 1;
    }
    let st = c.stats().await.unwrap().store;
    assert_eq!(
        st.free_blocks, free,
        "killed uploads kept their blocks: {} objects, {} abandoned blocks",
        st.objects, st.abandoned_blocks
    );
    // ~40 MiB on a 64 MiB device: fits only if nothing leaked.
    let big: Vec<_> = (0..40).map(|i| Ok(noise(1000 + i, 1024, 1024))).collect();
    c.put("t", "big", schema(), futures::stream::iter(big))
        .await
        .unwrap();
}

/// A full device is RESOURCE_EXHAUSTED naming the free space, and the put is
/// rolled back; a put that fits then succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_device_is_resource_exhausted() {
    let node = node_of(ByteSize::mib(32)).await;
    let c = NodeClient::connect(&node.url).await.unwrap();
    let free = free_blocks(&c).await;
    let too_big: Vec<_> = (0..48).map(|i| Ok(noise(i, 1024, 1024))).collect();
    let e = c
        .put("t", "0", schema(), futures::stream::iter(too_big))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::ResourceExhausted), "{e}");
    assert!(e.to_string().contains("free"), "{e}");
    assert!(c.table("t").await.is_err());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(free_blocks(&c).await, free);
    let fits: Vec<_> = (0..8).map(|i| Ok(noise(i, 1024, 1024))).collect();
    c.put("t", "0", schema(), futures::stream::iter(fits))
        .await
        .unwrap();
}

/// A 100,000-character name is refused or not found with a short message that fits
/// gRPC's metadata limit (it used to be echoed whole: RESOURCE_EXHAUSTED).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_names_get_short_clear_statuses() {
    let node = node_of(ByteSize::mib(64)).await;
    let c = NodeClient::connect(&node.url).await.unwrap();
    let name = "x".repeat(100_000);
    let e = c.scan(&name, None, &[]).await.err().unwrap();
    assert_eq!(e.code(), Some(Code::NotFound), "{e}");
    assert!(e.to_string().len() < 1000, "{} bytes", e.to_string().len());
    let e = c.table(&name).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::NotFound), "{e}");
    let e = c
        .put(
            &name,
            "0",
            schema(),
            futures::stream::iter([Ok(noise(1, 2, 2))]),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("at most 128 bytes"), "{e}");
    let e = c.delete(&name, Some(&name)).await.unwrap_err();
    assert!(
        matches!(e.code(), Some(Code::NotFound | Code::InvalidArgument)),
        "{e}"
    );
    assert!(e.to_string().len() < 1000);
}

/// Invented tenant names share one bucket: 3,000 of them do not grow the node's
/// state (its stats stay the size they were).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invented_tenants_do_not_grow_the_node() {
    let node = node_of(ByteSize::mib(64)).await;
    let c = NodeClient::connect(&node.url).await.unwrap();
    c.put(
        "t",
        "0",
        schema(),
        futures::stream::iter([Ok(noise(1, 4, 4))]),
    )
    .await
    .unwrap();
    let before = serde_json::to_vec(&c.stats().await.unwrap()).unwrap().len();
    for i in 0..3000 {
        let t = c.clone().with_tenant(&format!("tenant{i}")).unwrap();
        t.table("t").await.unwrap();
        if i % 100 == 0 {
            let _: Vec<RecordBatch> = t
                .scan("t", None, &[])
                .await
                .unwrap()
                .try_collect()
                .await
                .unwrap();
        }
    }
    let after = serde_json::to_vec(&c.stats().await.unwrap()).unwrap().len();
    assert!(
        after < before + 2048,
        "stats grew from {before} to {after} bytes"
    );
}

/// A client that drops its `put` future half way (a timeout, a cancelled task) leaves
/// no table behind: the node sees the stream reset, not a clean end, and commits
/// nothing the client was not told about; the space comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_dropped_half_way_commits_nothing() {
    let node = node_of(ByteSize::mib(256)).await;
    let c = NodeClient::connect(&node.url).await.unwrap();
    let free_before = free_blocks(&c).await;
    for round in 0..3u64 {
        // Four batches, then a stream that never ends: the upload is cut by the drop.
        let batches =
            futures::stream::iter((0..4).map(move |i| Ok(noise(round * 10 + i, 256, 4096))))
                .chain(futures::stream::pending());
        let put = c.put("dropped", "p0", schema(), batches);
        assert!(
            tokio::time::timeout(Duration::from_millis(500), put)
                .await
                .is_err(),
            "the put cannot finish: its stream never ends"
        );
    }
    // A source that fails half way: the client reports it, and the node, which
    // saw a clean end without the end marker, stores nothing either.
    let failing = futures::stream::iter((0..3).map(|i| {
        if i < 2 {
            Ok(noise(100 + i, 256, 4096))
        } else {
            Err(csd_runtime::node_client::Error::InvalidInput(
                "the source file could not be read".into(),
            ))
        }
    }));
    assert!(c.put("dropped", "p1", schema(), failing).await.is_err());
    // The node notices each abandoned stream on its own time.
    let mut left = Vec::new();
    for _ in 0..100 {
        left = c.list_tables("").await.unwrap();
        if left.is_empty() && free_blocks(&c).await == free_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(left.is_empty(), "a dropped upload was committed: {left:?}");
    assert_eq!(
        free_blocks(&c).await,
        free_before,
        "a dropped upload kept its space"
    );
    // And the same name takes a whole upload afterwards.
    let batches = futures::stream::iter((0..2).map(|i| Ok(noise(i, 256, 4096))));
    let summary = c.put("dropped", "p0", schema(), batches).await.unwrap();
    assert_eq!(summary.rows, 512);
}
