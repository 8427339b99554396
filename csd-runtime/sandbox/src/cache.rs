//! Compiled modules: a bounded in-memory cache, and a lasting copy — on the device
//! at a node, in a private directory of the user's cache at the compute side.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use wasmtime::{Engine, InstancePre, Linker, Module};

use super::instance::GuestState;
use super::{MODULE_PREFIX, ModuleDigest};
use csd_protocol::{Error, Result};

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

/// A device that keeps compiled modules (a node's object store, under
/// [`MODULE_PREFIX`]: tenants can neither read nor write there), by object name.
#[async_trait::async_trait]
pub trait DeviceModules: Send + Sync {
    /// Whether `name` is kept.
    fn has(&self, name: &str) -> bool;
    /// All of `name`'s bytes, checksums verified (a damaged copy is
    /// [`Error::Corrupt`]).
    async fn read(&self, name: &str) -> Result<Vec<u8>>;
    /// Keeps `bytes` as `name`.
    async fn write(&self, name: &str, bytes: &[u8]) -> Result<()>;
    /// Removes `name`.
    async fn remove(&self, name: &str) -> Result<()>;
}

/// Where compiled modules last beyond the process.
pub enum ModuleStore {
    /// A node's device.
    Device(Arc<dyn DeviceModules>),
    /// A directory of this user's (mode 0700): the compute side's cache, so that a
    /// `csd sql --wasm-fn` does not compile the module again at every run. Compiled
    /// files carry the SHA-256 of their contents, and module bytes are checked
    /// against their digest: a damaged file is compiled again, never loaded.
    Dir(PathBuf),
}

/// The in-memory cache (least recently used out first) and the lasting copy.
pub(super) struct ModuleCache {
    engine: Engine,
    config: String,
    capacity: usize,
    map: Mutex<Lru>,
    device: Option<ModuleStore>,
}

impl ModuleStore {
    fn path(dir: &Path, name: &str) -> PathBuf {
        dir.join(name.strip_prefix(MODULE_PREFIX).unwrap_or(name))
    }

    fn has(&self, name: &str) -> bool {
        match self {
            ModuleStore::Device(d) => d.has(name),
            ModuleStore::Dir(dir) => Self::path(dir, name).is_file(),
        }
    }

    async fn read(&self, name: &str) -> Result<Option<Vec<u8>>> {
        match self {
            ModuleStore::Device(d) => match d.has(name) {
                true => Ok(Some(d.read(name).await?)),
                false => Ok(None),
            },
            ModuleStore::Dir(dir) => match std::fs::read(Self::path(dir, name)) {
                Ok(b) => {
                    // Its modification time is its last use: what pruning goes by.
                    if let Ok(f) = std::fs::File::options()
                        .append(true)
                        .open(Self::path(dir, name))
                    {
                        let _ = f.set_modified(std::time::SystemTime::now());
                    }
                    Ok(Some(b))
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(Error::io(format!("reading module {name}"), e)),
            },
        }
    }

    /// Reads `name`, a damaged copy (checksums or seal wrong) counting as absent
    /// and removed, so that it is written again.
    async fn read_intact(&self, name: &str) -> Result<Option<Vec<u8>>> {
        match self.read(name).await {
            Err(Error::Corrupt(why)) => {
                tracing::warn!("{name} is damaged ({why}); dropping it");
                self.remove(name).await;
                Ok(None)
            }
            r => r,
        }
    }

    async fn remove(&self, name: &str) {
        let r = match self {
            ModuleStore::Device(d) => d.remove(name).await,
            ModuleStore::Dir(dir) => std::fs::remove_file(Self::path(dir, name))
                .map_err(|e| Error::io(format!("removing module {name}"), e)),
        };
        if let Err(e) = r {
            tracing::warn!("removing {name}: {e}");
        }
    }

    async fn write(&self, name: &str, bytes: &[u8]) -> Result<()> {
        match self {
            ModuleStore::Device(d) => d.write(name, bytes).await,
            ModuleStore::Dir(dir) => {
                let path = Self::path(dir, name);
                let tmp = path.with_extension(format!("tmp{}", std::process::id()));
                std::fs::write(&tmp, bytes)
                    .and_then(|()| std::fs::rename(&tmp, &path))
                    .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
                prune(dir, DIR_BUDGET, &path);
                Ok(())
            }
        }
    }
}

/// The most a compute-side module directory holds; past it, the files used least
/// recently go.
const DIR_BUDGET: u64 = 1 << 30;

/// Removes the least recently modified files of `dir` until it holds at most
/// `budget` bytes, never `keep` (the file just written).
fn prune(dir: &Path, budget: u64, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut files: Vec<(std::time::SystemTime, u64, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            m.is_file().then(|| {
                (
                    m.modified().unwrap_or(std::time::UNIX_EPOCH),
                    m.len(),
                    e.path(),
                )
            })
        })
        .collect();
    let mut total: u64 = files.iter().map(|f| f.1).sum();
    files.sort();
    for (_, len, path) in files {
        if total <= budget {
            break;
        }
        if path != keep && std::fs::remove_file(&path).is_ok() {
            total = total.saturating_sub(len);
        }
    }
}

/// `bytes` behind the SHA-256 of them (a compiled module in a directory).
fn sealed(bytes: &[u8]) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let mut out = Sha256::digest(bytes).to_vec();
    out.extend_from_slice(bytes);
    out
}

/// What [`sealed`] sealed, if it is intact.
fn unsealed(bytes: &[u8]) -> Option<&[u8]> {
    use sha2::{Digest, Sha256};
    let (sum, rest) = bytes.split_at_checked(32)?;
    (Sha256::digest(rest).as_slice() == sum).then_some(rest)
}

impl ModuleCache {
    pub(super) fn new(engine: &Engine, capacity: usize, device: Option<ModuleStore>) -> Self {
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
                .is_some_and(|d| d.has(&Self::source_object(digest)))
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
        if !dev.has(&source) {
            dev.write(&source, bytes).await?;
        }
        let compiled = match dev {
            ModuleStore::Device(_) => compiled,
            ModuleStore::Dir(_) => sealed(&compiled),
        };
        dev.write(&self.compiled_object(&module.digest), &compiled)
            .await?;
        Ok(())
    }

    /// The module from the lasting copy: its compiled form for this engine, else its
    /// bytes compiled again (another engine configuration wrote it, or the compiled
    /// file is damaged; the time it took is returned); `None` if absent.
    pub(super) async fn load(
        &self,
        linker: &Linker<GuestState>,
        digest: &ModuleDigest,
    ) -> Result<Option<(Arc<CompiledModule>, Option<std::time::Duration>)>> {
        let Some(dev) = &self.device else {
            return Ok(None);
        };
        let source_name = Self::source_object(digest);
        let Some(source) = dev.read_intact(&source_name).await? else {
            return Ok(None);
        };
        if ModuleDigest::of(&source) != *digest {
            // A damaged copy: as if it were not there (the client sends it again).
            tracing::warn!("{source_name} does not hash to its name; dropping it");
            dev.remove(&source_name).await;
            return Ok(None);
        }
        let compiled = match dev.read_intact(&self.compiled_object(digest)).await? {
            Some(c) => match dev {
                ModuleStore::Device(_) => Some(c),
                ModuleStore::Dir(_) => unsealed(&c).map(<[u8]>::to_vec),
            },
            None => None,
        };
        // SAFETY: the compiled form was written by an engine of this configuration
        // (its hash is in the name): at a node under `.csd/`, which no tenant can
        // write or read, read back with its checksums verified; at the compute side
        // in this user's private directory, behind the SHA-256 of its contents,
        // checked above.
        let deserialized = compiled.and_then(|bytes| {
            unsafe { Module::deserialize(&self.engine, &bytes) }
                .map_err(|e| {
                    tracing::warn!("the compiled form of module {digest:?} does not load ({e:#}); compiling it again");
                })
                .ok()
        });
        let module = match deserialized {
            Some(m) => (link(linker, *digest, source.len(), &m)?, None),
            None => {
                // Not compiled for this engine yet, or the compiled form was damaged.
                let started = std::time::Instant::now();
                let m = compile(&self.engine, linker, *digest, &source)?;
                let took = started.elapsed();
                self.persist(&m, &source).await?;
                (m, Some(took))
            }
        };
        self.insert(module.0.clone());
        Ok(Some(module))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_module_directory_is_pruned_least_recently_used_first() {
        let dir = tempfile::tempdir().unwrap();
        let t = |s: u64| std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000 + s);
        for (name, age) in [("old", 1), ("mid", 2), ("new", 3)] {
            let p = dir.path().join(name);
            std::fs::write(&p, vec![0u8; 100]).unwrap();
            std::fs::File::options()
                .append(true)
                .open(&p)
                .unwrap()
                .set_modified(t(age))
                .unwrap();
        }
        let left = |n: &str| dir.path().join(n).exists();
        // 300 bytes in a 250-byte budget: the oldest goes, unless it is the file
        // just written; then the next oldest.
        super::prune(dir.path(), 250, &dir.path().join("old"));
        assert!(left("old") && !left("mid") && left("new"));
        super::prune(dir.path(), 1000, &dir.path().join("new"));
        assert!(left("old") && left("new"));
        super::prune(dir.path(), 100, &dir.path().join("new"));
        assert!(!left("old") && left("new"));
    }
}
