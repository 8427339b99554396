//! ADBC — PyPI's `adbc-driver-flightsql`, the Go Flight SQL driver under Python's
//! DBAPI, a client nobody here wrote — against a `csd gateway` process over TLS, in
//! front of a node with tenants: the 22 TPC-H queries equal DataFusion's local
//! answers, a parameterised query, the metadata calls, pandas, a wrong token.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::sync::Arc;

use csd_runtime::auth::token_digest;
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node;
use csd_runtime::node_client::{Credentials, NodeClient};
use csd_testbed::sql::canonical_rows;
use csd_testbed::tpch;
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;

const SF: f64 = 0.01;

/// Kills the gateway process when the test ends, however it ends.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn local() -> SessionContext {
    let ctx = SessionContext::new();
    for t in tpch::TABLES {
        let (schema, batches) = tpch::generate(t, SF, 1, 1).unwrap();
        let table = MemTable::try_new(schema, vec![batches]).unwrap();
        ctx.register_table(t, Arc::new(table)).unwrap();
    }
    ctx
}

async fn local_rows(ctx: &SessionContext, sql: &str) -> Vec<String> {
    canonical_rows(&ctx.sql(sql).await.unwrap().collect().await.unwrap()).unwrap()
}

fn read_arrow(path: &std::path::Path) -> Vec<arrow::record_batch::RecordBatch> {
    let f = std::fs::File::open(path).unwrap();
    arrow::ipc::reader::FileReader::try_new(f, None)
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adbc_dbapi_through_the_gateway_answers_like_local_datafusion() {
    let Some(python) = super::adbc_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = |f: &str| dir.path().join(f);
    std::fs::write(
        path("tenants.toml"),
        format!(
            r#"
[[tenant]]
name = "ops"
token_sha256 = "{}"
tables = ["*"]
can = ["read", "write"]

[[tenant]]
name = "analyst"
token_sha256 = "{}"
tables = ["*"]
can = ["read"]
"#,
            token_digest("ops-token"),
            token_digest("analyst-token1"),
        ),
    )
    .unwrap();
    let config = NodeConfig {
        device: "emulated:mem".into(),
        capacity: ByteSize::mib(512),
        listen: "127.0.0.1:0".into(),
        cpus: 2,
        auth: Some(path("tenants.toml")),
        ..NodeConfig::default()
    };
    let operators = csd_query_pushdown::registry_with(&config).unwrap();
    let node = node::start_with(&config, operators).await.unwrap();
    let ops = NodeClient::connect_with(&node.url, &Credentials::token("ops-token"))
        .await
        .unwrap();
    tpch::load(&[ops], SF, 2, |_, _| {}).await.unwrap();
    let certs =
        csd_runtime::tls::make_certificates(&["localhost".into(), "127.0.0.1".into()], "a-client")
            .unwrap();
    std::fs::write(path("ca.pem"), &certs.ca_pem).unwrap();
    std::fs::write(path("gw.pem"), &certs.server_cert_pem).unwrap();
    std::fs::write(path("gw.key"), &certs.server_key_pem).unwrap();
    // The gateway as a user starts it.
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_csd"))
        .args(["gateway", "--listen", "127.0.0.1:0", "--node", &node.url])
        .arg("--listen-tls-cert")
        .arg(path("gw.pem"))
        .arg("--listen-tls-key")
        .arg(path("gw.key"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(path("gateway.log")).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let gateway = Killed(child);
    let uri = line
        .split_whitespace()
        .find(|w| w.starts_with("grpc+tls://"))
        .unwrap_or_else(|| panic!("{line}"))
        .to_string();
    let queries: BTreeMap<String, &str> = tpch::QUERIES
        .iter()
        .map(|(n, sql)| (format!("q{n:02}"), *sql))
        .collect();
    std::fs::write(path("queries.json"), serde_json::to_vec(&queries).unwrap()).unwrap();
    std::fs::create_dir(path("out")).unwrap();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/integration/adbc_client.py"
    );
    let out = {
        let (python, uri, dir) = (python.clone(), uri.clone(), dir.path().to_path_buf());
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(python)
                .arg(script)
                .arg(&uri)
                .arg(dir.join("ca.pem"))
                .args(["analyst", "analyst-token1"])
                .arg(dir.join("queries.json"))
                .arg(dir.join("out"))
                .output()
                .unwrap()
        })
        .await
        .unwrap()
    };
    assert!(
        out.status.success(),
        "{}{}\ngateway's stderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(path("gateway.log")).unwrap_or_default()
    );
    let ctx = local();
    let mut nonempty = 0;
    for (name, sql) in &queries {
        let got = canonical_rows(&read_arrow(&path(&format!("out/{name}.arrow")))).unwrap();
        let want = local_rows(&ctx, sql).await;
        assert_eq!(got, want, "{name} through ADBC");
        nonempty += usize::from(!want.is_empty());
    }
    assert!(nonempty >= 18, "only {nonempty} queries had rows");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(path("out/report.json")).unwrap()).unwrap();
    let rows = |key: &str| -> Vec<String> {
        let mut v: Vec<String> = report[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                format!(
                    "{}|{}|",
                    r["o_orderkey"],
                    r["o_orderstatus"].as_str().unwrap()
                )
            })
            .collect();
        v.sort();
        v
    };
    for (key, custkey, price) in [("params", 370, "1000.5"), ("params2", 781, "0.0")] {
        let want = local_rows(
            &ctx,
            &format!(
                "SELECT o_orderkey || '|' || o_orderstatus FROM orders WHERE o_custkey = {custkey} AND o_totalprice > {price}"
            ),
        )
        .await;
        assert!(!want.is_empty(), "{key}");
        assert_eq!(rows(key), want, "{key}");
    }
    assert_eq!(
        report["pandas"],
        serde_json::json!(["ARGENTINA", "BRAZIL", "CANADA", "PERU", "UNITED STATES"])
    );
    if report["polars"] != "not installed" {
        assert_eq!(report["polars"], serde_json::json!(["AFRICA", "AMERICA"]));
    }
    assert_eq!(report["catalogs"], serde_json::json!(["datafusion"]));
    let mut tables: Vec<&str> = tpch::TABLES.to_vec();
    tables.sort();
    assert_eq!(report["tables"], serde_json::json!(tables));
    assert_eq!(report["lineitem_columns"].as_array().unwrap().len(), 16);
    assert_eq!(report["orders_schema"][0], "o_orderkey");
    assert_eq!(report["vendor_name"], "csd");
    assert_eq!(report["bearer_count"], serde_json::json!([5]));
    let wrong = report["wrong_token"].as_str().unwrap();
    assert!(wrong.to_lowercase().contains("unauthenticated"), "{wrong}");
    // The gateway counted the sessions and queries.
    let stats = tokio::task::spawn_blocking({
        let ca = path("ca.pem");
        move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_csd"))
                .args(["stats", "--gateway", &uri, "--token", "analyst-token1"])
                .arg("--tls-ca")
                .arg(ca)
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(
        stats.status.success(),
        "{}",
        String::from_utf8_lossy(&stats.stderr)
    );
    let stats: csd_protocol::GatewayStats = serde_json::from_slice(&stats.stdout).unwrap();
    // 22 + 3 statements prepared (DBAPI prepares the repeated one once), 26 run.
    assert!(stats.queries >= 26 && stats.prepared >= 25, "{stats:?}");
    // The good handshake answered; the wrong token's refused and counted.
    assert!(
        stats.handshakes >= 1 && stats.unauthenticated >= 1,
        "{stats:?}"
    );
    assert!(stats.sessions >= 2, "{stats:?}");
    assert_eq!((stats.running, stats.queries_failed), (0, 0), "{stats:?}");
    drop(gateway);
}
