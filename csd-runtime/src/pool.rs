//! The node's CPU pool: a dedicated runtime with `--cpus` workers for operator work
//! (Parquet encode/decode, Arrow IPC, later pushed-down plans), so the gRPC and I/O
//! threads stay responsive. Its workers can be pinned to a set of cores
//! (`--cpu-set`), so operator work stays off the cores the I/O threads, or an
//! emulated compute tier on the same machine, use.

use std::future::Future;
use std::sync::Arc;

use tokio::runtime::{Builder, Runtime};
use tokio::task::JoinHandle;

use crate::error::{Error, Result, StatusCode};

/// A bounded pool of CPU workers.
pub struct CpuPool {
    runtime: Option<Runtime>,
    threads: usize,
    cores: Option<Arc<[usize]>>,
}

impl CpuPool {
    /// Starts `threads` workers, free to run on any core.
    pub fn new(threads: usize) -> Result<Self> {
        Self::pinned(threads, None)
    }

    /// Starts `threads` workers; with `cores`, every worker is pinned to that set.
    pub fn pinned(threads: usize, cores: Option<Vec<usize>>) -> Result<Self> {
        if threads == 0 {
            return Err(Error::InvalidArgument("--cpus must be at least 1".into()));
        }
        let cores: Option<Arc<[usize]>> = match cores {
            Some(c) => {
                check_cores(&c)?;
                Some(c.into())
            }
            None => None,
        };
        let mut builder = Builder::new_multi_thread();
        builder
            .worker_threads(threads)
            .thread_name("csd-cpu")
            .enable_all();
        if let Some(c) = cores.clone() {
            builder.on_thread_start(move || pin_current_thread(&c));
        }
        let runtime = builder
            .build()
            .map_err(|e| Error::io("starting the CPU pool", e))?;
        Ok(CpuPool {
            runtime: Some(runtime),
            threads,
            cores,
        })
    }

    /// Worker count.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The cores the workers are pinned to, if any. Operators that start their own
    /// threads (the ML operator's rayon pool) pin them to the same set.
    pub fn cores(&self) -> Option<&[usize]> {
        self.cores.as_deref()
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

/// Cores this process may run on (its affinity mask), in ascending order.
pub fn available_cores() -> Vec<usize> {
    // SAFETY: `set` is a plain bit mask that sched_getaffinity fills in; size given.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get());
            return (0..n).collect();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Parses a core list as `taskset -c` writes it: `0-3,6,8-9`.
pub fn parse_core_list(text: &str) -> Result<Vec<usize>> {
    let bad = |why: &str| {
        Error::InvalidArgument(format!(
            "cpu set {text:?}: {why} (expected a list like 0-3,6)"
        ))
    };
    let mut cores = Vec::new();
    for part in text.split(',').map(str::trim) {
        let num = |s: &str| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| bad("not a core number"))
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(bad("a range runs backwards"));
                }
                cores.extend(a..=b);
            }
            None => cores.push(num(part)?),
        }
    }
    cores.sort_unstable();
    cores.dedup();
    check_cores(&cores)?;
    Ok(cores)
}

/// Every core must be one this process may run on.
fn check_cores(cores: &[usize]) -> Result<()> {
    if cores.is_empty() {
        return Err(Error::InvalidArgument("the cpu set is empty".into()));
    }
    let have = available_cores();
    if let Some(c) = cores.iter().find(|c| !have.contains(c)) {
        return Err(Error::InvalidArgument(format!(
            "core {c} is not available to this process (it may use {have:?})"
        )));
    }
    Ok(())
}

/// Pins the calling thread to `cores`. Failure is logged, not fatal: the thread
/// then runs unpinned, which changes timing, never results.
pub fn pin_current_thread(cores: &[usize]) {
    // SAFETY: `set` is a plain bit mask; CPU_SET is only called for in-range cores.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        tracing::warn!(
            "pinning a worker to cores {cores:?} failed: {}",
            std::io::Error::last_os_error()
        );
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
            Err(e) => Err(Error::external(
                StatusCode::Internal,
                "a CPU task panicked",
                e,
            )),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_lists_parse_like_taskset() {
        let have = available_cores();
        let last = *have.last().unwrap();
        assert_eq!(parse_core_list("0").unwrap(), vec![0]);
        assert_eq!(
            parse_core_list(&format!("{last},0-0, {last}")).unwrap(),
            if last == 0 { vec![0] } else { vec![0, last] }
        );
        for bad in ["", "x", "1-0", "0,,1", &format!("{}", last + 1)] {
            let e = parse_core_list(bad).unwrap_err().to_string();
            assert!(
                e.contains("cpu set") || e.contains("not available"),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn pinned_workers_run_on_their_cores_only() {
        let core = *available_cores().last().unwrap();
        let pool = CpuPool::pinned(2, Some(vec![core])).unwrap();
        assert_eq!(pool.cores(), Some(&[core][..]));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let seen = rt
            .block_on(pool.spawn(async { Ok::<_, Error>(available_cores()) }))
            .unwrap();
        assert_eq!(seen, vec![core]);
        assert_eq!(CpuPool::new(1).unwrap().cores(), None);
    }
}
