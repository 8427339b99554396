//! # csd-ml-pushdown (not yet built)
//!
//! Will hold the storage-side DNN-prefix operator (candle), the split planner and the
//! compute-side feature stream. Tracked by the "ML pushdown (HAPI-style)" issue.
