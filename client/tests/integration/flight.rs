use std::sync::Arc;

use arrow::array::{Int32Array, StringArray};
use arrow::compute::concat_batches;
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{Action, FlightData, FlightDescriptor, Ticket as FlightTicket};
use csd_client::{NodeClient, demo::lineitem};
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node;
use futures::TryStreamExt;
use tonic::Code;

fn stream(
    batches: Vec<RecordBatch>,
) -> impl futures::Stream<Item = csd_runtime::node_client::Result<RecordBatch>> + Send + 'static {
    futures::stream::iter(batches.into_iter().map(Ok))
}

async fn scan_all(
    c: &NodeClient,
    table: &str,
    partition: Option<&str>,
    cols: &[&str],
) -> Vec<RecordBatch> {
    c.scan(table, partition, cols)
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_list_scan_range_delete_round_trip() {
    let node = crate::mem_node().await;
    let c = NodeClient::connect(&node.url).await.unwrap();
    let parts = [lineitem(0.01, 1, 2).unwrap(), lineitem(0.01, 2, 2).unwrap()];
    let schema = parts[0][0].schema();
    for (i, p) in parts.iter().enumerate() {
        let s = c
            .put(
                "lineitem",
                &format!("p{i}"),
                schema.clone(),
                stream(p.clone()),
            )
            .await
            .unwrap();
        assert_eq!(
            s.rows as usize,
            p.iter().map(|b| b.num_rows()).sum::<usize>()
        );
        assert!(s.row_groups >= 1 && s.bytes > 0);
    }
    // Listing describes what was stored.
    let tables = c.list_tables("").await.unwrap();
    assert_eq!(tables.len(), 1);
    let t = &tables[0];
    assert_eq!(t.name, "lineitem");
    assert_eq!(t.schema.fields(), schema.fields());
    let total: usize = parts.iter().flatten().map(|b| b.num_rows()).sum();
    assert_eq!(t.rows as usize, total);
    assert_eq!(
        t.description
            .partitions
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>(),
        ["p0", "p1"]
    );
    assert!(c.list_tables("orders").await.unwrap().is_empty());
    // Each partition reads back identical.
    for (i, p) in parts.iter().enumerate() {
        let got = scan_all(&c, "lineitem", Some(&format!("p{i}")), &[]).await;
        assert_eq!(
            concat_batches(&schema, &got).unwrap(),
            concat_batches(&schema, p).unwrap(),
            "partition p{i}"
        );
    }
    // A limit returns the first rows, across partitions' objects too.
    let whole = concat_batches(&schema, parts.iter().flatten()).unwrap();
    let rows = |skip: u64, limit: Option<u64>| {
        let (c, schema) = (c.clone(), schema.clone());
        async move {
            let got: Vec<RecordBatch> = c
                .scan_rows("lineitem", None, &[], skip, limit)
                .await
                .unwrap()
                .try_collect()
                .await
                .unwrap();
            concat_batches(&schema, &got).unwrap()
        }
    };
    for limit in [0u64, 1, 1000, total as u64 - 1, total as u64 + 5] {
        let got = rows(0, Some(limit)).await;
        let n = (limit as usize).min(total);
        assert_eq!(got, whole.slice(0, n), "limit {limit}");
    }
    // Rows skipped first: inside the first object, exactly at and across the
    // boundary of the two partitions' objects, past the end; with and without a limit.
    let first: u64 = parts[0].iter().map(|b| b.num_rows() as u64).sum();
    for (skip, limit) in [
        (1, None),
        (700, Some(10)),
        (first, None),
        (first - 3, Some(7)),
        (first + 2, Some(0)),
        (total as u64 - 1, None),
        (total as u64 + 4, Some(3)),
    ] {
        let got = rows(skip, limit).await;
        let from = (skip as usize).min(total);
        let n = (total - from).min(limit.map_or(usize::MAX, |l| l as usize));
        assert_eq!(got, whole.slice(from, n), "skip {skip} limit {limit:?}");
    }
    // Projection, asked out of table order, comes back in table order.
    let got = scan_all(&c, "lineitem", None, &["l_shipdate", "l_orderkey"]).await;
    let got = concat_batches(&got[0].schema(), &got).unwrap();
    assert_eq!(got.num_rows(), total);
    assert_eq!(
        got.schema()
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect::<Vec<_>>(),
        ["l_orderkey", "l_shipdate"]
    );
    let want = concat_batches(&schema, parts.iter().flatten()).unwrap();
    assert_eq!(got.column(0), &want.column(0).clone());
    // Raw range reads return the stored Parquet bytes.
    let obj = &t.description.partitions[0].objects[0];
    let all = c.read_range(&obj.name, 0, obj.len).await.unwrap();
    assert_eq!(&all[..4], b"PAR1");
    assert_eq!(&all[all.len() - 4..], b"PAR1");
    let mid = c
        .read_range(&obj.name, 1000, 3_000_000.min(obj.len - 1000))
        .await
        .unwrap();
    assert_eq!(&mid[..], &all[1000..1000 + mid.len()]);
    // Asked compressed: the same bytes, fewer of them on the wire (the node stores
    // column chunks uncompressed).
    for codec in [
        csd_protocol::Compression::Lz4Frame,
        csd_protocol::Compression::Zstd,
    ] {
        let (packed, wire) = c
            .read_range_with(&obj.name, 1000, obj.len - 1000, codec)
            .await
            .unwrap();
        assert_eq!(&packed[..], &all[1000..], "{codec:?}");
        assert!(
            wire < (obj.len - 1000) * 3 / 4,
            "{codec:?}: {wire} of {}",
            obj.len
        );
    }
    let parsed = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(all)
        .unwrap()
        .build()
        .unwrap();
    assert_eq!(
        parsed.map(|b| b.unwrap().num_rows()).sum::<usize>() as u64,
        obj.rows
    );
    // Appending to a partition adds an object; deleting it removes the partition.
    c.put(
        "lineitem",
        "p1",
        schema.clone(),
        stream(parts[1][..1].to_vec()),
    )
    .await
    .unwrap();
    assert_eq!(
        c.table("lineitem").await.unwrap().description.partitions[1]
            .objects
            .len(),
        2
    );
    assert_eq!(c.delete("lineitem", Some("p1")).await.unwrap(), 2);
    assert_eq!(
        c.table("lineitem").await.unwrap().rows as usize,
        parts[0].iter().map(|b| b.num_rows()).sum::<usize>()
    );
    let stats = c.stats().await.unwrap();
    assert_eq!(stats.store.objects, 1);
    assert!(stats.device.stats.bytes_read > 0);
    // The process's real memory, next to the budget (Linux says it).
    let rss = stats.resident_bytes.expect("resident memory on Linux");
    assert!(rss > 1 << 20, "{rss}");
    assert!(stats.peak_resident_bytes.unwrap() >= rss);
    node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_statuses_and_the_node_survives() {
    let node = crate::mem_node().await;
    let c = NodeClient::connect(&node.url).await.unwrap();
    let schema = Arc::new(Schema::new(vec![
        Field::new("a", DataType::Int32, false),
        Field::new("b", DataType::Utf8, true),
    ]));
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(Int32Array::from(vec![1, 2, 3])),
            Arc::new(StringArray::from(vec![Some("x"), None, Some("z")])),
        ],
    )
    .unwrap();
    c.put("t", "0", schema.clone(), stream(vec![batch.clone()]))
        .await
        .unwrap();
    let channel = tonic::transport::Endpoint::from_shared(node.url.replace("grpc://", "http://"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut raw = FlightServiceClient::new(channel).max_encoding_message_size(128 << 20);

    let status = |r: Result<tonic::Response<tonic::Streaming<FlightData>>, tonic::Status>| {
        r.map(|_| ()).unwrap_err()
    };
    // Malformed tickets.
    for bad in [
        vec![],
        vec![9, 9, 9],
        vec![1, 0xff, 0xff, 0xff, 0xff],
        b"\x01hello".to_vec(),
    ] {
        let s = status(raw.do_get(FlightTicket::new(bad.clone())).await);
        assert_eq!(s.code(), Code::InvalidArgument, "{bad:?}: {s:?}");
        assert!(!s.message().is_empty());
    }
    // Unknown things.
    let e = c.scan("nope", None, &[]).await.err().unwrap();
    assert_eq!(e.code(), Some(Code::NotFound), "{e}");
    assert!(e.to_string().contains("table nope"), "{e}");
    assert_eq!(
        c.table("nope").await.unwrap_err().code(),
        Some(Code::NotFound)
    );
    assert_eq!(
        c.scan("t", Some("9"), &[]).await.err().unwrap().code(),
        Some(Code::NotFound)
    );
    let e = c.scan("t", None, &["zz"]).await.err().unwrap();
    assert!(
        e.code() == Some(Code::InvalidArgument) && e.to_string().contains("columns: a, b"),
        "{e}"
    );
    assert_eq!(
        c.read_range("t/0/nope.parquet", 0, 1)
            .await
            .unwrap_err()
            .code(),
        Some(Code::NotFound)
    );
    let obj = c.table("t").await.unwrap().description.partitions[0].objects[0].clone();
    let e = c.read_range(&obj.name, obj.len - 1, 2).await.unwrap_err();
    assert!(
        e.code() == Some(Code::InvalidArgument) && e.to_string().contains("beyond the end"),
        "{e}"
    );
    assert_eq!(
        c.delete("nope", None).await.unwrap_err().code(),
        Some(Code::NotFound)
    );
    // Wrong schema on append.
    let other = Arc::new(Schema::new(vec![Field::new("a", DataType::Utf8, false)]));
    let b2 =
        RecordBatch::try_new(other.clone(), vec![Arc::new(StringArray::from(vec!["q"]))]).unwrap();
    let e = c.put("t", "0", other, stream(vec![b2])).await.unwrap_err();
    assert!(
        e.code() == Some(Code::InvalidArgument) && e.to_string().contains("does not match table t"),
        "{e}"
    );
    // Bad names.
    let e = c
        .put(
            "drop table;",
            "0",
            schema.clone(),
            stream(vec![batch.clone()]),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    let e = c
        .put("t", "../x", schema.clone(), stream(vec![batch.clone()]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    // A DoPut without a descriptor, and one whose body is not Arrow IPC.
    let s = raw
        .do_put(futures::stream::iter(vec![FlightData::default()]))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    let junk = FlightData {
        flight_descriptor: Some(FlightDescriptor::new_path(vec!["t".into()])),
        data_header: vec![1, 2, 3, 4, 5].into(),
        ..Default::default()
    };
    let s = raw
        .do_put(futures::stream::iter(vec![junk]))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    // An oversized message.
    let huge = FlightData {
        flight_descriptor: Some(FlightDescriptor::new_path(vec!["t".into()])),
        data_body: vec![0u8; (csd_runtime::protocol::MAX_MESSAGE_BYTES) + 1024].into(),
        ..Default::default()
    };
    let s = raw
        .do_put(futures::stream::iter(vec![huge]))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
    assert!(s.message().contains("too large"), "{s:?}");
    // A schema Parquet cannot hold is the caller's problem, not the node's.
    let odd = Arc::new(Schema::new(vec![Field::new(
        "i",
        DataType::Interval(arrow::datatypes::IntervalUnit::MonthDayNano),
        false,
    )]));
    let ob = RecordBatch::try_new(
        odd.clone(),
        vec![Arc::new(arrow::array::IntervalMonthDayNanoArray::from(
            vec![arrow::datatypes::IntervalMonthDayNano::new(1, 2, 3)],
        ))],
    )
    .unwrap();
    let e = c.put("odd", "0", odd, stream(vec![ob])).await.unwrap_err();
    assert!(
        e.code() == Some(Code::InvalidArgument) && e.to_string().contains("Parquet"),
        "{e}"
    );
    assert!(
        c.table("odd").await.is_err(),
        "a failed first append must not leave a table behind"
    );
    // Unknown action.
    let s = raw
        .do_action(Action::new("format-disk", ""))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(
        s.code() == Code::InvalidArgument && s.message().contains("stats"),
        "{s:?}"
    );
    // Nothing was harmed: the table still reads back exactly.
    let got = scan_all(&c, "t", None, &[]).await;
    assert_eq!(concat_batches(&schema, &got).unwrap(), batch);
    assert_eq!(
        c.table("t").await.unwrap().description.partitions[0]
            .objects
            .len(),
        1
    );
    node.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_survive_a_restart_on_an_io_uring_device() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = NodeConfig {
        device: dir.path().join("dev.img").display().to_string(),
        capacity: ByteSize::mib(128),
        listen: "127.0.0.1:0".into(),
        cpus: 1,
        ..NodeConfig::default()
    };
    let data = lineitem(0.002, 1, 1).unwrap();
    let schema = data[0].schema();
    {
        let node = node::start(&config).await.unwrap();
        let c = NodeClient::connect(&node.url).await.unwrap();
        c.put("lineitem", "0", schema.clone(), stream(data.clone()))
            .await
            .unwrap();
        node.shutdown().await.unwrap();
    }
    let node = node::start(&config).await.unwrap();
    let c = NodeClient::connect(&node.url).await.unwrap();
    let got = scan_all(&c, "lineitem", None, &[]).await;
    assert_eq!(
        concat_batches(&schema, &got).unwrap(),
        concat_batches(&schema, &data).unwrap()
    );
    node.shutdown().await.unwrap();
}

#[tokio::test]
async fn config_files_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("node.toml");
    std::fs::write(
        &p,
        "device = \"emulated:mem\"\ncpus = 1\nlisten = \"127.0.0.1:0\"\ncapacity = \"64MiB\"\n",
    )
    .unwrap();
    let cfg = NodeConfig::from_toml_file(&p).unwrap();
    assert_eq!(cfg.cpus, 1);
    std::fs::write(&p, "cpu = 1\n").unwrap();
    let e = NodeConfig::from_toml_file(&p).unwrap_err().to_string();
    assert!(e.contains("unknown field `cpu`"), "{e}");
    let bad = NodeConfig {
        device: "emulated:mem,latency_us=-1".into(),
        capacity: ByteSize::mib(64),
        listen: "127.0.0.1:0".into(),
        ..NodeConfig::default()
    };
    let e = node::start(&bad).await.err().unwrap().to_string();
    assert!(e.contains("non-negative"), "{e}");
}

/// An object copy (`csd repair`'s DoPut) is stored byte for byte: the same length
/// and digest as its source, the same rows; bytes that are not Parquet and an
/// upload cut off before its end store nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_copy_is_byte_for_byte_or_nothing() {
    let (a, b) = (crate::mem_node().await, crate::mem_node().await);
    let ca = NodeClient::connect(&a.url).await.unwrap();
    let cb = NodeClient::connect(&b.url).await.unwrap();
    let part = lineitem(0.02, 1, 1).unwrap();
    let schema = part[0].schema();
    ca.put_copy("li", "p0", 2, None, schema, stream(part))
        .await
        .unwrap();
    let source = ca.table("li").await.unwrap().description.partitions;
    let object = &source[0].objects[0];
    assert!(object.len > 4 << 20, "several 4 MiB pieces: {}", object.len);
    let summary = cb.copy_object_from(&ca, "li", "p0", object).await.unwrap();
    assert_eq!(summary.bytes, object.len);
    let copied = cb.table("li").await.unwrap().description.partitions;
    assert_eq!(copied[0].objects[0].len, object.len);
    assert_eq!(copied[0].objects[0].digest, object.digest);
    assert!(object.digest.is_some());
    assert_eq!(
        copied[0].copies, 2,
        "the footer carries the copies asked for"
    );
    assert_eq!(
        concat(&scan_all(&cb, "li", None, &[]).await),
        concat(&scan_all(&ca, "li", None, &[]).await)
    );

    let channel = tonic::transport::Endpoint::from_shared(b.url.replace("grpc://", "http://"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut raw = FlightServiceClient::new(channel);
    let first = |body: &'static [u8]| FlightData {
        flight_descriptor: Some(FlightDescriptor::new_path(vec!["x".into(), "p".into()])),
        app_metadata: csd_runtime::protocol::PUT_OBJECT_COPY.into(),
        data_body: body.into(),
        ..Default::default()
    };
    let end = FlightData {
        app_metadata: csd_runtime::protocol::PUT_END.into(),
        ..Default::default()
    };
    // Not Parquet.
    let s = raw
        .do_put(futures::stream::iter(vec![
            first(b"not parquet at all"),
            end,
        ]))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(s.message().contains("does not read as Parquet"), "{s:?}");
    // Cut off: no end marker.
    let s = raw
        .do_put(futures::stream::iter(vec![first(b"PAR1")]))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(s.message().contains("cut off"), "{s:?}");
    // A descriptor that is not [table, partition].
    let mut bad = first(b"");
    bad.flight_descriptor = Some(FlightDescriptor::new_path(vec!["x".into()]));
    let s = raw
        .do_put(futures::stream::iter(vec![bad]))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    let e = cb.table("x").await.unwrap_err();
    assert_eq!(e.code(), Some(Code::NotFound), "nothing stored: {e}");
    assert!(cb.objects("x/").await.unwrap().is_empty());
}

/// The copies of one put (`csd put --replicas`) have the same bytes on every node,
/// and another put of the same rows other bytes: a deleted copy is known by its
/// digests alone. A put id that is no name is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_puts_copies_share_their_digests_and_no_other_put_does() {
    let (a, b) = (crate::mem_node().await, crate::mem_node().await);
    let ca = NodeClient::connect(&a.url).await.unwrap();
    let cb = NodeClient::connect(&b.url).await.unwrap();
    let part = lineitem(0.002, 1, 1).unwrap();
    let schema = part[0].schema();
    let digests = |c: &NodeClient, p: &'static str| {
        let c = c.clone();
        async move {
            let t = c.table("li").await.unwrap();
            let p = t
                .description
                .partitions
                .iter()
                .find(|x| x.name == p)
                .unwrap();
            csd_protocol::DeletedCopy::of(p).unwrap().digests
        }
    };
    for (c, p, put) in [
        (&ca, "p0", "put-1"),
        (&cb, "p0", "put-1"),
        (&ca, "p1", "put-2"),
    ] {
        c.put_copy("li", p, 2, Some(put), schema.clone(), stream(part.clone()))
            .await
            .unwrap();
    }
    assert_eq!(digests(&ca, "p0").await, digests(&cb, "p0").await);
    assert_ne!(digests(&ca, "p0").await, digests(&ca, "p1").await);
    let bad = ca
        .put_copy("li", "p2", 2, Some("no spaces"), schema, stream(part))
        .await
        .unwrap_err();
    assert_eq!(
        bad.status_code(),
        csd_protocol::StatusCode::InvalidArgument,
        "{bad}"
    );
    assert!(bad.to_string().contains("put id"), "{bad}");
}

fn concat(batches: &[RecordBatch]) -> RecordBatch {
    concat_batches(&batches[0].schema(), batches).unwrap()
}
