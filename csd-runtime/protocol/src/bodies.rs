//! Compressed pieces of a `Range` answer: raw bytes of a stored object, compressed
//! when the asker asks and the piece shrinks. Column chunks are stored uncompressed
//! (a node's cores are the scarce part when it scans them itself), so the raw bytes
//! a compute tier reads by range — a fragment handed back, an aggregate kept there
//! — are larger than the same Parquet compressed; over a slow link the asker asks
//! for them compressed, as it does for pushed answers.
//!
//! A compressed piece's `app_metadata` names its codec ([`LZ4`]: an LZ4 frame;
//! [`ZSTD`]: a zstd frame); a piece without one is raw. A piece never holds more
//! than the bytes still due, compressed or not, and decompressing one never makes
//! more (a peer cannot make the asker allocate beyond what it asked for).

use std::io::Read;

use bytes::Bytes;

use crate::ticket::Compression;

/// `app_metadata` of an LZ4-frame piece.
pub const LZ4: &[u8] = b"lz4";
/// `app_metadata` of a zstd-frame piece.
pub const ZSTD: &[u8] = b"zstd";

/// zstd's fastest standard level: on a 1 Gbit/s link it costs the node less time
/// than the bytes it saves.
const ZSTD_LEVEL: i32 = 1;

/// `raw` compressed with `c`, and the piece's codec marker; `None` when `c` is
/// `None` or the piece does not shrink (it is then sent raw).
pub fn compress(c: Compression, raw: &[u8]) -> Option<(Vec<u8>, &'static [u8])> {
    let (packed, marker) = match c {
        Compression::None => return None,
        Compression::Lz4Frame | Compression::Auto => {
            let mut w = lz4_flex::frame::FrameEncoder::new(Vec::with_capacity(raw.len() / 2));
            std::io::Write::write_all(&mut w, raw).ok()?;
            (w.finish().ok()?, LZ4)
        }
        Compression::Zstd => (zstd::bulk::compress(raw, ZSTD_LEVEL).ok()?, ZSTD),
    };
    (packed.len() < raw.len()).then_some((packed, marker))
}

/// A piece as received: `body` decompressed by the codec `marker` names (raw when
/// empty), at most `most` bytes. An unknown codec, a corrupt frame or more than
/// `most` bytes is an error naming what was wrong.
pub fn decompress(marker: &[u8], body: Bytes, most: u64) -> Result<Bytes, String> {
    let most = usize::try_from(most).unwrap_or(usize::MAX);
    let out = match marker {
        b"" => {
            if body.len() > most {
                return Err(format!(
                    "a raw piece of {} bytes where at most {most} were due",
                    body.len()
                ));
            }
            return Ok(body);
        }
        LZ4 => {
            let mut out = Vec::new();
            let mut r = lz4_flex::frame::FrameDecoder::new(body.as_ref()).take(most as u64 + 1);
            r.read_to_end(&mut out)
                .map_err(|e| format!("an LZ4 piece cannot be read: {e}"))?;
            out
        }
        ZSTD => {
            let mut out = Vec::new();
            let d = zstd::stream::read::Decoder::new(body.as_ref())
                .map_err(|e| format!("a zstd piece cannot be read: {e}"))?;
            d.take(most as u64 + 1)
                .read_to_end(&mut out)
                .map_err(|e| format!("a zstd piece cannot be read: {e}"))?;
            out
        }
        other => {
            return Err(format!(
                "a piece compressed with {:?}, which this client does not know",
                String::from_utf8_lossy(other)
            ));
        }
    };
    if out.len() > most {
        return Err(format!(
            "a compressed piece holds more than the {most} bytes still due"
        ));
    }
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_round_trip_and_bad_ones_are_refused() {
        let raw: Vec<u8> = (0..200_000u32)
            .flat_map(|i| (i % 1000).to_le_bytes())
            .collect();
        for c in [Compression::Lz4Frame, Compression::Zstd] {
            let (packed, marker) = compress(c, &raw).expect("compressible");
            assert!(packed.len() < raw.len() / 2, "{c:?}: {}", packed.len());
            let back = decompress(marker, Bytes::from(packed.clone()), raw.len() as u64).unwrap();
            assert_eq!(back.as_ref(), raw.as_slice());
            // Less room than it holds, a flipped byte, garbage: errors, not panics.
            assert!(decompress(marker, Bytes::from(packed.clone()), 10).is_err());
            let mut bad = packed.clone();
            let mid = bad.len() / 2;
            bad[mid] ^= 0xff;
            let _ = decompress(marker, Bytes::from(bad), raw.len() as u64);
            assert!(decompress(marker, Bytes::from_static(b"\x00\x01garbage"), 100).is_err());
        }
        assert!(compress(Compression::None, &raw).is_none());
        // Random bytes do not shrink: sent raw.
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                // xorshift64*
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
            })
            .collect();
        assert!(compress(Compression::Lz4Frame, &noise).is_none());
        assert!(decompress(b"snappy", Bytes::from_static(b"x"), 10).is_err());
        assert!(decompress(b"", Bytes::from_static(b"xyz"), 2).is_err());
    }
}
