//! What Identify says about a controller and a namespace, read from the 4096-byte
//! data structures of the NVMe base specification (Figures "Identify Controller
//! Data Structure" and "Identify Namespace Data Structure, NVM Command Set").

/// The controller's fields the device uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControllerInfo {
    /// Model number (MN), trimmed.
    pub model: String,
    /// Serial number (SN), trimmed.
    pub serial: String,
    /// Maximum Data Transfer Size as a power of two of the minimum memory page size;
    /// 0 means no limit.
    pub mdts: u8,
    /// Dataset Management supported (ONCS bit 2).
    pub dataset_management: bool,
    /// A volatile write cache is present (VWC bit 0): Flush matters.
    pub volatile_write_cache: bool,
}

/// The namespace's fields the device uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceInfo {
    /// Size in logical blocks (NSZE).
    pub blocks: u64,
    /// Bytes per logical block of the format in use.
    pub lba_bytes: u32,
    /// Metadata bytes per block of the format in use (MS).
    pub metadata_bytes: u16,
    /// End-to-end protection enabled (DPS type bits non-zero).
    pub protection: bool,
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b)
        .trim_matches(|c: char| c == ' ' || c == '\0')
        .to_string()
}

impl ControllerInfo {
    /// Parses an Identify Controller data structure.
    pub fn parse(id: &[u8; 4096]) -> Self {
        let oncs = u16::from_le_bytes([id[520], id[521]]);
        ControllerInfo {
            serial: text(&id[4..24]),
            model: text(&id[24..64]),
            mdts: id[77],
            dataset_management: oncs & (1 << 2) != 0,
            volatile_write_cache: id[525] & 1 != 0,
        }
    }

    /// Largest transfer in bytes, assuming the common 4 KiB minimum page size (the
    /// capability register that says otherwise is not visible through passthrough).
    pub fn max_transfer(&self) -> Option<usize> {
        (self.mdts != 0).then(|| 4096usize << self.mdts.min(20))
    }
}

impl NamespaceInfo {
    /// Parses an Identify Namespace data structure; `None` for one that names no
    /// usable format (an inactive namespace reads as zeros).
    pub fn parse(id: &[u8; 4096]) -> Option<Self> {
        let blocks = u64::from_le_bytes(id[0..8].try_into().ok()?);
        let nlbaf = id[25] as usize;
        let flbas = id[26];
        // FLBAS bits 3:0 are the format's low bits, 6:5 its high bits (64 formats).
        let index = (flbas & 0x0f) as usize | (((flbas >> 5) & 0x03) as usize) << 4;
        if blocks == 0 || index > nlbaf.max(15) {
            return None;
        }
        let f = 128 + 4 * index;
        let lbads = id[f + 2];
        if !(9..=16).contains(&lbads) {
            return None;
        }
        Some(NamespaceInfo {
            blocks,
            lba_bytes: 1 << lbads,
            metadata_bytes: u16::from_le_bytes([id[f], id[f + 1]]),
            protection: id[29] & 0x07 != 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_fields_used() {
        let mut c = [0u8; 4096];
        c[4..12].copy_from_slice(b"csd0    ");
        c[24..38].copy_from_slice(b"QEMU NVMe Ctrl");
        c[77] = 7;
        c[520] = 0b0000_0100;
        c[525] = 1;
        let c = ControllerInfo::parse(&c);
        assert_eq!(c.model, "QEMU NVMe Ctrl");
        assert_eq!(c.serial, "csd0");
        assert_eq!(c.max_transfer(), Some(512 << 10));
        assert!(c.dataset_management && c.volatile_write_cache);

        let mut n = [0u8; 4096];
        n[0..8].copy_from_slice(&(1u64 << 21).to_le_bytes());
        n[25] = 1; // two formats
        n[26] = 1; // the second in use
        n[128 + 2] = 9; // format 0: 512 B
        n[132 + 2] = 12; // format 1: 4 KiB
        let ns = NamespaceInfo::parse(&n).unwrap();
        assert_eq!(
            (ns.blocks, ns.lba_bytes, ns.metadata_bytes),
            (1 << 21, 4096, 0)
        );
        assert!(!ns.protection);
        n[26] = 0;
        assert_eq!(NamespaceInfo::parse(&n).unwrap().lba_bytes, 512);
        assert!(NamespaceInfo::parse(&[0u8; 4096]).is_none(), "inactive");
    }
}
