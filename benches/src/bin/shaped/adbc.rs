//! The `adbc` system: one `csd gateway` process on the compute side, one ADBC
//! connection (PyPI's Flight SQL driver under Python's DBAPI, `benches/adbc_query.py`)
//! running every query in turn, as a BI tool or notebook would; and the large-result
//! comparison, `SELECT *` through ADBC against a direct Flight `DoGet`.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use serde::Serialize;

use crate::Ctx;
use crate::figures::Run;
use csd_benches::net::Net;

/// The gateway and the client, stopped when dropped.
pub(crate) struct Adbc {
    gateway: Child,
    python: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
}

/// `SELECT * FROM table` through ADBC against a direct `DoGet`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct LargeFigures {
    pub(crate) table: String,
    pub(crate) layout: String,
    pub(crate) rate_mbit: f64,
    pub(crate) rows: u64,
    pub(crate) adbc_secs: f64,
    pub(crate) doget_secs: f64,
    /// Bytes on the veth during the ADBC read and during the direct one.
    pub(crate) adbc_bytes: u64,
    pub(crate) doget_bytes: u64,
}

impl Adbc {
    pub(crate) fn start(ctx: &Ctx) -> Adbc {
        let mut gateway = Command::new(csd_benches::csd_binary());
        gateway.args(["gateway", "--listen", "127.0.0.1:0"]);
        for n in &ctx.nodes {
            gateway.args(["--node", n]);
        }
        let mut gateway = gateway
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("csd gateway");
        let mut line = String::new();
        BufReader::new(gateway.stdout.take().expect("gateway stdout"))
            .read_line(&mut line)
            .expect("the gateway's address");
        let uri = line
            .split_whitespace()
            .find(|w| w.starts_with("grpc://"))
            .unwrap_or_else(|| panic!("csd gateway said {line:?}"))
            .to_string();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("adbc_query.py");
        let mut python = Command::new(&ctx.python)
            .arg(script)
            .arg(&uri)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the ADBC client");
        let to = python.stdin.take().expect("client stdin");
        let from = BufReader::new(python.stdout.take().expect("client stdout"));
        Adbc {
            gateway,
            python,
            to,
            from,
        }
    }

    fn ask(&mut self, line: &str) -> serde_json::Value {
        writeln!(self.to, "{line}").expect("writing to the ADBC client");
        let mut answer = String::new();
        self.from
            .read_line(&mut answer)
            .expect("reading the ADBC client");
        serde_json::from_str(&answer).unwrap_or_else(|e| panic!("ADBC client: {e}: {answer:?}"))
    }

    /// One query through the connection: its time as the client saw it (execute to
    /// the last batch) and the bytes on the veth meanwhile.
    pub(crate) fn run(&mut self, file: &Path, net: &Net) -> Run {
        let before = net.bytes();
        let a = self.ask(&format!("sql {}", file.display()));
        let bytes = net.bytes() - before;
        let secs = a["secs"]
            .as_f64()
            .unwrap_or_else(|| panic!("ADBC client: {a}"));
        Run {
            secs,
            bytes,
            inner_ms: None,
            handed_back: None,
            query_ms: Some(secs * 1e3),
            stdout: a["csv"].as_str().unwrap_or_default().to_string(),
        }
    }

    /// `SELECT * FROM table` through ADBC, then the same table by a direct `DoGet`
    /// from the nodes: rows, seconds and bytes on the veth of each.
    pub(crate) fn large(&mut self, table: &str, ctx: &Ctx, net: &Net) -> (u64, [(f64, u64); 2]) {
        let before = net.bytes();
        let a = self.ask(&format!("large {table}"));
        let adbc = (a["secs"].as_f64().unwrap_or_default(), net.bytes() - before);
        let before = net.bytes();
        let d = self.ask(&format!("doget {table} {}", ctx.nodes.join(",")));
        let doget = (d["secs"].as_f64().unwrap_or_default(), net.bytes() - before);
        let rows = a["rows"]
            .as_u64()
            .unwrap_or_else(|| panic!("ADBC client: {a}"));
        assert_eq!(
            Some(rows),
            d["rows"].as_u64(),
            "rows through ADBC and by DoGet"
        );
        (rows, [adbc, doget])
    }
}

impl Drop for Adbc {
    fn drop(&mut self) {
        let _ = self.python.kill();
        let _ = self.python.wait();
        let _ = self.gateway.kill();
        let _ = self.gateway.wait();
    }
}
