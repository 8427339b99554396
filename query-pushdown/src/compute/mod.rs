//! The compute tier: a DataFusion session over a cluster's tables, the rules that
//! decide what is pushed, and the scan that sends fragments to the nodes.

pub mod dimension_join_down;
pub mod endpoints;
pub mod gate;
pub mod key_collector;
pub mod key_filter_rule;
pub mod provider;
pub mod pushdown;
pub mod range_read;
pub mod scan;
pub mod semijoin_down;
pub mod session;
