//! A bench's network as a user's would be: a namespace holding the storage nodes (and
//! whatever else serves from there), a veth pair into it shaped with `tc tbf`, bytes
//! counted on the veth; all removed on drop. Needs root.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::csd_binary;

/// The namespace's address.
pub const NODE_IP: &str = "10.231.7.2";

/// The host's end of the veth.
pub const HOST_IP: &str = "10.231.7.1";

/// Runs `cmd`, panicking with its stderr unless it succeeds; its stdout.
pub fn sh(cmd: &mut Command) -> String {
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

/// `ip ARGS…`.
pub fn ip(args: &[&str]) -> String {
    sh(Command::new("ip").args(args))
}

/// The namespace, the veth pair and the servers in it; all removed on drop.
pub struct Net {
    /// The namespace's name.
    pub ns: String,
    /// The veth's host end.
    pub host_dev: String,
    /// The veth's end in the namespace.
    pub peer_dev: String,
    /// Servers started in the namespace, stopped on drop.
    pub children: Vec<Child>,
}

impl Net {
    /// Creates the namespace and the veth pair, addresses up.
    pub fn create() -> Net {
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

    /// `program` run in the namespace.
    pub fn in_ns(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, program]);
        c
    }

    /// Runs `args` in the namespace; its stdout.
    pub fn exec(&self, args: &[&str]) -> String {
        sh(self.in_ns(args[0]).args(&args[1..]))
    }

    /// `tbf` at `mbit` on both ends (0: remove the shaping).
    pub fn shape(&self, mbit: f64) {
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
    pub fn bytes(&self) -> u64 {
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

/// Starts one `csd serve` per device in the namespace with `policy` (ports 50051,
/// 50052, …); returns their URLs.
pub fn start_nodes(
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
        let url = crate::node_url(&mut child);
        net.children.push(child);
        urls.push(url.replace("0.0.0.0", NODE_IP));
    }
    urls
}

/// Stops the `n` nodes started last.
pub fn stop_nodes(net: &mut Net, n: usize) {
    for _ in 0..n {
        if let Some(mut c) = net.children.pop() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
