//! Shipped code: WebAssembly modules a tenant sends run here, sandboxed — at a
//! node (`csd-runtime`) or at the compute tier (`csd-query-pushdown`'s `wasm`
//! feature), which is why this crate holds no part of the node: a module store is
//! whatever implements [`DeviceModules`] (the node's object store does).
//!
//! A [`Sandbox`] holds one wasmtime [`Engine`] (Cranelift; epoch interruption on;
//! no WASI: a guest reaches nothing but the two host functions below), a bounded
//! cache of compiled modules keyed by the SHA-256 of their bytes ([`ModuleDigest`])
//! and the engine's configuration, and — at a node — the device, where compiled
//! modules are kept (`.csd/wasm/…`) so that a restart does not compile again.
//! Nothing is deployed ahead: a request names its module by digest, and a node that
//! lacks it says so ([`Error::ModuleMissing`]: `NOT_FOUND` with the digest in the
//! status's metadata); the client then sends the bytes once.
//!
//! Every instance runs under [`SandboxLimits`]: CPU time (epoch deadlines, checked
//! every [`EPOCH_TICK`]; past it the call ends with `DEADLINE_EXCEEDED`), memory (a
//! [`ResourceLimiter`] that takes every page the guest grows from the node's
//! [`MemoryLedger`], the same budget `--memory` gives operators' pools; a refusal ends
//! the call with `RESOURCE_EXHAUSTED` and the pages come back when the instance
//! drops), wasm stack, module size. A trap or an ABI violation ends the request with
//! `INVALID_ARGUMENT` naming the module and the function; the node goes on serving.
//!
//! # The guest ABI, version 1
//!
//! A guest module exports its `memory` and:
//!
//! | export | signature | |
//! |---|---|---|
//! | `csd_abi_version` | `() -> i32` | must return 1 |
//! | `csd_kind` | `() -> i32` | 0: rows (outputs are united); 1: aggregate (the compute side merges the partial outputs by running the module again with `csd.phase=merge`) |
//! | `csd_alloc` | `(len: i32) -> i32` | memory for the host to write `len` bytes into; the callee it is passed to owns it |
//! | `csd_init` | `(ptr: i32, len: i32) -> i64` | the arguments: u32 count, then (u32 length, UTF-8 bytes) key and value pairs, little-endian; `csd.phase` is `map` or `merge` |
//! | `csd_batch` | `(ptr: i32, len: i32) -> i64` | one input batch as an Arrow IPC stream (schema, one batch, end) |
//! | `csd_finish` | `() -> i64` | after the last batch |
//!
//! The `i64` results: `-1` is a failure whose message the guest passed to `fail`
//! before returning; otherwise `(ptr << 32) | len` of an Arrow IPC stream of output
//! batches in the guest's memory (length 0: no output), read before the next call.
//!
//! Host imports (module `csd`): `fail(ptr: i32, len: i32)` records the message of a
//! failure; `read(object_ptr: i32, object_len: i32, offset: i64, dst: i32, len: i32) ->
//! i32` reads up to `len` bytes (at most [`MAX_HOST_READ`]) of an object of a table the
//! tenant may read into `dst` and returns how many (fewer only at its end); the node
//! checks the permission and verifies checksums; a refused or failed read ends the
//! request with the node's error.
//!
//! ## SQL functions
//!
//! A module may also export scalar SQL functions (the compute tier registers one
//! with `csd sql --wasm-fn NAME=FILE.wasm:EXPORT` and pushes calls to it inside
//! fragments). It then needs `memory`, `csd_abi_version` and `csd_alloc` as above,
//! and for each function:
//!
//! | export | signature | |
//! |---|---|---|
//! | `EXPORT` | `(ptr: i32, len: i32) -> i64` | an Arrow IPC stream of one batch, a column per argument in order; returns as above an Arrow IPC stream of one batch of one column with one value per input row |
//! | `csd_signature_EXPORT` | `() -> i64` | `(ptr << 32) \| len` of UTF-8 text `ARG, … -> RET` in Arrow's type names (`Float64, Utf8 -> Int64`) |
//!
//! A function must give the same output for the same input (it runs at the node or
//! at the compute side, in as many instances as a fragment has streams).
//!
//! The Rust SDK (`csd-runtime/guest/sdk`, crate `csd-guest`) implements this ABI
//! behind a trait over `RecordBatch`; any language that compiles to
//! `wasm32-unknown-unknown` can implement it.

#![warn(unreachable_pub)]

mod cache;
mod instance;
pub mod memory;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, Linker, OptLevel, PoolingAllocationConfig,
};

use csd_protocol::{Error, Result};

use crate::memory::MemoryLedger;
pub use csd_protocol::digest::ModuleDigest;
pub use csd_protocol::stats::SandboxStats;

pub use cache::{CompiledModule, DeviceModules, ModuleStore};
pub use instance::{GuestInstance, GuestKind, GuestReader};

/// How often the engine's epoch advances: the resolution of CPU-time limits.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Most bytes one host `read` returns.
pub const MAX_HOST_READ: usize = 16 << 20;
/// Objects on the device that hold compiled modules (and their bytes).
pub const MODULE_PREFIX: &str = ".csd/wasm/";

/// The limits every instance runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxLimits {
    /// CPU time one request's guest calls may take in all.
    pub cpu_time: Duration,
    /// Linear memory one instance may grow to (and never more than the node's
    /// memory budget has free).
    pub memory: u64,
    /// Wasm stack of a call, in bytes.
    pub stack: usize,
    /// Largest module accepted, in bytes.
    pub max_module_bytes: usize,
    /// Compiled modules kept in memory.
    pub cached_modules: usize,
    /// Instances in wasmtime's pooling allocator (0: allocated on demand).
    #[serde(default)]
    pub pool: u32,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        SandboxLimits {
            cpu_time: Duration::from_secs(30),
            memory: 256 << 20,
            stack: 512 << 10,
            max_module_bytes: 32 << 20,
            cached_modules: 64,
            pool: 0,
        }
    }
}

/// The sandbox's counters.
#[derive(Debug, Default)]
struct Counters {
    compiled: AtomicU64,
    compile_us: AtomicU64,
    loaded_from_device: AtomicU64,
    cache_hits: AtomicU64,
    instances: AtomicU64,
    deadline_exceeded: AtomicU64,
    memory_refused: AtomicU64,
    traps: AtomicU64,
}

/// Advances an engine's epoch every [`EPOCH_TICK`] until dropped.
struct EpochTicker {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EpochTicker {
    fn start(engine: Engine) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("csd-wasm-epoch".into())
            .spawn({
                let stop = stop.clone();
                move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(EPOCH_TICK);
                        engine.increment_epoch();
                    }
                }
            })
            .map_err(|e| Error::io("starting the wasm epoch thread", e))?;
        Ok(EpochTicker {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The engine, its module cache and its limits.
pub struct Sandbox {
    engine: Engine,
    linker: Linker<instance::GuestState>,
    limits: SandboxLimits,
    memory: Arc<MemoryLedger>,
    cache: cache::ModuleCache,
    counters: Counters,
    memory_held: Arc<AtomicU64>,
    /// One compile at a time: two requests for a new module compile it once.
    compiling: tokio::sync::Mutex<()>,
    _ticker: EpochTicker,
}

impl fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sandbox")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// Maps a wasmtime error met while setting up (not running) a module.
fn setup_error(what: impl fmt::Display, e: wasmtime::Error) -> Error {
    Error::Internal(format!("{what}: {e:#}"))
}

impl Sandbox {
    /// A sandbox whose instances draw memory from `memory`, keeping compiled modules
    /// in `store` too when given (see [`ModuleStore`]).
    pub fn new(
        limits: SandboxLimits,
        memory: Arc<MemoryLedger>,
        store: Option<ModuleStore>,
    ) -> Result<Self> {
        let mut config = Config::new();
        config
            .epoch_interruption(true)
            .max_wasm_stack(limits.stack.max(64 << 10))
            .cranelift_opt_level(OptLevel::Speed);
        // `perf` names guest functions when CSD_WASM_PERFMAP is set (writes
        // /tmp/perf-PID.map); it does not change the compiled code.
        if std::env::var_os("CSD_WASM_PERFMAP").is_some() {
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        if limits.pool > 0 {
            let mut pool = PoolingAllocationConfig::new();
            pool.total_core_instances(limits.pool)
                .total_memories(limits.pool)
                .total_tables(limits.pool)
                .max_memory_size(usize::try_from(limits.memory).unwrap_or(usize::MAX));
            config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        }
        let engine = Engine::new(&config).map_err(|e| setup_error("starting wasmtime", e))?;
        let linker = instance::linker(&engine)?;
        let cache = cache::ModuleCache::new(&engine, limits.cached_modules, store);
        Ok(Sandbox {
            _ticker: EpochTicker::start(engine.clone())?,
            engine,
            linker,
            limits,
            memory,
            cache,
            counters: Counters::default(),
            memory_held: Arc::new(AtomicU64::new(0)),
            compiling: tokio::sync::Mutex::new(()),
        })
    }

    /// The limits instances run under.
    pub fn limits(&self) -> SandboxLimits {
        self.limits
    }

    /// Whether the module is here (compiled in memory or kept on the device).
    pub fn has(&self, digest: &ModuleDigest) -> bool {
        self.cache.has(digest)
    }

    /// The compiled module `digest`: from memory, else from the device, else
    /// compiled from `bytes` (which must hash to `digest`); [`Error::ModuleMissing`]
    /// when none of these has it.
    pub async fn module(
        &self,
        digest: &ModuleDigest,
        bytes: Option<&[u8]>,
    ) -> Result<Arc<CompiledModule>> {
        if let Some(m) = self.cache.get(digest) {
            self.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(m);
        }
        let _one = self.compiling.lock().await;
        if let Some(m) = self.cache.get(digest) {
            self.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(m);
        }
        if let Some(bytes) = bytes {
            let got = ModuleDigest::of(bytes);
            if got != *digest {
                return Err(Error::InvalidArgument(format!(
                    "the module's bytes hash to {got}, not to the {digest} the request names"
                )));
            }
        }
        if let Some((m, compiled)) = self.cache.load(&self.linker, digest).await? {
            let c = &self.counters;
            match compiled {
                Some(t) => {
                    c.compiled.fetch_add(1, Ordering::Relaxed);
                    c.compile_us
                        .fetch_add(t.as_micros() as u64, Ordering::Relaxed);
                }
                None => {
                    c.loaded_from_device.fetch_add(1, Ordering::Relaxed);
                }
            }
            return Ok(m);
        }
        match bytes {
            Some(b) => self.compile_locked(b, *digest).await,
            None => Err(Error::ModuleMissing(*digest)),
        }
    }

    /// Compiles `bytes` (checking size and shape), caches it and keeps it on the
    /// device; a module already here is not compiled again.
    pub async fn compile(&self, bytes: &[u8]) -> Result<Arc<CompiledModule>> {
        self.module(&ModuleDigest::of(bytes), Some(bytes)).await
    }

    /// Compiles, caches and keeps `bytes` (the caller holds `compiling`).
    async fn compile_locked(
        &self,
        bytes: &[u8],
        digest: ModuleDigest,
    ) -> Result<Arc<CompiledModule>> {
        if bytes.len() > self.limits.max_module_bytes {
            return Err(Error::ResourcesExhausted(format!(
                "the module is {} bytes; this node takes modules of at most {} bytes (--wasm-max-module)",
                bytes.len(),
                self.limits.max_module_bytes
            )));
        }
        let started = std::time::Instant::now();
        let m = cache::compile(&self.engine, &self.linker, digest, bytes)?;
        self.counters.compiled.fetch_add(1, Ordering::Relaxed);
        self.counters
            .compile_us
            .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.cache.insert(m.clone());
        self.cache.persist(&m, bytes).await?;
        Ok(m)
    }

    /// A new instance of `module`, initialized with `args` (the request's arguments
    /// plus `csd.phase`), whose host reads go to `reader`; its calls stop (within an
    /// [`EPOCH_TICK`]) once `cancel` is set.
    pub fn instantiate(
        self: &Arc<Self>,
        module: &Arc<CompiledModule>,
        args: &BTreeMap<String, String>,
        reader: Option<Arc<dyn GuestReader>>,
        cancel: Arc<AtomicBool>,
    ) -> Result<GuestInstance> {
        self.counters.instances.fetch_add(1, Ordering::Relaxed);
        GuestInstance::new(self.clone(), module, Some(args), reader, cancel)
    }

    /// A new instance of `module` for calling its SQL functions
    /// ([`GuestInstance::call_function`]); no host reads. Its calls stop once
    /// `cancel` is set.
    pub fn instantiate_functions(
        self: &Arc<Self>,
        module: &Arc<CompiledModule>,
        cancel: Arc<AtomicBool>,
    ) -> Result<GuestInstance> {
        self.counters.instances.fetch_add(1, Ordering::Relaxed);
        GuestInstance::new(self.clone(), module, None, None, cancel)
    }

    /// The sandbox's figures now.
    pub fn stats(&self) -> SandboxStats {
        let c = &self.counters;
        SandboxStats {
            compiled: c.compiled.load(Ordering::Relaxed),
            compile_ms: c.compile_us.load(Ordering::Relaxed) as f64 / 1e3,
            loaded_from_device: c.loaded_from_device.load(Ordering::Relaxed),
            cache_hits: c.cache_hits.load(Ordering::Relaxed),
            cached: self.cache.len(),
            instances: c.instances.load(Ordering::Relaxed),
            deadline_exceeded: c.deadline_exceeded.load(Ordering::Relaxed),
            memory_refused: c.memory_refused.load(Ordering::Relaxed),
            traps: c.traps.load(Ordering::Relaxed),
            memory_held: self.memory_held.load(Ordering::Relaxed),
        }
    }
}

/// Sets its flag when dropped: held by whoever still waits for an answer, so that
/// a guest running on its thread stops (within an [`EPOCH_TICK`]) once nobody does.
pub struct CancelOnDrop(pub Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_module_is_named_in_its_status() {
        let d = ModuleDigest::of(b"module");
        let status = Error::ModuleMissing(d).to_status();
        assert_eq!(status.code(), tonic::Code::NotFound);
        let back = Error::from_status("asking", status);
        assert!(
            matches!(back, Error::ModuleMissing(x) if x == d),
            "{back:?}"
        );
        let other = Error::from_status("asking", Error::NotFound("table x".into()).to_status());
        assert!(!matches!(other, Error::ModuleMissing(_)), "{other:?}");
    }

    /// The smallest valid module: `(module)`.
    const EMPTY_MODULE: &[u8] = b"\0asm\x01\0\0\0";

    fn dir_sandbox(dir: &std::path::Path) -> Arc<Sandbox> {
        Arc::new(
            Sandbox::new(
                SandboxLimits::default(),
                MemoryLedger::new(1 << 30),
                Some(ModuleStore::Dir(dir.to_path_buf())),
            )
            .unwrap(),
        )
    }

    #[tokio::test]
    async fn a_cache_directory_spares_a_compile_and_survives_damage() {
        let dir = tempfile::tempdir().unwrap();
        let digest = ModuleDigest::of(EMPTY_MODULE);
        let first = dir_sandbox(dir.path());
        first.compile(EMPTY_MODULE).await.unwrap();
        assert_eq!(first.stats().compiled, 1);

        // Another process: loaded, not compiled.
        let second = dir_sandbox(dir.path());
        second.module(&digest, None).await.unwrap();
        let st = second.stats();
        assert_eq!((st.compiled, st.loaded_from_device), (0, 1), "{st:?}");

        // Every byte of the compiled file flipped in turn: compiled again from the
        // module's bytes, never loaded damaged.
        let cwasm = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|x| x == "cwasm"))
            .unwrap();
        let good = std::fs::read(&cwasm).unwrap();
        for i in (0..good.len()).step_by((good.len() / 64).max(1)) {
            let mut bad = good.clone();
            bad[i] ^= 0x40;
            std::fs::write(&cwasm, &bad).unwrap();
            let s = dir_sandbox(dir.path());
            s.module(&digest, None).await.unwrap();
            assert_eq!(s.stats().compiled, 1, "byte {i}");
        }

        // Damaged module bytes: as if absent (the caller sends them again).
        let wasm = dir.path().join(format!("{}.wasm", digest.hex()));
        std::fs::write(&wasm, b"\0asm\x01\0\0\x01").unwrap();
        let e = dir_sandbox(dir.path())
            .module(&digest, None)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::ModuleMissing(d) if d == digest), "{e:?}");
    }
}
