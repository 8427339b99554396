//! Queries over a node whose drive misbehaves on purpose (a `faulty:` device with
//! bit-rot and latent sector errors, no read cache): pushed down or read by byte
//! range, every answer equals DataFusion's on the same rows, or the query fails
//! with a data-loss error naming the object; never a different answer.

use std::sync::Arc;

use arrow::array::{ArrayRef, Int32Array, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use csd_runtime::config::{ByteSize, NodeConfig};
use datafusion::prelude::SessionContext;

use crate::{canonical, register_local, sessions};

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("k", DataType::Int32, false),
        Field::new("s", DataType::Utf8, false),
    ]))
}

fn part(p: i64) -> RecordBatch {
    let ids: Vec<i64> = (p * 20_000..(p + 1) * 20_000).collect();
    let k: Vec<i32> = ids.iter().map(|i| (i * 7919 % 97) as i32).collect();
    let s: Vec<String> = ids.iter().map(|i| format!("name-{}", i % 1013)).collect();
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(Int64Array::from(ids)) as ArrayRef,
            Arc::new(Int32Array::from(k)),
            Arc::new(StringArray::from(s)),
        ],
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn answers_are_exact_or_data_loss_over_a_rotting_drive() {
    let seeds: u64 = std::env::var("CSD_FAULT_SEEDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(4);
    let queries = [
        "SELECT k, count(*) AS n, sum(id) AS s FROM t GROUP BY k",
        "SELECT id, s FROM t WHERE k = 5 AND id % 3 = 0",
        "SELECT count(DISTINCT s) AS d FROM t",
        "SELECT * FROM t WHERE s = 'name-17'",
    ];
    let local = SessionContext::new();
    register_local(&local, "t", schema(), (0..4).map(part).collect());
    let (mut exact, mut lost) = (0, 0);
    for seed in 1..=seeds {
        // 64 MiB: catalog slots of 64 blocks, so the store's metadata ends at 129.
        let config = NodeConfig {
            device: format!("faulty:{seed},rot=0.0001,lse=0.00005,safe_below=129:emulated:mem"),
            capacity: ByteSize::mib(64),
            read_cache: Some(ByteSize(0)),
            ..NodeConfig::default()
        };
        let node = crate::sql_node_on(config).await;
        let client = csd_protocol::node_client::NodeClient::connect(&node.url)
            .await
            .unwrap();
        for p in 0..4 {
            // A put whose footer rots as it is read back is committed but lost:
            // it says so, and its partition reads as lost.
            let put = client
                .put(
                    "t",
                    &format!("p{p}"),
                    schema(),
                    futures::stream::iter([Ok(part(p))]),
                )
                .await;
            if let Err(e) = put {
                assert!(
                    e.code() == Some(tonic::Code::DataLoss) && e.to_string().contains("t/p"),
                    "seed {seed}: put p{p}: {e}"
                );
            }
        }
        let (on, off) = sessions(std::slice::from_ref(&node)).await;
        for round in 0..3 {
            for sql in queries {
                let want = canonical(&local.sql(sql).await.unwrap().collect().await.unwrap());
                for session in [&on, &off] {
                    match session.run(sql).await {
                        Ok(run) => {
                            assert_eq!(
                                canonical(&run.batches),
                                want,
                                "seed {seed} round {round}: a WRONG ANSWER (pushdown {}) for {sql}",
                                session.pushdown()
                            );
                            exact += 1;
                        }
                        Err(e) => {
                            let text = e.to_string();
                            let data_loss = text.contains("t/p")
                                && (text.contains("checksum")
                                    || text.contains("cannot be read")
                                    || text.contains("not readable Parquet")
                                    || text.contains("lost an object"));
                            assert!(
                                data_loss,
                                "seed {seed}: {sql} failed without naming lost data: {text}"
                            );
                            // Of that kind too, wherever it was found (a footer's
                            // failure once reached here as an internal error).
                            assert_eq!(
                                csd_query_pushdown::error::status_code(&e),
                                csd_protocol::StatusCode::DataLoss,
                                "seed {seed}: {sql}: {text}"
                            );
                            if std::env::var_os("CSD_FAULT_TRACE").is_some() {
                                println!("seed {seed}: {text}");
                            }
                            lost += 1;
                        }
                    }
                }
            }
        }
    }
    println!(
        "over a rotting drive: {exact} answers exact, {lost} failed naming lost data, 0 wrong"
    );
    assert!(exact > 0 && lost > 0, "{exact} exact, {lost} lost");
}
