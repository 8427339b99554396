//! `Compression::Auto` end to end: a node's answer read slowly goes zstd where its
//! queue backs up, read at once it goes (mostly) LZ4, and either way every row
//! arrives as sent, read back by Arrow's own Flight decoder.

use std::sync::Arc;
use std::time::Duration;

use arrow::array::{Int64Array, RecordBatch, StringArray};
use arrow::compute::concat_batches;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::ipc::CompressionType;
use arrow_flight::FlightData;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::flight_service_client::FlightServiceClient;
use csd_protocol::{Compression, Ticket};
use csd_query_pushdown::wire::fragment::{Mode, OPERATOR_NAME, SqlFragment};
use datafusion::prelude::SessionContext;
use datafusion_substrait::logical_plan::producer::to_substrait_plan;
use futures::{StreamExt, TryStreamExt};
use prost::Message;

use crate::{nodes, register_local};

const ROWS: i64 = 1_500_000;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("a", DataType::Int64, false),
        Field::new("b", DataType::Int64, false),
        Field::new("s", DataType::Utf8, false),
    ]))
}

fn part(start: i64, n: i64) -> RecordBatch {
    let rows = start..start + n;
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from_iter_values(rows.clone())),
            Arc::new(Int64Array::from_iter_values(
                rows.clone()
                    .map(|i| i.wrapping_mul(0x9E37_79B9) % 1_000_003),
            )),
            Arc::new(StringArray::from_iter_values(
                rows.map(|i| format!("key-{}", i % 5000)),
            )),
        ],
    )
    .unwrap()
}

/// `SELECT * FROM t` as the `sql` operator's arguments.
async fn select_all() -> Vec<u8> {
    let ctx = SessionContext::new();
    register_local(&ctx, "t", schema(), vec![part(0, 1)]);
    let p = ctx
        .sql("SELECT a, b, s FROM t")
        .await
        .unwrap()
        .into_optimized_plan()
        .unwrap();
    let plan = to_substrait_plan(&p, &ctx.state()).unwrap();
    SqlFragment {
        table: "t".into(),
        partition: None,
        plan: plan.encode_to_vec(),
        mode: Mode::Complete as i32,
        ..Default::default()
    }
    .to_bytes()
}

/// The answer's messages, each read `pause` after the one before.
async fn answer(url: &str, args: Vec<u8>, pause: Duration) -> Vec<FlightData> {
    let ticket = Ticket::Operator {
        name: OPERATOR_NAME.into(),
        args,
        compression: Compression::Auto,
        patient: true,
        asker: None,
        keep_ms: None,
        keep_group: None,
    };
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = FlightServiceClient::new(channel);
    let mut stream = client
        .do_get(arrow_flight::Ticket::new(ticket.encode()))
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    while let Some(d) = stream.next().await {
        out.push(d.unwrap());
        tokio::time::sleep(pause).await;
    }
    out
}

/// The codec of each Arrow record batch message (`None`: uncompressed).
fn codecs(messages: &[FlightData]) -> Vec<Option<CompressionType>> {
    messages
        .iter()
        .filter(|m| !m.data_header.is_empty())
        .filter_map(|m| {
            let message = arrow::ipc::root_as_message(&m.data_header).unwrap();
            let batch = message.header_as_record_batch()?;
            Some(batch.compression().map(|c| c.codec()))
        })
        .collect()
}

/// The answer's rows, in `a`'s order (the node's scan may interleave row groups).
async fn decoded(messages: Vec<FlightData>) -> RecordBatch {
    // The trailing report is app_metadata only: not Arrow.
    let arrow = messages.into_iter().filter(|m| !m.data_header.is_empty());
    let batches: Vec<RecordBatch> =
        FlightRecordBatchStream::new_from_flight_data(futures::stream::iter(arrow.map(Ok)))
            .try_collect()
            .await
            .unwrap();
    let all = concat_batches(&schema(), &batches).unwrap();
    let order = arrow::compute::sort_to_indices(all.column(0), None, None).unwrap();
    arrow::compute::take_record_batch(&all, &order).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_read_slowly_goes_zstd_and_arrives_whole() {
    let (nodes, clients) = nodes(1).await;
    let batches: Vec<RecordBatch> = (0..15).map(|i| part(i * ROWS / 15, ROWS / 15)).collect();
    let sent = concat_batches(&schema(), &batches).unwrap();
    clients[0]
        .put(
            "t",
            "0",
            schema(),
            futures::stream::iter(batches.into_iter().map(Ok)),
        )
        .await
        .unwrap();
    let args = select_all().await;

    let slow = answer(&nodes[0].url, args.clone(), Duration::from_millis(40)).await;
    let fast = answer(&nodes[0].url, args, Duration::ZERO).await;
    let zstd = |m: &[FlightData]| {
        let c = codecs(m);
        let z = c
            .iter()
            .filter(|c| **c == Some(CompressionType::ZSTD))
            .count();
        assert!(
            c.iter().all(|c| c.is_some()),
            "every piece is compressed: {c:?}"
        );
        (z, c.len())
    };
    let (slow_zstd, slow_pieces) = zstd(&slow);
    let (fast_zstd, fast_pieces) = zstd(&fast);
    assert!(slow_pieces >= 10, "{slow_pieces} pieces");
    // Read slowly, the queue is full after the first pieces: the rest go zstd.
    assert!(
        slow_zstd * 2 >= slow_pieces,
        "{slow_zstd} of {slow_pieces} pieces zstd when read slowly"
    );
    assert!(
        fast_zstd < slow_zstd,
        "{fast_zstd} of {fast_pieces} zstd read at once, {slow_zstd} of {slow_pieces} read slowly"
    );
    for messages in [slow, fast] {
        assert_eq!(decoded(messages).await, sent);
    }
}
