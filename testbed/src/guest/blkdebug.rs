//! Media faults under a guest's namespace, through QEMU's `blkdebug` driver: the
//! namespace's backing file is opened as `blkdebug:RULES:DISK`, and each rule fails
//! the host-side I/O the emulated controller issues for one kind of command
//! (covering one 512-byte sector, or any for a flush) with EIO. The controller
//! answers the guest as a drive does: a failed read is Unrecovered Read Error, a
//! failed write or flush is Write Fault, a failed deallocate an internal error.
//! Failed writes leave the sector's old bytes in place.
//!
//! Every rule is armed by the namespace's first read (blkdebug's `read_aio` event,
//! which the node's catalog read at start fires), so it applies from the node's
//! start to the guest's end, or to its first hit when `once`.

use std::fmt::Write as _;

/// The command a [`MediaFault`] fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultedIo {
    /// Reads covering the sector: Unrecovered Read Error.
    Read,
    /// Writes covering the sector: Write Fault, nothing written.
    Write,
    /// Every flush: Write Fault.
    Flush,
    /// Deallocations (Dataset Management) covering the sector.
    Discard,
}

impl FaultedIo {
    /// blkdebug's name for the I/O type.
    fn iotype(self) -> &'static str {
        match self {
            FaultedIo::Read => "read",
            FaultedIo::Write => "write",
            FaultedIo::Flush => "flush",
            FaultedIo::Discard => "discard",
        }
    }
}

/// One failing command on the namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaFault {
    /// What fails.
    pub io: FaultedIo,
    /// The byte on the namespace whose 512-byte sector the command must cover
    /// (`None`: any, which is how flushes are matched).
    pub at: Option<u64>,
    /// Fails the first matching command only (a transient error); otherwise every
    /// one, until the guest is restarted without it (a latent sector error).
    pub once: bool,
}

impl MediaFault {
    /// Reads of the sector holding byte `at` fail, every time.
    pub fn read(at: u64) -> Self {
        MediaFault {
            io: FaultedIo::Read,
            at: Some(at),
            once: false,
        }
    }

    /// Writes of the sector holding byte `at` fail, every time.
    pub fn write(at: u64) -> Self {
        MediaFault {
            io: FaultedIo::Write,
            at: Some(at),
            once: false,
        }
    }

    /// Every flush fails.
    pub fn flush() -> Self {
        MediaFault {
            io: FaultedIo::Flush,
            at: None,
            once: false,
        }
    }

    /// Deallocations of the sector holding byte `at` fail, every time.
    pub fn discard(at: u64) -> Self {
        MediaFault {
            io: FaultedIo::Discard,
            at: Some(at),
            once: false,
        }
    }

    /// The same fault, on the first matching command only.
    pub fn once(mut self) -> Self {
        self.once = true;
        self
    }

    /// This fault's `[inject-error]` section of a blkdebug rules file.
    fn rule(&self) -> String {
        let mut r = format!(
            "[inject-error]\nevent = \"read_aio\"\niotype = \"{}\"\nerrno = \"5\"\n",
            self.io.iotype()
        );
        if let Some(at) = self.at {
            let _ = writeln!(r, "sector = \"{}\"", at / 512);
        }
        if self.once {
            r.push_str("once = \"on\"\n");
        }
        r
    }
}

/// A blkdebug rules file failing each of `faults`.
pub fn rules(faults: &[MediaFault]) -> String {
    faults
        .iter()
        .map(|f| f.rule())
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_names_the_sector_and_the_io_it_fails() {
        let text = rules(&[
            MediaFault::read(1024 + 7),
            MediaFault::write(4096).once(),
            MediaFault::flush(),
        ]);
        assert_eq!(
            text,
            "[inject-error]\nevent = \"read_aio\"\niotype = \"read\"\nerrno = \"5\"\nsector = \"2\"\n\n\
             [inject-error]\nevent = \"read_aio\"\niotype = \"write\"\nerrno = \"5\"\nsector = \"8\"\nonce = \"on\"\n\n\
             [inject-error]\nevent = \"read_aio\"\niotype = \"flush\"\nerrno = \"5\"\n"
        );
    }
}
