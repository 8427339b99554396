//! NVMe-shaped block devices.
//!
//! One asynchronous trait, [`BlockDevice`]: fixed-size LBA-addressed blocks, aligned
//! DMA-able buffers ([`DmaBuf`]) whose ownership passes to the device for the duration
//! of a command (as with SPDK's `spdk_dma_malloc` buffers and io_uring fixed buffers),
//! asynchronous submit/complete, a bounded queue depth, and a flush barrier.
//!
//! Backends: [`uring::UringDevice`] (io_uring + O_DIRECT over a file or raw block
//! device; the default), [`nvme::NvmeDevice`] (NVMe commands through io_uring
//! passthrough on a namespace's generic character device, `/dev/ngXnY`) and
//! [`emulated::EmulatedDevice`] (memory- or file-backed with a timing model, for tests
//! and the testbed). Pick one from a [`DeviceSpec`].

mod block;
pub mod emulated;
pub mod faulty;
mod mailbox;
pub mod nvme;
mod ring;
#[cfg(feature = "spdk")]
pub mod spdk;
pub mod uring;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

pub use csd_protocol::size::parse_size;
pub use csd_protocol::stats::{DeviceStats, Geometry};

use crate::error::{Error, Result};
pub(crate) use block::DEFAULT_BLOCK_SIZE;
pub use block::{BlockDevice, DMA_ALIGN, DmaBuf, limit_idle_buffers};

/// How to open a device, parsed from `--device`:
///
/// * `PATH` or `uring:PATH` – io_uring with O_DIRECT on a file (created or grown to
///   `--capacity`) or a raw block device such as `/dev/nvme0n1`.
/// * `nvme:PATH` – NVMe commands through io_uring passthrough on a namespace's generic
///   character device (`/dev/ngXnY`); a plain path of that name means the same.
/// * `spdk:malloc=MIB`, `spdk:tcp=HOST:PORT/NQN`, `spdk:pcie=BDF` – an SPDK bdev
///   (builds with the `spdk` feature only).
/// * `emulated:mem[,opts]` or `emulated:file=PATH[,opts]` – emulated NVMe, with
///   `latency_us`, `read_mbps`, `write_mbps`, `queue_depth`, `parallelism` options.
///   A model with no options is untimed (plain memory or pread/pwrite): the fallback
///   where the kernel refuses io_uring.
/// * `faulty:SEED[,RATE=P…][,safe_below=LBA]:INNER` – any of the above, misbehaving
///   on purpose and deterministically for `SEED` ([`faulty`]): rates `rot`,
///   `corrupt`, `misdirect`, `lse`, `write_eio`, `enospc`, `flush_fail`, `spike`
///   (probabilities), `spike_ms`; no silent faults below block `safe_below`.
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceSpec {
    /// io_uring on a file or raw block device.
    Uring {
        /// The file or device path.
        path: std::path::PathBuf,
    },
    /// NVMe passthrough on a namespace's generic character device.
    Nvme {
        /// `/dev/ngXnY`.
        path: std::path::PathBuf,
    },
    /// An SPDK bdev (what follows `spdk:`).
    Spdk {
        /// `malloc=MIB`, `tcp=HOST:PORT/NQN` or `pcie=BDF`.
        target: String,
    },
    /// Another device, misbehaving on purpose.
    Faulty {
        /// The faults' seed.
        seed: u64,
        /// How often each fault happens.
        rates: faulty::FaultRates,
        /// No silent faults below this block.
        safe_below: u64,
        /// The device underneath.
        inner: Box<DeviceSpec>,
    },
    /// Emulated NVMe.
    Emulated {
        /// `None` for memory-backed.
        path: Option<std::path::PathBuf>,
        /// Timing model.
        model: emulated::TimingModel,
    },
}

impl FromStr for DeviceSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: String| Error::InvalidArgument(format!("device spec {s:?}: {why}"));
        if let Some(rest) = s.strip_prefix("faulty:") {
            let (head, inner) = rest
                .split_once(':')
                .ok_or_else(|| bad("expected faulty:SEED[,RATE=P…]:INNER_SPEC".into()))?;
            let mut parts = head.split(',');
            let seed = parts.next().unwrap_or_default();
            let seed = seed
                .parse::<u64>()
                .map_err(|_| bad(format!("seed {seed:?} is not a number")))?;
            let (mut rates, mut safe_below) = (faulty::FaultRates::default(), 0);
            for opt in parts {
                let (k, v) = opt
                    .split_once('=')
                    .ok_or_else(|| bad(format!("option {opt:?} is not key=value")))?;
                let v = v
                    .parse::<f64>()
                    .map_err(|_| bad(format!("option {k}: {v:?} is not a number")))?;
                if k == "safe_below" {
                    safe_below = v as u64;
                } else if !rates.set(k, v) {
                    return Err(bad(format!(
                        "unknown option {k:?} (known: {}, safe_below)",
                        faulty::FaultRates::KEYS
                    )));
                }
            }
            rates.validate().map_err(|e| bad(e.to_string()))?;
            return Ok(DeviceSpec::Faulty {
                seed,
                rates,
                safe_below,
                inner: Box::new(inner.parse()?),
            });
        }
        if let Some(rest) = s.strip_prefix("emulated:") {
            let mut parts = rest.split(',');
            let target = parts.next().unwrap_or_default();
            let path = if target == "mem" {
                None
            } else if let Some(p) = target.strip_prefix("file=") {
                Some(std::path::PathBuf::from(p))
            } else {
                return Err(bad(
                    "expected `emulated:mem` or `emulated:file=PATH` before the options".into(),
                ));
            };
            let mut model = emulated::TimingModel::untimed();
            for opt in parts {
                let (k, v) = opt
                    .split_once('=')
                    .ok_or_else(|| bad(format!("option {opt:?} is not key=value")))?;
                let num = |v: &str| {
                    v.parse::<f64>()
                        .map_err(|_| bad(format!("option {k}: {v:?} is not a number")))
                };
                match k {
                    "latency_us" => model.latency_us = num(v)?,
                    "read_mbps" => model.read_mbps = num(v)?,
                    "write_mbps" => model.write_mbps = num(v)?,
                    "queue_depth" => model.queue_depth = num(v)? as usize,
                    "parallelism" => model.parallelism = num(v)? as usize,
                    _ => {
                        return Err(bad(format!(
                            "unknown option {k:?} (known: latency_us, read_mbps, write_mbps, queue_depth, parallelism)"
                        )));
                    }
                }
            }
            model.validate().map_err(|e| bad(e.to_string()))?;
            return Ok(DeviceSpec::Emulated { path, model });
        }
        if let Some(target) = s.strip_prefix("spdk:") {
            #[cfg(feature = "spdk")]
            spdk::SpdkTarget::parse(target)?;
            return Ok(DeviceSpec::Spdk {
                target: target.into(),
            });
        }
        if let Some(path) = s.strip_prefix("nvme:") {
            if path.is_empty() {
                return Err(bad("empty path".into()));
            }
            return Ok(DeviceSpec::Nvme { path: path.into() });
        }
        let path = s.strip_prefix("uring:").unwrap_or(s);
        if path.is_empty() {
            return Err(bad("empty path".into()));
        }
        if s == path && is_nvme_generic_name(path) {
            return Ok(DeviceSpec::Nvme { path: path.into() });
        }
        Ok(DeviceSpec::Uring { path: path.into() })
    }
}

/// True for `/dev/ngXnY`, the name the kernel gives a namespace's generic device.
fn is_nvme_generic_name(path: &str) -> bool {
    let Some(rest) = path.strip_prefix("/dev/ng") else {
        return false;
    };
    let Some((ctrl, ns)) = rest.split_once('n') else {
        return false;
    };
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    digits(ctrl) && digits(ns)
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Uring { path } => write!(f, "uring:{}", path.display()),
            DeviceSpec::Nvme { path } => write!(f, "nvme:{}", path.display()),
            DeviceSpec::Spdk { target } => write!(f, "spdk:{target}"),
            DeviceSpec::Faulty {
                seed,
                rates,
                safe_below,
                inner,
            } => write!(f, "faulty:{seed}{rates},safe_below={safe_below}:{inner}"),
            DeviceSpec::Emulated { path, model } => {
                match path {
                    None => write!(f, "emulated:mem")?,
                    Some(p) => write!(f, "emulated:file={}", p.display())?,
                }
                write!(
                    f,
                    ",latency_us={},read_mbps={},write_mbps={},queue_depth={},parallelism={}",
                    model.latency_us,
                    model.read_mbps,
                    model.write_mbps,
                    model.queue_depth,
                    model.parallelism
                )
            }
        }
    }
}

impl DeviceSpec {
    /// Opens the device. `capacity` sizes new files and memory devices; an existing raw
    /// device or file keeps its size when `capacity` is `None`.
    pub fn open(&self, capacity: Option<u64>) -> Result<Arc<dyn BlockDevice>> {
        match self {
            DeviceSpec::Uring { path } => {
                Ok(Arc::new(uring::UringDevice::open(path, capacity, 64)?))
            }
            DeviceSpec::Nvme { path } => Ok(Arc::new(nvme::NvmeDevice::open(path, 64)?)),
            DeviceSpec::Faulty {
                seed,
                rates,
                safe_below,
                inner,
            } => {
                let disk = faulty::FaultyDisk::new(inner.open(capacity)?, *seed, rates.clone())?;
                disk.set_safe_below(*safe_below);
                Ok(disk.device())
            }
            #[cfg(feature = "spdk")]
            DeviceSpec::Spdk { target } => Ok(Arc::new(spdk::SpdkDevice::open(
                &spdk::SpdkTarget::parse(target)?,
                64,
            )?)),
            #[cfg(not(feature = "spdk"))]
            DeviceSpec::Spdk { target } => Err(Error::Unimplemented(format!(
                "device spdk:{target}: this csd was built without SPDK (build SPDK with \
                 scripts/build-spdk.sh, then cargo build --release --features spdk with SPDK_DIR set)"
            ))),
            DeviceSpec::Emulated { path, model } => {
                let cap = capacity.or_else(|| {
                    path.as_ref()
                        .and_then(|p| std::fs::metadata(p).ok())
                        .map(|m| m.len())
                });
                let cap = cap.ok_or_else(|| {
                    Error::InvalidArgument("an emulated device needs a capacity".into())
                })?;
                Ok(Arc::new(emulated::EmulatedDevice::open(
                    path.as_deref(),
                    cap,
                    DEFAULT_BLOCK_SIZE,
                    model.clone(),
                )?))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        assert_eq!(
            "/tmp/x".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Uring {
                path: "/tmp/x".into()
            }
        );
        let DeviceSpec::Emulated { path, model } =
            "emulated:mem,latency_us=80,read_mbps=2000,parallelism=4"
                .parse()
                .unwrap()
        else {
            panic!("not emulated")
        };
        assert!(path.is_none());
        assert_eq!(
            (model.latency_us, model.read_mbps, model.parallelism),
            (80.0, 2000.0, 4)
        );
        let e = "emulated:mem,speed=3"
            .parse::<DeviceSpec>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown option \"speed\""), "{e}");
        assert!("emulated:disk".parse::<DeviceSpec>().is_err());
        for (spec, nvme) in [
            ("nvme:/dev/ng0n1", true),
            ("/dev/ng12n3", true),
            ("uring:/dev/ng0n1", false),
            ("/dev/nvme0n1", false),
            ("/dev/ngx", false),
            ("/dev/ng0n", false),
        ] {
            let parsed = spec.parse::<DeviceSpec>().unwrap();
            assert_eq!(matches!(parsed, DeviceSpec::Nvme { .. }), nvme, "{spec}");
        }
        assert!("nvme:".parse::<DeviceSpec>().is_err());
        // A faulty device over another spec, round-tripping through its text.
        let spec = "faulty:42,rot=0.001,flush_fail=0.01,safe_below=129:emulated:mem"
            .parse::<DeviceSpec>()
            .unwrap();
        let DeviceSpec::Faulty {
            seed,
            rates,
            safe_below,
            inner,
        } = &spec
        else {
            panic!("not faulty: {spec:?}")
        };
        assert_eq!(
            (*seed, rates.rot, rates.flush_fail, *safe_below),
            (42, 0.001, 0.01, 129)
        );
        assert!(matches!(**inner, DeviceSpec::Emulated { path: None, .. }));
        assert_eq!(spec.to_string().parse::<DeviceSpec>().unwrap(), spec);
        assert!(spec.open(Some(1 << 20)).is_ok());
        for bad in [
            "faulty:x:emulated:mem",
            "faulty:1,rot=2:emulated:mem",
            "faulty:1,wobble=0.1:emulated:mem",
            "faulty:1",
        ] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad}");
        }
        assert!(
            "emulated:mem,latency_us=fast"
                .parse::<DeviceSpec>()
                .is_err()
        );
    }

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("3 parsecs").is_err());
    }

    #[test]
    fn dma_buf_is_aligned_and_zeroed() {
        let mut b = DmaBuf::zeroed(8192);
        assert_eq!(b.as_mut_ptr() as usize % DMA_ALIGN, 0);
        assert!(b.iter().all(|&x| x == 0));
    }
}
