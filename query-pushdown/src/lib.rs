//! # csd-query-pushdown: plain SQL, with the data-reducing part run at the storage nodes
//!
//! **Compute side.** [`Cluster::session`] gives a DataFusion session whose tables live
//! on storage nodes ([`CsdTable`]). Without any hint from the user, projections,
//! filters the node evaluates exactly ([`pushable`]), LIMIT, ORDER BY … LIMIT (top-k
//! per node partition, merged here) and partial aggregates (`sum`, `count`, `min`,
//! `max`, `avg`, `count(*)` with GROUP BY, merged by DataFusion's final aggregate here)
//! run at the nodes ([`rule`]); an aggregate grouped by a column whose partitions
//! hold disjoint ranges runs whole at each partition, HAVING included. A hash join's
//! build keys filter its probe-side scan at the nodes ([`semijoin`]), and `IN`
//! subqueries move below inner joins to the table their key comes from
//! ([`semipush`]), as do inner joins with a small filtered input such as a nation
//! chosen by name ([`joinpush`]). Anything else stays here, so results are the same with pushdown
//! on or off. `EXPLAIN` shows `CsdPushdown` / `CsdScanExec` nodes with
//! the pushed fragment and its endpoints; `EXPLAIN ANALYZE` adds, per endpoint, bytes
//! read from the device, bytes sent, rows scanned and returned, and time at the node.
//! With pushdown off the session is the baseline ([`baseline`]): DataFusion reading
//! the nodes' Parquet by byte range with all of its own pruning.
//!
//! **On the wire.** The fragment is Substrait inside a Flight ticket; see
//! [`fragment`] for the message, the supported subset and the limits.
//!
//! **Storage side.** [`SqlOperator`] validates, plans with DataFusion over the node's
//! own Parquet objects and streams the answer (see [`storage`]). A fragment the node
//! hands back is evaluated here, oldest first, a core at a time ([`gate`]). A node serves it when
//! started with `csd_runtime::node::start_with(config, registry())`.

pub mod baseline;
pub mod error;
pub mod exec;
pub mod fragment;
pub mod gate;
pub mod joinpush;
pub mod keyfilter;
pub mod like;
pub mod pushable;
pub mod rule;
pub mod scan;
pub mod semijoin;
pub mod semipush;
pub mod session;
pub mod storage;
pub mod table;
pub mod tpch;

pub use fragment::{Mode, SqlFragment};
pub use gate::LocalGate;
pub use pushable::pushable;
pub use session::{Cluster, CsdSession, QueryRun, SessionOptions};
pub use storage::{Parallelism, SqlOperator};
pub use table::CsdTable;

use std::sync::Arc;

/// The operators a storage node needs for SQL pushdown.
pub fn registry() -> csd_runtime::operator::OperatorRegistry {
    csd_runtime::operator::OperatorRegistry::new().with(Arc::new(SqlOperator::new()))
}
