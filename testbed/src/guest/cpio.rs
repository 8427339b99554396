//! A writer of the `newc` cpio format, the one the Linux kernel unpacks as an
//! initramfs (Documentation/driver-api/early-userspace/buffer-format.rst): a
//! 110-byte ASCII header per entry, the name, the data, each padded to 4 bytes, and a
//! `TRAILER!!!` entry at the end. Files stream from disk; nothing is staged.

use std::io::{self, Write};
use std::path::Path;

/// Writes an archive entry by entry.
pub(crate) struct CpioWriter<W: Write> {
    out: W,
    ino: u32,
    written: u64,
}

const DIR: u32 = 0o040_000;
const FILE: u32 = 0o100_000;
const SYMLINK: u32 = 0o120_000;

impl<W: Write> CpioWriter<W> {
    pub(crate) fn new(out: W) -> Self {
        CpioWriter {
            out,
            ino: 1,
            written: 0,
        }
    }

    fn pad(&mut self) -> io::Result<()> {
        let n = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0u8; 3][..n])
    }

    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    fn header(&mut self, name: &str, mode: u32, size: u64) -> io::Result<()> {
        let size = u32::try_from(size).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name}: newc archives hold files under 4 GiB"),
            )
        })?;
        let nlink = if mode & DIR != 0 { 2 } else { 1 };
        let h = format!(
            "070701{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}",
            self.ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            size,
            0, // dev major
            0, // dev minor
            0, // rdev major
            0, // rdev minor
            name.len() + 1,
            0, // check
        );
        self.ino += 1;
        self.put(h.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()
    }

    /// A directory (its parents must come first).
    pub(crate) fn dir(&mut self, name: &str) -> io::Result<()> {
        self.header(name, DIR | 0o755, 0)
    }

    /// A file with these bytes.
    pub(crate) fn file(&mut self, name: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        self.header(name, FILE | mode, data.len() as u64)?;
        self.put(data)?;
        self.pad()
    }

    /// A file copied from `src`, streamed.
    pub(crate) fn file_from(&mut self, name: &str, mode: u32, src: &Path) -> io::Result<()> {
        let mut f = std::fs::File::open(src)?;
        let len = f.metadata()?.len();
        self.header(name, FILE | mode, len)?;
        let copied = io::copy(&mut f, &mut self.out)?;
        if copied != len {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{} changed while it was archived", src.display()),
            ));
        }
        self.written += copied;
        self.pad()
    }

    /// A symbolic link to `target`.
    pub(crate) fn symlink(&mut self, name: &str, target: &str) -> io::Result<()> {
        self.header(name, SYMLINK | 0o777, target.len() as u64)?;
        self.put(target.as_bytes())?;
        self.pad()
    }

    /// Ends the archive and hands back the writer.
    pub(crate) fn finish(mut self) -> io::Result<W> {
        self.header("TRAILER!!!", 0, 0)?;
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_aligned_and_named() {
        let mut w = CpioWriter::new(Vec::new());
        w.dir("bin").unwrap();
        w.file("bin/x", 0o755, b"hello").unwrap();
        w.symlink("sh", "bin/x").unwrap();
        let out = w.finish().unwrap();
        assert_eq!(out.len() % 4, 0);
        assert!(out.starts_with(b"070701"));
        // Second entry: header at a 4-byte boundary after "bin\0" (110 + 4 = 114 -> 116).
        assert_eq!(&out[116..122], b"070701");
        let size = std::str::from_utf8(&out[116 + 54..116 + 62]).unwrap();
        assert_eq!(u32::from_str_radix(size, 16).unwrap(), 5);
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("bin/x\0") && text.contains("hello"));
        let trailer = text.rfind("070701").unwrap();
        assert_eq!(&text[trailer + 110..trailer + 121], "TRAILER!!!\0");
    }
}
