//! A node's settings, defined once: [`NodeConfig`] is at the same time the `csd serve`
//! flags (clap), the `CSD_*` environment variables and the keys of a TOML file
//! (serde). [`NodeConfig::load`] layers them: defaults < file (`--config`) <
//! environment < flags. Sizes are typed ([`ByteSize`]) and checked when read.
//!
//! Operators take their own options from `[operators.NAME]` tables of the file or
//! `--set NAME.KEY=VALUE` flags ([`NodeConfig::operator_options`]); each operator
//! reads its table with its own types, so a misspelt key is an error naming it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgMatches, Args, FromArgMatches};
use serde::{Deserialize, Serialize};

use crate::admission::{AdmissionConfig, Policy, parse_tenant};
use crate::error::{Error, Result};
use crate::table::ParquetOptions;
pub use csd_protocol::size::ByteSize;

/// A node's settings (see the module docs). Every field is a `csd serve` flag, a
/// `CSD_*` variable and a TOML key of the same name.
#[derive(Debug, Clone, Serialize, Deserialize, Args)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// Device: a file or raw device path (io_uring + O_DIRECT), `nvme:/dev/ngXnY` (NVMe
    /// commands through io_uring passthrough; a path of that name means the same), or
    /// `emulated:mem|file=PATH[,latency_us=..,read_mbps=..,write_mbps=..,queue_depth=..,parallelism=..]`;
    /// `faulty:SEED[,rot=P,corrupt=P,misdirect=P,lse=P,write_eio=P,enospc=P,flush_fail=P,spike=P,spike_ms=MS,safe_below=LBA]:DEVICE`
    /// injects a drive's faults in front of any of them (docs/node.md).
    #[arg(long, env = "CSD_DEVICE", default_value = "csd-device.img")]
    pub device: String,
    /// Capacity of a new device file or emulated device.
    #[arg(long, env = "CSD_CAPACITY", default_value = "4GiB")]
    pub capacity: ByteSize,
    /// Address to listen on (`127.0.0.1:0` picks a free port).
    #[arg(long, env = "CSD_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: String,
    /// URL advertised to clients (default: `grpc://` + the bound listen address).
    #[arg(long, env = "CSD_ADVERTISE")]
    pub advertise: Option<String>,
    /// CPU workers for operator work.
    #[arg(long, env = "CSD_CPUS", default_value_t = 2)]
    pub cpus: usize,
    /// Pin the operator workers to these cores (`0-3,6`, as `taskset -c` takes).
    #[arg(long, env = "CSD_CPU_SET")]
    pub cpu_set: Option<String>,
    /// Memory budget of the whole node: operators, uploads, scans and range reads,
    /// the read cache, Wasm instances. Work that finds no room waits, then is
    /// refused with RESOURCE_EXHAUSTED and a retry hint.
    #[arg(long, env = "CSD_MEMORY", default_value = "2GiB")]
    pub memory: ByteSize,
    /// Recently read object bytes kept in memory, at most (0: none): a column chunk
    /// read again is served without a device read. Inside `--memory`: the cache
    /// keeps a range only while the budget has room, and lets go of everything when
    /// other work needs the room. Default: a quarter of `--memory`, at most 512MiB.
    #[arg(long, env = "CSD_READ_CACHE")]
    pub read_cache: Option<ByteSize>,
    /// Erase and format the device at start.
    #[arg(long, env = "CSD_FORMAT")]
    pub format: bool,
    /// How tables are written.
    #[command(flatten)]
    pub parquet: ParquetOptions,
    /// Admission policy: adaptive (run, queue or push back), always (run all pushed
    /// work, queueing), never (push every operator back to the compute tier).
    #[arg(long, env = "CSD_POLICY", default_value = "adaptive")]
    pub policy: Policy,
    /// Queueing-delay target in milliseconds (adaptive): a request predicted to wait
    /// longer is pushed back.
    #[arg(long, env = "CSD_QUEUE_TARGET_MS", default_value_t = 50.0)]
    pub queue_target_ms: f64,
    /// The link to a compute tier assumed until one is measured, in Mbit/s
    /// (adaptive: handing work back is priced by it; 0 = unpriced until measured).
    #[arg(long, env = "CSD_LINK_PRIOR_MBIT", default_value_t = 1000.0)]
    pub link_prior_mbit: f64,
    /// A tenant's share: `name=weight[:reserved slots]` (repeat for several); others
    /// get weight 1.
    #[arg(long = "tenant", env = "CSD_TENANTS", value_delimiter = ',')]
    pub tenants: Vec<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, env = "CSD_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// Serve metrics on a non-loopback address in clear although the Flight port has
    /// TLS or tenants (refused otherwise).
    #[arg(long, env = "CSD_METRICS_PUBLIC")]
    pub metrics_public: bool,
    /// Tenants file (TOML): their token digests, tables, permissions, shares and
    /// quotas. Every request must then prove a tenant. Re-read on SIGHUP.
    #[arg(long, env = "CSD_AUTH")]
    pub auth: Option<PathBuf>,
    /// TLS certificate chain (PEM) of the Flight port (with --tls-key).
    #[arg(long, env = "CSD_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM) of the Flight port.
    #[arg(long, env = "CSD_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: refuse clients without a certificate signed by this CA (PEM).
    #[arg(long, env = "CSD_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// The key that seals tickets: a file, created (random, mode 0600) if missing.
    /// Default: a key kept on the device.
    #[arg(long, env = "CSD_TICKET_KEY")]
    pub ticket_key: Option<PathBuf>,
    /// How long the tickets a node hands out stay valid, in seconds.
    #[arg(long, env = "CSD_TICKET_TTL_S", default_value_t = 3600)]
    pub ticket_ttl_s: u64,
    /// Longest a kept result (a reference) may live, in seconds (keep and renew).
    #[arg(long, env = "CSD_REF_MAX_TTL_S", default_value_t = 86_400)]
    pub ref_max_ttl_s: u64,
    /// Longest lease of CPU slots, in seconds.
    #[arg(long, env = "CSD_LEASE_MAX_S", default_value_t = 3600)]
    pub lease_max_s: u64,
    /// CPU time a shipped (Wasm) module may use per request, in milliseconds.
    #[arg(long, env = "CSD_WASM_CPU_MS", default_value_t = 30_000)]
    pub wasm_cpu_ms: u64,
    /// Memory one Wasm instance may grow to (it also draws on `--memory`).
    #[arg(long, env = "CSD_WASM_MEMORY", default_value = "256MiB")]
    pub wasm_memory: ByteSize,
    /// Wasm stack of a call.
    #[arg(long, env = "CSD_WASM_STACK", default_value = "512KiB")]
    pub wasm_stack: ByteSize,
    /// Largest Wasm module the node compiles.
    #[arg(long, env = "CSD_WASM_MAX_MODULE", default_value = "32MiB")]
    pub wasm_max_module: ByteSize,
    /// Compiled Wasm modules kept in memory (all are kept on the device).
    #[arg(long, env = "CSD_WASM_CACHED_MODULES", default_value_t = 64)]
    pub wasm_cached_modules: usize,
    /// Wasm instances kept in a pre-reserved pool (wasmtime's pooling allocator:
    /// memories reused between requests); 0 allocates each instance on demand.
    /// More instances than this at once wait for a slot's request to end or fail
    /// with RESOURCE_EXHAUSTED.
    #[arg(long, env = "CSD_WASM_POOL", default_value_t = 0)]
    pub wasm_pool: u32,
    /// Raw reads served at once.
    #[arg(long, env = "CSD_READ_SLOTS", default_value_t = 64)]
    pub read_slots: usize,
    /// Raw reads that may wait before the node answers RESOURCE_EXHAUSTED.
    #[arg(long, env = "CSD_READ_QUEUE", default_value_t = 4096)]
    pub read_queue: usize,
    /// Background scrub: every object read back from the device and checked, pass
    /// after pass (a minute apart), at most this many bytes a second (e.g. `20MiB`),
    /// each read taking a raw-read slot in turn with the node's other reads. Off
    /// unless given.
    #[arg(long, env = "CSD_SCRUB_RATE")]
    pub scrub_rate: Option<ByteSize>,
    /// Bytes of an object a raw range stream sends per message.
    #[arg(long, env = "CSD_RANGE_CHUNK", default_value = "1MiB")]
    pub range_chunk: ByteSize,
    /// Largest Arrow IPC message an operator answer is cut into (larger batches are
    /// sliced into pieces of about this size).
    #[arg(long, env = "CSD_WIRE_PIECE", default_value = "2MiB")]
    pub wire_piece: ByteSize,
    /// An operator's option, `OPERATOR.KEY=VALUE` (repeat; e.g. `sql.streams=4`).
    #[arg(long = "set", value_name = "OPERATOR.KEY=VALUE")]
    #[serde(skip)]
    pub set: Vec<String>,
    /// Operators' options by operator name (`[operators.sql]` in the file).
    #[arg(skip)]
    pub operators: BTreeMap<String, toml::Table>,
}

impl Default for NodeConfig {
    /// The flags' defaults (environment variables are not read).
    fn default() -> Self {
        crate::flags::clap_defaults()
    }
}

impl NodeConfig {
    /// Bytes of the read cache: `--read-cache`, else a quarter of `--memory` up to
    /// 512 MiB.
    pub fn read_cache_bytes(&self) -> u64 {
        self.read_cache
            .map(|b| b.bytes())
            .unwrap_or_else(|| (self.memory.bytes() / 4).min(512 << 20))
    }

    /// Reads a TOML file over the defaults; unknown keys and bad values are errors
    /// naming the key.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        toml::from_str(&text)
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", path.display())))
    }

    /// The settings `matches` (parsed from [`NodeConfig`]'s flags) describe, layered:
    /// the defaults, then the TOML file `file` (when given), then what came from
    /// `CSD_*` variables and flags.
    pub fn load(matches: &ArgMatches, file: Option<&PathBuf>) -> Result<Self> {
        let given = NodeConfig::from_arg_matches(matches)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let Some(path) = file else {
            return given.with_set();
        };
        let base = NodeConfig::from_toml_file(path)?;
        let mut merged = serde_json::to_value(&base).map_err(|e| Error::Internal(e.to_string()))?;
        let over = serde_json::to_value(&given).map_err(|e| Error::Internal(e.to_string()))?;
        for id in matches.ids() {
            let id = id.as_str();
            let explicit = matches!(
                matches.value_source(id),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            );
            if explicit {
                overlay(&mut merged, &over, id);
            }
        }
        let mut config: NodeConfig = serde_json::from_value(merged)
            .map_err(|e| Error::InvalidArgument(format!("settings: {e}")))?;
        config.set = given.set;
        config.with_set()
    }

    /// Folds the `--set` flags into [`operators`](Self::operators).
    fn with_set(mut self) -> Result<Self> {
        for s in std::mem::take(&mut self.set) {
            let (op, key, value) = parse_set(&s)?;
            self.operators.entry(op).or_default().insert(key, value);
        }
        Ok(self)
    }

    /// The options of operator `name`, read as `T` (missing keys take `T`'s
    /// defaults); a bad or unknown key is an error naming it.
    pub fn operator_options<T: serde::de::DeserializeOwned + Default>(
        &self,
        name: &str,
    ) -> Result<T> {
        // `set` not yet folded in (settings built in code rather than loaded) still
        // counts, over the table.
        let mut table = self.operators.get(name).cloned().unwrap_or_default();
        for s in &self.set {
            let (op, key, value) = parse_set(s)?;
            if op == name {
                table.insert(key, value);
            }
        }
        table
            .try_into()
            .map_err(|e| Error::InvalidArgument(format!("options of operator {name}: {e}")))
    }

    /// The limits shipped code runs under.
    pub fn sandbox_limits(&self) -> crate::sandbox::SandboxLimits {
        crate::sandbox::SandboxLimits {
            cpu_time: std::time::Duration::from_millis(self.wasm_cpu_ms.max(1)),
            memory: self.wasm_memory.bytes(),
            stack: self.wasm_stack.bytes() as usize,
            max_module_bytes: self.wasm_max_module.bytes() as usize,
            cached_modules: self.wasm_cached_modules.max(1),
            pool: self.wasm_pool,
        }
    }

    /// The admission settings these describe.
    pub fn admission(&self) -> Result<AdmissionConfig> {
        let mut a = AdmissionConfig::new(self.cpus, self.memory.bytes());
        a.policy = self.policy;
        if self.read_slots == 0 {
            return Err(Error::InvalidArgument(
                "read slots must be at least 1".into(),
            ));
        }
        a.io_in_flight = self.read_slots;
        a.io_queue = self.read_queue;
        if !(self.queue_target_ms.is_finite() && self.queue_target_ms >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "queue target {} ms must be a non-negative number",
                self.queue_target_ms
            )));
        }
        a.queue_target = std::time::Duration::from_secs_f64(self.queue_target_ms / 1e3);
        if !(self.link_prior_mbit.is_finite() && self.link_prior_mbit >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "link prior {} Mbit/s must be a non-negative number",
                self.link_prior_mbit
            )));
        }
        a.link_prior = (self.link_prior_mbit > 0.0).then(|| self.link_prior_mbit * 1e6 / 8.0);
        if self.auth.is_some() && !self.tenants.is_empty() {
            return Err(Error::InvalidArgument(
                "--tenant and --auth both set tenants' shares: put weight and reserve in the tenants file".into(),
            ));
        }
        for t in &self.tenants {
            let (name, share) = parse_tenant(t)?;
            a.tenants.insert(name, share);
        }
        let reserved: usize = a.tenants.values().map(|t| t.reserve).sum();
        if reserved > a.slots {
            return Err(Error::InvalidArgument(format!(
                "tenants reserve {reserved} slots but the node has {} CPU workers",
                a.slots
            )));
        }
        Ok(a)
    }
}

/// Sets key `id` of `into` (at the top level, or in the nested table holding it) to
/// its value in `from`.
fn overlay(into: &mut serde_json::Value, from: &serde_json::Value, id: &str) {
    let (Some(into), Some(from)) = (into.as_object_mut(), from.as_object()) else {
        return;
    };
    if let Some(v) = from.get(id) {
        into.insert(id.to_string(), v.clone());
        return;
    }
    for (k, sub) in from {
        if sub.as_object().is_some_and(|o| o.contains_key(id))
            && let Some(target) = into.get_mut(k)
        {
            overlay(target, sub, id);
        }
    }
}

/// One `--set OPERATOR.KEY=VALUE`: the value a TOML value (number, boolean, quoted
/// string), or else the text itself.
fn parse_set(s: &str) -> Result<(String, String, toml::Value)> {
    let bad = || Error::InvalidArgument(format!("--set {s:?}: expected OPERATOR.KEY=VALUE"));
    let (key, value) = s.split_once('=').ok_or_else(bad)?;
    let (op, key) = key.split_once('.').ok_or_else(bad)?;
    let value = toml::from_str::<toml::Table>(&format!("v = {value}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()));
    Ok((op.trim().to_string(), key.trim().to_string(), value))
}

#[cfg(test)]
mod tests {
    use super::*;
    fn matches(args: &[&str]) -> ArgMatches {
        NodeConfig::augment_args(clap::Command::new("csd"))
            .mut_args(|a| a.env(None::<&str>))
            .try_get_matches_from(args)
            .unwrap()
    }

    #[test]
    fn flags_win_over_the_file_which_wins_over_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("node.toml");
        std::fs::write(
            &file,
            "cpus = 7\nmemory = \"3GiB\"\npolicy = \"always\"\n[parquet]\npage_rows = 4096\n[operators.sql]\nstreams = 3\n",
        )
        .unwrap();
        let m = matches(&[
            "csd",
            "--cpus",
            "5",
            "--row-group-rows",
            "1000",
            "--set",
            "sql.split_min_bytes=1",
        ]);
        let c = NodeConfig::load(&m, Some(&file)).unwrap();
        assert_eq!(c.cpus, 5, "flag over file");
        assert_eq!(c.memory, ByteSize(3 << 30), "file over default");
        assert_eq!(c.policy, Policy::Always);
        assert_eq!(c.parquet.page_rows, 4096);
        assert_eq!(c.parquet.row_group_rows, 1000, "nested flag over file");
        assert_eq!(c.read_slots, 64, "default");
        let sql = &c.operators["sql"];
        assert_eq!(sql["streams"].as_integer(), Some(3));
        assert_eq!(sql["split_min_bytes"].as_integer(), Some(1));

        let d = NodeConfig::default();
        assert_eq!(
            (d.cpus, d.memory, d.capacity),
            (2, ByteSize(2 << 30), ByteSize(4 << 30))
        );
        // The read cache follows --memory unless set.
        assert_eq!(d.read_cache_bytes(), 512 << 20);
        let small = NodeConfig {
            memory: ByteSize(256 << 20),
            ..NodeConfig::default()
        };
        assert_eq!(small.read_cache_bytes(), 64 << 20);
        let off = NodeConfig {
            read_cache: Some(ByteSize(0)),
            ..NodeConfig::default()
        };
        assert_eq!(off.read_cache_bytes(), 0);
    }

    #[test]
    fn bad_settings_name_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("node.toml");
        std::fs::write(&file, "memroy = \"1GiB\"\n").unwrap();
        let e = NodeConfig::load(&matches(&["csd"]), Some(&file)).unwrap_err();
        assert!(e.to_string().contains("memroy"), "{e}");
        std::fs::write(&file, "memory = \"1 parsec\"\n").unwrap();
        let e = NodeConfig::load(&matches(&["csd"]), Some(&file)).unwrap_err();
        assert!(e.to_string().contains("parsec"), "{e}");
        let e = NodeConfig::load(&matches(&["csd", "--set", "sql"]), None).unwrap_err();
        assert!(e.to_string().contains("OPERATOR.KEY=VALUE"), "{e}");
        assert_eq!(
            "1536MiB".parse::<ByteSize>().unwrap().to_string(),
            "1536MiB"
        );
        assert_eq!(ByteSize(1 << 30).to_string(), "1GiB");
    }
}
