//! Join-key filters ("bloom joins"): the keys of a hash join's build side, sent to
//! the storage nodes with the probe side's fragment so that rows which cannot match
//! never cross the network.
//!
//! A [`Bloom`] holds a set of 64-bit row hashes ([`hash_rows`]: the same function on
//! both tiers, stable across processes and builds). It has false positives (about 1%
//! at the sizes chosen here) and no false negatives, so filtering the probe side with
//! it keeps every row that can match: the join above still decides exactly. Rows whose
//! key has a NULL are always kept (the filter never has to reason about NULL
//! semantics). The compute side collects keys and decides where the filter applies
//! (`crate::compute::key_filter_rule`); this module is what both tiers share.
//!
//! The filter is split-block, the layout of Parquet's bloom filters: 256-bit blocks of
//! eight 32-bit words; a hash's upper half picks the block, its lower half one bit in
//! each word (eight salted multiply-shifts). A probe reads one cache line and has no
//! branches, several times faster per row than a classic bloom's seven scattered
//! probes with early exits.
//!
//! On the wire, in [`SqlFragment`](crate::wire::fragment::SqlFragment) field 5:
//!
//! ```text
//! message KeyFilter {
//!   repeated uint32 columns = 1;  // output columns of the fragment, hashed together
//!   reserved 2, 3;                // the classic bloom of earlier builds, refused
//!   bytes blocks = 4;             // 32-byte blocks of eight little-endian u32 words
//!   optional bytes attachment = 5; // or: the SHA-256 of those blocks, sent before
//!   repeated sint64 within = 6;   // a cut filter: [lo, hi] pairs, sorted, disjoint
//!   optional uint32 within_column = 7; // a cut filter's one key column (then 1 is empty)
//! }
//! ```
//!
//! A **cut** filter holds only the build keys inside `within`: the `[min, max]`
//! ranges of the key over the objects the node was listed with, where a table's
//! files hold key ranges (TPC-H's orders, lineitem and partsupp as generated), so
//! each node gets the keys its rows can have, not all of them. It only judges rows
//! whose key lies inside `within`; any other row (one appended after the listing)
//! passes, as the filter cannot know its key. A cut filter names its one integer or
//! date column in field 7 and leaves field 1 empty, so a node of an earlier build,
//! which would apply it to every row, refuses it instead.
//!
//! A filter carries its blocks, or names them by `attachment`: the compute tier sends
//! a filter that several fragments at one node apply once (the `put_attachment`
//! action) and names it in each, and the node substitutes the blocks it keeps
//! ([`KeyFilterMsg::attached`]) before anything reads them. A node refuses a filter
//! with neither (one from an earlier build, which a node of this build cannot read)
//! rather than guess; an earlier node refuses this one for its empty bit array.

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray, RecordBatch, downcast_integer};
use arrow::compute::filter_record_batch;
use std::sync::Arc;

use arrow::datatypes::DataType;
use csd_protocol::{Error, ModuleDigest};

/// Largest bit array accepted on the wire and built here (2 MiB: 16 Mbit).
pub const MAX_FILTER_BYTES: usize = 2 << 20;

/// Why a key filter cannot be read or applied.
#[derive(Debug)]
pub enum KeyFilterError {
    /// The filter as sent is malformed or does not fit the fragment: the asker's.
    Invalid(String),
    /// A join key of a type the filter cannot hash.
    Unhashable(DataType),
    /// A batch the filter does not fit (a key column missing or of another length).
    Batch(String),
    /// Arrow failed applying the filter.
    Arrow(arrow::error::ArrowError),
}

impl std::fmt::Display for KeyFilterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyFilterError::Invalid(why) | KeyFilterError::Batch(why) => f.write_str(why),
            KeyFilterError::Unhashable(t) => write!(f, "join keys of type {t} cannot be filtered"),
            KeyFilterError::Arrow(e) => write!(f, "applying a key filter: {e}"),
        }
    }
}

impl std::error::Error for KeyFilterError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            KeyFilterError::Arrow(e) => Some(e),
            _ => None,
        }
    }
}

/// A node's error of the filter's kind: one sent wrong (or over keys it cannot
/// hash) is the asker's, `INVALID_ARGUMENT`; one that does not fit the batches the
/// node's own plan made is the node's, `INTERNAL`.
impl From<KeyFilterError> for Error {
    fn from(e: KeyFilterError) -> Self {
        match e {
            KeyFilterError::Invalid(_) | KeyFilterError::Unhashable(_) => {
                Error::InvalidArgument(e.to_string())
            }
            KeyFilterError::Batch(_) | KeyFilterError::Arrow(_) => Error::Internal(e.to_string()),
        }
    }
}
/// Most key columns in one filter.
pub const MAX_KEY_COLUMNS: usize = 8;
/// Most `[lo, hi]` ranges of a cut filter.
pub const MAX_RANGES: usize = 4096;
/// Default bits per key: about 1% false positives for a split-block filter
/// (`csd.bloom_bits_per_key`).
pub(crate) const BITS_PER_KEY: usize = 12;
/// Smallest bit array built (8 KiB, within a core's L1 cache): a few keys get many
/// bits each and next to no false positives (at 12 bits a key, a filter of a hundred
/// keys would let about 1% of a large probe side through).
pub const MIN_FILTER_BYTES: usize = 8 << 10;
/// Salts of the eight words of a block (Parquet's).
const SALT: [u32; 8] = [
    0x47b6_137b,
    0x4497_4d91,
    0x8824_ad5b,
    0xa2b7_289d,
    0x7054_95c7,
    0x2df1_424b,
    0x9efc_4947,
    0x5c6b_fb31,
];

/// Whether keys of this type can be hashed (integers, dates, times, timestamps,
/// decimals, strings and binaries).
pub fn supported(dt: &DataType) -> bool {
    use DataType::*;
    dt.is_integer()
        || matches!(
            dt,
            Date32
                | Date64
                | Time32(_)
                | Time64(_)
                | Timestamp(_, _)
                | Decimal128(_, _)
                | Utf8
                | LargeUtf8
                | Utf8View
                | Binary
                | LargeBinary
                | BinaryView
        )
}

/// splitmix64's finalizer: a stable, well-mixed 64-bit hash of a 64-bit value.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a over bytes, then mixed.
fn hash_bytes(b: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &x in b {
        h = (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3);
    }
    mix(h)
}

fn fold(acc: &mut u64, v: u64) {
    *acc = mix(acc.rotate_left(27) ^ v);
}

/// One stable 64-bit hash per row of `columns` (hashed together, in order), and
/// whether each row's key is free of NULLs. An unsupported type is an error.
pub fn hash_rows(
    columns: &[ArrayRef],
    rows: usize,
) -> Result<(Vec<u64>, Vec<bool>), KeyFilterError> {
    let mut hashes = vec![0x5EED_u64; rows];
    let mut valid = vec![true; rows];
    for col in columns {
        if col.len() != rows {
            return Err(KeyFilterError::Batch(format!(
                "key column has {} rows, expected {rows}",
                col.len()
            )));
        }
        if let Some(n) = col.logical_nulls() {
            for (v, ok) in valid.iter_mut().zip(n.iter()) {
                *v &= ok;
            }
        }
        hash_column(col, &mut hashes)?;
    }
    Ok((hashes, valid))
}

fn hash_column(col: &ArrayRef, out: &mut [u64]) -> Result<(), KeyFilterError> {
    macro_rules! ints {
        ($t:ty) => {{
            let a = col.as_primitive::<$t>();
            for (h, v) in out.iter_mut().zip(a.values().iter()) {
                fold(h, mix(*v as i64 as u64));
            }
        }};
    }
    macro_rules! strings {
        ($a:expr) => {{
            for (h, v) in out.iter_mut().zip($a.iter()) {
                fold(h, v.map_or(0, |s| hash_bytes(s.as_ref())));
            }
        }};
    }
    use arrow::datatypes::*;
    match col.data_type() {
        dt if dt.is_integer() => downcast_integer! {
            dt => (ints),
            _ => unreachable!("is_integer covers exactly the integer types"),
        },
        DataType::Date32 => ints!(Date32Type),
        DataType::Date64 => ints!(Date64Type),
        DataType::Time32(TimeUnit::Second) => ints!(Time32SecondType),
        DataType::Time32(TimeUnit::Millisecond) => ints!(Time32MillisecondType),
        DataType::Time64(TimeUnit::Microsecond) => ints!(Time64MicrosecondType),
        DataType::Time64(TimeUnit::Nanosecond) => ints!(Time64NanosecondType),
        DataType::Timestamp(TimeUnit::Second, _) => ints!(TimestampSecondType),
        DataType::Timestamp(TimeUnit::Millisecond, _) => ints!(TimestampMillisecondType),
        DataType::Timestamp(TimeUnit::Microsecond, _) => ints!(TimestampMicrosecondType),
        DataType::Timestamp(TimeUnit::Nanosecond, _) => ints!(TimestampNanosecondType),
        DataType::Decimal128(_, _) => {
            let a = col.as_primitive::<Decimal128Type>();
            for (h, v) in out.iter_mut().zip(a.values().iter()) {
                let v = *v as u128;
                fold(h, mix(v as u64) ^ mix((v >> 64) as u64).rotate_left(1));
            }
        }
        DataType::Utf8 => strings!(col.as_string::<i32>()),
        DataType::LargeUtf8 => strings!(col.as_string::<i64>()),
        DataType::Utf8View => strings!(col.as_string_view()),
        DataType::Binary => strings!(col.as_binary::<i32>()),
        DataType::LargeBinary => strings!(col.as_binary::<i64>()),
        DataType::BinaryView => strings!(col.as_binary_view()),
        other => return Err(KeyFilterError::Unhashable(other.clone())),
    }
    Ok(())
}

/// A key column's values as `i64`, when it is a signed integer or date column (the
/// types a node lists `[min, max]` ranges of, and that a cut filter takes).
pub(crate) fn int_values(c: &ArrayRef) -> Option<Vec<i64>> {
    use arrow::datatypes::{Date32Type, Int8Type, Int16Type, Int32Type, Int64Type};
    fn widen<T: Copy + Into<i64>>(v: &[T]) -> Vec<i64> {
        v.iter().map(|x| (*x).into()).collect()
    }
    Some(match c.data_type() {
        DataType::Int8 => widen(c.as_primitive::<Int8Type>().values()),
        DataType::Int16 => widen(c.as_primitive::<Int16Type>().values()),
        DataType::Int32 => widen(c.as_primitive::<Int32Type>().values()),
        DataType::Int64 => c.as_primitive::<Int64Type>().values().to_vec(),
        DataType::Date32 => widen(c.as_primitive::<Date32Type>().values()),
        _ => return None,
    })
}

/// A split-block bloom filter over row hashes (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Bloom {
    blocks: Vec<[u32; 8]>,
}

/// The bit a hash sets in each word of its block.
#[inline(always)]
fn block_bits(h: u64) -> [u32; 8] {
    let k = h as u32;
    std::array::from_fn(|i| 1u32 << (k.wrapping_mul(SALT[i]) >> 27))
}

impl Bloom {
    /// A filter holding `keys` (row hashes; duplicates are fine), sized for about 1%
    /// false positives or fewer (at least [`MIN_FILTER_BYTES`]); `None` when that
    /// would exceed [`MAX_FILTER_BYTES`].
    pub fn with_keys(keys: &[u64]) -> Option<Bloom> {
        Bloom::with_bits_per_key(keys, BITS_PER_KEY)
    }

    /// [`with_keys`](Self::with_keys), sized at `bits` per key (at least 1).
    pub(crate) fn with_bits_per_key(keys: &[u64], bits: usize) -> Option<Bloom> {
        let blocks = keys
            .len()
            .saturating_mul(bits.max(1))
            .div_ceil(256)
            .max(MIN_FILTER_BYTES / 32);
        if blocks * 32 > MAX_FILTER_BYTES {
            return None;
        }
        let mut b = Bloom {
            blocks: vec![[0; 8]; blocks],
        };
        for &k in keys {
            let bits = block_bits(k);
            let block = b.block_of(k);
            for (w, bit) in b.blocks[block].iter_mut().zip(bits) {
                *w |= bit;
            }
        }
        Some(b)
    }

    #[inline(always)]
    fn block_of(&self, h: u64) -> usize {
        // Any block count: multiply-shift maps the upper 32 bits onto it.
        (((h >> 32) * self.blocks.len() as u64) >> 32) as usize
    }

    /// Whether `h` may be in the set (never false for an inserted hash).
    #[inline(always)]
    pub fn contains(&self, h: u64) -> bool {
        let block = &self.blocks[self.block_of(h)];
        let bits = block_bits(h);
        // Every word checked, no early exit: branch-free.
        block
            .iter()
            .zip(bits)
            .fold(true, |ok, (w, b)| ok & (w & b != 0))
    }

    /// [`Bloom::contains`] for each of `hashes`. With AVX2 (detected at run time)
    /// a probe's eight words are computed in one vector: the default x86-64 target
    /// has no per-lane shifts, and the scalar probe costs the nodes more than
    /// hashing the keys.
    pub(crate) fn contains_all(&self, hashes: &[u64]) -> Vec<bool> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { self.contains_all_avx2(hashes) };
        }
        self.contains_each(hashes)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn contains_all_avx2(&self, hashes: &[u64]) -> Vec<bool> {
        use std::arch::x86_64::{
            __m256i, _mm256_loadu_si256, _mm256_mullo_epi32, _mm256_set1_epi32, _mm256_sllv_epi32,
            _mm256_srli_epi32, _mm256_testc_si256,
        };
        // SAFETY: both loads read 32 bytes from a `[u32; 8]` (unaligned loads).
        let salt = unsafe { _mm256_loadu_si256(SALT.as_ptr().cast::<__m256i>()) };
        let one = _mm256_set1_epi32(1);
        hashes
            .iter()
            .map(|&h| {
                // The same bits as `block_bits`: one per word, at the top 5 bits
                // of the salted product of the hash's lower half.
                let bits = _mm256_sllv_epi32(
                    one,
                    _mm256_srli_epi32(
                        _mm256_mullo_epi32(_mm256_set1_epi32(h as u32 as i32), salt),
                        27,
                    ),
                );
                let block = &self.blocks[self.block_of(h)];
                let words = unsafe { _mm256_loadu_si256(block.as_ptr().cast::<__m256i>()) };
                // Every bit of `bits` set in `words`.
                _mm256_testc_si256(words, bits) != 0
            })
            .collect()
    }

    fn contains_each(&self, hashes: &[u64]) -> Vec<bool> {
        hashes.iter().map(|&h| self.contains(h)).collect()
    }

    /// Size in bytes.
    #[cfg(test)]
    fn size_bytes(&self) -> usize {
        self.blocks.len() * 32
    }

    /// The wire form, filtering `columns`.
    pub fn to_msg(&self, columns: &[usize]) -> KeyFilterMsg {
        KeyFilterMsg {
            columns: columns.iter().map(|&c| c as u32).collect(),
            blocks: self
                .blocks
                .iter()
                .flatten()
                .flat_map(|w| w.to_le_bytes())
                .collect(),
            attachment: None,
            within: Vec::new(),
            within_column: None,
        }
    }

    /// The wire form of a cut filter: it holds the keys of `column` inside `ranges`
    /// (sorted, disjoint) and judges only rows whose key lies inside them.
    pub fn to_cut_msg(&self, column: usize, ranges: &[[i64; 2]]) -> KeyFilterMsg {
        KeyFilterMsg {
            columns: Vec::new(),
            within: ranges.iter().flatten().copied().collect(),
            within_column: Some(column as u32),
            ..self.to_msg(&[])
        }
    }
}

impl Bloom {
    /// A filter from its blocks' wire form ([`KeyFilterMsg::blocks`]), checked.
    pub(crate) fn from_blocks(bytes: &[u8]) -> Result<Bloom, KeyFilterError> {
        let n = bytes.len();
        if n == 0 || n > MAX_FILTER_BYTES || !n.is_multiple_of(32) {
            return Err(KeyFilterError::Invalid(format!(
                "key filter of {n} bytes: its blocks must be whole 32-byte blocks, 1 to {} of them",
                MAX_FILTER_BYTES / 32
            )));
        }
        let blocks = bytes
            .chunks_exact(32)
            .map(|b| {
                std::array::from_fn(|i| {
                    u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
                })
            })
            .collect();
        Ok(Bloom { blocks })
    }
}

/// A key filter as it travels (see the module docs).
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyFilterMsg {
    /// Output columns of the fragment whose values form the key.
    #[prost(uint32, repeated, tag = "1")]
    pub columns: Vec<u32>,
    /// The blocks: 32 bytes each, eight little-endian u32 words.
    #[prost(bytes = "vec", tag = "4")]
    pub blocks: Vec<u8>,
    /// Or the blocks' SHA-256, naming what the node was sent with `put_attachment`.
    #[prost(bytes = "vec", optional, tag = "5")]
    pub attachment: Option<Vec<u8>>,
    /// A cut filter's key ranges: `[lo, hi]` pairs, inclusive, sorted, disjoint.
    #[prost(sint64, repeated, tag = "6")]
    pub within: Vec<i64>,
    /// A cut filter's one key column (`columns` is then empty).
    #[prost(uint32, optional, tag = "7")]
    pub within_column: Option<u32>,
}

impl KeyFilterMsg {
    /// This filter naming its blocks by their digest instead of carrying them.
    pub fn by_attachment(&self, digest: &ModuleDigest) -> KeyFilterMsg {
        KeyFilterMsg {
            blocks: Vec::new(),
            attachment: Some(digest.0.to_vec()),
            ..self.clone()
        }
    }

    /// The attachment the filter names instead of carrying its blocks (checked:
    /// one or the other, and a well-formed digest), if any.
    pub fn attached(&self) -> Result<Option<ModuleDigest>, KeyFilterError> {
        match &self.attachment {
            None => Ok(None),
            Some(_) if !self.blocks.is_empty() => Err(KeyFilterError::Invalid(
                "a key filter carries its blocks and names an attachment: send one or the other"
                    .into(),
            )),
            Some(d) => ModuleDigest::parse(d)
                .map(Some)
                .map_err(|e| KeyFilterError::Invalid(format!("key filter attachment: {e}"))),
        }
    }
}

/// A checked key filter, ready to apply.
#[derive(Debug, Clone)]
pub struct KeyFilter {
    pub(crate) columns: Vec<usize>,
    pub(crate) bloom: Bloom,
    /// A cut filter's key ranges: rows whose key lies outside them pass.
    pub(crate) within: Option<Arc<Vec<[i64; 2]>>>,
}

/// The filter as sent does not fit: why.
fn invalid(why: impl Into<String>) -> KeyFilterError {
    KeyFilterError::Invalid(why.into())
}

impl KeyFilter {
    /// `bloom` over `columns`.
    pub fn new(columns: Vec<usize>, bloom: Bloom) -> Self {
        KeyFilter {
            columns,
            bloom,
            within: None,
        }
    }

    /// The same filter over `columns` (the same values, found elsewhere).
    pub(crate) fn on(&self, columns: Vec<usize>) -> Self {
        KeyFilter {
            columns,
            ..self.clone()
        }
    }

    /// Checks an untrusted filter against the fragment's output types.
    pub fn from_msg(m: &KeyFilterMsg, output: &[DataType]) -> Result<KeyFilter, KeyFilterError> {
        if m.within_column.is_some() || !m.within.is_empty() {
            return KeyFilter::cut_from_msg(m, output);
        }
        if m.columns.is_empty() || m.columns.len() > MAX_KEY_COLUMNS {
            return Err(invalid(format!(
                "a key filter needs 1 to {MAX_KEY_COLUMNS} key columns, it names {}",
                m.columns.len()
            )));
        }
        let mut columns = Vec::with_capacity(m.columns.len());
        for &c in &m.columns {
            let dt = output.get(c as usize).ok_or_else(|| {
                invalid(format!(
                    "key filter names output column {c}, the fragment returns {} columns",
                    output.len()
                ))
            })?;
            if !supported(dt) {
                return Err(invalid(format!(
                    "key filter on column {c} of type {dt}, which cannot be hashed"
                )));
            }
            columns.push(c as usize);
        }
        if m.blocks.is_empty() {
            return Err(invalid(
                "key filter without split-block bloom blocks (field 4) or an attachment \
                 (field 5): a client of an earlier build sends a filter this node cannot \
                 read; use a client of the node's version",
            ));
        }
        Ok(KeyFilter::new(columns, Bloom::from_blocks(&m.blocks)?))
    }

    /// [`from_msg`](Self::from_msg) for a cut filter (fields 6 and 7).
    fn cut_from_msg(m: &KeyFilterMsg, output: &[DataType]) -> Result<KeyFilter, KeyFilterError> {
        let (Some(c), true) = (m.within_column, m.columns.is_empty()) else {
            return Err(invalid(
                "a cut key filter names its one column in field 7 and none in field 1",
            ));
        };
        let dt = output.get(c as usize).ok_or_else(|| {
            invalid(format!(
                "key filter names output column {c}, the fragment returns {} columns",
                output.len()
            ))
        })?;
        if !matches!(
            dt,
            DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 | DataType::Date32
        ) {
            return Err(invalid(format!(
                "a cut key filter's column must be a signed integer or date, column {c} is {dt}"
            )));
        }
        if m.within.is_empty()
            || !m.within.len().is_multiple_of(2)
            || m.within.len() > 2 * MAX_RANGES
        {
            return Err(invalid(format!(
                "a cut key filter needs 1 to {MAX_RANGES} [lo, hi] pairs, it has {} values",
                m.within.len()
            )));
        }
        let ranges: Vec<[i64; 2]> = m.within.chunks_exact(2).map(|p| [p[0], p[1]]).collect();
        if ranges.iter().any(|[lo, hi]| lo > hi) || ranges.windows(2).any(|w| w[0][1] >= w[1][0]) {
            return Err(invalid(
                "a cut key filter's ranges must be [lo <= hi] pairs, sorted and disjoint",
            ));
        }
        if m.blocks.is_empty() {
            return Err(invalid(
                "key filter without bloom blocks (field 4) or an attachment (field 5)",
            ));
        }
        Ok(KeyFilter {
            columns: vec![c as usize],
            bloom: Bloom::from_blocks(&m.blocks)?,
            within: Some(Arc::new(ranges)),
        })
    }

    /// Which rows of `batch` may match (every row with a NULL in its key does).
    pub fn mask(&self, batch: &RecordBatch) -> Result<BooleanArray, KeyFilterError> {
        let cols: Vec<ArrayRef> = self
            .columns
            .iter()
            .map(|&c| {
                batch.columns().get(c).cloned().ok_or_else(|| {
                    KeyFilterError::Batch(format!("key column {c} is not in the batch"))
                })
            })
            .collect::<Result<_, _>>()?;
        let (hashes, valid) = hash_rows(&cols, batch.num_rows())?;
        let mut keep = self.bloom.contains_all(&hashes);
        for (k, v) in keep.iter_mut().zip(&valid) {
            *k |= !v;
        }
        if let (Some(ranges), [col]) = (&self.within, &cols[..]) {
            let values = int_values(col).ok_or_else(|| {
                KeyFilterError::Batch(format!(
                    "a cut key filter over a column of type {}",
                    col.data_type()
                ))
            })?;
            for (k, v) in keep.iter_mut().zip(values) {
                if !*k {
                    let i = ranges.partition_point(|r| r[1] < v);
                    *k = ranges.get(i).is_none_or(|r| r[0] > v);
                }
            }
        }
        Ok(BooleanArray::from(keep))
    }

    /// `batch` without the rows that cannot match.
    pub fn apply(&self, batch: &RecordBatch) -> Result<RecordBatch, KeyFilterError> {
        let mask = self.mask(batch)?;
        if mask.true_count() == batch.num_rows() {
            return Ok(batch.clone());
        }
        filter_record_batch(batch, &mask).map_err(KeyFilterError::Arrow)
    }
}

/// Which rows of `batch` every filter of `filters` keeps.
pub(crate) fn mask_all(
    filters: &[KeyFilter],
    batch: &RecordBatch,
) -> Result<BooleanArray, KeyFilterError> {
    let mut mask: Option<BooleanArray> = None;
    for f in filters {
        let m = f.mask(batch)?;
        mask = Some(match mask {
            Some(a) => arrow::compute::and(&a, &m).map_err(KeyFilterError::Arrow)?,
            None => m,
        });
    }
    Ok(mask.unwrap_or_else(|| BooleanArray::from(vec![true; batch.num_rows()])))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int32Array, Int64Array, StringArray};
    use std::sync::Arc;

    fn h(cols: &[ArrayRef]) -> Vec<u64> {
        hash_rows(cols, cols[0].len()).unwrap().0
    }

    #[test]
    fn the_vector_probe_agrees_with_the_scalar_one() {
        let keys: Vec<u64> = (0..5_000u64).map(mix).collect();
        let b = Bloom::with_keys(&keys).unwrap();
        let probe: Vec<u64> = (0..200_000u64).map(|x| mix(x % 7_000)).collect();
        let fast = b.contains_all(&probe);
        let slow: Vec<bool> = probe.iter().map(|&h| b.contains(h)).collect();
        assert_eq!(fast, slow);
        // Every inserted key, and some of the others, pass.
        assert!(fast[..5_000].iter().all(|&x| x));
        assert!(fast.iter().filter(|&&x| !x).count() > 10_000);
    }

    /// A cut filter holds the keys of its ranges and judges only rows inside them:
    /// a row whose key lies outside (appended after the listing) always passes.
    #[test]
    fn a_cut_filter_judges_only_keys_inside_its_ranges() {
        let inside: Vec<i64> = (100..200)
            .step_by(2)
            .chain((1_000..1_100).step_by(2))
            .collect();
        let col: ArrayRef = Arc::new(Int64Array::from(inside.clone()));
        let bloom = Bloom::with_keys(&h(std::slice::from_ref(&col))).unwrap();
        let ranges = [[100, 199], [1_000, 1_099]];
        let msg = bloom.to_cut_msg(0, &ranges);
        assert!(msg.columns.is_empty(), "an earlier node must refuse it");
        let f = KeyFilter::from_msg(&msg, &[DataType::Int64]).unwrap();
        let probe: Vec<i64> = (0..1_500).collect();
        let batch = RecordBatch::try_from_iter([(
            "k",
            Arc::new(Int64Array::from(probe.clone())) as ArrayRef,
        )])
        .unwrap();
        let mask = f.mask(&batch).unwrap();
        for (k, keep) in probe.iter().zip(mask.iter()) {
            let in_range = ranges.iter().any(|[lo, hi]| lo <= k && k <= hi);
            if !in_range || inside.contains(k) {
                assert_eq!(keep, Some(true), "key {k}");
            }
        }
        // Odd keys inside the ranges were never inserted: nearly all dropped.
        let dropped = mask.iter().filter(|k| *k == Some(false)).count();
        assert!(dropped > 90, "{dropped}");
        // Named by attachment, it stays cut; under an aggregate, on another column.
        let d = ModuleDigest([7; 32]);
        let by = msg.by_attachment(&d);
        assert_eq!(
            (by.within.clone(), by.within_column),
            (msg.within.clone(), msg.within_column)
        );
        assert!(f.on(vec![0]).within.is_some());
        // Dates too.
        let days: ArrayRef = Arc::new(arrow::array::Date32Array::from(vec![150, 5_000]));
        let batch = RecordBatch::try_from_iter([("d", days)]).unwrap();
        let f = KeyFilter::from_msg(&msg, &[DataType::Date32]).unwrap();
        // A date hashes as its day number: 150 is a key, 5,000 lies outside.
        assert_eq!(f.mask(&batch).unwrap().true_count(), 2);
    }

    #[test]
    fn malformed_cut_filters_are_refused_with_a_reason() {
        let bloom = Bloom::with_keys(&[1, 2, 3]).unwrap();
        let good = bloom.to_cut_msg(0, &[[1, 5], [10, 20]]);
        let types = [DataType::Int32, DataType::Utf8];
        assert!(KeyFilter::from_msg(&good, &types).is_ok());
        let refused = |m: KeyFilterMsg, types: &[DataType]| {
            KeyFilter::from_msg(&m, types)
                .expect_err("refused")
                .to_string()
        };
        let mut m = good.clone();
        m.columns = vec![0];
        assert!(refused(m, &types).contains("field 7"));
        let mut m = good.clone();
        m.within.pop();
        assert!(refused(m, &types).contains("pairs"));
        let mut m = good.clone();
        m.within = vec![10, 20, 1, 5];
        assert!(refused(m, &types).contains("sorted"));
        let mut m = good.clone();
        m.within = vec![5, 1];
        assert!(refused(m, &types).contains("lo <= hi"));
        let mut m = good.clone();
        m.within = vec![1, 10, 10, 20];
        assert!(refused(m, &types).contains("disjoint"));
        let mut m = good.clone();
        m.within_column = Some(1);
        assert!(refused(m, &types).contains("signed integer or date"));
        let mut m = good.clone();
        m.within_column = Some(9);
        assert!(refused(m, &types).contains("returns 2 columns"));
        let mut m = good.clone();
        m.within_column = None;
        assert!(refused(m, &types).contains("field 7"));
        let mut m = good;
        m.blocks.clear();
        assert!(refused(m, &types).contains("bloom blocks"));
    }

    #[test]
    fn every_inserted_key_passes_and_few_others_do() {
        let keys: Vec<i64> = (0..20_000).map(|i| i * 7 + 3).collect();
        let col: ArrayRef = Arc::new(Int64Array::from(keys.clone()));
        let bloom = Bloom::with_keys(&h(std::slice::from_ref(&col))).unwrap();
        let f = KeyFilter::new(vec![0], bloom);
        let batch = RecordBatch::try_from_iter([("k", col)]).unwrap();
        assert_eq!(f.mask(&batch).unwrap().true_count(), keys.len());
        // Keys never inserted: at most ~1% false positives (0.61% measured).
        let others: ArrayRef = Arc::new(Int64Array::from(
            (0..100_000).map(|i| i * 7 + 4).collect::<Vec<i64>>(),
        ));
        let batch = RecordBatch::try_from_iter([("k", others)]).unwrap();
        let passed = f.mask(&batch).unwrap().true_count();
        assert!(passed < 1_000, "{passed} of 100000 false positives");
    }

    #[test]
    fn a_few_keys_get_a_filter_with_next_to_no_false_positives() {
        let col: ArrayRef = Arc::new(Int64Array::from((0..100).collect::<Vec<i64>>()));
        let f = KeyFilter::new(
            vec![0],
            Bloom::with_keys(&h(std::slice::from_ref(&col))).unwrap(),
        );
        assert_eq!(f.bloom.size_bytes(), MIN_FILTER_BYTES);
        let others: ArrayRef = Arc::new(Int64Array::from((100..200_100).collect::<Vec<i64>>()));
        let batch = RecordBatch::try_from_iter([("k", others)]).unwrap();
        let passed = f.mask(&batch).unwrap().true_count();
        // At 12 bits a key this would be about 1,200.
        assert!(passed < 20, "{passed} of 200000 false positives");
    }

    #[test]
    fn hashes_are_stable_and_width_independent() {
        let a: ArrayRef = Arc::new(Int32Array::from(vec![1, 2, 3]));
        let b: ArrayRef = Arc::new(Int64Array::from(vec![1, 2, 3]));
        assert_eq!(h(std::slice::from_ref(&a)), h(&[b]));
        // Pinned: the node and the compute tier may be different builds.
        assert_eq!(h(&[a])[0], 0x42d4_ce30_d229_5610);
        let s: ArrayRef = Arc::new(StringArray::from(vec!["a", "b"]));
        let (hs, _) = hash_rows(&[s], 2).unwrap();
        assert_ne!(hs[0], hs[1]);
    }

    #[test]
    fn nulls_always_pass_and_bad_filters_are_refused() {
        let keys: ArrayRef = Arc::new(Int64Array::from(vec![Some(1), None, Some(5)]));
        let f = KeyFilter::new(vec![0], Bloom::with_keys(&[]).unwrap());
        let batch = RecordBatch::try_from_iter([("k", keys)]).unwrap();
        let kept = f.apply(&batch).unwrap();
        assert_eq!(kept.num_rows(), 1);
        assert!(kept.column(0).is_null(0));

        let good = Bloom::with_keys(&[1, 2]).unwrap().to_msg(&[0]);
        let types = [DataType::Int64];
        assert!(KeyFilter::from_msg(&good, &types).is_ok());
        let mut bad = good.clone();
        bad.columns = vec![3];
        assert!(
            KeyFilter::from_msg(&bad, &types)
                .unwrap_err()
                .to_string()
                .contains("column 3")
        );
        let mut bad = good.clone();
        bad.blocks.truncate(24);
        assert!(KeyFilter::from_msg(&bad, &types).is_err());
        let mut bad = good.clone();
        bad.blocks.clear();
        assert!(
            KeyFilter::from_msg(&bad, &types)
                .unwrap_err()
                .to_string()
                .contains("earlier build")
        );
        let mut bad = good;
        bad.columns = vec![];
        assert!(KeyFilter::from_msg(&bad, &types).is_err());
        assert!(
            KeyFilter::from_msg(
                &Bloom::with_keys(&[1]).unwrap().to_msg(&[0]),
                &[DataType::Float64]
            )
            .is_err()
        );
    }

    proptest::proptest! {
        /// Whatever a client sends as a filter is refused with a reason, or applies
        /// to a batch without a panic and keeps every key it was built from.
        #[test]
        fn any_filter_is_refused_or_applies(
            columns in proptest::collection::vec(0u32..4, 0..10),
            blocks in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            keys in proptest::collection::vec(proptest::prelude::any::<i64>(), 0..500),
        ) {
            let types = [DataType::Int64, DataType::Utf8];
            let col: ArrayRef = Arc::new(Int64Array::from(keys.clone()));
            let names: ArrayRef = Arc::new(StringArray::from(
                keys.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
            ));
            let batch = RecordBatch::try_from_iter([("k", col.clone()), ("s", names)]).unwrap();
            let msg = KeyFilterMsg { columns, blocks, ..KeyFilterMsg::default() };
            if let Ok(f) = KeyFilter::from_msg(&msg, &types) {
                proptest::prop_assert!(f.apply(&batch).unwrap().num_rows() <= keys.len());
            }
            let built = Bloom::with_keys(&h(std::slice::from_ref(&col))).unwrap();
            let f = KeyFilter::from_msg(&built.to_msg(&[0]), &types).unwrap();
            proptest::prop_assert_eq!(f.apply(&batch).unwrap().num_rows(), keys.len());
        }
    }
}
