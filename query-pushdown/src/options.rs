//! Compute-side settings of pushdown, in DataFusion's configuration under the `csd.`
//! prefix: `SET csd.direct_above = 0.5` in SQL, `SHOW csd.direct_above`, or
//! [`CsdOptions`] in a `SessionConfig`. Every session [`Cluster::session`] makes has
//! them, with the defaults below.
//!
//! [`Cluster::session`]: crate::Cluster::session

use std::time::Duration;

use datafusion::config::{ConfigExtension, ConfigOptions};

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
        /// The session's Wasm SQL functions, as `NAME=DIGEST:EXPORT` entries joined
        /// by `;` (set by `register_wasm_udf` on a session with workers: how a
        /// worker's task session finds them; the modules were sent to the workers).
        pub(crate) wasm_functions: String, default = String::new()
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
