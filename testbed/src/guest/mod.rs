//! Storage nodes in QEMU guests: a whole machine per node — its own kernel, an
//! emulated NVMe controller over a backing file on the host, the node reached over
//! QEMU's user network — so the node drives a real NVMe queue through the guest
//! kernel (`--device nvme:/dev/ng0n1`) instead of a file.
//!
//! QEMU runs in TCG (software emulation): the host has no KVM for a stock guest.
//! Timings inside a guest are those of an emulated machine and say nothing about
//! real hardware; answers, commands and crash behaviour are real.
//!
//! * [`kit`]: QEMU, busybox and the guest kernel on the host.
//! * [`blkdebug`]: media faults injected under the namespace.
//! * [`initramfs`]: the guest's root file system, written with [`cpio`].
//! * [`spdk`]: what a guest whose node runs SPDK's PCIe driver adds.

pub mod blkdebug;
mod cpio;
pub mod initramfs;
pub mod kit;
mod spdk;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use csd_runtime::node_client::NodeClient;

use crate::{Error, Result};

pub use blkdebug::{FaultedIo, MediaFault};
pub use kit::{Arch, Kit};

/// The port the node listens on inside every guest.
const GUEST_PORT: u16 = 7070;

/// How long a guest may take from QEMU's start to a node answering.
const BOOT_TIMEOUT: Duration = Duration::from_secs(180);

/// One guest machine running one node.
#[derive(Debug, Clone)]
pub struct GuestSpec {
    /// The machine emulated.
    pub arch: Arch,
    /// The `csd` executable the guest runs (any Linux build for `arch`; debug info is
    /// stripped on the way in).
    pub binary: PathBuf,
    /// The backing file of the guest's emulated NVMe namespace (created, or grown, to
    /// `disk_bytes`; kept across boots).
    pub disk: PathBuf,
    /// The namespace's size.
    pub disk_bytes: u64,
    /// Bytes per LBA of the emulated namespace (512 or 4096).
    pub lba_bytes: u32,
    /// Virtual CPUs.
    pub cpus: usize,
    /// Guest memory in MiB (the initramfs, with the binary, lives in it).
    pub memory_mib: u64,
    /// `--device` of the node inside the guest: `nvme:/dev/ng0n1` (passthrough) or
    /// `uring:/dev/nvme0n1` (the same namespace through the block layer).
    pub device: String,
    /// Further `csd serve` arguments (no spaces: each travels as one kernel
    /// command-line word).
    pub node_args: Vec<String>,
    /// Run the binary with these arguments instead of `serve` (no spaces either),
    /// then power off: see [`Guest::run_to_exit`].
    pub run: Option<Vec<String>>,
    /// Where the serial log goes (the initramfs is kept in the kit's folder).
    pub work: PathBuf,
    /// Commands of the namespace that fail, as a drive's media errors: QEMU's
    /// `blkdebug` driver under the namespace fails them with EIO, and the emulated
    /// controller answers with the NVMe status a drive would (Unrecovered Read
    /// Error for a read; see [`blkdebug`] and [`Guest::restart_with_faults`]).
    pub media_faults: Vec<MediaFault>,
    /// The SPDK build (`SPDK_DIR`) a `binary` built with the `spdk` feature loads:
    /// set by [`with_spdk`](Self::with_spdk), the node drives the controller with
    /// SPDK's user-space PCIe driver.
    pub spdk: Option<PathBuf>,
    /// An onnxruntime library built for `arch` (`libonnxruntime.so`, e.g.
    /// [`Kit::onnxruntime`]): set by [`with_onnxruntime`](Self::with_onnxruntime),
    /// the guest carries it and the libraries it links, and the node loads it for
    /// ONNX models.
    pub onnxruntime: Option<PathBuf>,
}

impl GuestSpec {
    /// A guest of `cpus` CPUs running `binary` on an NVMe namespace backed by `disk`,
    /// with the usual sizes.
    pub fn new(binary: PathBuf, disk: PathBuf, work: PathBuf) -> Self {
        GuestSpec {
            arch: Arch::X86_64,
            binary,
            disk,
            disk_bytes: 1 << 30,
            lba_bytes: 512,
            cpus: 1,
            memory_mib: 1536,
            device: "nvme:/dev/ng0n1".into(),
            node_args: Vec::new(),
            run: None,
            work,
            media_faults: Vec::new(),
            spdk: None,
            onnxruntime: None,
        }
    }

    /// A computational storage drive's shape: an arm64 machine with four Cortex-A53
    /// cores and 2 GiB, its node told so (`--cpus 4 --memory 2GiB`), running
    /// `binary` (an aarch64 build: `scripts/build-aarch64.sh`).
    pub fn csd(binary: PathBuf, disk: PathBuf, work: PathBuf) -> Self {
        GuestSpec {
            arch: Arch::Aarch64,
            cpus: 4,
            memory_mib: 2048,
            node_args: ["--cpus", "4", "--memory", "2GiB"]
                .map(String::from)
                .to_vec(),
            ..GuestSpec::new(binary, disk, work)
        }
    }

    /// The node drives the emulated controller with SPDK's PCIe driver
    /// (`--device spdk:pcie=…`), loading SPDK from `spdk_dir`'s build: the guest
    /// binds the controller to `uio_pci_generic`, reserves hugepages and advertises
    /// the CPU features SPDK and DPDK were built for; it gets at least 2 GiB.
    pub fn with_spdk(mut self, spdk_dir: PathBuf) -> Self {
        self.device = format!("spdk:pcie={}", spdk::BDF);
        self.memory_mib = self.memory_mib.max(spdk::MIN_MEMORY_MIB);
        self.spdk = Some(spdk_dir);
        self
    }

    /// The node runs ONNX models on `lib`, an onnxruntime library built for the
    /// guest's machine (the guest's `/lib/libonnxruntime.so`, found through
    /// `ORT_DYLIB_PATH`).
    pub fn with_onnxruntime(mut self, lib: PathBuf) -> Self {
        self.onnxruntime = Some(lib);
        self
    }
}

/// The `csd` binary an x86-64 guest should run when none is named: see
/// [`default_binary_for`].
pub fn default_binary() -> Result<PathBuf> {
    default_binary_for(Arch::X86_64)
}

/// The `csd` binary an `arch` guest should run when none is named. x86-64:
/// `$CSD_GUEST_BINARY`, else the `csd` next to this executable (or one folder up,
/// from a test binary in `deps/`). aarch64: `$CSD_GUEST_BINARY_AARCH64`, else the
/// cross build beside this target folder (`scripts/build-aarch64.sh`:
/// `TARGET/aarch64-unknown-linux-gnu/{debug,release}/csd`, the same profile first).
pub fn default_binary_for(arch: Arch) -> Result<PathBuf> {
    let var = match arch {
        Arch::X86_64 => "CSD_GUEST_BINARY",
        Arch::Aarch64 => "CSD_GUEST_BINARY_AARCH64",
    };
    if let Some(p) = std::env::var_os(var) {
        return Ok(PathBuf::from(p));
    }
    let me = std::env::current_exe()
        .map_err(|e| Error::Guest(format!("finding this executable: {e}")))?;
    let dir = me.parent().map(PathBuf::from).unwrap_or_default();
    let candidates: Vec<PathBuf> = match arch {
        Arch::X86_64 => vec![dir.join("csd"), dir.join("../csd")],
        Arch::Aarch64 => {
            // TARGET/PROFILE or TARGET/PROFILE/deps.
            let profile_dir = if dir.ends_with("deps") {
                dir.join("..")
            } else {
                dir.clone()
            };
            let profile = profile_dir
                .canonicalize()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "debug".into());
            let cross = profile_dir.join("../aarch64-unknown-linux-gnu");
            let mut order = vec![profile.clone()];
            order.extend(
                ["debug", "release"]
                    .iter()
                    .map(|p| p.to_string())
                    .filter(|p| *p != profile),
            );
            order.iter().map(|p| cross.join(p).join("csd")).collect()
        }
    };
    if let Some(found) = candidates.into_iter().find(|c| c.is_file()) {
        return Ok(found);
    }
    Err(Error::Guest(match arch {
        Arch::X86_64 => format!(
            "no csd binary next to {} (build it: cargo build -p csd-client --bin csd, or set CSD_GUEST_BINARY)",
            me.display()
        ),
        Arch::Aarch64 => format!(
            "no aarch64 csd beside {} (build it: scripts/build-aarch64.sh, or set CSD_GUEST_BINARY_AARCH64)",
            me.display()
        ),
    }))
}

/// The ELF machine of `binary`, or `None` when it is no ELF file.
fn elf_machine(binary: &std::path::Path) -> Option<u16> {
    use std::io::Read;
    let mut head = [0u8; 20];
    std::fs::File::open(binary)
        .ok()?
        .read_exact(&mut head)
        .ok()?;
    (head[..4] == *b"\x7fELF").then(|| u16::from_le_bytes([head[18], head[19]]))
}

/// A running guest.
pub struct Guest {
    spec: GuestSpec,
    kit: Kit,
    initramfs: PathBuf,
    child: Option<Child>,
    port: u16,
    /// The node's URL from the host.
    pub url: String,
    /// Seconds from starting QEMU to the node's first answer, last boot.
    pub boot_s: f64,
    /// The serial console's log.
    pub log: PathBuf,
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0")
        .map_err(|e| Error::Guest(format!("finding a free port: {e}")))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| Error::Guest(format!("finding a free port: {e}")))
}

impl Guest {
    /// Checks `spec`, builds its initramfs and backing file; starts nothing.
    async fn prepare(spec: GuestSpec) -> Result<Guest> {
        let kit = Kit::find_for(spec.arch)?;
        if elf_machine(&spec.binary) != Some(spec.arch.elf_machine()) {
            return Err(Error::Guest(format!(
                "{} is not a Linux {} executable: the guest cannot run it{}",
                spec.binary.display(),
                spec.arch.name(),
                match spec.arch {
                    Arch::Aarch64 => " (build one with scripts/build-aarch64.sh)",
                    Arch::X86_64 => "",
                }
            )));
        }
        if let Some(lib) = &spec.onnxruntime
            && elf_machine(lib) != Some(spec.arch.elf_machine())
        {
            return Err(Error::Guest(format!(
                "{} is not an onnxruntime library for {}: the guest cannot load it (an arm64 \
                 guest's comes from scripts/setup-qemu.sh --arch aarch64)",
                lib.display(),
                spec.arch.name()
            )));
        }
        if let Some(a) = spec
            .node_args
            .iter()
            .chain(spec.run.iter().flatten())
            .find(|a| a.contains(char::is_whitespace) || a.is_empty())
        {
            return Err(Error::Guest(format!(
                "node argument {a:?}: guest arguments travel as kernel command-line words and \
                 cannot be empty or hold spaces"
            )));
        }
        if ![512, 4096].contains(&spec.lba_bytes) {
            return Err(Error::Guest(format!(
                "lba_bytes {}: QEMU's NVMe namespace takes 512 or 4096",
                spec.lba_bytes
            )));
        }
        let initramfs = {
            let (kit, binary) = (kit.clone(), spec.binary.clone());
            let extras = initramfs::Extras {
                spdk: spec.spdk.clone(),
                onnxruntime: spec.onnxruntime.clone(),
            };
            let dir = kit::home().join("initramfs");
            tokio::task::spawn_blocking(move || initramfs::build(&kit, &binary, &dir, &extras))
                .await
                .map_err(|e| Error::Guest(format!("building the initramfs: {e}")))??
        };
        let disk = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&spec.disk)
            .map_err(|e| Error::Guest(format!("opening {}: {e}", spec.disk.display())))?;
        let len = disk.metadata().map(|m| m.len()).unwrap_or(0);
        if len < spec.disk_bytes {
            disk.set_len(spec.disk_bytes)
                .map_err(|e| Error::Guest(format!("sizing {}: {e}", spec.disk.display())))?;
        }
        let log = spec.work.join(format!(
            "{}.serial.log",
            spec.disk
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("guest")
        ));
        Ok(Guest {
            spec,
            kit,
            initramfs,
            child: None,
            port: 0,
            url: String::new(),
            boot_s: 0.0,
            log,
        })
    }

    /// Builds the guest's initramfs (once per binary) and boots it; returns when the
    /// node answers.
    pub async fn boot(spec: GuestSpec) -> Result<Guest> {
        let mut g = Self::prepare(spec).await?;
        g.start().await?;
        Ok(g)
    }

    /// Boots a guest whose [`GuestSpec::run`] is set, waits (at most `timeout`) for
    /// the program to end and the guest to power off, and returns the serial
    /// console's text (the program's output among the kernel's) and the seconds the
    /// whole machine ran.
    pub async fn run_to_exit(spec: GuestSpec, timeout: Duration) -> Result<(String, f64)> {
        if spec.run.is_none() {
            return Err(Error::Guest("run_to_exit needs GuestSpec::run".into()));
        }
        let mut g = Self::prepare(spec).await?;
        let t = Instant::now();
        let mut child = g.spawn()?;
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            if t.elapsed() > timeout {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Guest(format!(
                    "the guest ran past {} s:\n{}",
                    timeout.as_secs(),
                    g.log_tail(30)
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let text = std::fs::read_to_string(&g.log).unwrap_or_default();
        Ok((text, t.elapsed().as_secs_f64()))
    }

    /// The QEMU command line.
    fn command(&self) -> Command {
        let s = &self.spec;
        let console = match s.arch {
            Arch::X86_64 => "ttyS0",
            Arch::Aarch64 => "ttyAMA0",
        };
        let mut append = format!("console={console} quiet panic=-1");
        if s.spdk.is_some() {
            append.push_str(&format!(" hugepages={}", spdk::HUGEPAGES));
        }
        let advertise = format!("grpc://127.0.0.1:{}", self.port);
        let args = [
            "serve",
            "--listen",
            &format!("0.0.0.0:{GUEST_PORT}"),
            "--advertise",
            &advertise,
            "--device",
            &s.device,
        ]
        .map(String::from);
        let words: Vec<&String> = match &s.run {
            Some(run) => run.iter().collect(),
            None => args.iter().chain(&s.node_args).collect(),
        };
        for a in words {
            append.push_str(" csd.arg=");
            append.push_str(a);
        }
        let mut c = Command::new(&self.kit.qemu);
        if s.arch == Arch::Aarch64 {
            c.args(["-M", "virt", "-cpu", "cortex-a53"]);
        }
        c.args(["-accel", "tcg", "-display", "none", "-no-reboot"])
            .args(["-m", &s.memory_mib.to_string()])
            .args(["-smp", &s.cpus.to_string()])
            .arg("-serial")
            .arg(format!("file:{}", self.log.display()))
            .arg("-kernel")
            .arg(&self.kit.vmlinuz)
            .arg("-initrd")
            .arg(&self.initramfs)
            .args(["-append", &append])
            .arg("-drive")
            .arg(format!(
                "file={},if=none,id=nvm,format=raw,cache=writeback",
                self.backing()
            ))
            .arg("-device")
            .arg(format!(
                "nvme,serial=csd0,drive=nvm,logical_block_size={0},physical_block_size={0}{1}",
                s.lba_bytes,
                // SPDK is told the controller's address.
                if s.spdk.is_some() { ",addr=0x10" } else { "" }
            ))
            .args(["-netdev"])
            .arg(format!(
                "user,id=n0,hostfwd=tcp:127.0.0.1:{}-:{GUEST_PORT}",
                self.port
            ))
            .args(["-device", "virtio-net-pci,netdev=n0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if s.spdk.is_some() {
            c.args(["-cpu", spdk::CPU]);
        }
        c
    }

    /// The namespace's backing file as QEMU's `-drive file=` names it: the disk, or
    /// `blkdebug:CONFIG:DISK` with a rule per media fault (see
    /// [`write_blkdebug_rules`](Self::write_blkdebug_rules)).
    fn backing(&self) -> String {
        let s = &self.spec;
        if s.media_faults.is_empty() {
            s.disk.display().to_string()
        } else {
            format!(
                "blkdebug:{}:{}",
                self.blkdebug_rules().display(),
                s.disk.display()
            )
        }
    }

    /// Where the `blkdebug` rules go: next to the serial log.
    fn blkdebug_rules(&self) -> PathBuf {
        self.spec.work.join("blkdebug.conf")
    }

    /// Writes the `blkdebug` rules of the spec's media faults.
    fn write_blkdebug_rules(&self) -> Result<()> {
        if self.spec.media_faults.is_empty() {
            return Ok(());
        }
        let path = self.blkdebug_rules();
        std::fs::write(&path, blkdebug::rules(&self.spec.media_faults))
            .map_err(|e| Error::Guest(format!("writing {}: {e}", path.display())))
    }

    /// Starts QEMU on a fresh forwarded port, with a fresh serial log.
    fn spawn(&mut self) -> Result<Child> {
        self.port = free_port()?;
        self.url = format!("grpc://127.0.0.1:{}", self.port);
        let _ = std::fs::remove_file(&self.log);
        self.write_blkdebug_rules()?;
        self.command()
            .spawn()
            .map_err(|e| Error::Guest(format!("starting {}: {e}", self.kit.qemu.display())))
    }

    async fn start(&mut self) -> Result<()> {
        let t = Instant::now();
        let child = self.spawn()?;
        self.child = Some(child);
        loop {
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                let mut err = String::new();
                if let Some(mut e) = c.stderr.take() {
                    use std::io::Read;
                    let _ = e.read_to_string(&mut err);
                }
                self.child = None;
                return Err(Error::Guest(format!(
                    "QEMU exited ({status}) before the node answered: {}\n{}",
                    err.trim(),
                    self.log_tail(30)
                )));
            }
            if t.elapsed() > BOOT_TIMEOUT {
                self.kill();
                return Err(Error::Guest(format!(
                    "the guest's node did not answer within {} s:\n{}",
                    BOOT_TIMEOUT.as_secs(),
                    self.log_tail(30)
                )));
            }
            // QEMU accepts on the forwarded port before the guest listens: only an
            // answer counts.
            if let Ok(c) = NodeClient::connect(&self.url).await
                && c.stats().await.is_ok()
            {
                self.boot_s = t.elapsed().as_secs_f64();
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Kills QEMU (SIGKILL: the guest gets no chance to flush or shut down) and
    /// waits for it to go.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills the guest and boots it again on the same backing file (a new port).
    pub async fn restart(&mut self) -> Result<()> {
        self.kill();
        self.start().await
    }

    /// Kills the guest and boots it again with these commands failing as media
    /// errors ([`GuestSpec::media_faults`]; empty: none).
    pub async fn restart_with_faults(&mut self, faults: Vec<MediaFault>) -> Result<()> {
        self.spec.media_faults = faults;
        self.restart().await
    }

    /// The last `lines` lines of the serial console.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Where the host reaches the node (QEMU's forwarded port).
    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// What the guest runs.
    pub fn spec(&self) -> &GuestSpec {
        &self.spec
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill();
    }
}
