//! # csd-client: the user's front door
//!
//! * [`NodeClient`] (from `csd-runtime`, which owns the wire protocol) talks Arrow
//!   Flight to one storage node: store tables, list, scan, read object bytes by range,
//!   run pushed-down operators, delete, read node figures.
//! * [`csd_query_pushdown::Cluster`]: a DataFusion session over a cluster's tables,
//!   with or without pushdown; [`script`] splits the SQL scripts `csd sql -f` runs.
//! * [`features`]: image datasets in, DNN features out (split planned, prefix at the
//!   nodes, the rest here).
//! * [`placement`]: which nodes hold the copies of a partition (`csd put --replicas`).
//! * [`demo`] is the README's main job. The `csd` binary (`src/main.rs`) wraps them.

#![warn(unreachable_pub)]

pub mod demo;
pub mod error;
pub mod features;
pub mod placement;
pub mod script;

pub use csd_protocol::node_client::{NodeClient, OperatorReply, ReplyStats, TableInfo};
pub use error::{Error, Result};
