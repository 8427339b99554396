//! The bench's network: a namespace holding the storage node and nginx, a veth pair
//! into it shaped with `tc tbf`, bytes counted on the veth; all removed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use csd_benches::csd_binary;

pub(crate) const NODE_IP: &str = "10.231.7.2";

pub(crate) const HOST_IP: &str = "10.231.7.1";

pub(crate) fn sh(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub(crate) fn ip(args: &[&str]) -> String {
    sh(Command::new("ip").args(args))
}

/// The namespace, the veth pair and the servers in it; all removed on drop.
pub(crate) struct Net {
    pub(crate) ns: String,
    pub(crate) host_dev: String,
    pub(crate) peer_dev: String,
    pub(crate) children: Vec<Child>,
}

impl Net {
    pub(crate) fn new() -> Net {
        let id = std::process::id() % 100_000;
        let net = Net {
            ns: format!("csd-shaped-{id}"),
            host_dev: format!("csdh{id}"),
            peer_dev: format!("csdn{id}"),
            children: Vec::new(),
        };
        ip(&["netns", "add", &net.ns]);
        ip(&[
            "link",
            "add",
            &net.host_dev,
            "type",
            "veth",
            "peer",
            "name",
            &net.peer_dev,
        ]);
        ip(&["link", "set", &net.peer_dev, "netns", &net.ns]);
        ip(&[
            "addr",
            "add",
            &format!("{HOST_IP}/24"),
            "dev",
            &net.host_dev,
        ]);
        ip(&["link", "set", &net.host_dev, "up"]);
        net.exec(&[
            "ip",
            "addr",
            "add",
            &format!("{NODE_IP}/24"),
            "dev",
            &net.peer_dev,
        ]);
        net.exec(&["ip", "link", "set", &net.peer_dev, "up"]);
        net.exec(&["ip", "link", "set", "lo", "up"]);
        net
    }

    pub(crate) fn in_ns(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, program]);
        c
    }

    pub(crate) fn exec(&self, args: &[&str]) -> String {
        sh(self.in_ns(args[0]).args(&args[1..]))
    }

    /// `tbf` at `mbit` on both ends (0: remove the shaping).
    pub(crate) fn shape(&self, mbit: f64) {
        let _ = Command::new("tc")
            .args(["qdisc", "del", "dev", &self.host_dev, "root"])
            .stderr(Stdio::null())
            .status();
        let _ = self
            .in_ns("tc")
            .args(["qdisc", "del", "dev", &self.peer_dev, "root"])
            .stderr(Stdio::null())
            .status();
        if mbit <= 0.0 {
            return;
        }
        let rate = format!("{}kbit", (mbit * 1000.0) as u64);
        // A burst of 10 ms of the rate (at least 64 KiB, the largest GSO packet).
        let burst = format!("{}", ((mbit * 1e6 / 8.0 / 100.0) as u64).max(65536));
        let tbf = [
            "root", "tbf", "rate", &rate, "burst", &burst, "latency", "50ms",
        ];
        sh(Command::new("tc")
            .args(["qdisc", "add", "dev", &self.host_dev])
            .args(tbf));
        sh(self
            .in_ns("tc")
            .args(["qdisc", "add", "dev", &self.peer_dev])
            .args(tbf));
    }

    /// Bytes both ways on the veth so far.
    pub(crate) fn bytes(&self) -> u64 {
        ["rx_bytes", "tx_bytes"]
            .iter()
            .map(|f| {
                std::fs::read_to_string(format!("/sys/class/net/{}/statistics/{f}", self.host_dev))
                    .ok()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            })
            .sum()
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // SIGTERM first: nginx's master then stops its workers (a SIGKILLed master
        // leaves them running, holding the namespace and this process's stdout).
        for c in &self.children {
            // SAFETY: kill has no memory preconditions; the pid is our own child's.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
        }
        for c in &mut self.children {
            let deadline = Instant::now() + Duration::from_secs(3);
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_dev])
            .stderr(Stdio::null())
            .status();
    }
}

pub(crate) fn start_nginx(net: &mut Net, data: &Path, work: &Path) -> String {
    let conf = work.join("nginx.conf");
    let w = work.display();
    std::fs::write(
        &conf,
        format!(
            "worker_processes 2;\npid {w}/nginx.pid;\nerror_log {w}/nginx.err;\nevents {{}}\n\
             http {{\n  access_log off;\n  sendfile on;\n  client_body_temp_path {w};\n  proxy_temp_path {w};\n  fastcgi_temp_path {w};\n  uwsgi_temp_path {w};\n  scgi_temp_path {w};\n  server {{\n    listen {NODE_IP}:8080;\n    root {};\n  }}\n}}\n",
            data.display()
        ),
    )
    .expect("nginx.conf");
    let child = net
        .in_ns("nginx")
        .args(["-c"])
        .arg(&conf)
        .args(["-g", "daemon off;"])
        .stderr(Stdio::null())
        .spawn()
        .expect("nginx (scripts/setup-shaped-bench.sh installs it)");
    net.children.push(child);
    std::thread::sleep(Duration::from_millis(300));
    format!("http://{NODE_IP}:8080")
}

/// Starts one `csd serve` per device in the namespace with `policy` (ports 50051,
/// 50052, …); returns their URLs.
pub(crate) fn start_nodes(
    net: &mut Net,
    devices: &[PathBuf],
    format: bool,
    policy: &str,
    extra: &str,
) -> Vec<String> {
    let mut urls = Vec::new();
    for (j, device) in devices.iter().enumerate() {
        let mut cmd = net.in_ns(csd_binary().to_str().expect("utf-8 path"));
        cmd.args(["serve", "--listen", &format!("{NODE_IP}:{}", 50051 + j)])
            .arg("--device")
            .arg(device)
            .args(["--capacity", "8GiB", "--policy", policy])
            .args(extra.split_whitespace())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped());
        if format {
            cmd.arg("--format");
        }
        let mut child = cmd.spawn().expect("csd serve");
        let url = csd_benches::node_url(&mut child);
        net.children.push(child);
        urls.push(url.replace("0.0.0.0", NODE_IP));
    }
    urls
}

/// Stops the `n` nodes started last.
pub(crate) fn stop_nodes(net: &mut Net, n: usize) {
    for _ in 0..n {
        if let Some(mut c) = net.children.pop() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The token of the bench's tenant on `secure` nodes.
pub(crate) const TOKEN: &str = "shaped-bench-token";

/// Certificates for the node's address and a tenants file, in `dir`.
pub(crate) fn write_security(dir: &Path) {
    let certs =
        csd_runtime::tls::make_certificates(&[NODE_IP.to_string()], "bench").expect("certificates");
    certs.write(dir).expect("writing certificates");
    std::fs::write(
        dir.join("tenants.toml"),
        format!(
            "[[tenant]]\nname = \"bench\"\ntoken_sha256 = \"{}\"\ntables = [\"*\"]\ncan = [\"read\"]\n",
            csd_runtime::auth::token_digest(TOKEN)
        ),
    )
    .expect("tenants file");
}
