//! # csd-testbed: emulated clusters on one machine
//!
//! * [`link`]: throttled TCP links (bandwidth and latency per direction) that real
//!   gRPC traffic passes through. The SQL benchmark and the scenarios both use them.
//!
//! Scenario files, cluster start-up and reports come with the testbed issue; emulated
//! NVMe devices live in `csd_runtime::device::emulated`.

pub mod link;
