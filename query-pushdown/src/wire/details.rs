//! What a node reports of the fragments it ran, beyond the figures every operator
//! reports: the typed details of an
//! [`OperatorReport`](csd_protocol::OperatorReport), written by the node's operators
//! and read back with [`OperatorReport::details`](csd_protocol::OperatorReport::details).

use serde::{Deserialize, Serialize};

/// The `"sql"` operator's details.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SqlDetails {
    /// Streams the fragment's largest Parquet scan ran in.
    pub streams: usize,
}

/// What a guest's outputs are (its `csd_kind` export).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WasmKind {
    /// Rows: the outputs of its calls are united.
    Rows,
    /// An aggregate: its partial outputs are merged by running it again.
    Aggregate,
}

/// The `"wasm"` operator's details.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WasmDetails {
    /// What the guest's outputs are.
    pub wasm_kind: WasmKind,
    /// CPU time the guest took, milliseconds.
    pub wasm_cpu_ms: f64,
}
