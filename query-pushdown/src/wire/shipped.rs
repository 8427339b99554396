//! The Wasm SQL functions a fragment ships: their declaration in a fragment
//! ([`WasmFunctionMsg`]) and its checks. A fragment that calls one carries its
//! module's digest (and, when small, its bytes); the node compiles it once and runs
//! the function inside the plan, as the compute tier does for a handed-back fragment.

use std::sync::Arc;

use csd_protocol::error::truncated;
use csd_protocol::{Error, ModuleDigest};

/// Largest module sent inside a request (larger ones go by `put_module`).
pub const MAX_INLINE_MODULE: usize = 256 << 10;
/// Most Wasm SQL functions one fragment calls.
pub const MAX_SHIPPED_FUNCTIONS: usize = 16;
/// Longest Wasm SQL function name or export.
pub const MAX_FUNCTION_NAME: usize = 64;

/// A Wasm SQL function a fragment calls (see [`crate::wire::fragment`]):
///
/// ```text
/// message WasmFunction {
///   string name = 1;           // as the plan calls it (lower case: [a-z_][a-z0-9_]*)
///   bytes module_digest = 2;   // SHA-256 of the module's bytes
///   string export = 3;         // the module's export (and csd_signature_<export>)
///   optional bytes module = 4; // the module's bytes, when small enough
/// }
/// ```
#[derive(Clone, PartialEq, prost::Message)]
pub struct WasmFunctionMsg {
    /// The function's SQL name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// SHA-256 of the module's bytes.
    #[prost(bytes = "vec", tag = "2")]
    pub module_digest: Vec<u8>,
    /// The module's export that computes it.
    #[prost(string, tag = "3")]
    pub export: String,
    /// The module's bytes, when they ride in the fragment.
    #[prost(bytes = "vec", optional, tag = "4")]
    pub module: Option<Vec<u8>>,
}

/// What names a shipped function: its SQL name, its module and export, and (on the
/// compute side) the module's bytes, to send a node that lacks them.
#[derive(Debug, Clone)]
pub struct ShippedFunction {
    /// The SQL name.
    pub name: String,
    /// The export that computes it.
    pub export: String,
    /// The module's digest.
    pub digest: ModuleDigest,
    /// The module's bytes (compute side only).
    pub bytes: Option<Arc<[u8]>>,
}

impl ShippedFunction {
    /// How a fragment declares it (the bytes inline when they are small).
    pub fn to_msg(&self) -> WasmFunctionMsg {
        WasmFunctionMsg {
            name: self.name.clone(),
            module_digest: self.digest.0.to_vec(),
            export: self.export.clone(),
            module: self
                .bytes
                .as_ref()
                .filter(|b| b.len() <= MAX_INLINE_MODULE / 4)
                .map(|b| b.to_vec()),
        }
    }
}

/// Checks a Wasm SQL function's name: what SQL calls it by (unquoted names fold to
/// lower case) and what a fragment may declare.
pub fn check_function_name(name: &str) -> Result<(), Error> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    if !first_ok
        || name.len() > MAX_FUNCTION_NAME
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(invalid(format!(
            "{:?} is not a usable name for a Wasm SQL function: use lower-case letters, digits and _ (at most {MAX_FUNCTION_NAME}, not starting with a digit)",
            truncated(name)
        )));
    }
    if super::functions::node_evaluates(name) {
        return Err(invalid(format!(
            "a Wasm SQL function may not be called {name}: that is a built-in function"
        )));
    }
    Ok(())
}

/// Checks the Wasm SQL functions a fragment declares: their names, exports and
/// digests, and that their inline bytes stay within [`MAX_INLINE_MODULE`].
pub fn check_functions(functions: &[WasmFunctionMsg]) -> Result<Vec<ModuleDigest>, Error> {
    if functions.len() > MAX_SHIPPED_FUNCTIONS {
        return Err(invalid(format!(
            "a fragment declares {} Wasm SQL functions; at most {MAX_SHIPPED_FUNCTIONS} are accepted",
            functions.len()
        )));
    }
    let mut inline = 0usize;
    let mut digests = Vec::with_capacity(functions.len());
    for (i, f) in functions.iter().enumerate() {
        check_function_name(&f.name)?;
        if functions[..i].iter().any(|g| g.name == f.name) {
            return Err(invalid(format!(
                "a fragment declares the Wasm SQL function {} twice",
                f.name
            )));
        }
        if f.export.is_empty()
            || f.export.len() > MAX_FUNCTION_NAME
            || !f
                .export
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err(invalid(format!(
                "the Wasm SQL function {} names the export {:?}: use letters, digits and _ (at most {MAX_FUNCTION_NAME})",
                f.name,
                truncated(&f.export)
            )));
        }
        digests.push(ModuleDigest::parse(&f.module_digest)?);
        inline += f.module.as_ref().map_or(0, Vec::len);
    }
    if inline > MAX_INLINE_MODULE {
        return Err(invalid(format!(
            "a fragment carries {inline} bytes of Wasm modules; at most {MAX_INLINE_MODULE} ride inline (send larger ones with put_module)"
        )));
    }
    Ok(digests)
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}
