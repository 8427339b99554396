//! One running guest: its store, limits, host functions and the ABI's calls.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use arrow::array::ArrayRef;
use arrow::record_batch::RecordBatch;
use wasmtime::{
    Caller, Engine, Extern, Linker, Memory, ResourceLimiter, Store, Trap, TypedFunc, UpdateDeadline,
};

use super::{CompiledModule, MAX_HOST_READ, ModuleDigest, Sandbox};
use crate::memory::MemoryLedger;
use csd_protocol::{Error, Result};

/// Where a guest's host `read`s go: the objects of the tables its tenant may read.
pub trait GuestReader: Send + Sync {
    /// Up to `len` bytes of `object` from `offset` (fewer only at its end), checked
    /// against the tenant's permissions and the object's checksums.
    fn read(&self, object: &str, offset: u64, len: usize) -> Result<Vec<u8>>;
}

/// What a guest's outputs are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestKind {
    /// Rows: the outputs of all partitions are united.
    Rows,
    /// A partial aggregate: the compute side merges the outputs by running the
    /// module again with `csd.phase=merge`.
    Aggregate,
}

/// Memory a guest may grow, taken from the node's ledger as it grows.
struct Limiter {
    ledger: Arc<MemoryLedger>,
    live: Arc<std::sync::atomic::AtomicU64>,
    max: u64,
    held: u64,
    refused: Option<u64>,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let (current, desired) = (current as u64, desired as u64);
        let more = desired.saturating_sub(current);
        if desired > self.max || !self.ledger.try_take(more) {
            self.refused = Some(desired);
            return Ok(false);
        }
        self.held += more;
        self.live.fetch_add(more, Ordering::Relaxed);
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 1 << 20)
    }
}

impl Drop for Limiter {
    fn drop(&mut self) {
        self.ledger.give_back(self.held);
        self.live.fetch_sub(self.held, Ordering::Relaxed);
    }
}

/// A store's data.
pub(crate) struct GuestState {
    limits: Limiter,
    /// Set by the request's owner when nobody waits for the answer any more.
    cancel: Arc<std::sync::atomic::AtomicBool>,
    /// When the current call's CPU time runs out.
    deadline: Instant,
    failure: Option<String>,
    host_error: Option<Error>,
    reader: Option<Arc<dyn GuestReader>>,
}

/// `len` bytes of the caller's memory at `ptr`, copied; `None` if outside it.
fn guest_bytes(c: &mut Caller<'_, GuestState>, ptr: i32, len: i32) -> Option<Vec<u8>> {
    let mem = c.get_export("memory").and_then(Extern::into_memory)?;
    let (ptr, len) = (ptr as u32 as usize, usize::try_from(len).ok()?);
    mem.data(&c)
        .get(ptr..ptr.checked_add(len)?)
        .map(<[u8]>::to_vec)
}

/// Ends the guest's call with `e` as the request's error.
fn host_failure(c: &mut Caller<'_, GuestState>, e: Error) -> wasmtime::Error {
    let msg = e.to_string();
    c.data_mut().host_error = Some(e);
    wasmtime::format_err!("{msg}")
}

/// The host functions every guest may import (module `csd`).
pub(super) fn linker(engine: &Engine) -> Result<Linker<GuestState>> {
    let mut l = Linker::new(engine);
    l.func_wrap(
        "csd",
        "fail",
        |mut c: Caller<'_, GuestState>, ptr: i32, len: i32| {
            let msg = match guest_bytes(&mut c, ptr, len.clamp(0, 4096)) {
                Some(b) => String::from_utf8_lossy(&b).into_owned(),
                None => "(its message lies outside its memory)".to_string(),
            };
            c.data_mut().failure = Some(msg);
        },
    )
    .map_err(|e| Error::Internal(format!("linking csd::fail: {e:#}")))?;
    l.func_wrap(
        "csd",
        "read",
        |mut c: Caller<'_, GuestState>,
         obj: i32,
         obj_len: i32,
         offset: i64,
         dst: i32,
         len: i32|
         -> wasmtime::Result<i32> {
            let Some(name) = guest_bytes(&mut c, obj, obj_len.clamp(0, 1024)) else {
                return Err(host_failure(
                    &mut c,
                    Error::InvalidArgument(
                        "a wasm module passed read an object name outside its memory".into(),
                    ),
                ));
            };
            let name = String::from_utf8_lossy(&name).into_owned();
            let (Ok(offset), Ok(len)) = (u64::try_from(offset), usize::try_from(len)) else {
                return Err(host_failure(
                    &mut c,
                    Error::InvalidArgument(format!(
                        "a wasm module asked to read {len} bytes of {name} at {offset}"
                    )),
                ));
            };
            let Some(reader) = c.data().reader.clone() else {
                return Err(host_failure(
                    &mut c,
                    Error::Unimplemented("host reads are not available to this module".into()),
                ));
            };
            let bytes = match reader.read(&name, offset, len.min(MAX_HOST_READ)) {
                Ok(b) => b,
                Err(e) => return Err(host_failure(&mut c, e)),
            };
            let Some(mem) = c.get_export("memory").and_then(Extern::into_memory) else {
                return Err(host_failure(
                    &mut c,
                    Error::InvalidArgument("a wasm module exports no memory".into()),
                ));
            };
            if mem.write(&mut c, dst as u32 as usize, &bytes).is_err() {
                return Err(host_failure(
                    &mut c,
                    Error::InvalidArgument(format!(
                        "a wasm module asked read to write {} bytes at {:#x}, outside its memory",
                        bytes.len(),
                        dst as u32
                    )),
                ));
            }
            Ok(bytes.len() as i32)
        },
    )
    .map_err(|e| Error::Internal(format!("linking csd::read: {e:#}")))?;
    Ok(l)
}

/// A running guest: an operator (one per request and partition), or the SQL
/// functions of a module (a few per fragment, reused batch after batch).
pub struct GuestInstance {
    sandbox: Arc<Sandbox>,
    digest: ModuleDigest,
    store: Store<GuestState>,
    instance: wasmtime::Instance,
    memory: Memory,
    alloc: TypedFunc<i32, i32>,
    /// `csd_batch` and `csd_finish` (operators only).
    operator: Option<OperatorCalls>,
    functions: BTreeMap<String, TypedFunc<(i32, i32), i64>>,
    kind: GuestKind,
    cpu_used: Duration,
}

/// An operator's `csd_batch` and `csd_finish`.
type OperatorCalls = (TypedFunc<(i32, i32), i64>, TypedFunc<(), i64>);

/// Most bytes of a function's signature text.
const MAX_SIGNATURE: usize = 4096;

impl std::fmt::Debug for GuestInstance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GuestInstance({:?})", self.digest)
    }
}

impl GuestInstance {
    /// An instance of `module` set up as an operator (`args` given: `csd_init`
    /// runs) or for its SQL functions (`None`: only the common exports are needed).
    pub(super) fn new(
        sandbox: Arc<Sandbox>,
        module: &Arc<CompiledModule>,
        args: Option<&BTreeMap<String, String>>,
        reader: Option<Arc<dyn GuestReader>>,
        cancel: Arc<std::sync::atomic::AtomicBool>,
    ) -> Result<Self> {
        let limits = sandbox.limits;
        let state = GuestState {
            limits: Limiter {
                ledger: sandbox.memory.clone(),
                live: sandbox.memory_held.clone(),
                max: limits.memory,
                held: 0,
                refused: None,
            },
            cancel,
            deadline: Instant::now() + limits.cpu_time,
            failure: None,
            host_error: None,
            reader,
        };
        let mut store = Store::new(&sandbox.engine, state);
        store.limiter(|s| &mut s.limits);
        // Checked every tick: the call's CPU time, and whether anyone still waits.
        store.epoch_deadline_callback(|ctx| {
            let s = ctx.data();
            if s.cancel.load(Ordering::Relaxed) || Instant::now() >= s.deadline {
                Ok(UpdateDeadline::Interrupt)
            } else {
                Ok(UpdateDeadline::Continue(1))
            }
        });
        store.set_epoch_deadline(1);
        let digest = module.digest;
        let started = Instant::now();
        let instance = module
            .pre
            .instantiate(&mut store)
            .map_err(|e| classify(&sandbox, &mut store, digest, "instantiation", e))?;
        let who = |what: &str| {
            Error::InvalidArgument(format!(
                "wasm module {digest:?} is not a csd guest (ABI 1): it does not export {what}"
            ))
        };
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or_else(|| who("its memory"))?;
        let version = instance
            .get_typed_func::<(), i32>(&mut store, "csd_abi_version")
            .map_err(|_| who("csd_abi_version: () -> i32"))?;
        let alloc = instance
            .get_typed_func::<i32, i32>(&mut store, "csd_alloc")
            .map_err(|_| who("csd_alloc: (i32) -> i32"))?;
        let mut me = GuestInstance {
            sandbox,
            digest,
            store,
            instance,
            memory,
            alloc,
            operator: None,
            functions: BTreeMap::new(),
            kind: GuestKind::Rows,
            cpu_used: started.elapsed(),
        };
        let v = me.call(&version, "csd_abi_version", ())?;
        if v != 1 {
            return Err(Error::InvalidArgument(format!(
                "wasm module {digest:?} speaks guest ABI {v}; this node speaks 1"
            )));
        }
        let Some(args) = args else {
            return Ok(me);
        };
        let (inst, store) = (me.instance, &mut me.store);
        let kind = inst
            .get_typed_func::<(), i32>(&mut *store, "csd_kind")
            .map_err(|_| who("csd_kind: () -> i32"))?;
        let init = inst
            .get_typed_func::<(i32, i32), i64>(&mut *store, "csd_init")
            .map_err(|_| who("csd_init: (i32, i32) -> i64"))?;
        let batch = inst
            .get_typed_func::<(i32, i32), i64>(&mut *store, "csd_batch")
            .map_err(|_| who("csd_batch: (i32, i32) -> i64"))?;
        let finish = inst
            .get_typed_func::<(), i64>(&mut *store, "csd_finish")
            .map_err(|_| who("csd_finish: () -> i64"))?;
        me.operator = Some((batch, finish));
        me.kind = match me.call(&kind, "csd_kind", ())? {
            0 => GuestKind::Rows,
            1 => GuestKind::Aggregate,
            k => {
                return Err(Error::InvalidArgument(format!(
                    "wasm module {digest:?} says its kind is {k}; the ABI knows 0 (rows) and 1 (aggregate)"
                )));
            }
        };
        let (ptr, len) = me.write_input(&encode_args(args), "csd_init")?;
        let r = me.call(&init, "csd_init", (ptr, len))?;
        if r != 0 {
            me.output(r, "csd_init")?;
        }
        Ok(me)
    }

    /// What its outputs are.
    pub fn kind(&self) -> GuestKind {
        self.kind
    }

    /// Time spent in the guest so far.
    pub fn cpu_used(&self) -> Duration {
        self.cpu_used
    }

    fn operator(&self) -> Result<OperatorCalls> {
        self.operator.clone().ok_or_else(|| {
            Error::Internal("a wasm instance made for functions was run as an operator".into())
        })
    }

    /// Runs the guest over one input batch.
    pub fn batch(&mut self, batch: &RecordBatch) -> Result<Vec<RecordBatch>> {
        let (f, _) = self.operator()?;
        let bytes = encode_batch(batch)?;
        let (ptr, len) = self.write_input(&bytes, "csd_batch")?;
        let r = self.call(&f, "csd_batch", (ptr, len))?;
        self.output(r, "csd_batch")
    }

    /// Ends the input; returns the guest's last outputs.
    pub fn finish(&mut self) -> Result<Vec<RecordBatch>> {
        let (_, f) = self.operator()?;
        let r = self.call(&f, "csd_finish", ())?;
        self.output(r, "csd_finish")
    }

    /// The signature of the module's SQL function `export`, as its
    /// `csd_signature_<export>` export returns it (`ARG_TYPE, … -> RETURN_TYPE`, Arrow
    /// type names).
    pub fn signature(&mut self, export: &str) -> Result<String> {
        let name = format!("csd_signature_{export}");
        let f = self
            .instance
            .get_typed_func::<(), i64>(&mut self.store, &name)
            .map_err(|_| {
                Error::InvalidArgument(format!(
                    "wasm module {:?} has no SQL function {export:?}: it does not export {name}: () -> i64",
                    self.digest
                ))
            })?;
        let r = self.call(&f, &name, ())?;
        let bytes = self.returned(r, &name)?.to_vec();
        if bytes.len() > MAX_SIGNATURE {
            return Err(self.abi_violation(format!(
                "{name} returned {} bytes; a signature has at most {MAX_SIGNATURE}",
                bytes.len()
            )));
        }
        String::from_utf8(bytes)
            .map_err(|_| self.abi_violation(format!("{name} returned text that is not UTF-8")))
    }

    /// Calls the module's SQL function `export` on `args` (one column per argument):
    /// its result column, as many rows as `args`. The function is
    /// `(ptr: i32, len: i32) -> i64` over an Arrow IPC stream of that one batch and
    /// returns an Arrow IPC stream of one batch of one column.
    pub fn call_function(&mut self, export: &str, args: &RecordBatch) -> Result<ArrayRef> {
        let f = match self.functions.get(export) {
            Some(f) => f.clone(),
            None => {
                let f = self
                    .instance
                    .get_typed_func::<(i32, i32), i64>(&mut self.store, export)
                    .map_err(|_| {
                        Error::InvalidArgument(format!(
                            "wasm module {:?} does not export the SQL function {export}: (i32, i32) -> i64",
                            self.digest
                        ))
                    })?;
                self.functions.insert(export.to_string(), f.clone());
                f
            }
        };
        let bytes = encode_batch(args)?;
        let (ptr, len) = self.write_input(&bytes, export)?;
        let r = self.call(&f, export, (ptr, len))?;
        let out = self.output(r, export)?;
        let [batch] = out.as_slice() else {
            return Err(self.abi_violation(format!(
                "{export} returned {} batches; a SQL function returns one",
                out.len()
            )));
        };
        if batch.num_columns() != 1 || batch.num_rows() != args.num_rows() {
            return Err(self.abi_violation(format!(
                "{export} returned {} columns of {} rows for {} rows; a SQL function returns one column, a value per row",
                batch.num_columns(),
                batch.num_rows(),
                args.num_rows()
            )));
        }
        Ok(batch.column(0).clone())
    }

    fn call<P, R>(&mut self, f: &TypedFunc<P, R>, name: &str, params: P) -> Result<R>
    where
        P: wasmtime::WasmParams,
        R: wasmtime::WasmResults,
    {
        let limit = self.sandbox.limits.cpu_time;
        let left = limit.saturating_sub(self.cpu_used);
        if left.is_zero() {
            return Err(self.deadline(name));
        }
        let started = Instant::now();
        self.store.data_mut().deadline = started + left;
        self.store.set_epoch_deadline(1);
        let r = f.call(&mut self.store, params);
        self.cpu_used += started.elapsed();
        r.map_err(|e| classify(&self.sandbox, &mut self.store, self.digest, name, e))
    }

    fn deadline(&self, name: &str) -> Error {
        self.sandbox
            .counters
            .deadline_exceeded
            .fetch_add(1, Ordering::Relaxed);
        Error::DeadlineExceeded(format!(
            "wasm module {:?} used up its CPU-time limit of {:?} in {name}",
            self.digest, self.sandbox.limits.cpu_time
        ))
    }

    fn abi_violation(&self, msg: String) -> Error {
        self.sandbox.counters.traps.fetch_add(1, Ordering::Relaxed);
        Error::InvalidArgument(format!(
            "wasm module {:?} broke the guest ABI: {msg}",
            self.digest
        ))
    }

    /// Copies `bytes` into memory the guest allocates for them.
    fn write_input(&mut self, bytes: &[u8], func: &str) -> Result<(i32, i32)> {
        let len = i32::try_from(bytes.len()).map_err(|_| {
            Error::InvalidArgument(format!(
                "an input of {} bytes is too large for a wasm module",
                bytes.len()
            ))
        })?;
        let alloc = self.alloc.clone();
        let ptr = self.call(&alloc, "csd_alloc", len)?;
        if self
            .memory
            .write(&mut self.store, ptr as u32 as usize, bytes)
            .is_err()
        {
            return Err(self.abi_violation(format!(
                "csd_alloc({len}) for {func} returned {:#x}, outside its memory",
                ptr as u32
            )));
        }
        Ok((ptr, len))
    }

    /// Decodes a call's result: a failure, or Arrow IPC in the guest's memory.
    fn output(&mut self, r: i64, func: &str) -> Result<Vec<RecordBatch>> {
        let decoded = match self.returned(r, func)? {
            [] => return Ok(Vec::new()),
            bytes => decode_output(bytes),
        };
        decoded.map_err(|e| {
            self.abi_violation(format!(
                "{func} returned bytes that are not an Arrow IPC stream: {e}"
            ))
        })
    }

    /// The bytes a call returned: a failure, or `(ptr << 32) | len` in its memory.
    fn returned(&mut self, r: i64, func: &str) -> Result<&[u8]> {
        if r == -1 {
            if let Some(e) = self.refused(func) {
                return Err(e);
            }
            let msg = self
                .store
                .data_mut()
                .failure
                .take()
                .unwrap_or_else(|| "(no message)".into());
            return Err(Error::InvalidArgument(format!(
                "wasm module {:?} failed in {func}: {msg}",
                self.digest
            )));
        }
        if r < 0 {
            return Err(self.abi_violation(format!("{func} returned {r}")));
        }
        let (ptr, len) = ((r >> 32) as u32 as usize, (r & 0xffff_ffff) as usize);
        if len == 0 {
            return Ok(&[]);
        }
        let size = self.memory.data_size(&self.store);
        if ptr.checked_add(len).is_none_or(|end| end > size) {
            return Err(self.abi_violation(format!(
                "{func} returned {len} bytes at {ptr:#x}, outside its {size} bytes of memory"
            )));
        }
        Ok(&self.memory.data(&self.store)[ptr..ptr + len])
    }

    fn refused(&mut self, func: &str) -> Option<Error> {
        refused(&self.sandbox, &mut self.store, self.digest, func)
    }
}

fn refused(
    sandbox: &Sandbox,
    store: &mut Store<GuestState>,
    digest: ModuleDigest,
    func: &str,
) -> Option<Error> {
    let limits = &mut store.data_mut().limits;
    let desired = limits.refused.take()?;
    sandbox
        .counters
        .memory_refused
        .fetch_add(1, Ordering::Relaxed);
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    let reason = format!(
        "wasm module {digest:?} asked for {:.1} MiB of memory in {func}; it may have {:.1} MiB (--wasm-memory) and the node's memory budget had {:.1} MiB free",
        mib(desired),
        mib(limits.max),
        mib(limits
            .ledger
            .operator_limit()
            .saturating_sub(limits.ledger.pooled())),
    );
    Some(if desired > limits.max {
        // More than any instance may have: asking again will not help.
        Error::ResourcesExhausted(reason)
    } else {
        // The node's budget was in use: it may have room later.
        Error::Busy {
            reason,
            retry_after: std::time::Duration::from_secs(1),
        }
    })
}

/// The request's error for a failed call.
fn classify(
    sandbox: &Sandbox,
    store: &mut Store<GuestState>,
    digest: ModuleDigest,
    func: &str,
    e: wasmtime::Error,
) -> Error {
    if let Some(h) = store.data_mut().host_error.take() {
        return h;
    }
    if let Some(r) = refused(sandbox, store, digest, func) {
        return r;
    }
    let c = &sandbox.counters;
    if e.downcast_ref::<wasmtime::PoolConcurrencyLimitError>()
        .is_some()
    {
        return Error::Busy {
            reason: format!(
                "no Wasm instance slot free for module {digest:?} ({func}): all {} are in use (--wasm-pool)",
                sandbox.limits.pool
            ),
            retry_after: std::time::Duration::from_millis(200),
        };
    }
    match e.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) if store.data().cancel.load(Ordering::Relaxed) => Error::Cancelled(
            format!("wasm module {digest:?} stopped in {func}: nobody waits for its answer"),
        ),
        Some(Trap::Interrupt) => {
            c.deadline_exceeded.fetch_add(1, Ordering::Relaxed);
            Error::DeadlineExceeded(format!(
                "wasm module {digest:?} ran past its CPU-time limit of {:?} in {func}",
                sandbox.limits.cpu_time
            ))
        }
        Some(Trap::StackOverflow) => {
            c.traps.fetch_add(1, Ordering::Relaxed);
            Error::InvalidArgument(format!(
                "wasm module {digest:?} trapped in {func}: call stack exhausted (its stack limit is {} KiB)",
                sandbox.limits.stack >> 10
            ))
        }
        Some(t) => {
            c.traps.fetch_add(1, Ordering::Relaxed);
            Error::InvalidArgument(format!("wasm module {digest:?} trapped in {func}: {t}"))
        }
        None => {
            c.traps.fetch_add(1, Ordering::Relaxed);
            Error::InvalidArgument(format!("wasm module {digest:?} failed in {func}: {e:#}"))
        }
    }
}

/// The ABI's argument encoding.
pub(crate) fn encode_args(args: &BTreeMap<String, String>) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(args.len() as u32).to_le_bytes());
    for (k, v) in args {
        for s in [k, v] {
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
    }
    out
}

fn encode_batch(batch: &RecordBatch) -> Result<Vec<u8>> {
    let mut w = arrow::ipc::writer::StreamWriter::try_new(Vec::new(), &batch.schema())?;
    w.write(batch)?;
    w.finish()?;
    Ok(w.into_inner()?)
}

fn decode_output(bytes: &[u8]) -> std::result::Result<Vec<RecordBatch>, arrow::error::ArrowError> {
    arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(bytes), None)?.collect()
}
