//! NVMe completion status, as io_uring passthrough reports it (a positive CQE
//! result: the status field without its phase bit), and what it means to the store.

use std::fmt;

use crate::error::Error;

/// A command's non-zero NVMe status: Status Code (bits 7:0), Status Code Type
/// (bits 10:8), Do Not Retry (bit 14).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvmeStatus(pub u16);

/// Status code types.
const GENERIC: u8 = 0;
const MEDIA: u8 = 2;

impl NvmeStatus {
    /// Status Code Type.
    pub fn sct(self) -> u8 {
        ((self.0 >> 8) & 0x7) as u8
    }

    /// Status Code.
    pub fn sc(self) -> u8 {
        self.0 as u8
    }

    /// The controller says retrying will not help.
    pub fn do_not_retry(self) -> bool {
        self.0 & (1 << 14) != 0
    }

    /// True for a media or data integrity error: the stored bytes are in doubt.
    pub fn is_media_error(self) -> bool {
        self.sct() == MEDIA
    }

    /// The specification's name for the status, where we know it.
    pub fn meaning(self) -> &'static str {
        match (self.sct(), self.sc()) {
            (GENERIC, 0x01) => "invalid command opcode",
            (GENERIC, 0x02) => "invalid field in command",
            (GENERIC, 0x04) => "data transfer error",
            (GENERIC, 0x05) => "commands aborted due to power loss notification",
            (GENERIC, 0x06) => "internal error",
            (GENERIC, 0x07) => "command abort requested",
            (GENERIC, 0x0b) => "invalid namespace or format",
            (GENERIC, 0x80) => "LBA out of range",
            (GENERIC, 0x81) => "capacity exceeded",
            (GENERIC, 0x82) => "namespace not ready",
            (MEDIA, 0x80) => "write fault",
            (MEDIA, 0x81) => "unrecovered read error",
            (MEDIA, 0x82) => "end-to-end guard check error",
            (MEDIA, 0x83) => "end-to-end application tag check error",
            (MEDIA, 0x84) => "end-to-end reference tag check error",
            (MEDIA, 0x85) => "compare failure",
            (MEDIA, 0x86) => "access denied",
            (MEDIA, 0x87) => "deallocated or unwritten logical block",
            (MEDIA, _) => "media or data integrity error",
            (1, _) => "command specific error",
            (3, _) => "path related error",
            _ => "error",
        }
    }

    /// The store's error for a command on `what` (device, operation and range) that
    /// ended with this status: a media error on a read is data loss (the stored
    /// bytes are in doubt); one on a write, flush or deallocation is the drive
    /// failing to store (nothing stored is lost, the change is not made: the
    /// caller may try again, or another copy); capacity and readiness are what
    /// they say, anything else an I/O error carrying the status.
    pub fn to_error(self, reading: bool, what: String) -> Error {
        let msg = format!("{what}: NVMe {self}");
        match (self.sct(), self.sc()) {
            (MEDIA, _) if reading => Error::Corrupt(msg),
            (MEDIA, _) => Error::Unavailable(format!("{msg}: the drive did not store it")),
            (GENERIC, 0x81) => Error::ResourcesExhausted(msg),
            (GENERIC, 0x82) | (GENERIC, 0x05) => Error::Unavailable(msg),
            _ => Error::io(what, std::io::Error::other(self)),
        }
    }
}

impl fmt::Display for NvmeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (status code type {:#x}, status code {:#04x}{})",
            self.meaning(),
            self.sct(),
            self.sc(),
            if self.do_not_retry() {
                ", do not retry"
            } else {
                ""
            }
        )
    }
}

impl std::error::Error for NvmeStatus {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StatusCode;

    #[test]
    fn media_errors_are_data_loss_naming_the_range() {
        let s = NvmeStatus(0x4281);
        assert!(s.is_media_error() && s.do_not_retry());
        let e = s.to_error(true, "read of bytes [4096, 8192) on nvme:/dev/ng0n1".into());
        assert_eq!(e.status_code(), StatusCode::DataLoss);
        let m = e.to_string();
        assert!(
            m.contains("unrecovered read error") && m.contains("[4096, 8192)"),
            "{m}"
        );
        assert_eq!(
            NvmeStatus(0x0081).to_error(false, "x".into()).status_code(),
            StatusCode::ResourceExhausted
        );
        let other = NvmeStatus(0x0002).to_error(false, "write".into());
        assert!(
            other.to_string().contains("invalid field in command"),
            "{other}"
        );
        // A write the drive failed stored nothing: not data loss.
        let w = NvmeStatus(0x0280)
            .to_error(false, "write of bytes [0, 4096) on nvme:/dev/ng0n1".into());
        assert_eq!(w.status_code(), StatusCode::Unavailable);
        assert!(w.to_string().contains("write fault"), "{w}");
    }
}
