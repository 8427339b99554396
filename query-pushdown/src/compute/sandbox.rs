//! Shipped code the compute tier runs itself: a handed-back fragment's Wasm SQL
//! functions, a handed-back `"wasm"` request, the merge of an aggregate's partial
//! outputs, a worker session's functions — all in this process's own sandbox
//! (compiled modules kept on local disk, so a later process does not compile them
//! again). Without the `wasm` feature there is no sandbox: what would need one is
//! refused with a status that says so, and everything else works.

#[cfg(feature = "wasm")]
mod here {
    use std::sync::atomic::AtomicBool;
    use std::sync::{Arc, Mutex};

    use csd_protocol::ModuleDigest;
    use csd_sandbox::memory::MemoryLedger;
    use csd_sandbox::{ModuleStore, Sandbox, SandboxLimits};
    use datafusion::common::{DataFusionError, Result};
    use datafusion::logical_expr::{LogicalPlan, ScalarUDF};
    use datafusion::physical_plan::SendableRecordBatchStream;
    use datafusion::prelude::SessionContext;

    use crate::eval::wasm::{CancelOnDrop, cancel_on_drop};
    use crate::eval::wasm_fn::{WasmScalarUdf, register_functions};
    use crate::wire::shipped::{ShippedFunction, WasmFunctionMsg};

    /// Stops the Wasm SQL functions of a fragment run here once dropped.
    pub(crate) struct FunctionsGuard(CancelOnDrop);

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
            Sandbox::new(limits, ledger, module_cache_dir())
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
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache"))
                })?
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

    /// The Wasm SQL functions `plan` calls.
    pub(crate) fn functions_in(plan: &LogicalPlan) -> Vec<Arc<ShippedFunction>> {
        crate::eval::wasm_fn::functions_in(plan)
    }

    /// Whether `f` is a Wasm SQL function.
    pub(crate) fn is_wasm_function(f: &ScalarUDF) -> bool {
        crate::eval::wasm_fn::is_wasm_function(f)
    }

    /// Registers on `session` the Wasm SQL functions a fragment declares (checked
    /// with it: `digests`), from this process's sandbox (compiled from `known`'s
    /// bytes when it lacks them).
    pub(crate) async fn register_here(
        session: &SessionContext,
        known: &[Arc<ShippedFunction>],
        declared: &[WasmFunctionMsg],
        digests: &[ModuleDigest],
    ) -> Result<FunctionsGuard> {
        let external = |e: csd_protocol::Error| DataFusionError::External(Box::new(e));
        let sandbox = local_sandbox()?;
        for f in known {
            sandbox
                .module(&f.digest, f.bytes.as_deref())
                .await
                .map_err(external)?;
        }
        let flag = Arc::new(AtomicBool::new(false));
        register_functions(session, &sandbox, declared, digests, &flag)
            .await
            .map_err(external)?;
        Ok(FunctionsGuard(CancelOnDrop(flag)))
    }

    /// `stream`, stopping its Wasm SQL functions when it is dropped.
    pub(crate) fn guarded(
        stream: SendableRecordBatchStream,
        guard: FunctionsGuard,
    ) -> SendableRecordBatchStream {
        cancel_on_drop(stream, guard.0)
    }

    /// The session's Wasm function `f` (from its [`CsdOptions`]), from the module
    /// the coordinator sent this worker.
    ///
    /// [`CsdOptions`]: crate::CsdOptions
    pub(crate) async fn worker_function(f: &ShippedFunction) -> Result<ScalarUDF> {
        let sandbox = local_sandbox()?;
        let module = sandbox.module(&f.digest, None).await.map_err(|e| {
            DataFusionError::Plan(format!(
                "wasm function {}: this worker does not have module {} ({e}); \
                 register the function on the session again to send it",
                f.name, f.digest
            ))
        })?;
        let udf = WasmScalarUdf::load(sandbox, module, f.clone(), Arc::new(AtomicBool::new(false)))
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        Ok(ScalarUDF::new_from_impl(udf))
    }
}

/// Without shipped code at this tier: no Wasm functions; a fragment or a worker
/// session that needs one is refused, saying why.
#[cfg(not(feature = "wasm"))]
mod here {
    use std::sync::Arc;

    use csd_protocol::ModuleDigest;
    use datafusion::common::{DataFusionError, Result};
    use datafusion::logical_expr::{LogicalPlan, ScalarUDF};
    use datafusion::physical_plan::SendableRecordBatchStream;
    use datafusion::prelude::SessionContext;

    use crate::wire::shipped::{ShippedFunction, WasmFunctionMsg};

    /// Nothing to stop.
    pub(crate) struct FunctionsGuard;

    fn not_built(what: &str) -> DataFusionError {
        DataFusionError::NotImplemented(format!(
            "{what} needs shipped code at the compute tier: this program was built \
             without csd-query-pushdown's `wasm` feature"
        ))
    }

    pub(crate) fn functions_in(_: &LogicalPlan) -> Vec<Arc<ShippedFunction>> {
        Vec::new()
    }

    pub(crate) fn is_wasm_function(_: &ScalarUDF) -> bool {
        false
    }

    pub(crate) async fn register_here(
        _: &SessionContext,
        _: &[Arc<ShippedFunction>],
        _: &[WasmFunctionMsg],
        _: &[ModuleDigest],
    ) -> Result<FunctionsGuard> {
        Err(not_built(
            "a handed-back fragment that calls Wasm SQL functions",
        ))
    }

    pub(crate) fn guarded(
        stream: SendableRecordBatchStream,
        _: FunctionsGuard,
    ) -> SendableRecordBatchStream {
        stream
    }

    pub(crate) async fn worker_function(f: &ShippedFunction) -> Result<ScalarUDF> {
        Err(not_built(&format!("the Wasm SQL function {}", f.name)))
    }
}

#[cfg(feature = "wasm")]
pub use here::local_sandbox;
pub(crate) use here::{functions_in, guarded, is_wasm_function, register_here, worker_function};
