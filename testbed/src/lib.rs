//! # csd-testbed (not yet built)
//!
//! Will run emulated clusters from scenario files (emulated NVMe from
//! `csd_runtime::device::emulated`, throttled links) and write reports. Tracked by the
//! "Testbed" issue.
