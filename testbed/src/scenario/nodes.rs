//! The cluster a scenario starts: its storage nodes ([`NodesSpec`]: how many,
//! their cores, their emulated device, and every setting a node takes, as the node
//! defines it), the compute node ([`ComputeSpec`]) and the links between them
//! ([`LinkConf`]).

use csd_runtime::config::NodeConfig;
use serde::{Deserialize, Serialize};

use super::{MAX_NODES, MAX_WORKERS, Scenario, bad};
use crate::Result;

/// Storage nodes, all alike. Besides the keys below, `[nodes]` takes every setting
/// of a node (`cpus`, `memory`, `capacity`, `queue_target_ms`, `read_cache`,
/// `wire_piece`, `[nodes.operators.sql]`, …: [`NodeConfig`], with the node's
/// defaults); those the testbed decides itself (where nodes listen, their device,
/// cores, TLS and tenants, the admission policy compared) it refuses.
#[derive(Debug, Clone)]
pub struct NodesSpec {
    /// How many.
    pub count: usize,
    /// The emulated NVMe device.
    pub device: DeviceConf,
    /// Give every node its own cores (node `i` gets the `i`-th run of `cpus` cores)
    /// and the compute node's ML work the cores left over, so that a node and the
    /// compute tier do not share cores the way separate machines would not. Needs
    /// `count × cpus` + 1 cores. (The compute tier's SQL runs on the async runtime and
    /// stays unpinned.)
    pub pin: bool,
    /// TLS on every node and a tenant's token on every request (a private CA and a
    /// tenants file made for the run): what security costs, measured.
    pub secure: bool,
    /// Where each node runs: `process` (in this process, on an emulated device) or
    /// `qemu` (a QEMU guest of its own, on an emulated NVMe controller).
    pub system: NodeSystem,
    /// The guests, with `system = "qemu"`.
    pub qemu: QemuConf,
    /// Each node's settings.
    pub settings: NodeConfig,
}

/// Where a scenario's nodes run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeSystem {
    /// In the testbed's process, on the emulated device of `[nodes.device]`.
    #[default]
    Process,
    /// Each in a QEMU guest (TCG) with an emulated NVMe controller over a backing
    /// file, reached over QEMU's user network (`scripts/setup-qemu.sh` installs what
    /// it needs). Timings are an emulated machine's.
    Qemu,
}

/// `[nodes.qemu]`: the guests.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QemuConf {
    /// How the node reaches its namespace: `nvme` (NVMe commands through io_uring
    /// passthrough, `/dev/ng0n1`) or `block` (io_uring + O_DIRECT on `/dev/nvme0n1`).
    pub device: GuestDevice,
    /// The namespace's size, MiB.
    pub disk_mib: u64,
    /// Bytes per LBA: 512 or 4096.
    pub lba_bytes: u32,
    /// Guest memory, MiB.
    pub memory_mib: u64,
    /// The machine emulated: `x86_64`, or `aarch64` (an arm64 board with Cortex-A53
    /// cores running the cross build of `scripts/build-aarch64.sh`; its kit from
    /// `scripts/setup-qemu.sh --arch aarch64`).
    pub arch: crate::guest::Arch,
}

/// How a guest's node reaches its NVMe namespace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuestDevice {
    /// NVMe passthrough on the generic device.
    #[default]
    Nvme,
    /// The block device, through the block layer.
    Block,
}

impl GuestDevice {
    /// The node's `--device` inside the guest.
    pub fn spec(self) -> &'static str {
        match self {
            GuestDevice::Nvme => "nvme:/dev/ng0n1",
            GuestDevice::Block => "uring:/dev/nvme0n1",
        }
    }
}

impl Default for QemuConf {
    fn default() -> Self {
        QemuConf {
            device: GuestDevice::Nvme,
            disk_mib: 1024,
            lba_bytes: 512,
            memory_mib: 1536,
            arch: crate::guest::Arch::X86_64,
        }
    }
}

/// `[nodes]` as it is read: the testbed's keys and the node's settings side by side,
/// settings left unset left out (TOML has no null; a report's scenario reads back).
impl Serialize for NodesSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::{Error as _, SerializeMap};
        let mut settings = toml::Table::try_from(&self.settings).map_err(S::Error::custom)?;
        // The node's device path is the testbed's to choose; `device` here is the
        // emulated device.
        settings.remove("device");
        let mut m = s.serialize_map(Some(6 + settings.len()))?;
        m.serialize_entry("count", &self.count)?;
        m.serialize_entry("system", &self.system)?;
        m.serialize_entry("qemu", &self.qemu)?;
        m.serialize_entry("device", &self.device)?;
        m.serialize_entry("pin", &self.pin)?;
        m.serialize_entry("secure", &self.secure)?;
        for (k, v) in &settings {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// `[nodes]`: the testbed's own keys taken out, the rest a node's settings (an
/// unknown key is refused naming it and every key there is).
impl<'de> Deserialize<'de> for NodesSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut table = toml::Table::deserialize(d)?;
        fn take<T: serde::de::DeserializeOwned, E: serde::de::Error>(
            table: &mut toml::Table,
            key: &str,
        ) -> std::result::Result<Option<T>, E> {
            table
                .remove(key)
                .map(|v| T::deserialize(v).map_err(|e| E::custom(format!("nodes.{key}: {e}"))))
                .transpose()
        }
        let count = take(&mut table, "count")?.ok_or_else(|| D::Error::missing_field("count"))?;
        let device = take(&mut table, "device")?.unwrap_or_default();
        let pin = take(&mut table, "pin")?.unwrap_or_default();
        let secure = take(&mut table, "secure")?.unwrap_or_default();
        let system = take(&mut table, "system")?.unwrap_or_default();
        let qemu = take(&mut table, "qemu")?.unwrap_or_default();
        let settings = NodeConfig::deserialize(toml::Value::Table(table)).map_err(|e| {
            D::Error::custom(format!(
                "nodes: {e} (or count, device, pin, secure, system, qemu)"
            ))
        })?;
        Ok(NodesSpec {
            count,
            device,
            pin,
            secure,
            system,
            qemu,
            settings,
        })
    }
}

impl NodesSpec {
    /// `Ok` unless the scenario sets a node setting the testbed decides, or one the
    /// node would refuse.
    fn check_settings(&self) -> Result<()> {
        let ours = NodeConfig::default();
        let s = &self.settings;
        for (key, set) in [
            ("listen", s.listen != ours.listen),
            ("advertise", s.advertise.is_some()),
            ("format", s.format != ours.format),
            ("cpu_set", s.cpu_set.is_some()),
            ("policy", s.policy != ours.policy),
            ("auth", s.auth.is_some()),
            ("tls_cert", s.tls_cert.is_some()),
            ("tls_key", s.tls_key.is_some()),
            ("tls_client_ca", s.tls_client_ca.is_some()),
            ("metrics_listen", s.metrics_listen.is_some()),
            ("ticket_key", s.ticket_key.is_some()),
        ] {
            if set {
                return Err(bad(
                    &format!("nodes.{key}"),
                    "the testbed sets it (the policies compare admission; `pin` places \
                     cores; `secure` sets TLS and tenants)",
                ));
            }
        }
        s.admission().map_err(|e| bad("nodes", e))?;
        if self.system == NodeSystem::Qemu {
            if self.pin || self.secure {
                return Err(bad(
                    "nodes.system",
                    "QEMU guests take neither `pin` (their vCPUs are host threads) nor `secure`",
                ));
            }
            if ![512, 4096].contains(&self.qemu.lba_bytes) {
                return Err(bad("nodes.qemu.lba_bytes", "expected 512 or 4096"));
            }
            if self.qemu.disk_mib < 64 || self.qemu.memory_mib < 512 {
                return Err(bad(
                    "nodes.qemu",
                    "a guest needs disk_mib >= 64 and memory_mib >= 512",
                ));
            }
            self.guest_args(self.settings.policy)?;
        }
        Ok(())
    }

    /// The `csd serve` flags a guest's node gets for these settings under `policy`:
    /// every setting that differs from the node's default, as `--name=value`.
    /// Settings that are tables or lists cannot travel on a kernel command line.
    pub(crate) fn guest_args(&self, policy: csd_runtime::admission::Policy) -> Result<Vec<String>> {
        let table = |c: &NodeConfig| {
            toml::Table::try_from(c).map_err(|e| bad("nodes", format!("settings: {e}")))
        };
        let ours = table(&NodeConfig::default())?;
        let theirs = table(&NodeConfig {
            policy,
            ..self.settings.clone()
        })?;
        let mut args = Vec::new();
        for (k, v) in &theirs {
            if matches!(k.as_str(), "device" | "listen" | "format" | "advertise")
                || ours.get(k) == Some(v)
            {
                continue;
            }
            let value = match v {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(_) | toml::Value::Float(_) | toml::Value::Boolean(_) => {
                    v.to_string()
                }
                _ => {
                    return Err(bad(
                        &format!("nodes.{k}"),
                        "QEMU guests take plain settings only (no tables or lists)",
                    ));
                }
            };
            if value.is_empty() || value.contains(char::is_whitespace) {
                return Err(bad(
                    &format!("nodes.{k}"),
                    "a guest's settings travel on its kernel command line: no spaces",
                ));
            }
            args.push(format!("--{}={value}", k.replace('_', "-")));
        }
        Ok(args)
    }
}

/// Which cores each node and the compute tier run on (`nodes.pin`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CorePlan {
    /// Per node.
    pub nodes: Vec<Vec<usize>>,
    /// The compute tier's ML work.
    pub compute: Vec<usize>,
}

/// Emulated NVMe timing (see `csd_runtime::device::emulated::TimingModel`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeviceConf {
    /// Per-command latency, microseconds.
    pub latency_us: f64,
    /// Read bandwidth, MB/s.
    pub read_mbps: f64,
    /// Write bandwidth, MB/s.
    pub write_mbps: f64,
    /// Commands the device accepts at once.
    pub queue_depth: usize,
    /// Commands it works on in parallel.
    pub parallelism: usize,
}

impl Default for DeviceConf {
    /// A datacenter NVMe drive, roughly.
    fn default() -> Self {
        DeviceConf {
            latency_us: 80.0,
            read_mbps: 3000.0,
            write_mbps: 1500.0,
            queue_depth: 64,
            parallelism: 8,
        }
    }
}

/// The compute node.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeSpec {
    /// DataFusion partitions (default: this machine's cores).
    #[serde(default)]
    pub partitions: Option<usize>,
    /// datafusion-distributed workers (`csd worker`, in-process, serving gRPC on
    /// 127.0.0.1) that run the pushdown policies' stages; 0: the session runs them.
    /// They reach the nodes through the same links. The `none` policy always runs
    /// in the session.
    #[serde(default)]
    pub workers: usize,
}

/// One link's bandwidth and latency (each direction).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LinkConf {
    /// Megabits per second; 0 = not throttled.
    pub bandwidth_mbit: f64,
    /// One-way latency, microseconds.
    pub latency_us: f64,
}

impl Default for LinkConf {
    fn default() -> Self {
        LinkConf {
            bandwidth_mbit: 1000.0,
            latency_us: 100.0,
        }
    }
}

impl Scenario {
    /// The cluster's part of [`Scenario::validate`].
    pub(super) fn validate_cluster(&self) -> Result<()> {
        let n = &self.nodes;
        if n.count == 0 || n.count > MAX_NODES {
            return Err(bad(
                "nodes.count",
                format!("expected 1 to {MAX_NODES}, got {}", n.count),
            ));
        }
        if n.settings.cpus == 0 || n.settings.cpus > 64 {
            return Err(bad(
                "nodes.cpus",
                format!("expected 1 to 64, got {}", n.settings.cpus),
            ));
        }
        n.check_settings()?;
        if self.compute.workers > MAX_WORKERS {
            return Err(bad(
                "compute.workers",
                format!("expected 0 to {MAX_WORKERS}, got {}", self.compute.workers),
            ));
        }
        self.device_spec()?;
        for (i, l) in std::iter::once(&self.link).chain(&self.links).enumerate() {
            let field = if i == 0 {
                "link".to_string()
            } else {
                format!("links[{}]", i - 1)
            };
            if !(l.bandwidth_mbit.is_finite() && l.bandwidth_mbit >= 0.0) {
                return Err(bad(
                    &format!("{field}.bandwidth_mbit"),
                    "expected megabits per second ≥ 0 (0: not throttled)",
                ));
            }
            if !(l.latency_us.is_finite() && (0.0..=10e6).contains(&l.latency_us)) {
                return Err(bad(
                    &format!("{field}.latency_us"),
                    "expected microseconds from 0 to 10,000,000",
                ));
            }
        }
        if self.links.len() > n.count && self.sweep.iter().all(|a| a.parameter != "nodes.count") {
            return Err(bad(
                "links",
                format!("{} entries for {} nodes", self.links.len(), n.count),
            ));
        }
        Ok(())
    }
}
