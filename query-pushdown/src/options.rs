//! Compute-side settings of pushdown, in DataFusion's configuration under the `csd.`
//! prefix: `SET csd.direct_above = 0.5` in SQL, `SHOW csd.direct_above`, or
//! [`CsdOptions`] in a `SessionConfig`. Every session [`Cluster::session`] makes has
//! them, with the defaults below.
//!
//! [`Cluster::session`]: crate::Cluster::session

use std::fmt;
use std::time::Duration;

use datafusion::common::{DataFusionError, Result};
use datafusion::config::{ConfigExtension, ConfigField, ConfigOptions, Visit};

use crate::wire::shipped::{ShippedFunction, WasmFunctionMsg, check_functions};

datafusion::common::extensions_options! {
    /// Tuning of the compute tier's side of pushdown (`csd.*`).
    pub struct CsdOptions {
        /// A scan that reduces nothing by itself is sent to a node only with a
        /// join-key filter, and the node hands it back when the filter keeps more than
        /// this fraction of its first rows: then compressed Parquet read by byte range
        /// is smaller than the survivors as Arrow IPC.
        pub direct_above: f64, default = 0.3
        /// Batches a scan fetches ahead of its consumer once executed, so that scans
        /// on both sides of a hash join run at the node together.
        pub(crate) prefetch_batches: usize, default = 2
        /// Seconds a probe-side scan waits for its build side's keys before it runs
        /// without a join-key filter (a safeguard: a hash join reads its build side
        /// before it polls the probe side).
        pub(crate) key_wait_secs: f64, default = 30.0
        /// Bits per key of a join-key filter: 12 gives about 1% false positives.
        pub(crate) bloom_bits_per_key: usize, default = 12
        /// Most join-key filters sent with one scan (at most the wire's limit, 4).
        pub(crate) max_key_filters: usize, default = 4
        /// Scans that reduce nothing (no filter, no limit) read the Parquet objects by
        /// byte range instead of asking the nodes, unless a join-key filter applies.
        pub direct_unfiltered: bool, default = true
        /// An aggregate is pushed to the nodes only when the groups they would
        /// answer (from their distinct-count sketches: the product of the group
        /// keys' distinct values, at most the rows) are at most this fraction of
        /// the rows they hold; otherwise the Parquet is read here and aggregated
        /// here. 1 pushes every aggregate.
        pub max_group_fraction: f64, default = 0.5
        /// A query's part that reads one table, all of whose partitions live on one
        /// node (aggregates, the filters and aggregates over them), runs whole at
        /// that node, which answers the part's rows; otherwise aggregates run in
        /// two phases. Off: for nodes whose cores are much slower than this tier's.
        pub whole_at_node: bool, default = true
        /// Most bytes of aggregation state a part run whole at a node may hold, by
        /// the nodes' sketches (a group's keys, accumulators and hash-table entry; a
        /// median's every value); a larger part runs in two phases. The default
        /// leaves a node with the default 2 GiB budget room to read beside it.
        pub whole_at_node_max_state: u64, default = 768 << 20
        /// A filter expected (from the objects' min/max) to keep at most this
        /// fraction of the rows, in a scan that reads at least twice as many other
        /// columns as the filter's, is evaluated while decoding (Parquet late
        /// materialization): most pages then hold no kept row, and only the
        /// filter's columns are decoded there. 0 never.
        pub late_filters_below: f64, default = 1e-4
        /// The session's Wasm SQL functions (set by `register_wasm_udf` on a
        /// session with workers: how a worker's task session finds them; the
        /// modules were sent to the workers). Written `NAME=DIGEST:EXPORT` entries
        /// joined by `;`, checked when set.
        pub(crate) wasm_functions: WasmFunctions, default = WasmFunctions::default()
    }
}

impl ConfigExtension for CsdOptions {
    const PREFIX: &'static str = "csd";
}

impl CsdOptions {
    /// The options in `config`, or the defaults when the session has none.
    pub fn of(config: &ConfigOptions) -> CsdOptions {
        config
            .extensions
            .get::<CsdOptions>()
            .cloned()
            .unwrap_or_default()
    }

    /// [`key_wait_secs`](Self::key_wait_secs) as a duration (a bad value: the
    /// default).
    pub(crate) fn key_wait(&self) -> Duration {
        Duration::try_from_secs_f64(self.key_wait_secs).unwrap_or(Duration::from_secs(30))
    }
}

/// A session's Wasm SQL functions as its workers find them ([`CsdOptions`]): each
/// its name, module and export, checked as a fragment's declared functions are
/// (`NAME=DIGEST:EXPORT;…` only where the option travels as text, between a
/// coordinator and its workers).
#[derive(Debug, Clone, Default)]
pub(crate) struct WasmFunctions(Vec<ShippedFunction>);

impl WasmFunctions {
    /// Adds `f` (its bytes are not kept: the workers have the module).
    pub(crate) fn push(&mut self, f: ShippedFunction) {
        self.0.push(ShippedFunction { bytes: None, ..f });
    }

    /// The functions, in the order registered.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &ShippedFunction> {
        self.0.iter()
    }

    /// Parses `NAME=DIGEST:EXPORT;…` (empty: none).
    fn parse(text: &str) -> Result<Self> {
        let mut msgs = Vec::new();
        for entry in text.split(';').filter(|e| !e.trim().is_empty()) {
            let bad = || {
                DataFusionError::Configuration(format!(
                    "csd.wasm_functions entry {:?}: write NAME=DIGEST:EXPORT",
                    csd_protocol::error::truncated(entry)
                ))
            };
            let (name, rest) = entry.trim().split_once('=').ok_or_else(bad)?;
            let (digest, export) = rest.split_once(':').ok_or_else(bad)?;
            msgs.push(WasmFunctionMsg {
                name: name.to_string(),
                module_digest: digest.as_bytes().to_vec(),
                export: export.to_string(),
                module: None,
            });
        }
        let digests = check_functions(&msgs)
            .map_err(|e| DataFusionError::Configuration(format!("csd.wasm_functions: {e}")))?;
        Ok(WasmFunctions(
            msgs.into_iter()
                .zip(digests)
                .map(|(m, digest)| ShippedFunction {
                    name: m.name,
                    export: m.export,
                    digest,
                    bytes: None,
                })
                .collect(),
        ))
    }
}

/// `NAME=DIGEST:EXPORT` entries joined by `;`, as [`WasmFunctions::parse`] reads them.
impl fmt::Display for WasmFunctions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { ";" };
            write!(f, "{sep}{}={}:{}", s.name, s.digest.hex(), s.export)?;
        }
        Ok(())
    }
}

impl ConfigField for WasmFunctions {
    fn visit<V: Visit>(&self, v: &mut V, key: &str, description: &'static str) {
        v.some(key, self, description)
    }

    fn set(&mut self, _: &str, value: &str) -> Result<()> {
        *self = WasmFunctions::parse(value)?;
        Ok(())
    }

    fn reset(&mut self, _: &str) -> Result<()> {
        *self = WasmFunctions::default();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use datafusion::config::ExtensionOptions;

    use super::*;

    const DIGEST: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    /// What a coordinator writes, a worker reads back whole; what is not an entry
    /// is refused when set, saying which.
    #[test]
    fn wasm_functions_are_checked_once_when_set() {
        let mut o = CsdOptions::default();
        let text = format!("f={DIGEST}:plus_one;g={DIGEST}:twice");
        ExtensionOptions::set(&mut o, "wasm_functions", &text).unwrap();
        let names: Vec<_> = o
            .wasm_functions
            .iter()
            .map(|f| (f.name.as_str(), f.export.as_str(), f.digest.hex()))
            .collect();
        assert_eq!(
            names,
            [
                ("f", "plus_one", DIGEST.to_string()),
                ("g", "twice", DIGEST.to_string())
            ]
        );
        assert_eq!(o.wasm_functions.to_string(), text);
        ExtensionOptions::set(&mut o, "wasm_functions", "").unwrap();
        assert_eq!(o.wasm_functions.iter().count(), 0);
        for bad in [
            "f".to_string(),
            format!("f={DIGEST}"),
            "f=abc:plus_one".to_string(),
            format!("f={DIGEST}:plus one"),
            format!("f={DIGEST}:x;f={DIGEST}:y"),
        ] {
            let e = ExtensionOptions::set(&mut o, "wasm_functions", &bad).unwrap_err();
            assert!(e.to_string().contains("csd.wasm_functions"), "{bad}: {e}");
        }
    }
}
