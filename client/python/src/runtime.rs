//! One tokio runtime for the module, and waiting on it from Python: the GIL is
//! released while the nodes work, and Ctrl-C (a `KeyboardInterrupt`) drops the
//! work, which cancels the nodes' calls.

use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;

/// How often a wait looks for Ctrl-C.
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("csd")
            .build()
            .unwrap_or_else(|e| panic!("starting the csd runtime: {e}"))
    })
}

/// Runs `fut` to its end as a task of the runtime, the GIL released. On Ctrl-C the
/// task is aborted (its gRPC calls cancelled, so the nodes stop) and
/// `KeyboardInterrupt` raised.
pub(crate) fn wait<T, F>(py: Python<'_>, fut: F) -> PyResult<T>
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let task = runtime().spawn(fut);
    let abort = task.abort_handle();
    match wait_here(py, task) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
            "the csd task failed: {e}"
        ))),
        Err(interrupted) => {
            abort.abort();
            Err(interrupted)
        }
    }
}

/// Runs `fut` to its end on this thread, inside the runtime, the GIL released; on
/// Ctrl-C the future is dropped and `KeyboardInterrupt` returned (for futures that
/// borrow, which cannot be spawned).
pub(crate) fn wait_here<T, F>(py: Python<'_>, fut: F) -> PyResult<T>
where
    F: std::future::Future<Output = T> + Send,
    T: Send,
{
    let mut fut = std::pin::pin!(fut);
    loop {
        let done = py.detach(|| {
            runtime().block_on(async { tokio::time::timeout(SIGNAL_CHECK, &mut fut).await })
        });
        match done {
            Ok(v) => return Ok(v),
            Err(_elapsed) => py.check_signals()?,
        }
    }
}
