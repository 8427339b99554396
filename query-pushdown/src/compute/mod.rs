//! The compute tier: a DataFusion session over a cluster's tables, the rules that
//! decide what is pushed, and the scan that sends fragments to the nodes.

pub(crate) mod dimension_join_down;
pub(crate) mod distributed;
pub(crate) mod endpoints;
pub(crate) mod gate;
pub(crate) mod holistic_down;
pub(crate) mod keep;
pub(crate) mod key_collector;
pub(crate) mod key_filter_rule;
pub(crate) mod lost;
pub(crate) mod median_weighted;
pub(crate) mod no_filter;
pub(crate) mod provider;
pub(crate) mod pushable;
pub(crate) mod pushdown;
pub(crate) mod range_read;
pub(crate) mod replicas;
pub(crate) mod sandbox;
pub(crate) mod scan;
pub(crate) mod semijoin_down;
pub(crate) mod session;
pub(crate) mod shrink;
pub(crate) mod typed_footers;
#[cfg(feature = "wasm")]
pub(crate) mod wasm;
pub(crate) mod whole_at_node;
pub(crate) mod window_down;
pub(crate) mod worker_failure;
