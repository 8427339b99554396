//! # csd-guest: Wasm operators for csd storage nodes, written in Rust
//!
//! A guest is a plain Rust type implementing [`Operator`]: it is made from the
//! request's arguments, sees the record batches of the table partition it runs over
//! (after the columns and filter the request pushed), may return a batch for each,
//! and may return one more at the end (an aggregate). [`export_operator!`] turns it
//! into a module that speaks the csd guest ABI (version [`ABI_VERSION`]; the ABI is
//! documented in `csd_runtime::sandbox`), so any node runs it without deployment:
//!
//! ```ignore
//! use csd_guest::{Args, Operator, RecordBatch};
//!
//! struct Keep { column: String }
//! impl Operator for Keep {
//!     fn new(args: &Args) -> Result<Self, String> {
//!         Ok(Keep { column: args.get("column").unwrap_or("a").to_string() })
//!     }
//!     fn batch(&mut self, batch: RecordBatch) -> Result<Option<RecordBatch>, String> {
//!         Ok(Some(batch))
//!     }
//! }
//! csd_guest::export_operator!(Keep);
//! ```
//!
//! Build with `cargo build --release --target wasm32-unknown-unknown` and a
//! `crate-type = ["cdylib"]` library. A guest may read byte ranges of objects of the
//! tables its tenant may read with [`read`] (a traversal, a pointer chase).
//!
//! SQL functions: [`export_functions!`] exports plain functions over Arrow arrays as
//! scalar SQL functions (`csd sql --wasm-fn NAME=FILE.wasm:EXPORT`), which the
//! compute tier pushes to the nodes inside fragments. [`columns`] reads whole
//! columns of any layout with one type dispatch per batch.
//!
//! Aggregates: an operator whose [`Operator::AGGREGATE`] is `true` runs twice. At
//! each node (phase [`Phase::Map`]) its `finish` output is a partial state; at the
//! compute side (phase [`Phase::Merge`]) the same module is fed those partial states
//! as batches and its `finish` output is the answer.

use std::collections::BTreeMap;
use std::sync::Arc;

pub use arrow_array::{self, ArrayRef, RecordBatch};
pub use arrow_schema::{self, DataType, Field, Schema, SchemaRef};

/// The guest ABI version this SDK speaks.
pub const ABI_VERSION: i32 = 1;

pub mod columns;

/// The request's arguments (`--arg KEY=VALUE`), plus `csd.phase`.
#[derive(Debug, Default, Clone)]
pub struct Args(BTreeMap<String, String>);

impl Args {
    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// The value of `key` parsed, or `default` when absent; an error naming the key
    /// when it does not parse.
    pub fn parse_or<T: std::str::FromStr>(&self, key: &str, default: T) -> Result<T, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| format!("argument {key}={v:?} is not a valid value")),
        }
    }

    /// The value of `key`, or an error saying it is required.
    pub fn required(&self, key: &str) -> Result<&str, String> {
        self.get(key)
            .ok_or_else(|| format!("the argument {key} is required (--arg {key}=…)"))
    }

    /// The phase this instance runs in.
    pub fn phase(&self) -> Phase {
        match self.get("csd.phase") {
            Some("merge") => Phase::Merge,
            _ => Phase::Map,
        }
    }

    /// All arguments.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

/// Where an instance runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Over a partition's rows (at the node, or at the compute side after pushback).
    Map,
    /// Over the partial states of an aggregate (at the compute side).
    Merge,
}

/// A Wasm operator.
pub trait Operator: Sized {
    /// Whether `finish` emits a partial aggregate that the compute side merges by
    /// running the module again in [`Phase::Merge`].
    const AGGREGATE: bool = false;

    /// Made once per request (per partition), from its arguments.
    fn new(args: &Args) -> Result<Self, String>;

    /// Called for each input batch; the returned batch (if any) is output.
    fn batch(&mut self, batch: RecordBatch) -> Result<Option<RecordBatch>, String>;

    /// Called after the last batch; the returned batch (if any) is output.
    fn finish(&mut self) -> Result<Option<RecordBatch>, String> {
        Ok(None)
    }
}

/// Reads up to `buf.len()` bytes of `object` (a table's object, as the node names
/// it: `table/partition/seq.parquet`) from `offset`; returns the bytes read (fewer
/// only at the end of the object). The node checks the tenant may read the table and
/// verifies the bytes' checksums; a refused or failed read ends the request with
/// the node's error.
pub fn read(object: &str, offset: u64, buf: &mut [u8]) -> usize {
    #[cfg(target_arch = "wasm32")]
    {
        // SAFETY: the pointers are this module's own memory, valid for the lengths
        // given; the host writes only inside `buf`.
        let n = unsafe {
            host::read(
                object.as_ptr() as i32,
                object.len() as i32,
                offset as i64,
                buf.as_mut_ptr() as i32,
                buf.len() as i32,
            )
        };
        n.max(0) as usize
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (object, offset, buf);
        panic!("csd_guest::read runs only inside a node's sandbox")
    }
}

#[cfg(target_arch = "wasm32")]
mod host {
    #[link(wasm_import_module = "csd")]
    unsafe extern "C" {
        pub(crate) fn fail(ptr: i32, len: i32);
        pub(crate) fn read(obj: i32, obj_len: i32, offset: i64, dst: i32, len: i32) -> i32;
    }
}

/// What [`export_operator!`] expands to call; not for direct use.
#[doc(hidden)]
pub mod __private {
    use super::*;
    use std::cell::RefCell;

    thread_local! {
        static OUT: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }

    /// Reports `msg` to the host and returns the ABI's error value.
    pub fn fail(msg: &str) -> i64 {
        #[cfg(target_arch = "wasm32")]
        // SAFETY: a valid slice of this module's memory.
        unsafe {
            super::host::fail(msg.as_ptr() as i32, msg.len() as i32)
        };
        #[cfg(not(target_arch = "wasm32"))]
        let _ = msg;
        -1
    }

    /// Memory for the host to write `len` bytes into; owned by the callee it is
    /// passed to.
    pub fn alloc(len: i32) -> i32 {
        let mut v = Vec::<u8>::with_capacity(len.max(0) as usize);
        let p = v.as_mut_ptr();
        std::mem::forget(v);
        p as usize as i32
    }

    /// Takes back the bytes the host wrote at `ptr`.
    ///
    /// # Safety
    /// `ptr` must come from [`alloc`] with capacity `len`, written by the host.
    pub unsafe fn take(ptr: i32, len: i32) -> Vec<u8> {
        let len = len.max(0) as usize;
        // SAFETY: per the contract, `ptr` is an allocation of `len` bytes.
        unsafe { Vec::from_raw_parts(ptr as usize as *mut u8, len, len) }
    }

    /// Decodes the arguments: u32 count, then (u32 length, bytes) key and value pairs,
    /// little-endian.
    pub fn decode_args(b: &[u8]) -> Result<Args, String> {
        fn u32_at(b: &[u8], at: &mut usize) -> Result<usize, String> {
            let s = b.get(*at..*at + 4).ok_or("arguments truncated")?;
            *at += 4;
            Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]) as usize)
        }
        fn str_at(b: &[u8], at: &mut usize) -> Result<String, String> {
            let n = u32_at(b, at)?;
            let s = b.get(*at..*at + n).ok_or("arguments truncated")?;
            *at += n;
            String::from_utf8(s.to_vec()).map_err(|_| "an argument is not UTF-8".to_string())
        }
        let mut at = 0;
        let n = u32_at(b, &mut at)?;
        let mut m = BTreeMap::new();
        for _ in 0..n {
            let k = str_at(b, &mut at)?;
            let v = str_at(b, &mut at)?;
            m.insert(k, v);
        }
        Ok(Args(m))
    }

    /// Decodes one input: an Arrow IPC stream of one batch. The arrays point into
    /// `b` (no copy), and are not validated again: the host encoded them from arrays
    /// it had validated, and a guest that is lied to can only harm itself. (The
    /// stream is walked message by message and each one handed to a `FileDecoder`,
    /// because arrow-ipc's `StreamDecoder` validates record batches regardless.)
    pub fn decode_batch(b: Vec<u8>) -> Result<RecordBatch, String> {
        use arrow_ipc::MessageHeader;
        fn bad(e: impl std::fmt::Display) -> String {
            format!("input is not an Arrow IPC stream: {e}")
        }
        let buf = arrow_buffer::Buffer::from_vec(b);
        let word = |i: usize| -> Option<u32> {
            Some(u32::from_le_bytes(buf.get(i..i + 4)?.try_into().ok()?))
        };
        let mut at = 0usize;
        let mut decoder: Option<arrow_ipc::reader::FileDecoder> = None;
        let mut schema_seen = None;
        while let Some(w) = word(at) {
            // A message: [0xFFFFFFFF] length, flatbuffer metadata, body.
            let (prefix, meta) = match w {
                0xFFFF_FFFF => (8, word(at + 4).ok_or_else(|| bad("truncated"))? as usize),
                n => (4, n as usize),
            };
            if meta == 0 {
                break;
            }
            let fb = buf
                .get(at + prefix..at + prefix + meta)
                .ok_or_else(|| bad("truncated metadata"))?;
            let message = arrow_ipc::root_as_message(fb).map_err(bad)?;
            let body = usize::try_from(message.bodyLength()).map_err(bad)?;
            let len = prefix + meta + body;
            if at + len > buf.len() {
                return Err(bad("truncated body"));
            }
            let block = arrow_ipc::Block::new(
                at as i64,
                i32::try_from(prefix + meta).map_err(bad)?,
                body as i64,
            );
            let data = buf.slice_with_length(at, len);
            match message.header_type() {
                MessageHeader::Schema => {
                    let schema = message.header_as_schema().ok_or_else(|| bad("schema"))?;
                    let schema = Arc::new(arrow_ipc::convert::fb_to_schema(schema));
                    schema_seen = Some(schema.clone());
                    let d = arrow_ipc::reader::FileDecoder::new(schema, message.version());
                    // SAFETY: see above.
                    decoder = Some(unsafe { d.with_skip_validation(true) });
                }
                MessageHeader::DictionaryBatch => decoder
                    .as_mut()
                    .ok_or_else(|| bad("a dictionary before the schema"))?
                    .read_dictionary(&block, &data)
                    .map_err(bad)?,
                MessageHeader::RecordBatch => {
                    let d = decoder
                        .as_ref()
                        .ok_or_else(|| bad("a batch before the schema"))?;
                    if let Some(batch) = d.read_record_batch(&block, &data).map_err(bad)? {
                        return Ok(batch);
                    }
                }
                _ => {}
            }
            at += len;
        }
        Ok(RecordBatch::new_empty(
            schema_seen.ok_or_else(|| bad("no schema"))?,
        ))
    }

    /// Encodes `out` as the ABI's return value: (pointer << 32) | length of an Arrow
    /// IPC stream kept until the next call; length 0 for no output.
    pub fn output(out: Result<Option<RecordBatch>, String>) -> i64 {
        let batch = match out {
            Err(e) => return fail(&e),
            Ok(None) => return 0,
            Ok(Some(b)) => b,
        };
        OUT.with(|o| {
            let mut o = o.borrow_mut();
            o.clear();
            let written = (|| {
                let mut w = arrow_ipc::writer::StreamWriter::try_new(&mut *o, &batch.schema())?;
                w.write(&batch)?;
                w.finish()
            })();
            match written {
                Err(e) => fail(&format!("encoding output: {e}")),
                Ok(()) => ((o.as_ptr() as usize as i64) << 32) | o.len() as i64,
            }
        })
    }

    /// Runs a SQL function's export: decodes the argument batch, calls `f` on its
    /// columns and returns its one result column as the ABI's output.
    pub fn call_function(
        ptr: i32,
        len: i32,
        f: fn(&[ArrayRef]) -> Result<ArrayRef, String>,
    ) -> i64 {
        // SAFETY: the host wrote `len` bytes into memory from `csd_alloc(len)`.
        let bytes = unsafe { take(ptr, len) };
        let out = decode_batch(bytes).and_then(|b| {
            let col = f(b.columns())?;
            if col.len() != b.num_rows() {
                return Err(format!(
                    "the function returned {} values for {} rows",
                    col.len(),
                    b.num_rows()
                ));
            }
            let schema = Arc::new(Schema::new(vec![Field::new(
                "out",
                col.data_type().clone(),
                true,
            )]));
            RecordBatch::try_new(schema, vec![col])
                .map(Some)
                .map_err(|e| e.to_string())
        });
        output(out)
    }

    /// `s` as the ABI's `(ptr << 32) | len` (for a signature: static text).
    pub fn static_text(s: &'static str) -> i64 {
        ((s.as_ptr() as usize as i64) << 32) | s.len() as i64
    }

    /// A schema-only batch helper for guests that build outputs.
    pub fn schema(fields: Vec<Field>) -> SchemaRef {
        Arc::new(Schema::new(fields))
    }
}

/// Exports scalar SQL functions: each `name: "ARG, … -> RET" => path` becomes the
/// export `name` (a function over Arrow arrays, one per argument, returning one
/// array of as many values) and `csd_signature_name`, plus the ABI's
/// `csd_abi_version` and `csd_alloc`. A module exports either functions or an
/// operator ([`export_operator!`]), not both. Types are Arrow's names (`Float64`,
/// `Utf8`, `Int64`, …); the compute tier casts arguments to them.
///
/// ```ignore
/// fn double(args: &[ArrayRef]) -> Result<ArrayRef, String> { todo!() }
/// csd_guest::export_functions! {
///     double: "Float64 -> Float64" => double,
/// }
/// ```
#[macro_export]
macro_rules! export_functions {
    ($($name:ident : $sig:literal => $f:path),+ $(,)?) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn csd_abi_version() -> i32 {
            $crate::ABI_VERSION
        }

        #[unsafe(no_mangle)]
        pub extern "C" fn csd_alloc(len: i32) -> i32 {
            $crate::__private::alloc(len)
        }

        $(
            const _: () = {
                #[unsafe(export_name = stringify!($name))]
                pub extern "C" fn call(ptr: i32, len: i32) -> i64 {
                    $crate::__private::call_function(ptr, len, $f)
                }

                #[unsafe(export_name = concat!("csd_signature_", stringify!($name)))]
                pub extern "C" fn signature() -> i64 {
                    $crate::__private::static_text($sig)
                }
            };
        )+
    };
}

/// Exports `$t` (an [`Operator`]) as this module's operator: the ABI's
/// `csd_abi_version`, `csd_kind`, `csd_alloc`, `csd_init`, `csd_batch` and
/// `csd_finish`.
#[macro_export]
macro_rules! export_operator {
    ($t:ty) => {
        thread_local! {
            static __CSD_OP: ::std::cell::RefCell<Option<$t>> = const { ::std::cell::RefCell::new(None) };
        }

        #[unsafe(no_mangle)]
        pub extern "C" fn csd_abi_version() -> i32 {
            $crate::ABI_VERSION
        }

        #[unsafe(no_mangle)]
        pub extern "C" fn csd_kind() -> i32 {
            i32::from(<$t as $crate::Operator>::AGGREGATE)
        }

        #[unsafe(no_mangle)]
        pub extern "C" fn csd_alloc(len: i32) -> i32 {
            $crate::__private::alloc(len)
        }

        #[unsafe(no_mangle)]
        pub extern "C" fn csd_init(ptr: i32, len: i32) -> i64 {
            // SAFETY: the host wrote `len` bytes into memory from `csd_alloc(len)`.
            let bytes = unsafe { $crate::__private::take(ptr, len) };
            let made = $crate::__private::decode_args(&bytes)
                .and_then(|a| <$t as $crate::Operator>::new(&a));
            match made {
                Ok(op) => {
                    __CSD_OP.with(|o| *o.borrow_mut() = Some(op));
                    0
                }
                Err(e) => $crate::__private::fail(&e),
            }
        }

        #[unsafe(no_mangle)]
        pub extern "C" fn csd_batch(ptr: i32, len: i32) -> i64 {
            // SAFETY: as in csd_init.
            let bytes = unsafe { $crate::__private::take(ptr, len) };
            let out = $crate::__private::decode_batch(bytes).and_then(|b| {
                __CSD_OP.with(|o| match o.borrow_mut().as_mut() {
                    Some(op) => <$t as $crate::Operator>::batch(op, b),
                    None => Err("csd_batch before csd_init".to_string()),
                })
            });
            $crate::__private::output(out)
        }

        #[unsafe(no_mangle)]
        pub extern "C" fn csd_finish() -> i64 {
            let out = __CSD_OP.with(|o| match o.borrow_mut().as_mut() {
                Some(op) => <$t as $crate::Operator>::finish(op),
                None => Err("csd_finish before csd_init".to_string()),
            });
            $crate::__private::output(out)
        }
    };
}
