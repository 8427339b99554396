//! Emulated NVMe: memory- or file-backed, with a timing model.
//!
//! Model: a command first waits for one of `queue_depth` submission slots and one of
//! `parallelism` internal units (flash channels/dies), spends `latency_us` there, then
//! moves its bytes over a shared transfer bus at the read or write bandwidth. So one
//! command takes `latency + bytes/bandwidth`, and `c` concurrent commands reach
//! `min(bandwidth, c * bytes / (latency + bytes/bandwidth))` with
//! `c = min(commands offered, queue_depth, parallelism)` ([`TimingModel::predicted_throughput`]).
//! Completions are released by [`crate::timer`] (microsecond precision), since tokio's
//! timer wheel has millisecond granularity.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use super::block::{BlockDevice, DeviceCounters, DmaBuf, check_command};
use crate::error::{Error, Result, StatusCode};
use csd_protocol::stats::{DeviceStats, Geometry};

/// Timing of an emulated NVMe device. Bandwidths are in MB/s (10^6 bytes); 0 means
/// unlimited. All zero latency and bandwidth make an untimed device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimingModel {
    /// Fixed per-command latency in microseconds.
    pub latency_us: f64,
    /// Read bandwidth in MB/s (0 = unlimited).
    pub read_mbps: f64,
    /// Write bandwidth in MB/s (0 = unlimited).
    pub write_mbps: f64,
    /// Commands accepted at once.
    pub queue_depth: usize,
    /// Commands serviced concurrently (channels × dies).
    pub parallelism: usize,
}

impl TimingModel {
    /// No timing: as fast as memory or the backing file allows.
    pub fn untimed() -> Self {
        TimingModel {
            latency_us: 0.0,
            read_mbps: 0.0,
            write_mbps: 0.0,
            queue_depth: 64,
            parallelism: 64,
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let ok = self.latency_us >= 0.0
            && self.read_mbps >= 0.0
            && self.write_mbps >= 0.0
            && self.latency_us.is_finite()
            && self.read_mbps.is_finite()
            && self.write_mbps.is_finite();
        if !ok {
            return Err(Error::InvalidArgument(
                "latency and bandwidths must be finite and non-negative".into(),
            ));
        }
        if self.queue_depth == 0 || self.parallelism == 0 {
            return Err(Error::InvalidArgument(
                "queue_depth and parallelism must be at least 1".into(),
            ));
        }
        Ok(())
    }

    fn transfer(&self, bytes: usize, mbps: f64) -> Duration {
        if mbps > 0.0 {
            Duration::from_secs_f64(bytes as f64 / (mbps * 1e6))
        } else {
            Duration::ZERO
        }
    }

    /// Read throughput in bytes/s this model predicts for `io_size`-byte reads with
    /// `offered` commands kept in flight.
    pub fn predicted_throughput(&self, io_size: usize, offered: usize) -> f64 {
        let c = offered.min(self.queue_depth).min(self.parallelism) as f64;
        let per_cmd = self.latency_us * 1e-6 + self.transfer(io_size, self.read_mbps).as_secs_f64();
        let latency_bound = if per_cmd > 0.0 {
            c * io_size as f64 / per_cmd
        } else {
            f64::INFINITY
        };
        let bw = if self.read_mbps > 0.0 {
            self.read_mbps * 1e6
        } else {
            f64::INFINITY
        };
        latency_bound.min(bw)
    }

    fn is_timed(&self) -> bool {
        self.latency_us > 0.0 || self.read_mbps > 0.0 || self.write_mbps > 0.0
    }
}

enum Backing {
    Memory(RwLock<Vec<u8>>),
    File(Arc<File>),
}

/// `len` zero bytes, lazily backed by the OS (calloc), or a clear error where
/// `vec![0; len]` would abort the process.
fn zeroed_vec(len: usize) -> Result<Vec<u8>> {
    let too_big = || {
        Error::ResourcesExhausted(format!(
            "cannot allocate {len} bytes for an in-memory device: lower --capacity"
        ))
    };
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(len).map_err(|_| too_big())?;
    // SAFETY: layout has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(too_big());
    }
    // SAFETY: allocated by the global allocator with the layout of a Vec<u8> of
    // capacity `len`, and every byte is initialised (zero).
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// Emulated NVMe device.
pub struct EmulatedDevice {
    geometry: Geometry,
    model: TimingModel,
    backing: Backing,
    slots: Semaphore,
    units: Semaphore,
    bus_free: Mutex<Instant>,
    timed: bool,
    /// Writes hold a read guard while they run; flush takes the write guard, so it
    /// waits for every earlier write even when its caller stopped waiting.
    write_barrier: Arc<tokio::sync::RwLock<()>>,
    counters: DeviceCounters,
}

impl EmulatedDevice {
    /// Opens a memory-backed device (`path` = `None`) or a file-backed one.
    pub fn open(
        path: Option<&Path>,
        capacity: u64,
        block_size: usize,
        model: TimingModel,
    ) -> Result<Self> {
        model.validate()?;
        let num_blocks = capacity / block_size as u64;
        if num_blocks == 0 {
            return Err(Error::InvalidArgument(format!(
                "capacity {capacity} is smaller than one {block_size}-byte block"
            )));
        }
        let bytes = num_blocks * block_size as u64;
        let (backing, name) = match path {
            None => {
                let len = usize::try_from(bytes)
                    .map_err(|_| Error::ResourcesExhausted("capacity exceeds memory".into()))?;
                (
                    Backing::Memory(RwLock::new(zeroed_vec(len)?)),
                    "emulated:mem".to_string(),
                )
            }
            Some(p) => {
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(p)
                    .map_err(|e| Error::io(format!("opening {}", p.display()), e))?;
                let len = f.metadata().map_err(|e| Error::io("stat", e))?.len();
                if len < bytes {
                    f.set_len(bytes)
                        .map_err(|e| Error::io(format!("growing {}", p.display()), e))?;
                }
                (
                    Backing::File(Arc::new(f)),
                    format!("emulated:file={}", p.display()),
                )
            }
        };
        Ok(EmulatedDevice {
            geometry: Geometry {
                name,
                block_size,
                num_blocks,
                queue_depth: model.queue_depth,
            },
            slots: Semaphore::new(model.queue_depth),
            units: Semaphore::new(model.parallelism),
            bus_free: Mutex::new(Instant::now()),
            timed: model.is_timed(),
            write_barrier: Arc::new(tokio::sync::RwLock::new(())),
            counters: DeviceCounters::default(),
            model,
            backing,
        })
    }

    /// The timing model.
    pub fn model(&self) -> &TimingModel {
        &self.model
    }

    /// When a command of `bytes` submitted now completes under the model.
    fn deadline(&self, bytes: usize, mbps: f64) -> Instant {
        let ready = Instant::now() + Duration::from_secs_f64(self.model.latency_us * 1e-6);
        let mut bus = self.bus_free.lock().unwrap_or_else(|p| p.into_inner());
        let start = ready.max(*bus);
        *bus = start + self.model.transfer(bytes, mbps);
        *bus
    }

    async fn timed<T>(
        &self,
        bytes: usize,
        mbps: f64,
        work: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let _slot = self
            .slots
            .acquire()
            .await
            .map_err(|_| Error::Internal("device closed".into()))?;
        let _unit = self
            .units
            .acquire()
            .await
            .map_err(|_| Error::Internal("device closed".into()))?;
        let deadline = self.timed.then(|| self.deadline(bytes, mbps));
        let out = work.await?;
        if let Some(deadline) = deadline {
            crate::timer::sleep_until(deadline).await;
        }
        Ok(out)
    }

    fn offset(&self, lba: u64) -> u64 {
        lba * self.geometry.block_size as u64
    }
}

#[async_trait]
impl BlockDevice for EmulatedDevice {
    fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    async fn read(&self, lba: u64, mut buf: DmaBuf) -> Result<DmaBuf> {
        check_command(&self.geometry, "read", lba, &buf)?;
        let off = self.offset(lba);
        let len = buf.len();
        let buf = self
            .timed(len, self.model.read_mbps, async {
                match &self.backing {
                    Backing::Memory(m) => {
                        let m = m.read().unwrap_or_else(|p| p.into_inner());
                        buf.copy_from_slice(&m[off as usize..off as usize + len]);
                        Ok(buf)
                    }
                    Backing::File(f) => {
                        let f = f.clone();
                        tokio::task::spawn_blocking(move || {
                            f.read_exact_at(&mut buf, off)
                                .map(|_| buf)
                                .map_err(|e| Error::io(format!("read at {off}"), e))
                        })
                        .await
                        .map_err(|e| Error::external(StatusCode::Internal, "the read task", e))?
                    }
                }
            })
            .await?;
        self.counters.record_read(len);
        Ok(buf)
    }

    async fn write(&self, lba: u64, buf: DmaBuf) -> Result<DmaBuf> {
        check_command(&self.geometry, "write", lba, &buf)?;
        let off = self.offset(lba);
        let len = buf.len();
        let guard = self.write_barrier.clone().read_owned().await;
        let buf = self
            .timed(len, self.model.write_mbps, async {
                match &self.backing {
                    Backing::Memory(m) => {
                        let mut m = m.write().unwrap_or_else(|p| p.into_inner());
                        m[off as usize..off as usize + len].copy_from_slice(&buf);
                        drop(guard);
                        Ok(buf)
                    }
                    Backing::File(f) => {
                        let f = f.clone();
                        tokio::task::spawn_blocking(move || {
                            let r = f
                                .write_all_at(&buf, off)
                                .map(|_| buf)
                                .map_err(|e| Error::io(format!("write at {off}"), e));
                            drop(guard);
                            r
                        })
                        .await
                        .map_err(|e| Error::external(StatusCode::Internal, "the write task", e))?
                    }
                }
            })
            .await?;
        self.counters.record_write(len);
        Ok(buf)
    }

    async fn flush(&self) -> Result<()> {
        let _all_writes_done = self.write_barrier.write().await;
        if let Backing::File(f) = &self.backing {
            let f = f.clone();
            tokio::task::spawn_blocking(move || {
                f.sync_data().map_err(|e| Error::io("fdatasync", e))
            })
            .await
            .map_err(|e| Error::external(StatusCode::Internal, "the flush task", e))??;
        }
        self.counters.record_flush();
        Ok(())
    }

    fn stats(&self) -> DeviceStats {
        self.counters.snapshot()
    }
}
