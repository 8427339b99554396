//! # csd-client: the user's front door
//!
//! * [`NodeClient`] (from `csd-runtime`, which owns the wire protocol) talks Arrow
//!   Flight to one storage node: store tables, list, scan, read object bytes by range,
//!   run pushed-down operators, delete, read node figures.
//! * [`sql`]: a DataFusion session over a cluster's tables, with or without pushdown.
//! * [`features`]: image datasets in, DNN features out (split planned, prefix at the
//!   nodes, the rest here).
//! * [`demo`] is the README's main job. The `csd` binary (`src/main.rs`) wraps them.

pub mod demo;
pub mod features;

pub use csd_runtime::client::{Error, NodeClient, OperatorReply, ReplyStats, Result, TableInfo};
