//! The `"wasm"` operator's request: a shipped WebAssembly module run over the rows
//! of one pushed scan.
//!
//! ```text
//! message WasmRequest {
//!   bytes module_digest = 1;          // SHA-256 of the module's bytes (32 bytes)
//!   optional bytes module = 2;        // the bytes themselves, when small enough
//!   bytes input = 3;                  // a SqlFragment: the scan (columns, filter) the guest's input is
//!   map<string, string> args = 4;     // the guest's arguments
//!   string table = 5;                 // with no input: the table whose objects it reads
//!   optional string partition = 6;    // … and its partition (absent: all at this node)
//! }
//! ```
//!
//! The node runs `input` as it runs any `"sql"` fragment (so its Parquet pruning and
//! its checks apply), feeds the batches to the module through the guest ABI
//! (`csd_sandbox`) and streams the module's outputs. A request without
//! `input` runs the module over no rows (`csd_init`, then `csd_finish`): a guest that
//! only reads objects of `table` (a traversal, a pointer chase) skips planning and
//! scanning altogether. A node that lacks the
//! module answers `NOT_FOUND` naming its digest in the status's metadata
//! ([`csd_protocol::error::StatusDetail::ModuleMissing`]); the client sends the
//! bytes with the `put_module` action and asks again. The trailing report's details
//! are [`WasmDetails`](super::details::WasmDetails).

use std::collections::BTreeMap;

use csd_protocol::Error;
use csd_protocol::ModuleDigest;
use csd_protocol::error::truncated;
use prost::Message;

use crate::wire::fragment::{CheckedFragment, SqlFragment};

/// Name of the operator in tickets.
pub const OPERATOR_NAME: &str = "wasm";
/// Most arguments.
pub const MAX_ARGS: usize = 256;
/// Largest argument key or value.
pub const MAX_ARG_BYTES: usize = 64 << 10;

/// The `args` of a `"wasm"` operator ticket.
#[derive(Clone, PartialEq, prost::Message)]
pub struct WasmRequest {
    /// SHA-256 of the module's bytes.
    #[prost(bytes = "vec", tag = "1")]
    pub module_digest: Vec<u8>,
    /// The module's bytes, when they ride in the request.
    #[prost(bytes = "vec", optional, tag = "2")]
    pub module: Option<Vec<u8>>,
    /// The scan whose rows the guest receives: a [`SqlFragment`], encoded.
    #[prost(bytes = "vec", tag = "3")]
    pub input: Vec<u8>,
    /// The guest's arguments.
    #[prost(btree_map = "string, string", tag = "4")]
    pub args: BTreeMap<String, String>,
    /// Without `input`: the table whose objects the guest reads.
    #[prost(string, tag = "5")]
    pub table: String,
    /// Without `input`: one partition of it (absent: all at the node).
    #[prost(string, optional, tag = "6")]
    pub partition: Option<String>,
}

/// What a wasm request runs over.
#[derive(Debug, Clone)]
pub struct WasmInput {
    /// The table (whose read permission the request needs).
    pub table: String,
    /// Its partition (absent: all at the node).
    pub partition: Option<String>,
    /// The scan whose rows the guest receives, decoded and checked (the fragment,
    /// what it returns, its plan); `None`: no rows.
    pub scan: Option<CheckedFragment>,
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

impl WasmRequest {
    /// The request's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.encode_to_vec()
    }

    /// Decodes untrusted bytes: sizes, digest and the input fragment checked.
    pub fn decode_checked(bytes: &[u8]) -> Result<(WasmRequest, ModuleDigest, WasmInput), Error> {
        let r = WasmRequest::decode(bytes)
            .map_err(|e| invalid(format!("malformed wasm request: {e}")))?;
        let digest = ModuleDigest::parse(&r.module_digest)?;
        if r.args.len() > MAX_ARGS {
            return Err(invalid(format!(
                "a wasm request has {} arguments; at most {MAX_ARGS} are accepted",
                r.args.len()
            )));
        }
        if r.args
            .iter()
            .any(|(k, v)| k.len() > MAX_ARG_BYTES || v.len() > MAX_ARG_BYTES)
        {
            return Err(invalid(format!(
                "a wasm request's argument exceeds {MAX_ARG_BYTES} bytes"
            )));
        }
        if r.args.keys().any(|k| k.starts_with("csd.")) {
            return Err(invalid("argument names starting with csd. are the node's"));
        }
        if r.input.is_empty() {
            if r.table.is_empty() {
                return Err(invalid(
                    "a wasm request without input rows must name the table it reads",
                ));
            }
            let input = WasmInput {
                table: r.table.clone(),
                partition: r.partition.clone(),
                scan: None,
            };
            return Ok((r, digest, input));
        }
        let checked = SqlFragment::decode_checked(&r.input)?;
        if !r.table.is_empty() && r.table != checked.frag.table {
            return Err(invalid(format!(
                "a wasm request names table {:?} but its input reads {:?}",
                truncated(&r.table),
                checked.frag.table
            )));
        }
        let input = WasmInput {
            table: checked.frag.table.clone(),
            partition: checked.frag.partition.clone(),
            scan: Some(checked),
        };
        Ok((r, digest, input))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let e = WasmRequest::decode_checked(b"\xff\xff").unwrap_err();
        assert!(e.to_string().contains("malformed wasm request"), "{e}");
        let r = WasmRequest {
            module_digest: vec![1, 2, 3],
            ..Default::default()
        };
        let e = WasmRequest::decode_checked(&r.to_bytes()).unwrap_err();
        assert!(e.to_string().contains("module digest"), "{e}");
        let r = WasmRequest {
            module_digest: vec![7; 32],
            args: [("csd.phase".to_string(), "merge".to_string())].into(),
            ..Default::default()
        };
        let e = WasmRequest::decode_checked(&r.to_bytes()).unwrap_err();
        assert!(e.to_string().contains("csd."), "{e}");
        let r = WasmRequest {
            module_digest: vec![7; 32],
            ..Default::default()
        };
        let e = WasmRequest::decode_checked(&r.to_bytes()).unwrap_err();
        assert!(e.to_string().contains("must name the table"), "{e}");
        let r = WasmRequest {
            module_digest: vec![7; 32],
            table: "chain".into(),
            ..Default::default()
        };
        let (_, _, input) = WasmRequest::decode_checked(&r.to_bytes()).unwrap();
        assert!(input.scan.is_none() && input.table == "chain");
    }
}
