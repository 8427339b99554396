//! A guest whose node drives the emulated NVMe controller with SPDK's user-space PCIe
//! driver (`--device spdk:pcie=…`, a `csd` built with the `spdk` feature): the
//! controller is taken from the kernel's `nvme` driver and bound to
//! `uio_pci_generic`, 2 MiB hugepages are reserved and mounted, and the shared
//! libraries the binary loads at run time (SPDK's, DPDK's and the system ones they
//! need; nothing of them is linked, so `ldd csd` lists none) go into the initramfs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Error, Result};

/// Where the controller sits on the guest's PCI bus (QEMU's `addr=0x10`).
pub(crate) const BDF: &str = "0000:00:10.0";
/// 2 MiB hugepages reserved at boot: SPDK takes about 300 MiB at start (its buffer
/// pools), in 2 MiB pages that must stay physically put.
pub(crate) const HUGEPAGES: u32 = 320;
/// Guest memory an SPDK guest needs at least, MiB: the hugepages, the kernel, the
/// initramfs (in memory) and the node's own budget.
pub(crate) const MIN_MEMORY_MIB: u64 = 2048;
/// The CPU the guest advertises: SPDK (built for x86-64-v2 by
/// `scripts/build-spdk.sh`) and Debian's DPDK (`-march=corei7`) use SSSE3, SSE4.1/4.2
/// and POPCNT, which QEMU's default `qemu64` lacks (TCG raises #UD on them).
pub(crate) const CPU: &str = "qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt";

/// What `/init` sources before starting the node: folders DPDK and SPDK write to,
/// hugetlbfs, the controller rebound to `uio_pci_generic`, SPDK's library folder.
pub(crate) fn prestart() -> String {
    format!(
        r#"mkdir -p /var/run /var/tmp /dev/hugepages
mount -t hugetlbfs nodev /dev/hugepages
insmod /modules/spdk/uio.ko
insmod /modules/spdk/uio_pci_generic.ko
d=/sys/bus/pci/devices/{BDF}
[ -e $d/driver ] && echo {BDF} > $d/driver/unbind
echo uio_pci_generic > $d/driver_override
echo {BDF} > /sys/bus/pci/drivers_probe
echo "csd-guest: nvme {BDF} -> $(basename $(readlink $d/driver)); $(grep HugePages_Free /proc/meminfo)"
export LD_LIBRARY_PATH=/usr/local/lib
"#
    )
}

/// One entry of the archive: a file's bytes from the host, or a symlink.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Entry {
    File(PathBuf),
    Link(String),
}

/// The files a `csd` built against `spdk_dir` needs at run time, by archive path:
/// the libraries it loads — SPDK's in `usr/local/lib`, DPDK's and the system's in
/// `lib/x86_64-linux-gnu`; every name the loader may ask for (`libX.so`, its
/// SONAME) a symlink to the one file, so no library maps twice (DPDK registers its
/// buses in constructors) — and OpenSSL's configuration, which SPDK's environment
/// reads when it starts.
pub(crate) fn files(spdk_dir: &Path) -> Result<BTreeMap<String, Entry>> {
    let lib_dir = spdk_dir.join("build/lib");
    let mut out = BTreeMap::new();
    let mut names: Vec<(String, &str)> = Vec::new();
    let entries = std::fs::read_dir(&lib_dir)
        .map_err(|e| Error::Guest(format!("reading {}: {e}", lib_dir.display())))?;
    for e in entries.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with("libspdk_") && n.ends_with(".so") {
            names.push((n, "usr/local/lib"));
        }
    }
    if names.is_empty() {
        return Err(Error::Guest(format!(
            "no libspdk_*.so in {} (build SPDK with scripts/build-spdk.sh)",
            lib_dir.display()
        )));
    }
    // DPDK's and the system's, as SPDK's pkg-config lists them for its environment.
    let pc = Command::new("pkg-config")
        .env("PKG_CONFIG_PATH", lib_dir.join("pkgconfig"))
        .args(["--libs", "--static", "spdk_env_dpdk", "spdk_syslibs"])
        .output()
        .map_err(|e| Error::Guest(format!("running pkg-config: {e}")))?;
    if !pc.status.success() {
        return Err(Error::Guest(format!(
            "pkg-config spdk_env_dpdk spdk_syslibs: {}",
            String::from_utf8_lossy(&pc.stderr)
        )));
    }
    for w in String::from_utf8_lossy(&pc.stdout).split_whitespace() {
        if let Some(n) = w.strip_prefix("-l") {
            names.push((format!("lib{n}.so"), "lib/x86_64-linux-gnu"));
        }
    }
    let search = |name: &str, dir: &str| -> Option<PathBuf> {
        let mut dirs = vec![lib_dir.clone()];
        if dir != "usr/local/lib" {
            dirs = vec![
                "/usr/lib/x86_64-linux-gnu".into(),
                "/lib/x86_64-linux-gnu".into(),
            ];
        }
        dirs.into_iter().map(|d| d.join(name)).find(|p| p.exists())
    };
    let mut loaded = Vec::new();
    for (name, dir) in names {
        // Linker scripts (libm.so) and absent names (librt.so) fail to load in the
        // guest as on the host, where csd skips them.
        let Some(path) = search(&name, dir) else {
            continue;
        };
        let Ok(real) = std::fs::canonicalize(&path) else {
            continue;
        };
        if !is_elf(&real) {
            continue;
        }
        add(&mut out, dir, &name, &real);
        loaded.push((dir, real));
    }
    let ssl = Path::new("/usr/lib/ssl/openssl.cnf");
    let real = std::fs::canonicalize(ssl).map_err(|e| {
        Error::Guest(format!(
            "{}: {e} (SPDK's environment starts OpenSSL, which reads it)",
            ssl.display()
        ))
    })?;
    out.insert("usr/lib/ssl/openssl.cnf".into(), Entry::File(real));
    // What those need (NEEDED, by SONAME), where the loader looks for them.
    for (dir, real) in loaded {
        for (soname, path) in needed(&real)? {
            if let Ok(r) = std::fs::canonicalize(&path) {
                add(&mut out, dir, &soname, &r);
            }
        }
    }
    Ok(out)
}

/// `name` (in `dir`) as a link to `real`'s file, placed beside it.
fn add(out: &mut BTreeMap<String, Entry>, dir: &str, name: &str, real: &Path) {
    let file = real
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    out.entry(format!("{dir}/{file}"))
        .or_insert_with(|| Entry::File(real.to_path_buf()));
    if name != file {
        out.entry(format!("{dir}/{name}"))
            .or_insert_with(|| Entry::Link(file.clone()));
    }
}

fn is_elf(p: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 4];
    std::fs::File::open(p)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok_and(|()| head == *b"\x7fELF")
}

/// The libraries `lib` needs, as `ldd` resolves them: (SONAME, host path).
fn needed(lib: &Path) -> Result<Vec<(String, PathBuf)>> {
    let out = Command::new("ldd")
        .arg(lib)
        .output()
        .map_err(|e| Error::Guest(format!("running ldd on {}: {e}", lib.display())))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.trim().split_once(" => ")?;
            let path = rest.split_whitespace().next()?;
            path.starts_with('/')
                .then(|| (name.to_string(), PathBuf::from(path)))
        })
        // The C library and the loader are csd's own (copied from its ldd list).
        .filter(|(n, _)| !n.starts_with("libc.so") && !n.starts_with("ld-linux"))
        .collect())
}
