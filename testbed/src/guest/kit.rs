//! What booting a guest takes from the host: QEMU, a static busybox, and the guest
//! kernel with its virtio-net modules, as `scripts/setup-qemu.sh` unpacks them into
//! `$CSD_QEMU_HOME` (default `~/.cache/csd/qemu`; an arm64 guest's, from
//! `scripts/setup-qemu.sh --arch aarch64`, into its `arm64/`).

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The machine a guest emulates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// A PC (`qemu-system-x86_64`), the host's own architecture.
    #[default]
    #[serde(rename = "x86_64")]
    X86_64,
    /// An arm64 board (`qemu-system-aarch64 -M virt`) with Cortex-A53 cores: the
    /// cores computational storage drives run Linux on.
    Aarch64,
}

impl Arch {
    /// Its name, as Rust's target triples and `uname -m` spell it.
    pub fn name(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64",
            Arch::Aarch64 => "aarch64",
        }
    }

    /// ELF `e_machine` of its executables.
    pub(super) fn elf_machine(self) -> u16 {
        match self {
            Arch::X86_64 => 0x3e,
            Arch::Aarch64 => 0xb7,
        }
    }

    fn qemu(self) -> &'static str {
        match self {
            Arch::X86_64 => "qemu-system-x86_64",
            Arch::Aarch64 => "qemu-system-aarch64",
        }
    }

    /// The command that installs its kit.
    fn setup(self) -> &'static str {
        match self {
            Arch::X86_64 => "scripts/setup-qemu.sh",
            Arch::Aarch64 => "scripts/setup-qemu.sh --arch aarch64",
        }
    }

    /// Where its kernel and modules are unpacked.
    fn dir(self) -> PathBuf {
        match self {
            Arch::X86_64 => home(),
            Arch::Aarch64 => home().join("arm64"),
        }
    }
}

/// The host's parts of a guest.
#[derive(Debug, Clone)]
pub struct Kit {
    /// The machine the parts are for.
    pub arch: Arch,
    /// `qemu-system-x86_64` or `qemu-system-aarch64`.
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
    /// An onnxruntime library built for this machine, when there is one: an arm64
    /// guest's is unpacked from onnxruntime's aarch64 wheel into `onnxruntime/` by
    /// the setup script (when scripts/setup-ml.sh has run); an x86-64 guest uses the
    /// host's (`$CSD_ML_HOME/lib`). See [`GuestSpec::with_onnxruntime`](super::GuestSpec::with_onnxruntime).
    pub onnxruntime: Option<PathBuf>,
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
    /// Finds every part of an x86-64 guest, or says what is missing and how to get it.
    pub fn find() -> Result<Kit> {
        Self::find_for(Arch::X86_64)
    }

    /// Finds every part of an `arch` guest, or says what is missing and how to get it.
    pub fn find_for(arch: Arch) -> Result<Kit> {
        let dir = arch.dir();
        let missing = |what: String| {
            Error::Guest(format!(
                "{what}: run {} (it installs QEMU and busybox-static and unpacks Debian's \
                 cloud kernel into {})",
                arch.setup(),
                dir.display()
            ))
        };
        let qemu = on_path(arch.qemu())
            .ok_or_else(|| missing(format!("{} is not on PATH", arch.qemu())))?;
        let busybox = match arch {
            Arch::X86_64 => ["/bin/busybox", "/usr/bin/busybox"]
                .iter()
                .map(PathBuf::from)
                .find(|p| p.is_file()),
            Arch::Aarch64 => Some(dir.join("busybox")).filter(|p| p.is_file()),
        }
        .ok_or_else(|| missing("no busybox".into()))?;
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
        let onnxruntime = match arch {
            Arch::X86_64 => csd_ml_pushdown::onnx::runtime::library_path(),
            Arch::Aarch64 => dir.join("onnxruntime/libonnxruntime.so"),
        };
        Ok(Kit {
            arch,
            qemu,
            vmlinuz,
            modules,
            uio,
            busybox,
            kernel,
            onnxruntime: Some(onnxruntime).filter(|p| p.is_file()),
        })
    }
}
