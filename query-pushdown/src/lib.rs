//! # csd-query-pushdown: plain SQL, with the data-reducing part run at the storage nodes
//!
//! The folders say which side of the wire code runs on:
//!
//! | folder | runs on | what |
//! |---|---|---|
//! | `compute` | the compute tier | the DataFusion session over a cluster, the table provider, the optimizer rules that choose what to push, [`CsdScanExec`], join-key collection, the local gate, the no-pushdown baseline |
//! | `node` | the storage node | [`SqlOperator`]: the `"sql"` operator a node serves |
//! | `compute::distributed` | the compute tier's coordinator | running pushdown plans on `datafusion-distributed` workers (`csd worker`): the codec of our plan nodes, placing scan tasks beside their nodes ([`Cluster::distributed_session`], [`WorkerEnv`]) |
//! | `worker` | the compute tier's workers (`csd worker`) | the worker's session ([`worker_sessions`]) and server ([`serve_worker_on`]), its key board and modules |
//! | `eval` | both | planning and running one fragment (the node always; the compute tier for a fragment handed back), join-key filtering, the Parquet scan both share |
//! | `gateway` | the compute tier (`csd gateway`) | an Arrow Flight SQL server over the cluster ([`serve_gateway_on`]): ADBC, JDBC and BI tools query with the same pushdown |
//! | [`wire`] | both (the protocol) | the fragment message and its limits, the join-key filter as it travels, the functions a node may evaluate |
//!
//! **Compute side.** [`Cluster::session`] gives a DataFusion session whose tables live
//! on storage nodes ([`CsdTable`]). Without any hint from the user, projections,
//! filters the node evaluates exactly ([`wire::functions`]), LIMIT, ORDER BY … LIMIT
//! (top-k per node partition, merged here) and partial aggregates (`sum`, `count`,
//! `min`, `max`, `avg`, `count(*)` with GROUP BY, merged by DataFusion's final
//! aggregate here) run at the nodes (`compute::pushdown`); an aggregate grouped by
//! a column whose partitions hold disjoint ranges runs whole at each partition,
//! HAVING included. A hash join's build keys filter its probe-side scan at the nodes
//! (`compute::key_filter_rule`), and `IN` subqueries move below inner joins to the
//! table their key comes from (`compute::semijoin_down`), as do inner joins with a
//! small filtered input such as a nation chosen by name
//! (`compute::dimension_join_down`). Anything else stays here, so results are the
//! same with pushdown on or off. `EXPLAIN` shows `CsdPushdown` / `CsdScanExec` nodes
//! with the pushed fragment and its endpoints; `EXPLAIN ANALYZE` adds, per endpoint,
//! bytes read from the device, bytes sent, rows scanned and returned, and time at the
//! node. With pushdown off the session is the baseline (`compute::range_read`):
//! DataFusion reading the nodes' Parquet by byte range with all of its own pruning.
//!
//! **On the wire.** The fragment is Substrait inside a Flight ticket; see
//! [`wire::fragment`] for the message, the supported subset and the limits.
//!
//! **Storage side.** [`SqlOperator`] validates, plans with DataFusion over the node's
//! own Parquet objects and streams the answer. A fragment the node hands back is
//! evaluated on the compute tier, oldest first, a core at a time
//! (`compute::gate`). A node serves SQL when started with
//! `csd_runtime::node::start_with(config, registry())`.

#![warn(unreachable_pub)]

mod compute;
pub mod error;
mod eval;
mod gateway;
#[cfg(feature = "node")]
mod node;
mod options;
pub mod wire;
mod worker;

pub use compute::distributed::{CsdCodec, Placement, WorkerEnv, Workers};
pub use compute::gate::LocalGate;
pub use compute::provider::CsdTable;
pub use compute::provider::{Encoded, Unsendable};
pub use compute::pushable::pushable;
#[cfg(feature = "wasm")]
pub use compute::sandbox::local_sandbox;
pub use compute::scan::{CsdScanExec, EndpointRun};
pub use compute::session::{Cluster, CsdSession, QueryRun, SQL_RECURSION_LIMIT, SessionOptions};
#[cfg(feature = "wasm")]
pub use compute::wasm::{WasmEndpointRun, WasmJob, WasmRun};
pub use eval::Parallelism;
#[cfg(feature = "wasm")]
pub use eval::wasm_fn::{WasmScalarUdf, parse_signature};
pub use gateway::{GatewayOptions, GatewayTls, serve_gateway_on};
#[cfg(feature = "node")]
pub use node::{SqlNodeOptions, SqlOperator, WasmOperator};
pub use options::CsdOptions;
pub use wire::fragment::{Mode, SqlFragment};
pub use wire::shipped::ShippedFunction;
pub use worker::{WorkerSessions, serve_worker_on, worker_sessions};

#[cfg(feature = "node")]
use std::sync::Arc;

/// The operators a storage node needs for SQL pushdown, with default settings.
#[cfg(feature = "node")]
pub fn registry() -> csd_runtime::operator::OperatorRegistry {
    let sql = Arc::new(SqlOperator::new());
    csd_runtime::operator::OperatorRegistry::new()
        .with(sql.clone())
        .with(Arc::new(WasmOperator::new(sql)))
}

/// [`registry`], with the `"sql"` operator's settings from `config`
/// (`[operators.sql]`, `--set sql.KEY=VALUE`; see [`SqlNodeOptions`]).
#[cfg(feature = "node")]
pub fn registry_with(
    config: &csd_runtime::config::NodeConfig,
) -> csd_protocol::Result<csd_runtime::operator::OperatorRegistry> {
    let options: SqlNodeOptions = config.operator_options(wire::fragment::OPERATOR_NAME)?;
    let sql = Arc::new(SqlOperator::new().with_options(options));
    Ok(csd_runtime::operator::OperatorRegistry::new()
        .with(sql.clone())
        .with(Arc::new(WasmOperator::new(sql))))
}
