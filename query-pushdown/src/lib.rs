//! # csd-query-pushdown (not yet built)
//!
//! Will hold the compute-side DataFusion `TableProvider` and optimizer rules that push
//! filters, projections, limits, top-k and partial aggregates to storage nodes as
//! Substrait fragments, and the storage-side operator that runs them over the node's
//! Parquet objects. Tracked by the "Automatic SQL pushdown" issue.
