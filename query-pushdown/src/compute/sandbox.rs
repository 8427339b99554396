//! This process's own sandbox, for shipped code the compute tier runs itself: a
//! handed-back fragment's Wasm SQL functions, a handed-back `"wasm"` request, the
//! merge of an aggregate's partial outputs. Compiled modules are kept on local disk
//! so a later process does not compile them again.

use std::sync::{Arc, Mutex};

use csd_runtime::memory::MemoryLedger;
use csd_runtime::sandbox::{ModuleStore, Sandbox, SandboxLimits};
use datafusion::common::{DataFusionError, Result};

/// This process's sandbox (for handed-back requests and merges), made on first use.
pub fn local_sandbox() -> Result<Arc<Sandbox>> {
    static LOCAL: Mutex<Option<Arc<Sandbox>>> = Mutex::new(None);
    let mut g = LOCAL
        .lock()
        .map_err(|_| DataFusionError::Internal("the local sandbox's lock".into()))?;
    if let Some(s) = g.as_ref() {
        return Ok(s.clone());
    }
    let limits = SandboxLimits::default();
    let ledger = MemoryLedger::new(4 * limits.memory);
    let s = Arc::new(
        Sandbox::with_store(limits, ledger, module_cache_dir())
            .map_err(|e| DataFusionError::External(Box::new(e)))?,
    );
    *g = Some(s.clone());
    Ok(s)
}

/// Where this process keeps compiled modules: `$CSD_WASM_CACHE`, else
/// `$XDG_CACHE_HOME/csd/wasm`, else `~/.cache/csd/wasm` (made private, mode 0700);
/// `None` (memory only) when it cannot be made.
fn module_cache_dir() -> Option<ModuleStore> {
    let dir = match std::env::var_os("CSD_WASM_CACHE") {
        Some(d) if d.is_empty() => return None,
        Some(d) => std::path::PathBuf::from(d),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(std::path::PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache")))?
            .join("csd")
            .join("wasm"),
    };
    let made = std::fs::create_dir_all(&dir).and_then(|()| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
    });
    match made {
        Ok(()) => Some(ModuleStore::Dir(dir)),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), "no module cache directory: {e}");
            None
        }
    }
}
