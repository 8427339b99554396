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
    /// Each node's settings.
    pub settings: NodeConfig,
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
        let mut m = s.serialize_map(Some(4 + settings.len()))?;
        m.serialize_entry("count", &self.count)?;
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
        let settings = NodeConfig::deserialize(toml::Value::Table(table))
            .map_err(|e| D::Error::custom(format!("nodes: {e} (or count, device, pin, secure)")))?;
        Ok(NodesSpec {
            count,
            device,
            pin,
            secure,
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
        Ok(())
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
