//! The node's CPU pool: a dedicated runtime with `--cpus` workers for operator work
//! (Parquet encode/decode, Arrow IPC, later pushed-down plans), so the gRPC and I/O
//! threads stay responsive.

use std::future::Future;

use tokio::runtime::{Builder, Runtime};
use tokio::task::JoinHandle;

use crate::error::{Error, Result};

/// A bounded pool of CPU workers.
pub struct CpuPool {
    runtime: Option<Runtime>,
    threads: usize,
}

impl CpuPool {
    /// Starts `threads` workers.
    pub fn new(threads: usize) -> Result<Self> {
        if threads == 0 {
            return Err(Error::InvalidArgument("--cpus must be at least 1".into()));
        }
        let runtime = Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("csd-cpu")
            .enable_all()
            .build()
            .map_err(|e| Error::io("starting the CPU pool", e))?;
        Ok(CpuPool {
            runtime: Some(runtime),
            threads,
        })
    }

    /// Worker count.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `fut` on the pool. The handle aborts the task when dropped.
    pub fn spawn<F>(&self, fut: F) -> AbortOnDrop<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match &self.runtime {
            Some(rt) => AbortOnDrop(rt.spawn(fut)),
            None => unreachable!("the runtime lives until drop"),
        }
    }
}

impl Drop for CpuPool {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// A task handle that cancels its task when dropped, so no work outlives its request.
pub struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<T> Future for AbortOnDrop<Result<T>> {
    type Output = Result<T>;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx).map(|r| match r {
            Ok(v) => v,
            Err(e) if e.is_cancelled() => Err(Error::Internal("CPU task cancelled".into())),
            Err(e) => Err(Error::Internal(format!("CPU task panicked: {e}"))),
        })
    }
}
