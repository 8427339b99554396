//! The Flight SQL gateway with arrow-flight's own Flight SQL client (one nobody
//! here wrote): statements, prepared statements with bound values, metadata,
//! `GetSchema`, cancelling, bad input, and tenants asked as themselves. Every answer
//! is compared with DataFusion running the same SQL locally.

use std::sync::Arc;

use arrow::array::{Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{Schema, SchemaRef};
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::sql::client::FlightSqlServiceClient;
use arrow_flight::sql::{
    CommandGetDbSchemas, CommandGetTables, CommandGetXdbcTypeInfo, CommandStatementQuery,
    ProstMessageExt, SqlInfo,
};
use arrow_flight::{Action, CancelFlightInfoRequest, FlightDescriptor, FlightInfo, Ticket};
use csd_protocol::node_client::{Credentials, NodeClient};
use csd_query_pushdown::{GatewayOptions, GatewayTls, SessionOptions};
use csd_runtime::config::NodeConfig;
use csd_runtime::node::RunningNode;
use csd_testbed::tpch;
use futures::TryStreamExt;
use prost::Message;
use tonic::Code;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use crate::tpch::local;
use crate::{canonical, nodes, sql_node_with};

struct Gateway {
    url: String,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn gateway(nodes: &[RunningNode], pushdown: bool, tls: Option<GatewayTls>) -> Gateway {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let options = GatewayOptions {
        nodes: nodes.iter().map(|n| n.url.clone()).collect(),
        credentials: Credentials::default(),
        session: SessionOptions {
            pushdown,
            ..SessionOptions::default()
        },
        tls,
    };
    tokio::spawn(async move {
        csd_query_pushdown::serve_gateway_on(options, listener, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    });
    Gateway {
        url: format!("http://{addr}"),
        _stop: stop,
    }
}

async fn channel(url: &str) -> Channel {
    Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap()
}

async fn client(url: &str) -> FlightSqlServiceClient<Channel> {
    FlightSqlServiceClient::new(channel(url).await)
}

/// Fetches every endpoint of `info`; checks the stream's schema is the advertised
/// one, nullability included (ADBC refuses a difference).
async fn fetch(c: &mut FlightSqlServiceClient<Channel>, info: FlightInfo) -> Vec<RecordBatch> {
    let advertised: Schema = info.clone().try_decode_schema().unwrap();
    let mut out = Vec::new();
    for e in info.endpoint {
        let mut stream = c.do_get(e.ticket.unwrap()).await.unwrap();
        while let Some(b) = stream.try_next().await.unwrap() {
            out.push(b);
        }
        let got = stream.schema().expect("the stream sent its schema");
        assert_eq!(
            got.as_ref(),
            &advertised,
            "stream schema differs from FlightInfo's"
        );
    }
    out
}

/// The first result body of the action `kind` with `body`.
async fn action(
    c: &mut FlightSqlServiceClient<Channel>,
    kind: &str,
    body: Vec<u8>,
) -> bytes::Bytes {
    c.do_action(Action::new(kind.to_string(), body))
        .await
        .unwrap()
        .try_next()
        .await
        .unwrap()
        .unwrap()
        .body
}

/// A `CancelFlightInfoResult` with `status`, encoded.
fn encoded(status: arrow_flight::CancelStatus) -> bytes::Bytes {
    arrow_flight::CancelFlightInfoResult::new(status)
        .encode_to_vec()
        .into()
}

/// `sql`'s answer through `c`, as sorted rows.
async fn answer(c: &mut FlightSqlServiceClient<Channel>, sql: &str) -> Vec<String> {
    let info = c.execute(sql.to_string(), None).await.unwrap();
    canonical(&fetch(c, info).await)
}

async fn loaded(n: usize) -> (Vec<RunningNode>, Vec<NodeClient>) {
    let (nodes, clients) = nodes(n).await;
    tpch::load(&clients, 0.01, 2, |_, _| {}).await.unwrap();
    (nodes, clients)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tpch_through_flight_sql_equals_local() {
    let (nodes, _) = loaded(2).await;
    let local = local(0.01);
    let on = gateway(&nodes, true, None).await;
    let off = gateway(&nodes, false, None).await;
    let mut c_on = client(&on.url).await;
    let mut c_off = client(&off.url).await;
    for (n, sql) in tpch::QUERIES {
        let want = canonical(&local.sql(sql).await.unwrap().collect().await.unwrap());
        for c in [&mut c_on, &mut c_off] {
            let info = c.execute(sql.to_string(), None).await.unwrap();
            let batches = fetch(c, info).await;
            assert_eq!(canonical(&batches), want, "Q{n}");
            // Answers travel as plain types, cut to their rows: Q10's top 20 once
            // carried every string buffer its rows were cut from.
            for b in &batches {
                for f in b.schema().fields() {
                    assert!(
                        !matches!(
                            f.data_type(),
                            arrow::datatypes::DataType::Utf8View
                                | arrow::datatypes::DataType::BinaryView
                        ),
                        "Q{n}: {f:?}"
                    );
                }
            }
            if n == 10 {
                let size: usize = batches.iter().map(RecordBatch::get_array_memory_size).sum();
                assert!(size < 64 << 10, "Q10's 20 rows take {size} bytes");
            }
        }
    }
    // EXPLAIN shows the pushdown, as `csd sql`'s does.
    let info = c_on
        .execute(
            "EXPLAIN SELECT count(*) FROM lineitem WHERE l_quantity < 5".into(),
            None,
        )
        .await
        .unwrap();
    let text = arrow::util::pretty::pretty_format_batches(&fetch(&mut c_on, info).await)
        .unwrap()
        .to_string();
    assert!(text.contains("CsdScanExec"), "{text}");
    // The counters saw it.
    let stats: csd_protocol::GatewayStats =
        serde_json::from_slice(&action(&mut c_on, "gateway_stats", Vec::new()).await).unwrap();
    assert_eq!(stats.queries, 23, "{stats:?}");
    assert_eq!((stats.queries_failed, stats.running), (0, 0), "{stats:?}");
    assert!(stats.rows_sent > 0 && stats.sessions == 1, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prepared_statements_bind_values_and_handles_are_stateless() {
    let (nodes, _) = loaded(1).await;
    let local = local(0.01);
    let a = gateway(&nodes, true, None).await;
    let b = gateway(&nodes, true, None).await;
    let mut c = client(&a.url).await;
    let sql = "SELECT l_orderkey, l_linenumber, l_quantity FROM lineitem WHERE l_orderkey = ? AND l_shipmode <> ?";
    let mut stmt = c.prepare(sql.into(), None).await.unwrap();
    let params = stmt.parameter_schema().unwrap().clone();
    let names: Vec<_> = params.fields().iter().map(|f| f.name().clone()).collect();
    assert_eq!(names, ["$1", "$2"]);
    for key in [1i64, 7, 32] {
        let bind = RecordBatch::try_from_iter([
            ("0", Arc::new(Int64Array::from(vec![key])) as _),
            ("1", Arc::new(StringArray::from(vec!["MAIL"])) as _),
        ])
        .unwrap();
        stmt.set_parameters(bind).unwrap();
        let info = stmt.execute().await.unwrap();
        // The handle carries the SQL and its values: another gateway answers it.
        let mut other = client(&b.url).await;
        let got = canonical(&fetch(&mut other, info).await);
        let want = canonical(
            &local
                .sql(&format!(
                    "SELECT l_orderkey, l_linenumber, l_quantity FROM lineitem WHERE l_orderkey = {key} AND l_shipmode <> 'MAIL'"
                ))
                .await
                .unwrap()
                .collect()
                .await
                .unwrap(),
        );
        assert!(!want.is_empty(), "key {key} has rows");
        assert_eq!(got, want, "key {key}");
    }
    // Two rows of values are refused: a statement runs once per row.
    let two = RecordBatch::try_from_iter([
        ("0", Arc::new(Int64Array::from(vec![1, 2])) as _),
        ("1", Arc::new(StringArray::from(vec!["MAIL", "AIR"])) as _),
    ])
    .unwrap();
    stmt.set_parameters(two).unwrap();
    let e = stmt.execute().await.unwrap_err().to_string();
    assert!(e.contains("one row"), "{e}");
    stmt.close().await.unwrap();
    // A statement without parameters prepares and runs too.
    let mut plain = c
        .prepare("SELECT count(*) AS n FROM nation".into(), None)
        .await
        .unwrap();
    assert!(plain.parameter_schema().unwrap().fields().is_empty());
    let info = plain.execute().await.unwrap();
    let rows = fetch(&mut c, info).await;
    assert_eq!(canonical(&rows), ["25"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metadata_answers_with_and_without_a_catalog() {
    let (nodes, clients) = loaded(1).await;
    let g = gateway(&nodes, true, None).await;
    let mut c = client(&g.url).await;
    let info = c.get_catalogs().await.unwrap();
    assert_eq!(canonical(&fetch(&mut c, info).await), ["datafusion"]);
    let info = c
        .get_db_schemas(CommandGetDbSchemas {
            catalog: None,
            db_schema_filter_pattern: None,
        })
        .await
        .unwrap();
    assert_eq!(
        canonical(&fetch(&mut c, info).await),
        ["datafusion | public"]
    );
    for include_schema in [false, true] {
        let info = c
            .get_tables(CommandGetTables {
                catalog: None,
                db_schema_filter_pattern: None,
                table_name_filter_pattern: Some("line%".into()),
                table_types: vec![],
                include_schema,
            })
            .await
            .unwrap();
        let rows = fetch(&mut c, info).await;
        assert_eq!(rows.iter().map(RecordBatch::num_rows).sum::<usize>(), 1);
        assert_eq!(rows[0].num_columns(), if include_schema { 5 } else { 4 });
    }
    let info = c
        .get_tables(CommandGetTables {
            catalog: Some("datafusion".into()),
            db_schema_filter_pattern: Some("public".into()),
            table_name_filter_pattern: None,
            table_types: vec!["TABLE".into()],
            include_schema: false,
        })
        .await
        .unwrap();
    let rows = fetch(&mut c, info).await;
    assert_eq!(
        rows.iter().map(RecordBatch::num_rows).sum::<usize>(),
        8,
        "TPC-H's 8 tables"
    );
    let info = c.get_table_types().await.unwrap();
    assert_eq!(canonical(&fetch(&mut c, info).await), ["TABLE", "VIEW"]);
    let info = c
        .get_sql_info(vec![
            SqlInfo::FlightSqlServerName,
            SqlInfo::FlightSqlServerReadOnly,
        ])
        .await
        .unwrap();
    let rows = fetch(&mut c, info).await;
    assert_eq!(rows.iter().map(RecordBatch::num_rows).sum::<usize>(), 2);
    let info = c
        .get_xdbc_type_info(CommandGetXdbcTypeInfo { data_type: None })
        .await
        .unwrap();
    assert!(fetch(&mut c, info).await[0].num_rows() >= 10);
    // GetSchema (beside the Flight SQL dispatch) equals the FlightInfo's schema.
    let mut raw = FlightServiceClient::new(channel(&g.url).await);
    let sql = "SELECT o_orderkey, min(l_shipdate), count(*) FROM orders JOIN lineitem ON o_orderkey = l_orderkey GROUP BY o_orderkey";
    let cmd = CommandStatementQuery {
        query: sql.into(),
        transaction_id: None,
    };
    let schema = raw
        .get_schema(FlightDescriptor::new_cmd(cmd.as_any().encode_to_vec()))
        .await
        .unwrap()
        .into_inner();
    let schema: Schema = (&schema).try_into().unwrap();
    let info = c.execute(sql.into(), None).await.unwrap();
    let advertised: Schema = info.clone().try_decode_schema().unwrap();
    assert_eq!(schema, advertised);
    fetch(&mut c, info).await;
    // A table stored now is listed and queried once the caller's session is renewed
    // (sessions are reused for 2 s).
    let (schema, batches) = tpch::generate("region", 0.01, 1, 1).unwrap();
    clients[0]
        .put(
            "late_region",
            "p0",
            schema,
            futures::stream::iter(batches.into_iter().map(Ok)),
        )
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    assert_eq!(
        answer(&mut c, "SELECT count(*) FROM late_region").await,
        ["5"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_gets_clear_statuses_never_internal() {
    let (nodes, _) = loaded(1).await;
    let g = gateway(&nodes, true, None).await;
    let mut c = client(&g.url).await;
    let mut raw = FlightServiceClient::new(channel(&g.url).await);
    // Writes of any kind are refused.
    for sql in [
        "CREATE EXTERNAL TABLE x STORED AS CSV LOCATION '/etc/passwd'",
        "COPY lineitem TO '/tmp/out.csv'",
        "SET datafusion.execution.batch_size = 1",
        "DROP TABLE lineitem",
    ] {
        let e = c.execute(sql.into(), None).await.unwrap_err().to_string();
        assert!(
            e.contains("InvalidArgument")
                || e.contains("invalid argument")
                || e.contains("queries only"),
            "{sql}: {e}"
        );
    }
    let s = raw
        .do_get(Ticket::new(b"\xff\x00garbage".to_vec()))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s}");
    // A statement ticket whose handle is junk.
    let t = arrow_flight::sql::TicketStatementQuery {
        statement_handle: b"\x08\x63junk".to_vec().into(),
    };
    let s = raw
        .do_get(Ticket::new(t.as_any().encode_to_vec()))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s}");
    assert!(s.message().contains("statement handle"), "{s}");
    // A known command type with a body that is not that command.
    let any = arrow_flight::sql::Any {
        type_url: CommandStatementQuery::type_url().into(),
        value: vec![0xff, 0xff, 0xff].into(),
    };
    let s = raw
        .get_flight_info(FlightDescriptor::new_cmd(any.encode_to_vec()))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s}");
    // SQL that does not parse, a table that does not exist.
    for sql in ["SELEC 1", "SELECT * FROM nowhere"] {
        let s = raw
            .get_flight_info(FlightDescriptor::new_cmd(
                CommandStatementQuery {
                    query: sql.into(),
                    transaction_id: None,
                }
                .as_any()
                .encode_to_vec(),
            ))
            .await
            .unwrap_err();
        assert_ne!(s.code(), Code::Internal, "{sql}: {s}");
    }
    let s = raw
        .do_action(Action::new("drop_everything", ""))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::Unimplemented, "{s}");
    let s = raw
        .list_flights(arrow_flight::Criteria::default())
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::Unimplemented, "{s}");
    // Updates are not served.
    let e = c
        .execute_update("DELETE FROM lineitem".into(), None)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("queries only"), "{e}");
    // Still serving.
    assert_eq!(answer(&mut c, "SELECT count(*) FROM region").await, ["5"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelling_stops_a_streaming_answer() {
    let (nodes, clients) = loaded(1).await;
    let g = gateway(&nodes, true, None).await;
    let mut c = client(&g.url).await;
    // A long answer: lineitem with itself on a small key range, in many batches.
    let info = c
        .execute(
            "SELECT a.l_orderkey, b.l_partkey FROM lineitem a JOIN lineitem b ON a.l_suppkey = b.l_suppkey".into(),
            None,
        )
        .await
        .unwrap();
    let mut stream = c
        .do_get(info.endpoint[0].ticket.clone().unwrap())
        .await
        .unwrap();
    assert!(stream.try_next().await.unwrap().is_some());
    assert_eq!(
        action(
            &mut c,
            "CancelFlightInfo",
            CancelFlightInfoRequest::new(info.clone()).encode_to_vec()
        )
        .await,
        encoded(arrow_flight::CancelStatus::Cancelled)
    );
    let e = loop {
        match stream.try_next().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("a cancelled answer ended as if complete"),
            Err(e) => break e.to_string(),
        }
    };
    assert!(e.contains("cancelled"), "{e}");
    // Cancelling again finds nothing to stop.
    assert_eq!(
        action(
            &mut c,
            "CancelFlightInfo",
            CancelFlightInfoRequest::new(info).encode_to_vec()
        )
        .await,
        encoded(arrow_flight::CancelStatus::NotCancellable)
    );
    // Nothing of it runs on at the node.
    let mut running = usize::MAX;
    for _ in 0..100 {
        running = clients[0].stats().await.unwrap().admission.running;
        if running == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(running, 0, "requests still running at the node");
}

fn tenants() -> String {
    use csd_runtime::auth::token_digest;
    format!(
        r#"
[[tenant]]
name = "ops"
token_sha256 = "{ops}"
tables = ["*"]
can = ["read", "write", "delete", "admin"]

[[tenant]]
name = "reader"
token_sha256 = "{reader}"
tables = ["lineitem", "orders"]
can = ["read"]
"#,
        ops = token_digest("ops-token"),
        reader = token_digest("reader-token7"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn callers_ask_the_nodes_as_their_tenant_over_tls() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tenants.toml"), tenants()).unwrap();
    let node = sql_node_with(NodeConfig {
        cpus: 2,
        auth: Some(dir.path().join("tenants.toml")),
        ..NodeConfig::default()
    })
    .await;
    let ops = NodeClient::connect_with(&node.url, &Credentials::token("ops-token"))
        .await
        .unwrap();
    tpch::load(&[ops], 0.01, 1, |_, _| {}).await.unwrap();
    let certs =
        csd_runtime::tls::make_certificates(&["localhost".into(), "127.0.0.1".into()], "a-client")
            .unwrap();
    let tls = GatewayTls {
        cert_pem: certs.server_cert_pem.clone().into_bytes(),
        key_pem: certs.server_key_pem.clone().into_bytes(),
        client_ca_pem: None,
    };
    let g = gateway(std::slice::from_ref(&node), true, Some(tls)).await;
    let url = g.url.replace("http://", "https://");
    let tls_channel = || async {
        Endpoint::from_shared(url.clone())
            .unwrap()
            .tls_config(
                ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(&certs.ca_pem))
                    .domain_name("localhost"),
            )
            .unwrap()
            .connect()
            .await
            .unwrap()
    };
    // Basic credentials become the bearer token (padded base64, as this client sends).
    let mut c = FlightSqlServiceClient::new(tls_channel().await);
    c.handshake("reader", "reader-token7").await.unwrap();
    assert_eq!(c.token().map(String::as_str), Some("reader-token7"));
    // The reader sees its tables only.
    let info = c
        .get_tables(CommandGetTables {
            catalog: None,
            db_schema_filter_pattern: None,
            table_name_filter_pattern: None,
            table_types: vec![],
            include_schema: false,
        })
        .await
        .unwrap();
    let tables = fetch(&mut c, info).await;
    let names = canonical(&[tables[0].project(&[2]).unwrap()]);
    assert_eq!(names, ["lineitem", "orders"]);
    let info = c
        .execute(
            "SELECT count(*) FROM orders WHERE o_totalprice > 1000".into(),
            None,
        )
        .await
        .unwrap();
    let want = canonical(
        &local(0.01)
            .sql("SELECT count(*) FROM orders WHERE o_totalprice > 1000")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap(),
    );
    assert_eq!(canonical(&fetch(&mut c, info).await), want);
    let e = c
        .execute("SELECT * FROM supplier".into(), None)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("supplier"), "{e}");
    // Unpadded Basic (what ADBC's Go driver sends): "reader:reader-token7" is 20
    // bytes, so its base64 would end in '='.
    use base64::Engine;
    let bare = base64::engine::general_purpose::STANDARD_NO_PAD.encode("reader:reader-token7");
    assert!(!bare.ends_with('='));
    let mut raw = FlightServiceClient::new(tls_channel().await);
    let mut req = tonic::Request::new(futures::stream::iter([
        arrow_flight::HandshakeRequest::default(),
    ]));
    req.metadata_mut()
        .insert("authorization", format!("Basic {bare}").parse().unwrap());
    let answer = raw.handshake(req).await.unwrap();
    assert_eq!(
        answer
            .metadata()
            .get("authorization")
            .unwrap()
            .to_str()
            .unwrap(),
        "Bearer reader-token7"
    );
    // A wrong token is refused at the handshake and on every call.
    let mut bad = FlightSqlServiceClient::new(tls_channel().await);
    let e = bad
        .handshake("reader", "not-the-token")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("Unauthenticated") || e.contains("unauthenticated") || e.contains("token"),
        "{e}"
    );
    bad.set_token("not-the-token".into());
    let e = bad
        .execute("SELECT 1".into(), None)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("Unauthenticated") || e.contains("nauthenticated"),
        "{e}"
    );
    // No credentials at all: the nodes have tenants, so no.
    let mut anonymous = FlightSqlServiceClient::new(tls_channel().await);
    assert!(anonymous.execute("SELECT 1".into(), None).await.is_err());
    // Plain gRPC to a TLS port fails.
    let plain = Endpoint::from_shared(g.url.clone())
        .unwrap()
        .connect()
        .await;
    if let Ok(ch) = plain {
        let mut c = FlightSqlServiceClient::new(ch);
        assert!(c.get_catalogs().await.is_err());
    }
    let _: SchemaRef = Arc::new(Schema::empty());
}
