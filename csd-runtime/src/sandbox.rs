//! The node's side of shipped code: the sandbox itself is the `csd-sandbox` crate
//! (re-exported here whole), which knows nothing of the node; this module gives it
//! the node's object store to keep compiled modules on ([`DeviceModules`]) and to
//! serve guests' host reads from ([`NodeObjectReader`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use csd_sandbox::*;

use crate::error::{Error, Result};
use crate::memory::MemoryLedger;
use crate::store::ObjectStore;

#[async_trait::async_trait]
impl DeviceModules for ObjectStore {
    fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    async fn read(&self, name: &str) -> Result<Vec<u8>> {
        Ok(self.get_all(name).await?.to_vec())
    }

    async fn write(&self, name: &str, bytes: &[u8]) -> Result<()> {
        self.put(name, bytes).await.map(drop)
    }

    async fn remove(&self, name: &str) -> Result<()> {
        self.delete(name).await.map(drop)
    }
}

/// A node's sandbox: instances draw from the node's `memory`, compiled modules are
/// kept on its device.
pub fn on_device(
    limits: SandboxLimits,
    memory: Arc<MemoryLedger>,
    device: ObjectStore,
) -> Result<Sandbox> {
    Sandbox::new(limits, memory, Some(ModuleStore::Device(Arc::new(device))))
}

/// A node's [`GuestReader`]: objects of the tables the request's tenant may read,
/// from the node's own store (checksums verified), counted as the request's reads.
///
/// Guests run on blocking threads (never on a runtime's workers): a read waits for
/// the device there.
pub struct NodeObjectReader {
    /// The node's objects.
    pub store: ObjectStore,
    /// Who asked.
    pub principal: crate::auth::Principal,
    /// The request's bytes read.
    pub bytes_read: Arc<AtomicU64>,
}

impl GuestReader for NodeObjectReader {
    fn read(&self, object: &str, offset: u64, len: usize) -> Result<Vec<u8>> {
        self.principal.check_object_read(object)?;
        let info = self.store.get(object).ok_or_else(|| {
            Error::NotFound(format!("object {}", crate::error::truncated(object)))
        })?;
        let len = (len as u64).min(info.len.saturating_sub(offset));
        if len == 0 {
            return Ok(Vec::new());
        }
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::Internal("a guest's read ran outside the node's runtime".into()))?;
        let bytes = handle.block_on(self.store.read_range(object, offset, len))?;
        self.bytes_read.fetch_add(len, Ordering::Relaxed);
        Ok(bytes.to_vec())
    }
}
