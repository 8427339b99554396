//! NVMe commands as the kernel's passthrough interfaces take them: the 72-byte
//! `struct nvme_uring_cmd` (io_uring, `IORING_OP_URING_CMD`) and its twin
//! `struct nvme_passthru_cmd` (the admin ioctl), from `<linux/nvme_ioctl.h>`.

/// `NVME_URING_CMD_IO`: `_IOWR('N', 0x80, struct nvme_uring_cmd)`.
pub(super) const URING_CMD_IO: u32 = 0xC048_4E80;
/// `NVME_IOCTL_ADMIN_CMD`: `_IOWR('N', 0x41, struct nvme_admin_cmd)`.
pub(super) const IOCTL_ADMIN_CMD: libc::c_ulong = 0xC048_4E41;
/// `NVME_IOCTL_ID`: `_IO('N', 0x40)`, the namespace id of the open device.
pub(super) const IOCTL_ID: libc::c_ulong = 0x4E40;

/// NVM command set opcodes.
pub(super) mod opcode {
    pub(crate) const FLUSH: u8 = 0x00;
    pub(crate) const WRITE: u8 = 0x01;
    pub(crate) const READ: u8 = 0x02;
    pub(crate) const DATASET_MANAGEMENT: u8 = 0x09;
    /// Admin: Identify.
    pub(crate) const IDENTIFY: u8 = 0x06;
}

/// Identify's CNS values.
pub(super) const CNS_NAMESPACE: u32 = 0x00;
pub(super) const CNS_CONTROLLER: u32 = 0x01;

/// Dataset Management's attribute "deallocate" (CDW11 bit 2).
pub(super) const DSM_DEALLOCATE: u32 = 1 << 2;
/// Bytes of one Dataset Management range.
pub(super) const DSM_RANGE_BYTES: usize = 16;
/// Ranges one Dataset Management command carries at most.
pub(super) const DSM_MAX_RANGES: usize = 256;

/// `struct nvme_uring_cmd` / `struct nvme_passthru_cmd` (the last word is `rsvd2` in
/// the first, the command's `result` in the second).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct NvmeCmd {
    pub opcode: u8,
    pub flags: u8,
    pub rsvd1: u16,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub metadata: u64,
    pub addr: u64,
    pub metadata_len: u32,
    pub data_len: u32,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
    pub timeout_ms: u32,
    pub result: u32,
}

const _: () = assert!(std::mem::size_of::<NvmeCmd>() == 72);

impl NvmeCmd {
    /// Read or Write of `nlb` logical blocks from `slba` into/out of `len` bytes at `addr`.
    pub(super) fn rw(write: bool, nsid: u32, slba: u64, nlb: u32, addr: u64, len: u32) -> Self {
        NvmeCmd {
            opcode: if write { opcode::WRITE } else { opcode::READ },
            nsid,
            addr,
            data_len: len,
            cdw10: slba as u32,
            cdw11: (slba >> 32) as u32,
            // NLB is zero-based.
            cdw12: nlb - 1,
            ..Default::default()
        }
    }

    /// Flush of the namespace's volatile write cache.
    pub(super) fn flush(nsid: u32) -> Self {
        NvmeCmd {
            opcode: opcode::FLUSH,
            nsid,
            ..Default::default()
        }
    }

    /// Dataset Management (deallocate) of `ranges` ranges laid out at `addr`.
    pub(super) fn deallocate(nsid: u32, ranges: u32, addr: u64) -> Self {
        NvmeCmd {
            opcode: opcode::DATASET_MANAGEMENT,
            nsid,
            addr,
            data_len: ranges * DSM_RANGE_BYTES as u32,
            // NR is zero-based.
            cdw10: ranges - 1,
            cdw11: DSM_DEALLOCATE,
            ..Default::default()
        }
    }

    /// Identify with `cns` into a 4096-byte buffer at `addr`.
    pub(super) fn identify(nsid: u32, cns: u32, addr: u64) -> Self {
        NvmeCmd {
            opcode: opcode::IDENTIFY,
            nsid,
            addr,
            data_len: 4096,
            cdw10: cns,
            ..Default::default()
        }
    }

    /// The command as the 80 bytes of an `IORING_OP_URING_CMD` SQE's command area.
    pub(super) fn to_sqe_bytes(self) -> [u8; 80] {
        let mut out = [0u8; 80];
        // SAFETY: NvmeCmd is repr(C), 72 bytes, of plain integers without padding.
        let raw: [u8; 72] = unsafe { std::mem::transmute(self) };
        out[..72].copy_from_slice(&raw);
        out
    }
}

/// Writes one Dataset Management range (context attributes 0) at `out`.
pub(super) fn put_range(out: &mut [u8], slba: u64, nlb: u32) {
    out[0..4].copy_from_slice(&0u32.to_le_bytes());
    out[4..8].copy_from_slice(&nlb.to_le_bytes());
    out[8..16].copy_from_slice(&slba.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_kernel_header() {
        let c = NvmeCmd::rw(false, 1, 0x1_0000_0002, 8, 0xdead_0000, 4096);
        let b = c.to_sqe_bytes();
        assert_eq!(b[0], opcode::READ);
        assert_eq!(u32::from_le_bytes(b[4..8].try_into().unwrap()), 1, "nsid");
        assert_eq!(
            u64::from_le_bytes(b[24..32].try_into().unwrap()),
            0xdead_0000,
            "addr"
        );
        assert_eq!(
            u32::from_le_bytes(b[36..40].try_into().unwrap()),
            4096,
            "data_len"
        );
        assert_eq!(
            u32::from_le_bytes(b[40..44].try_into().unwrap()),
            2,
            "slba low"
        );
        assert_eq!(
            u32::from_le_bytes(b[44..48].try_into().unwrap()),
            1,
            "slba high"
        );
        assert_eq!(
            u32::from_le_bytes(b[48..52].try_into().unwrap()),
            7,
            "nlb - 1"
        );
        assert!(b[72..].iter().all(|&x| x == 0));
        let d = NvmeCmd::deallocate(3, 2, 0x1000).to_sqe_bytes();
        assert_eq!(d[0], opcode::DATASET_MANAGEMENT);
        assert_eq!(u32::from_le_bytes(d[36..40].try_into().unwrap()), 32);
        assert_eq!(u32::from_le_bytes(d[40..44].try_into().unwrap()), 1);
        assert_eq!(u32::from_le_bytes(d[44..48].try_into().unwrap()), 4);
        // The ioctl numbers are _IOWR('N', nr, 72 bytes).
        let iowr = |nr: u32| (3u32 << 30) | (72 << 16) | ((b'N' as u32) << 8) | nr;
        assert_eq!(URING_CMD_IO, iowr(0x80));
        assert_eq!(IOCTL_ADMIN_CMD as u32, iowr(0x41));
    }

    #[test]
    fn ranges_are_little_endian() {
        let mut r = [0xffu8; 16];
        put_range(&mut r, 0x0102_0304_0506_0708, 9);
        assert_eq!(&r[0..4], &[0, 0, 0, 0]);
        assert_eq!(&r[4..8], &[9, 0, 0, 0]);
        assert_eq!(&r[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
    }
}
