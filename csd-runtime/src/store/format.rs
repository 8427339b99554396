//! On-device formats: superblock, catalog slots, catalog records.
//!
//! ```text
//! LBA 0                      superblock (written once, at format)
//! LBA 1 .. 1+S               catalog slot A ┐ each: header + prost catalog; commits go
//! LBA 1+S .. 1+2S            catalog slot B ┘ to the slot not holding the live catalog
//! LBA 1+2S .. end            data region: object extents
//! ```
//! An object's logical blocks are its data (padded to a block) followed by its CRC
//! table: one CRC32C per `chunk_size` bytes of data. The catalog entry records the
//! extents and the CRC32C of the table itself.

use crate::error::{Error, Result};
use crate::store::alloc::Extent;

pub(crate) const SUPER_MAGIC: &[u8; 8] = b"CSDSTOR1";
pub(crate) const SLOT_MAGIC: &[u8; 8] = b"CSDCATLG";
pub(crate) const SLOT_HEADER: usize = 32;
pub(crate) const FORMAT_VERSION: u32 = 1;

/// Geometry of a formatted store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Superblock {
    pub block_size: u32,
    pub num_blocks: u64,
    pub slot_blocks: u64,
    pub chunk_size: u32,
}

impl Superblock {
    pub(super) fn encode(&self, out: &mut [u8]) {
        out[..8].copy_from_slice(SUPER_MAGIC);
        out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&self.block_size.to_le_bytes());
        out[16..24].copy_from_slice(&self.num_blocks.to_le_bytes());
        out[24..32].copy_from_slice(&self.slot_blocks.to_le_bytes());
        out[32..36].copy_from_slice(&self.chunk_size.to_le_bytes());
        let crc = crc32c::crc32c(&out[..36]);
        out[36..40].copy_from_slice(&crc.to_le_bytes());
    }

    /// `Ok(None)` for a blank (all-zero) block.
    pub(super) fn decode(b: &[u8]) -> Result<Option<Self>> {
        if b.len() < 40 {
            return Err(Error::Internal("superblock buffer too small".into()));
        }
        if b.iter().all(|&x| x == 0) {
            return Ok(None);
        }
        if &b[..8] != SUPER_MAGIC {
            return Err(Error::InvalidArgument(
                "the device holds data that is not a csd object store; start with --format to erase it".into(),
            ));
        }
        if crc32c::crc32c(&b[..36]) != le_u32(&b[36..40]) {
            return Err(Error::Corrupt("superblock checksum mismatch".into()));
        }
        let version = le_u32(&b[8..12]);
        if version != FORMAT_VERSION {
            return Err(Error::InvalidArgument(format!(
                "store format version {version} is not supported (this build reads {FORMAT_VERSION})"
            )));
        }
        Ok(Some(Superblock {
            block_size: le_u32(&b[12..16]),
            num_blocks: le_u64(&b[16..24]),
            slot_blocks: le_u64(&b[24..32]),
            chunk_size: le_u32(&b[32..36]),
        }))
    }

    pub(super) fn slot_lba(&self, slot: usize) -> u64 {
        1 + slot as u64 * self.slot_blocks
    }

    pub(crate) fn data_start(&self) -> u64 {
        1 + 2 * self.slot_blocks
    }

    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_blocks as usize * self.block_size as usize
    }
}

/// Slot header: magic, generation, payload length, payload CRC, header CRC.
pub(crate) fn encode_slot_header(out: &mut [u8], generation: u64, payload: &[u8]) {
    out[..8].copy_from_slice(SLOT_MAGIC);
    out[8..16].copy_from_slice(&generation.to_le_bytes());
    out[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    out[24..28].copy_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    let crc = crc32c::crc32c(&out[..28]);
    out[28..32].copy_from_slice(&crc.to_le_bytes());
}

/// Parses a slot header: `Some((generation, payload_len, payload_crc))` if intact.
pub(crate) fn decode_slot_header(b: &[u8]) -> Option<(u64, u64, u32)> {
    if b.len() < SLOT_HEADER
        || &b[..8] != SLOT_MAGIC
        || crc32c::crc32c(&b[..28]) != le_u32(&b[28..32])
    {
        return None;
    }
    Some((le_u64(&b[8..16]), le_u64(&b[16..24]), le_u32(&b[24..28])))
}

pub(crate) fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

pub(crate) fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// The committed catalog.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct CatalogProto {
    #[prost(message, repeated, tag = "1")]
    pub objects: Vec<ObjectProto>,
    #[prost(uint64, tag = "2")]
    pub(crate) next_id: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ObjectProto {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(uint64, tag = "2")]
    pub id: u64,
    #[prost(uint64, tag = "3")]
    pub len: u64,
    #[prost(message, repeated, tag = "4")]
    pub extents: Vec<ExtentProto>,
    #[prost(uint32, tag = "5")]
    pub(crate) table_crc: u32,
    #[prost(uint64, tag = "6")]
    pub(crate) created_unix_ms: u64,
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
pub(crate) struct ExtentProto {
    #[prost(uint64, tag = "1")]
    pub lba: u64,
    #[prost(uint64, tag = "2")]
    pub blocks: u64,
}

impl From<Extent> for ExtentProto {
    fn from(e: Extent) -> Self {
        ExtentProto {
            lba: e.lba,
            blocks: e.blocks,
        }
    }
}
impl From<ExtentProto> for Extent {
    fn from(e: ExtentProto) -> Self {
        Extent {
            lba: e.lba,
            blocks: e.blocks,
        }
    }
}
