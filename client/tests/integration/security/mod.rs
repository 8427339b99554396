//! A node with TLS and tenants, as a user deploys it: real certificates (a private CA
//! made like `csd auth ca` makes it), real tokens, a real server on 127.0.0.1:0. Every
//! refusal is checked for its status, and that nothing was read or changed.

use std::path::PathBuf;
use std::sync::Arc;

use arrow::record_batch::RecordBatch;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{FlightClient, FlightDescriptor, Ticket as FlightTicket};
use csd_client::demo::lineitem;
use csd_runtime::auth::token_digest;
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node::{self, RunningNode};
use csd_runtime::node_client::{Credentials, Error as ClientError, NodeClient};
use csd_runtime::protocol::Ticket;
use futures::TryStreamExt;
use tonic::Code;

struct Secure {
    node: RunningNode,
    dir: tempfile::TempDir,
    ca: Vec<u8>,
    certs: csd_runtime::tls::Certificates,
}

fn tenants(reader_can: &str) -> String {
    format!(
        r#"
[[tenant]]
name = "ops"
token_sha256 = "{ops}"
tables = ["*"]
can = ["read", "write", "delete", "admin"]

[[tenant]]
name = "etl"
token_sha256 = "{etl}"
tables = ["lineitem", "orders"]
can = ["read", "write"]
weight = 3
reserve = 1

[[tenant]]
name = "reader"
token_sha256 = "{reader}"
tables = ["lineitem"]
can = [{reader_can}]

[[tenant]]
name = "small"
token_sha256 = "{small}"
tables = ["q_*"]
can = ["read", "write"]
max_stored_bytes = "64KiB"
max_requests = 1

[[tenant]]
name = "certified"
cert_subject = "certified-client"
tables = ["lineitem"]
can = ["read"]

[[tenant]]
name = "leaser"
token_sha256 = "{leaser}"
tables = ["lineitem"]
can = ["read", "code"]
max_requests = 1
"#,
        ops = token_digest("ops-token"),
        etl = token_digest("etl-token"),
        reader = token_digest("reader-token"),
        small = token_digest("small-token"),
        leaser = token_digest("leaser-token"),
    )
}

async fn secure_node(mutual: bool) -> Secure {
    let dir = tempfile::tempdir().unwrap();
    let certs = csd_runtime::tls::make_certificates(
        &["localhost".into(), "127.0.0.1".into()],
        "certified-client",
    )
    .unwrap();
    certs.write(dir.path()).unwrap();
    std::fs::write(dir.path().join("tenants.toml"), tenants("\"read\"")).unwrap();
    let p = |f: &str| Some(dir.path().join(f));
    let config = NodeConfig {
        device: "emulated:mem".into(),
        capacity: ByteSize::mib(256),
        listen: "127.0.0.1:0".into(),
        cpus: 2,
        auth: p("tenants.toml"),
        tls_cert: p("node.pem"),
        tls_key: p("node.key"),
        tls_client_ca: if mutual { p("ca.pem") } else { None },
        ..NodeConfig::default()
    };
    let operators = csd_query_pushdown::registry_with(&config)
        .unwrap()
        .with(Arc::new(csd_ml_pushdown::MlOperator::new()));
    let node = node::start_with(&config, operators).await.unwrap();
    assert!(node.url.starts_with("grpc+tls://"), "{}", node.url);
    Secure {
        node,
        ca: certs.ca_pem.clone().into_bytes(),
        certs,
        dir,
    }
}

impl Secure {
    fn creds(&self, token: Option<&str>) -> Credentials {
        Credentials {
            token: token.map(Into::into),
            tls_ca: Some(self.ca.clone()),
            ..Default::default()
        }
    }

    async fn client(&self, token: &str) -> NodeClient {
        NodeClient::connect_with(&self.node.url, &self.creds(Some(token)))
            .await
            .unwrap()
    }

    fn path(&self, f: &str) -> PathBuf {
        self.dir.path().join(f)
    }
}

fn code<T>(r: Result<T, ClientError>) -> (Code, String) {
    match r {
        Ok(_) => panic!("expected a refusal"),
        Err(e) => (e.code().unwrap_or(Code::Unknown), e.to_string()),
    }
}

async fn rows(c: &NodeClient, table: &str) -> usize {
    let b: Vec<RecordBatch> = c
        .scan(table, None, &[])
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    b.iter().map(|b| b.num_rows()).sum()
}

async fn put(c: &NodeClient, table: &str, batches: Vec<RecordBatch>) -> Result<u64, ClientError> {
    let schema = batches[0].schema();
    c.put(
        table,
        "0",
        schema,
        futures::stream::iter(batches.into_iter().map(Ok)),
    )
    .await
    .map(|s| s.rows)
}

/// A raw Flight client over the same TLS, sending `token` (as pyarrow would).
async fn flight(s: &Secure, token: &str) -> FlightClient {
    let ep = tonic::transport::Endpoint::from_shared(s.node.url.replace("grpc+tls", "https"))
        .unwrap()
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(&s.ca)),
        )
        .unwrap();
    let mut c = FlightClient::new_from_inner(FlightServiceClient::new(ep.connect().await.unwrap()));
    c.add_header("authorization", &format!("Bearer {token}"))
        .unwrap();
    c
}

async fn do_get_rows(c: &mut FlightClient, ticket: Vec<u8>) -> Result<usize, (Code, String)> {
    let s = c
        .do_get(FlightTicket::new(ticket))
        .await
        .map_err(|e| flight_code(&e))?;
    let b: Vec<RecordBatch> = s.try_collect().await.map_err(|e| flight_code(&e))?;
    Ok(b.iter().map(|b| b.num_rows()).sum())
}

fn flight_code(e: &arrow_flight::error::FlightError) -> (Code, String) {
    match e {
        arrow_flight::error::FlightError::Tonic(s) => (s.code(), s.message().to_string()),
        other => (Code::Unknown, other.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_is_authenticated_and_checked() {
    let s = secure_node(false).await;
    let ops = s.client("ops-token").await;
    let etl = s.client("etl-token").await;
    let reader = s.client("reader-token").await;
    let data = lineitem(0.002, 1, 1).unwrap();
    let n = data.iter().map(|b| b.num_rows()).sum::<usize>();
    assert_eq!(
        put(&etl, "lineitem", data.clone()).await.unwrap() as usize,
        n
    );
    put(&ops, "part", data.clone()).await.unwrap();

    // No token, a wrong token, a malformed header: UNAUTHENTICATED, on every RPC.
    let anon = NodeClient::connect_with(&s.node.url, &s.creds(None))
        .await
        .unwrap();
    let wrong = s.client("etl-token2").await;
    for c in [&anon, &wrong] {
        assert_eq!(code(c.list_tables("").await).0, Code::Unauthenticated);
        assert_eq!(code(c.table("lineitem").await).0, Code::Unauthenticated);
        assert_eq!(
            code(c.scan("lineitem", None, &[]).await).0,
            Code::Unauthenticated
        );
        assert_eq!(
            code(put(c, "lineitem", data.clone()).await).0,
            Code::Unauthenticated
        );
        assert_eq!(
            code(c.delete("lineitem", None).await).0,
            Code::Unauthenticated
        );
        assert_eq!(code(c.stats().await).0, Code::Unauthenticated);
    }
    let (_, m) = code(anon.list_tables("").await);
    assert!(m.contains("requires a token"), "{m}");
    // Plain TCP to a TLS port fails at once, with TLS settings for a plain URL refused.
    let plain = s.node.url.replace("grpc+tls", "grpc");
    assert!(
        NodeClient::connect_with(&plain, &s.creds(Some("ops-token")))
            .await
            .is_err()
    );
    if let Ok(c) = NodeClient::connect(&plain).await {
        assert!(c.list_tables("").await.is_err());
    }

    // The right token on the wrong table, or without the permission.
    let (c, m) = code(etl.scan("part", None, &[]).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("part") && m.contains("read"), "{m}");
    let (c, m) = code(etl.table("part").await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    let (c, m) = code(etl.delete("lineitem", None).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("delete") && m.contains("lineitem"), "{m}");
    let (c, m) = code(put(&reader, "lineitem", data.clone()).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("write"), "{m}");
    let (c, _) = code(put(&etl, "part", data.clone()).await);
    assert_eq!(c, Code::PermissionDenied);
    assert_eq!(code(etl.stats().await).0, Code::PermissionDenied);
    assert_eq!(code(etl.objects("").await).0, Code::PermissionDenied);
    // Nothing was changed by the refused calls.
    assert_eq!(rows(&ops, "lineitem").await, n);
    assert_eq!(rows(&ops, "part").await, n);
    assert_eq!(
        ops.table("lineitem")
            .await
            .unwrap()
            .description
            .partitions
            .len(),
        1
    );
    // Listing shows only what a tenant may read.
    let names: Vec<String> = etl
        .list_tables("")
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names, ["lineitem"]);
    assert_eq!(ops.list_tables("").await.unwrap().len(), 2);
    assert_eq!(rows(&etl, "lineitem").await, n);

    // Raw ranges: objects of readable tables; any table's for admin; the node's own
    // objects for nobody.
    let objects = ops.objects("").await.unwrap();
    let of = |t: &str| {
        objects
            .iter()
            .find(|o| o.name.starts_with(&format!("{t}/")))
            .unwrap()
            .name
            .clone()
    };
    assert_eq!(
        reader.read_range(&of("lineitem"), 0, 4).await.unwrap(),
        "PAR1"
    );
    let (c, m) = code(reader.read_range(&of("part"), 0, 4).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert_eq!(ops.read_range(&of("part"), 0, 4).await.unwrap(), "PAR1");
    assert!(objects.iter().any(|o| o.name == ".csd/ticket-key"));
    let (c, _) = code(ops.read_range(".csd/ticket-key", 0, 32).await);
    assert_eq!(c, Code::PermissionDenied);

    // Operators: the tables a request reads are checked before it is estimated.
    let ml = csd_ml_pushdown::request::FeatureRequest {
        dataset: "part".into(),
        partition: "0".into(),
        model: "efficientnet-lite0".parse().unwrap(),
        weights: "_w_00000000_10".into(),
        split: 1,
        dtype: Default::default(),
        max_batch: None,
        limit: None,
        mode: Default::default(),
        skip_bad_samples: false,
        pixels: None,
    };
    let r = etl
        .operator("ml", ml.encode(), csd_runtime::protocol::Compression::None)
        .await;
    let (c, m) = code(r);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("part"), "{m}");

    // SQL over TLS with a token answers as without pushdown.
    let creds = s.creds(Some("etl-token"));
    let cluster =
        csd_query_pushdown::Cluster::connect_with(std::slice::from_ref(&s.node.url), &creds)
            .await
            .unwrap();
    let q = "SELECT l_returnflag, count(*) AS n, sum(l_quantity) AS q FROM lineitem GROUP BY l_returnflag ORDER BY l_returnflag";
    let on = cluster
        .session(Default::default())
        .await
        .unwrap()
        .run(q)
        .await
        .unwrap();
    let off = cluster
        .session(csd_query_pushdown::SessionOptions {
            pushdown: false,
            ..Default::default()
        })
        .await
        .unwrap()
        .run(q)
        .await
        .unwrap();
    assert_eq!(
        arrow::util::pretty::pretty_format_batches(&on.batches)
            .unwrap()
            .to_string(),
        arrow::util::pretty::pretty_format_batches(&off.batches)
            .unwrap()
            .to_string()
    );

    // A Wasm SQL function ships code: a tenant without `code` may not push it.
    let with_fn = cluster.session(Default::default()).await.unwrap();
    with_fn
        .register_wasm_udf("word_count", &crate::wasm::guest("functions"), "word_count")
        .await
        .unwrap();
    let e = with_fn
        .run("SELECT count(*) FROM lineitem WHERE word_count(l_comment) > 3")
        .await
        .unwrap_err();
    assert_eq!(
        csd_query_pushdown::error::status_code(&e),
        csd_runtime::StatusCode::PermissionDenied,
        "{e}"
    );
    assert!(e.to_string().contains("code"), "{e}");

    let st = ops.stats().await.unwrap().requests;
    assert!(st.unauthenticated >= 12, "{st:?}");
    assert!(st.permission_denied >= 10, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tickets_are_bound_signed_and_expire() {
    let s = secure_node(false).await;
    let etl = s.client("etl-token").await;
    let data = lineitem(0.002, 1, 1).unwrap();
    let n = put(&etl, "lineitem", data).await.unwrap() as usize;
    let mut as_etl = flight(&s, "etl-token").await;
    let mut as_reader = flight(&s, "reader-token").await;
    let info = as_etl
        .get_flight_info(FlightDescriptor::new_path(vec!["lineitem".into()]))
        .await
        .unwrap();
    let sealed = info.endpoint[0].ticket.clone().unwrap().ticket.to_vec();
    assert_eq!(sealed[0], 2, "handed-out tickets are sealed");
    assert_eq!(do_get_rows(&mut as_etl, sealed.clone()).await.unwrap(), n);
    // Another tenant (which may read the table itself) cannot use etl's ticket.
    let (c, m) = do_get_rows(&mut as_reader, sealed.clone())
        .await
        .unwrap_err();
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("issued to tenant etl"), "{m}");
    // Altered: a flipped bit anywhere (ticket, tenant, expiry, MAC) breaks the seal.
    for i in [5, sealed.len() / 2, sealed.len() - 1] {
        let mut forged = sealed.clone();
        forged[i] ^= 0x01;
        let (c, m) = do_get_rows(&mut as_etl, forged).await.unwrap_err();
        assert!(
            matches!(c, Code::PermissionDenied | Code::InvalidArgument),
            "{c:?} {m}"
        );
    }
    // Sealed by another key (another node, or a guess).
    let other = csd_runtime::auth::TicketKey::random().seal(
        Ticket::Scan {
            table: "lineitem".into(),
            partition: None,
            columns: vec![],
            skip: 0,
            limit: None,
        }
        .encode(),
        "etl",
        std::time::Duration::from_secs(60),
    );
    let (c, m) = do_get_rows(&mut as_etl, other).await.unwrap_err();
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("signature"), "{m}");
    // Expired.
    let expired = s.node.state.ticket_key.seal(
        csd_runtime::protocol::ticket::Seal::decode(&sealed)
            .unwrap()
            .ticket,
        "etl",
        std::time::Duration::ZERO,
    );
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let (c, m) = do_get_rows(&mut as_etl, expired).await.unwrap_err();
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("expired"), "{m}");
    // A ticket built by hand passes the same permission checks as any request.
    let hand = |t: &str| {
        Ticket::Scan {
            table: t.into(),
            partition: None,
            columns: vec![],
            skip: 0,
            limit: None,
        }
        .encode()
    };
    assert_eq!(
        do_get_rows(&mut as_reader, hand("lineitem")).await.unwrap(),
        n
    );
    let (c, _) = do_get_rows(&mut as_reader, hand("orders"))
        .await
        .unwrap_err();
    assert_eq!(c, Code::PermissionDenied);
    // The Flight handshake (basic auth) answers the bearer token to use.
    let mut c = FlightClient::new_from_inner(as_etl.inner().clone());
    c.add_header(
        "authorization",
        "Basic ZXRsOmV0bC10b2tlbg==", // etl:etl-token
    )
    .unwrap();
    c.handshake(bytes::Bytes::new()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claimed_identities_quotas_and_reload() {
    let s = secure_node(false).await;
    let etl = s.client("etl-token").await;
    let ops = s.client("ops-token").await;
    put(&etl, "lineitem", lineitem(0.002, 1, 1).unwrap())
        .await
        .unwrap();

    // A reader claiming to be etl through the csd-tenant header gets its own share.
    let creds = s.creds(Some("reader-token"));
    let cluster =
        csd_query_pushdown::Cluster::connect_with(std::slice::from_ref(&s.node.url), &creds)
            .await
            .unwrap();
    let claimed = NodeClient::connect_with(&s.node.url, &creds)
        .await
        .unwrap()
        .with_tenant("etl")
        .unwrap();
    let claimed = csd_query_pushdown::Cluster::from_clients(vec![claimed]);
    let session = claimed.session(Default::default()).await.unwrap();
    for _ in 0..3 {
        session
            .run("SELECT count(*) FROM lineitem WHERE l_quantity > 10")
            .await
            .unwrap();
    }
    drop(cluster);
    let shares = ops.stats().await.unwrap().admission.tenants;
    assert!(
        shares.get("reader").is_some_and(|t| t.admitted >= 3),
        "{shares:?}"
    );
    assert!(
        shares.get("etl").is_none_or(|t| t.admitted == 0),
        "{shares:?}"
    );

    // Stored bytes: a tenant over its quota stores nothing.
    let small = s.client("small-token").await;
    let big = lineitem(0.002, 1, 1).unwrap();
    let (c, m) = code(put(&small, "q_big", big).await);
    assert_eq!(c, Code::ResourceExhausted, "{m}");
    assert!(m.contains("max_stored_bytes"), "{m}");
    assert!(ops.table("q_big").await.is_err(), "nothing stored");
    let tiny = RecordBatch::try_from_iter([(
        "x",
        Arc::new(arrow::array::Int64Array::from_iter_values(0..20)) as arrow::array::ArrayRef,
    )])
    .unwrap();
    put(&small, "q_tiny", vec![tiny.clone()]).await.unwrap();

    // Concurrent requests: small may have one request at a time. An upload left
    // open (its stream not ended) holds the one it has.
    // The upload is tried again while a probe below holds the slot as it arrives
    // (refused itself for max_requests); each try hands its stream's sender over.
    let (senders_tx, mut senders) = tokio::sync::mpsc::unbounded_channel();
    let held = tokio::spawn({
        let small = small.clone();
        let tiny = tiny.clone();
        async move {
            loop {
                let (tx, rx) = tokio::sync::mpsc::channel(1);
                tx.send(Ok(tiny.clone())).await.unwrap();
                senders_tx.send(tx).unwrap();
                match small
                    .put(
                        "q_tiny",
                        "0",
                        tiny.schema(),
                        tokio_stream::wrappers::ReceiverStream::new(rx),
                    )
                    .await
                {
                    Err(e) if e.code() == Some(Code::ResourceExhausted) => continue,
                    r => return r,
                }
            }
        }
    });
    let mut refused = None;
    // Until the upload reaches the node (seconds when the whole suite shares 2 cores).
    for _ in 0..1000 {
        match small.scan("q_tiny", None, &[]).await {
            Err(e) => {
                refused = Some(e);
                break;
            }
            Ok(s) => drop(s),
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut tx = senders.recv().await.unwrap();
    while let Ok(newer) = senders.try_recv() {
        tx = newer;
    }
    let (c, m) = code::<()>(Err(refused.expect("a second request refused")));
    assert_eq!(c, Code::ResourceExhausted, "{m}");
    assert!(m.contains("max_requests"), "{m}");
    // The upload abandoned: nothing of it stored, the slot back.
    tx.send(Err(ClientError::InvalidInput("abandoned".into())))
        .await
        .unwrap();
    assert!(held.await.unwrap().is_err());
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert_eq!(rows(&small, "q_tiny").await, 20);
    let reader = s.client("reader-token").await;

    // The tenants file re-read: reader gains write without a restart, on the same
    // connection.
    assert_eq!(
        code(put(&reader, "lineitem", lineitem(0.001, 1, 1).unwrap()).await).0,
        Code::PermissionDenied
    );
    std::fs::write(s.path("tenants.toml"), tenants("\"read\", \"write\"")).unwrap();
    assert_eq!(s.node.reload_auth().unwrap(), 6);
    put(&reader, "lineitem", lineitem(0.001, 1, 1).unwrap())
        .await
        .unwrap();
    // A broken file keeps the tenants as they were.
    std::fs::write(s.path("tenants.toml"), "[[tenant]]\nname = 1\n").unwrap();
    assert!(s.node.reload_auth().is_err());
    assert!(rows(&reader, "lineitem").await > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_refuses_clients_without_a_certificate() {
    let s = secure_node(true).await;
    // No client certificate: refused at the handshake, whatever the token.
    let no_cert = NodeClient::connect_with(&s.node.url, &s.creds(Some("ops-token"))).await;
    if let Ok(c) = no_cert {
        let e = c.list_tables("").await.unwrap_err();
        assert!(e.code() != Some(Code::Ok), "{e}");
    }
    // A certificate signed by the CA proves its tenant by its subject, without a token.
    let with_cert = Credentials {
        token: None,
        tls_ca: Some(s.ca.clone()),
        tls_identity: Some((
            s.certs.client_cert_pem.clone().into_bytes(),
            s.certs.client_key_pem.clone().into_bytes(),
        )),
        ..Default::default()
    };
    let c = NodeClient::connect_with(&s.node.url, &with_cert)
        .await
        .unwrap();
    assert!(c.list_tables("").await.unwrap().is_empty());
    let (code_, m) = code(put(&c, "lineitem", lineitem(0.001, 1, 1).unwrap()).await);
    assert_eq!(code_, Code::PermissionDenied, "{m}");
    assert!(m.contains("certified"), "{m}");
    // A certificate from another CA is refused.
    let stranger = csd_runtime::tls::make_certificates(&["localhost".into()], "ops").unwrap();
    let other = Credentials {
        tls_identity: Some((
            stranger.client_cert_pem.into_bytes(),
            stranger.client_key_pem.into_bytes(),
        )),
        ..with_cert.clone()
    };
    if let Ok(c) = NodeClient::connect_with(&s.node.url, &other).await {
        assert!(c.list_tables("").await.is_err());
    }
}

/// pyarrow, unmodified, against the node: TLS roots, a bearer token in call options,
/// the listing, a handed-out ticket, and the basic-auth handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyarrow_talks_to_a_secure_node() {
    let Some(python) = super::pyarrow_python() else {
        return;
    };
    let s = secure_node(false).await;
    let etl = s.client("etl-token").await;
    let n = put(&etl, "lineitem", lineitem(0.002, 1, 1).unwrap())
        .await
        .unwrap();
    let script = r#"
import json, sys
import pyarrow.flight as fl
url, ca = sys.argv[1], sys.argv[2]
c = fl.FlightClient(url, tls_root_certs=open(ca, "rb").read())
opts = fl.FlightCallOptions(headers=[(b"authorization", b"Bearer etl-token")])
names = [i.descriptor.path[0].decode() for i in c.list_flights(options=opts)]
info = c.get_flight_info(fl.FlightDescriptor.for_path("lineitem"), opts)
rows = sum(c.do_get(e.ticket, opts).read_all().num_rows for e in info.endpoints)
try:
    list(c.list_flights())
    anon = "served"
except fl.FlightUnauthenticatedError:
    anon = "unauthenticated"
try:
    c.do_get(fl.Ticket(b"\x01\n\x06\n\x04part"), opts).read_all()
    denied = "served"
except fl.FlightUnauthorizedError:
    denied = "unauthorized"
header = c.authenticate_basic_token(b"etl", b"etl-token")
opts2 = fl.FlightCallOptions(headers=[header])
again = len(list(c.list_flights(options=opts2)))
print(json.dumps({"tables": names, "rows": rows, "anon": anon, "denied": denied, "again": again}))
"#;
    let url = s.node.url.clone();
    let ca = s.path("ca.pem");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .args(["-c", script, &url, ca.to_str().unwrap()])
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
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["tables"], serde_json::json!(["lineitem"]));
    assert_eq!(v["rows"], n);
    assert_eq!(v["anon"], "unauthenticated");
    assert_eq!(v["denied"], "unauthorized");
    assert_eq!(v["again"], 1);
}

mod quotas;
