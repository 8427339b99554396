//! Compiled modules: a bounded in-memory cache, and the device.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use wasmtime::{Engine, InstancePre, Linker, Module};

use super::instance::GuestState;
use super::{MODULE_PREFIX, ModuleDigest};
use crate::error::{Error, Result};
use crate::store::ObjectStore;

/// A module compiled for this engine, linked against the host functions.
pub struct CompiledModule {
    /// Its name.
    pub digest: ModuleDigest,
    /// Size of its bytes.
    pub bytes: usize,
    pub(super) pre: InstancePre<GuestState>,
}

impl std::fmt::Debug for CompiledModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CompiledModule({:?}, {} bytes)", self.digest, self.bytes)
    }
}

/// Compiles and links `bytes`.
pub(super) fn compile(
    engine: &Engine,
    linker: &Linker<GuestState>,
    digest: ModuleDigest,
    bytes: &[u8],
) -> Result<Arc<CompiledModule>> {
    if !bytes.starts_with(b"\0asm") {
        return Err(Error::InvalidArgument(format!(
            "module {digest:?} is not WebAssembly (no \\0asm header)"
        )));
    }
    let module = Module::new(engine, bytes).map_err(|e| {
        Error::InvalidArgument(format!(
            "module {digest:?} is not a valid WebAssembly module: {e:#}"
        ))
    })?;
    link(linker, digest, bytes.len(), &module)
}

fn link(
    linker: &Linker<GuestState>,
    digest: ModuleDigest,
    len: usize,
    module: &Module,
) -> Result<Arc<CompiledModule>> {
    let pre = linker.instantiate_pre(module).map_err(|e| {
        let imports: Vec<String> = module
            .imports()
            .map(|i| format!("{}::{}", i.module(), i.name()))
            .collect();
        Error::InvalidArgument(format!(
            "module {digest:?} imports what a node does not provide ({}; nodes provide csd::fail and csd::read only): {e:#}",
            imports.join(", ")
        ))
    })?;
    Ok(Arc::new(CompiledModule {
        digest,
        bytes: len,
        pre,
    }))
}

/// Compiled modules by digest, and their order of use (least recent first).
type Lru = (
    HashMap<ModuleDigest, Arc<CompiledModule>>,
    VecDeque<ModuleDigest>,
);

/// The in-memory cache (least recently used out first) and the device copy.
pub(super) struct ModuleCache {
    engine: Engine,
    config: String,
    capacity: usize,
    map: Mutex<Lru>,
    device: Option<ObjectStore>,
}

impl ModuleCache {
    pub(super) fn new(engine: &Engine, capacity: usize, device: Option<ObjectStore>) -> Self {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut h);
        ModuleCache {
            engine: engine.clone(),
            config: format!("{:016x}", h.finish()),
            capacity: capacity.max(1),
            map: Mutex::new((HashMap::new(), VecDeque::new())),
            device,
        }
    }

    fn source_object(digest: &ModuleDigest) -> String {
        format!("{MODULE_PREFIX}{}.wasm", digest.hex())
    }

    fn compiled_object(&self, digest: &ModuleDigest) -> String {
        format!("{MODULE_PREFIX}{}-{}.cwasm", digest.hex(), self.config)
    }

    pub(super) fn len(&self) -> usize {
        self.map.lock().map(|m| m.0.len()).unwrap_or(0)
    }

    pub(super) fn get(&self, digest: &ModuleDigest) -> Option<Arc<CompiledModule>> {
        let mut m = self.map.lock().ok()?;
        let found = m.0.get(digest).cloned()?;
        m.1.retain(|d| d != digest);
        m.1.push_back(*digest);
        Some(found)
    }

    pub(super) fn has(&self, digest: &ModuleDigest) -> bool {
        self.get(digest).is_some()
            || self
                .device
                .as_ref()
                .is_some_and(|d| d.get(&Self::source_object(digest)).is_some())
    }

    pub(super) fn insert(&self, module: Arc<CompiledModule>) {
        let Ok(mut m) = self.map.lock() else { return };
        let d = module.digest;
        if m.0.insert(d, module).is_none() {
            m.1.push_back(d);
        }
        while m.0.len() > self.capacity {
            match m.1.pop_front() {
                Some(old) => {
                    m.0.remove(&old);
                }
                None => break,
            }
        }
    }

    /// Keeps `bytes` and the compiled form on the device (a node's sandbox only).
    pub(super) async fn persist(&self, module: &CompiledModule, bytes: &[u8]) -> Result<()> {
        let Some(dev) = &self.device else {
            return Ok(());
        };
        let compiled = module.pre.module().serialize().map_err(|e| {
            Error::Internal(format!("serializing module {:?}: {e:#}", module.digest))
        })?;
        let source = Self::source_object(&module.digest);
        if dev.get(&source).is_none() {
            dev.put(&source, bytes).await?;
        }
        dev.put(&self.compiled_object(&module.digest), &compiled)
            .await?;
        Ok(())
    }

    /// The module from the device: its compiled form for this engine, else its bytes
    /// compiled again (another engine configuration wrote it); `None` if absent.
    pub(super) async fn load(
        &self,
        linker: &Linker<GuestState>,
        digest: &ModuleDigest,
    ) -> Result<Option<Arc<CompiledModule>>> {
        let Some(dev) = &self.device else {
            return Ok(None);
        };
        let source = Self::source_object(digest);
        let Some(info) = dev.get(&source) else {
            return Ok(None);
        };
        let compiled = self.compiled_object(digest);
        let module = if dev.get(&compiled).is_some() {
            let bytes = dev.get_all(&compiled).await?;
            // SAFETY: the compiled form was written by this node's own engine (same
            // configuration hash) under `.csd/`, which no tenant can write or read,
            // and the object store verified its checksums on the way back.
            let m = unsafe { Module::deserialize(&self.engine, &bytes) }.map_err(|e| {
                Error::Corrupt(format!("the compiled form of module {digest:?}: {e:#}"))
            })?;
            link(linker, *digest, info.len as usize, &m)?
        } else {
            let bytes = dev.get_all(&source).await?;
            let m = compile(&self.engine, linker, *digest, &bytes)?;
            self.persist(&m, &bytes).await?;
            m
        };
        self.insert(module.clone());
        Ok(Some(module))
    }
}
