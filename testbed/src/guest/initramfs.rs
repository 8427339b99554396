//! The guest's root file system: busybox, an `/init` that brings up the network and
//! runs `/csd` with the arguments on the kernel command line (`csd.arg=…`, one per
//! argument), the `csd` binary stripped of debug info, the shared libraries it
//! links, and the virtio-net modules. Built once per binary (and variant: an SPDK
//! guest's adds what [`super::spdk`] lists, an ONNX-capable guest's onnxruntime and
//! its libraries) and kept.

use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::process::Command;

use std::collections::BTreeMap;

use super::cpio::CpioWriter;
use super::kit::{Arch, Kit};
use super::spdk::{self, Entry};
use crate::{Error, Result};

/// The guest's `/init`.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
/bin/busybox --install -s /bin
export PATH=/bin
[ -f /lib/libonnxruntime.so ] && export ORT_DYLIB_PATH=/lib/libonnxruntime.so
for m in $(cat /modules/order); do insmod /modules/$m.ko || echo "csd-guest: insmod $m failed"; done
[ -f /prestart ] && . /prestart
ip link set lo up
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
ip route add default via 10.0.2.2
set --
for w in $(cat /proc/cmdline); do
  case "$w" in csd.arg=*) set -- "$@" "${w#csd.arg=}" ;; esac
done
echo "csd-guest: up in $(cut -d' ' -f1 /proc/uptime) s; running csd $*"
/csd "$@"
echo "csd-guest: csd exited with status $?"
poweroff -f
"#;

/// Shared libraries `binary` loads (with its interpreter), each as its path in the
/// guest and the host file that holds it: for the host's own architecture as `ldd`
/// lists them; for another, the ELF's `NEEDED` entries and interpreter found in
/// Debian's cross sysroot (`/usr/aarch64-linux-gnu/lib`, from
/// `scripts/build-aarch64.sh`'s cross toolchain), all under the guest's `/lib`.
fn libraries(binary: &Path, arch: Arch) -> Result<Vec<(String, PathBuf)>> {
    if arch != Arch::X86_64 {
        return cross_libraries(binary, arch);
    }
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(|e| Error::Guest(format!("running ldd on {}: {e}", binary.display())))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || text.contains("not a dynamic executable") {
        return Ok(Vec::new());
    }
    Ok(text
        .lines()
        .filter_map(|l| {
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| {
                (
                    path.trim_start_matches('/').to_string(),
                    PathBuf::from(path),
                )
            })
        })
        .collect())
}

fn cross_libraries(binary: &Path, arch: Arch) -> Result<Vec<(String, PathBuf)>> {
    let sysroot = PathBuf::from(format!("/usr/{}-linux-gnu/lib", arch.name()));
    let readelf = |flag: &str| -> Result<String> {
        let out = Command::new("readelf")
            .args([flag, "-W"])
            .arg(binary)
            .output()
            .map_err(|e| Error::Guest(format!("running readelf on {}: {e}", binary.display())))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let mut names: Vec<String> = readelf("-d")?
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| Some(l.split_once('[')?.1.split_once(']')?.0.to_string()))
        .collect();
    if let Some(interp) = readelf("-l")?.lines().find_map(|l| {
        l.split_once("program interpreter: ")?
            .1
            .split_once(']')
            .map(|(p, _)| p.to_string())
    }) {
        names.push(
            Path::new(&interp)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or(interp),
        );
    }
    names
        .into_iter()
        .map(|n| {
            let host = sysroot.join(&n);
            if host.is_file() {
                Ok((format!("lib/{n}"), host))
            } else {
                Err(Error::Guest(format!(
                    "{} needs {n}, which is not in {} (run scripts/build-aarch64.sh: it installs \
                     the cross toolchain)",
                    binary.display(),
                    sysroot.display()
                )))
            }
        })
        .collect()
}

/// What a guest carries beyond busybox, `csd` and its libraries.
#[derive(Debug, Clone, Default)]
pub(crate) struct Extras {
    /// The SPDK build (`SPDK_DIR`) the binary loads: an SPDK guest's files.
    pub spdk: Option<PathBuf>,
    /// An onnxruntime library for the guest's machine, carried as
    /// `/lib/libonnxruntime.so` (which `/init` names in `ORT_DYLIB_PATH`) with the
    /// libraries it links.
    pub onnxruntime: Option<PathBuf>,
}

/// `lib` (an onnxruntime library) as the guest's `lib/libonnxruntime.so`, with the
/// libraries it links, by archive path.
fn onnxruntime_files(lib: &Path, arch: Arch) -> Result<BTreeMap<String, Entry>> {
    let real = std::fs::canonicalize(lib)
        .map_err(|e| Error::Guest(format!("resolving {}: {e}", lib.display())))?;
    let mut out = BTreeMap::new();
    for (rel, dep) in libraries(&real, arch)? {
        let dep = std::fs::canonicalize(&dep)
            .map_err(|e| Error::Guest(format!("resolving {}: {e}", dep.display())))?;
        out.insert(rel, Entry::File(dep));
    }
    out.insert("lib/libonnxruntime.so".into(), Entry::File(real));
    Ok(out)
}

/// Builds (or finds, when one of this binary, kit and extras is already there) the
/// guest's initramfs in `dir`, keeping no other binary's of the same variant.
pub(crate) fn build(kit: &Kit, binary: &Path, dir: &Path, extras: &Extras) -> Result<PathBuf> {
    let spdk_dir = extras.spdk.as_deref();
    let io = |what: &str, e: std::io::Error| Error::Guest(format!("{what}: {e}"));
    let meta =
        std::fs::metadata(binary).map_err(|e| io(&format!("reading {}", binary.display()), e))?;
    let stamp = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    // An SPDK guest's archive also depends on SPDK's files and the guest's script.
    let spdk_files = spdk_dir.map(spdk::files).transpose()?;
    let mut variant = match &spdk_files {
        Some(f) => {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            format!("{f:?}{}", spdk::prestart()).hash(&mut h);
            format!("-spdk{:x}", h.finish())
        }
        None => String::new(),
    };
    let ort_files = extras
        .onnxruntime
        .as_deref()
        .map(|lib| onnxruntime_files(lib, kit.arch))
        .transpose()?;
    if let Some(f) = &ort_files {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for (rel, entry) in f {
            let stamp = match entry {
                Entry::File(p) => std::fs::metadata(p)
                    .map(|m| (m.len(), m.modified().ok()))
                    .ok(),
                Entry::Link(_) => None,
            };
            format!("{rel}{entry:?}{stamp:?}").hash(&mut h);
        }
        variant.push_str(&format!("-ort{:x}", h.finish()));
    }
    let arch = match kit.arch {
        Arch::X86_64 => "",
        Arch::Aarch64 => "-aarch64",
    };
    let key = format!("{:x}-{:x}-{}{variant}{arch}", meta.len(), stamp, kit.kernel);
    std::fs::create_dir_all(dir).map_err(|e| io(&format!("creating {}", dir.display()), e))?;
    let out = dir.join(format!("initramfs-{key}.cpio"));
    // One build at a time in this process (guests boot together); another process
    // writes its own temporary file and renames it over the same name.
    static BUILDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = BUILDING.lock().unwrap_or_else(|p| p.into_inner());
    if out.is_file() {
        return Ok(out);
    }
    // Shared libraries by archive path: csd's (as ldd lists them), then an SPDK
    // guest's files (libraries csd loads at run time), each path once.
    let mut libs: BTreeMap<String, Entry> = BTreeMap::new();
    for (rel, lib) in libraries(binary, kit.arch)? {
        // Follow symlinks: the archive holds the library's bytes.
        let real = std::fs::canonicalize(&lib)
            .map_err(|e| io(&format!("resolving {}", lib.display()), e))?;
        libs.insert(rel, Entry::File(real));
    }
    for (k, v) in ort_files.into_iter().flatten() {
        libs.entry(k).or_insert(v);
    }
    let uio = match spdk_files {
        Some(files) => {
            for (k, v) in files {
                libs.entry(k).or_insert(v);
            }
            Some(kit.uio.clone().ok_or_else(|| {
                Error::Guest(format!(
                    "no uio_pci_generic module under {}/modules/spdk: run scripts/setup-qemu.sh \
                     again (it unpacks it)",
                    super::kit::home().display()
                ))
            })?)
        }
        None => None,
    };
    // Strip debug info: the guest keeps the whole archive in memory.
    let stripped = dir.join(format!("csd.{}.stripped", std::process::id()));
    let strip = match kit.arch {
        Arch::X86_64 => "strip".to_string(),
        other => format!("{}-linux-gnu-strip", other.name()),
    };
    let ok = Command::new(&strip)
        .args(["--strip-debug", "-o"])
        .arg(&stripped)
        .arg(binary)
        .status()
        .is_ok_and(|s| s.success());
    let csd = if ok {
        stripped.clone()
    } else {
        binary.to_path_buf()
    };
    let tmp = out.with_extension(format!("{}.tmp", std::process::id()));
    let file =
        std::fs::File::create(&tmp).map_err(|e| io(&format!("creating {}", tmp.display()), e))?;
    let mut w = CpioWriter::new(BufWriter::with_capacity(1 << 20, file));
    let wrote = (|| -> std::io::Result<()> {
        for d in [
            "bin", "dev", "proc", "sys", "tmp", "etc", "modules", "lib", "lib64", "usr",
        ] {
            w.dir(d)?;
        }
        w.file_from("bin/busybox", 0o755, &kit.busybox)?;
        w.symlink("bin/sh", "busybox")?;
        w.file("init", 0o755, INIT.as_bytes())?;
        let mut order = String::new();
        for m in &kit.modules {
            let name = m.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
            w.file_from(&format!("modules/{name}.ko"), 0o644, m)?;
            order.push_str(name);
            order.push('\n');
        }
        w.file("modules/order", 0o644, order.as_bytes())?;
        if let Some(uio) = &uio {
            w.dir("modules/spdk")?;
            for m in uio {
                let name = m.file_name().and_then(|s| s.to_str()).unwrap_or_default();
                w.file_from(&format!("modules/spdk/{name}"), 0o644, m)?;
            }
            w.file("prestart", 0o644, spdk::prestart().as_bytes())?;
        }
        w.file_from("csd", 0o755, &csd)?;
        let mut made = std::collections::BTreeSet::new();
        for (rel, entry) in &libs {
            // Parent folders first (lib/x86_64-linux-gnu, …); the top ones exist.
            let mut parents: Vec<String> = Path::new(rel)
                .ancestors()
                .skip(1)
                .map(|p| p.to_string_lossy().into_owned())
                .filter(|p| !p.is_empty() && !["lib", "lib64", "usr"].contains(&p.as_str()))
                .collect();
            parents.reverse();
            for p in parents {
                if made.insert(p.clone()) {
                    w.dir(&p)?;
                }
            }
            match entry {
                Entry::File(real) => w.file_from(rel, 0o755, real)?,
                Entry::Link(target) => w.symlink(rel, target)?,
            }
        }
        w.finish()?;
        Ok(())
    })();
    let _ = std::fs::remove_file(&stripped);
    wrote.map_err(|e| io(&format!("writing {}", tmp.display()), e))?;
    // Keep only this binary's archive of this variant.
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let n = e.file_name();
            let n = n.to_string_lossy();
            let same_variant = n.contains("-spdk") == spdk_dir.is_some()
                && n.contains("-ort") == extras.onnxruntime.is_some()
                && n.ends_with("-aarch64.cpio") == (kit.arch == Arch::Aarch64);
            if n.starts_with("initramfs-")
                && n.ends_with(".cpio")
                && same_variant
                && e.path() != out
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    std::fs::rename(&tmp, &out).map_err(|e| io(&format!("renaming {}", tmp.display()), e))?;
    Ok(out)
}
