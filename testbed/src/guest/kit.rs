//! What booting a guest takes from the host: QEMU, a static busybox, and the guest
//! kernel with its virtio-net modules, as `scripts/setup-qemu.sh` unpacks them into
//! `$CSD_QEMU_HOME` (default `~/.cache/csd/qemu`).

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The host's parts of a guest.
#[derive(Debug, Clone)]
pub struct Kit {
    /// `qemu-system-x86_64`.
    pub qemu: PathBuf,
    /// The guest kernel.
    pub vmlinuz: PathBuf,
    /// Kernel modules, in the order they load.
    pub modules: Vec<PathBuf>,
    /// `uio` and `uio_pci_generic`, in that order, when unpacked: what an SPDK
    /// guest binds its controller to.
    pub uio: Option<[PathBuf; 2]>,
    /// A statically linked busybox (the guest's shell and tools).
    pub busybox: PathBuf,
    /// The kernel package's name.
    pub kernel: String,
}

/// Where the setup script unpacks the kernel.
pub fn home() -> PathBuf {
    std::env::var_os("CSD_QEMU_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            Path::new(&home).join(".cache/csd/qemu")
        })
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

impl Kit {
    /// Finds every part, or says what is missing and how to get it.
    pub fn find() -> Result<Kit> {
        let missing = |what: String| {
            Error::Guest(format!(
                "{what}: run scripts/setup-qemu.sh (it installs QEMU and busybox-static and \
                 unpacks Debian's cloud kernel into {})",
                home().display()
            ))
        };
        let qemu = on_path("qemu-system-x86_64")
            .ok_or_else(|| missing("qemu-system-x86_64 is not on PATH".into()))?;
        let busybox = ["/bin/busybox", "/usr/bin/busybox"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .ok_or_else(|| missing("no busybox".into()))?;
        let dir = home();
        let vmlinuz = dir.join("vmlinuz");
        if !vmlinuz.is_file() {
            return Err(missing(format!("no guest kernel at {}", vmlinuz.display())));
        }
        let order = std::fs::read_to_string(dir.join("modules/order"))
            .map_err(|_| missing("no module list (modules/order)".into()))?;
        let modules: Vec<PathBuf> = order
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|m| dir.join("modules").join(format!("{}.ko", m.trim())))
            .collect();
        if let Some(m) = modules.iter().find(|m| !m.is_file()) {
            return Err(missing(format!("module {} is missing", m.display())));
        }
        let uio = ["uio", "uio_pci_generic"].map(|m| dir.join(format!("modules/spdk/{m}.ko")));
        let uio = uio.iter().all(|p| p.is_file()).then_some(uio);
        let kernel = std::fs::read_to_string(dir.join("kernel"))
            .unwrap_or_default()
            .trim()
            .to_string();
        Ok(Kit {
            qemu,
            vmlinuz,
            modules,
            uio,
            busybox,
            kernel,
        })
    }
}
