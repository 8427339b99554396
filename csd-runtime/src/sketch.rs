//! Distinct-count sketches the node writes with every Parquet object it stores: one
//! HyperLogLog per column, in the footer's key-value metadata under [`KEY`].
//! Parquet carries no usable distinct counts (its `distinct_count` statistic is
//! optional and arrow-rs never writes it), and whether an aggregate shrinks at a
//! node is a question of how many groups it would answer. Sketches merge, so the
//! node describes a partition, and a table at the node, by the union of its
//! objects' sketches (`TableDescription::distinct`), and the compute tier decides
//! before it asks a node to aggregate.
//!
//! Values hash by a stable function of their canonical bytes (integers, dates,
//! times and decimals by value; floats by bits, `-0.0` as `0.0`, every NaN alike;
//! strings and binaries by XXH64), so sketches written by different versions and
//! nodes merge. NULLs are not counted (a NULL group is one more at most). Nested
//! types are not sketched.

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{
    DataType, Date32Type, Date64Type, Decimal128Type, DurationMicrosecondType,
    DurationMillisecondType, DurationNanosecondType, DurationSecondType, Float32Type, Float64Type,
    Int8Type, Int16Type, Int32Type, Int64Type, Schema, Time32MillisecondType, Time32SecondType,
    Time64MicrosecondType, Time64NanosecondType, TimeUnit, TimestampMicrosecondType,
    TimestampMillisecondType, TimestampNanosecondType, TimestampSecondType, UInt8Type, UInt16Type,
    UInt32Type, UInt64Type,
};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use parquet::file::metadata::{KeyValue, ParquetMetaData};
use serde::{Deserialize, Serialize};

/// The footer key holding an object's sketches.
pub const KEY: &str = "csd.distinct";

/// Register index bits: 1,024 one-byte registers, a standard error of about 3.3%
/// (enough to tell an aggregate that shrinks from one that does not; every range
/// reader of an object reads its footer, so the sketches are kept small).
const P: u32 = 10;
const M: usize = 1 << P;

/// A HyperLogLog sketch of one column's distinct non-NULL values.
#[derive(Clone, PartialEq, Eq)]
pub struct DistinctSketch {
    registers: Vec<u8>,
}

impl std::fmt::Debug for DistinctSketch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DistinctSketch(~{})", self.estimate())
    }
}

impl Default for DistinctSketch {
    fn default() -> Self {
        DistinctSketch {
            registers: vec![0; M],
        }
    }
}

/// A 64-bit finalizer (MurmurHash3's `fmix64`): every input bit reaches every
/// output bit, so integer values hash well without a byte-wise hash.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn hash_bytes(b: &[u8]) -> u64 {
    twox_hash::XxHash64::oneshot(0, b)
}

fn float_bits(x: f64) -> u64 {
    if x == 0.0 {
        0
    } else if x.is_nan() {
        f64::NAN.to_bits()
    } else {
        x.to_bits()
    }
}

impl DistinctSketch {
    fn insert_hash(&mut self, h: u64) {
        let index = (h >> (64 - P)) as usize;
        // The remaining bits, with a guard bit so the rank stays within 64 - P + 1.
        let rest = (h << P) | (1 << (P - 1));
        let rank = rest.leading_zeros() as u8 + 1;
        let r = &mut self.registers[index];
        if rank > *r {
            *r = rank;
        }
    }

    /// The union of `self` and `other`.
    pub fn merge(&mut self, other: &DistinctSketch) {
        for (a, b) in self.registers.iter_mut().zip(&other.registers) {
            *a = (*a).max(*b);
        }
    }

    /// The estimated number of distinct values.
    pub fn estimate(&self) -> u64 {
        let m = M as f64;
        let (mut sum, mut zeros) = (0.0f64, 0usize);
        for &r in &self.registers {
            sum += 2f64.powi(-i32::from(r));
            zeros += usize::from(r == 0);
        }
        let alpha = 0.7213 / (1.0 + 1.079 / m);
        let raw = alpha * m * m / sum;
        let e = if raw <= 2.5 * m && zeros > 0 {
            // Linear counting: exact enough for small sets.
            m * (m / zeros as f64).ln()
        } else {
            raw
        };
        e.round() as u64
    }

    /// Adds the non-NULL values of `array`; false when its type is not sketched.
    pub fn update(&mut self, array: &dyn Array) -> bool {
        macro_rules! ints {
            ($t:ty) => {{
                let a = array.as_primitive::<$t>();
                for (i, v) in a.values().iter().enumerate() {
                    if a.is_valid(i) {
                        self.insert_hash(mix(*v as i64 as u64));
                    }
                }
            }};
        }
        match array.data_type() {
            DataType::Boolean => {
                let a = array.as_boolean();
                for v in a.iter().flatten() {
                    self.insert_hash(mix(u64::from(v)));
                }
            }
            DataType::Int8 => ints!(Int8Type),
            DataType::Int16 => ints!(Int16Type),
            DataType::Int32 => ints!(Int32Type),
            DataType::Int64 => ints!(Int64Type),
            DataType::UInt8 => ints!(UInt8Type),
            DataType::UInt16 => ints!(UInt16Type),
            DataType::UInt32 => ints!(UInt32Type),
            DataType::UInt64 => ints!(UInt64Type),
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
            DataType::Duration(TimeUnit::Second) => ints!(DurationSecondType),
            DataType::Duration(TimeUnit::Millisecond) => ints!(DurationMillisecondType),
            DataType::Duration(TimeUnit::Microsecond) => ints!(DurationMicrosecondType),
            DataType::Duration(TimeUnit::Nanosecond) => ints!(DurationNanosecondType),
            DataType::Decimal128(..) => {
                let a = array.as_primitive::<Decimal128Type>();
                for v in a.iter().flatten() {
                    self.insert_hash(mix(v as u64 ^ mix((v >> 64) as u64)));
                }
            }
            DataType::Float32 => {
                let a = array.as_primitive::<Float32Type>();
                for v in a.iter().flatten() {
                    self.insert_hash(mix(float_bits(f64::from(v))));
                }
            }
            DataType::Float64 => {
                let a = array.as_primitive::<Float64Type>();
                for v in a.iter().flatten() {
                    self.insert_hash(mix(float_bits(v)));
                }
            }
            DataType::Utf8 => self.bytes(array.as_string::<i32>().iter().flatten()),
            DataType::LargeUtf8 => self.bytes(array.as_string::<i64>().iter().flatten()),
            DataType::Utf8View => self.bytes(array.as_string_view().iter().flatten()),
            DataType::Binary => self.bytes(array.as_binary::<i32>().iter().flatten()),
            DataType::LargeBinary => self.bytes(array.as_binary::<i64>().iter().flatten()),
            DataType::BinaryView => self.bytes(array.as_binary_view().iter().flatten()),
            DataType::Dictionary(_, value) => {
                // Rare at put: the dictionary's values as they would be stored.
                match arrow::compute::cast(array, value) {
                    Ok(plain) => return self.update(plain.as_ref()),
                    Err(_) => return false,
                }
            }
            _ => return false,
        }
        true
    }

    fn bytes<'a, B: AsRef<[u8]> + ?Sized + 'a>(&mut self, values: impl Iterator<Item = &'a B>) {
        for v in values {
            self.insert_hash(hash_bytes(v.as_ref()));
        }
    }
}

/// An object's sketches: one per column of its schema, `None` where the column's
/// type is not sketched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnSketches {
    columns: Vec<Option<DistinctSketch>>,
}

/// The footer value: a version, the register bits, and one base64 sketch (or null)
/// per column.
#[derive(Serialize, Deserialize)]
struct Encoded {
    v: u32,
    p: u32,
    /// Version 1: each column's registers in base64.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    columns: Vec<Option<String>>,
    /// Version 2: which columns have a sketch ...
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    present: Vec<bool>,
    /// ... and their registers, one column after the other, zstd-compressed, in
    /// base64 (a fifth to a tenth of version 1: every range reader of the object
    /// reads its footer).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    z: String,
}

/// The zstd level sketches are compressed at (a few KiB per column, once per put).
const ZSTD_LEVEL: i32 = 9;

impl ColumnSketches {
    /// Empty sketches for `schema`'s columns.
    pub fn for_schema(schema: &Schema) -> Self {
        let columns = schema
            .fields()
            .iter()
            .map(|f| {
                let mut s = DistinctSketch::default();
                // A zero-length array of the type tells whether it is sketched.
                let empty = arrow::array::new_empty_array(f.data_type());
                s.update(empty.as_ref()).then_some(s)
            })
            .collect();
        ColumnSketches { columns }
    }

    /// Adds `batch`'s rows (its columns in the schema's order).
    pub fn update(&mut self, batch: &RecordBatch) {
        for (s, c) in self.columns.iter_mut().zip(batch.columns()) {
            if let Some(sketch) = s
                && !sketch.update(c.as_ref())
            {
                *s = None;
            }
        }
    }

    /// The union with `other`, column by column (a column either lacks stays
    /// unsketched); `None` when they have different column counts.
    pub fn merged(mut self, other: &ColumnSketches) -> Option<ColumnSketches> {
        if self.columns.len() != other.columns.len() {
            return None;
        }
        for (a, b) in self.columns.iter_mut().zip(&other.columns) {
            match (a.as_mut(), b) {
                (Some(x), Some(y)) => x.merge(y),
                _ => *a = None,
            }
        }
        Some(self)
    }

    /// The union of `all`; `None` when there are none or any lacks sketches.
    pub fn union<'a>(mut all: impl Iterator<Item = Option<&'a ColumnSketches>>) -> Option<Self> {
        let first = all.next()??.clone();
        all.try_fold(first, |acc, s| acc.merged(s?))
    }

    /// Estimated distinct non-NULL values per column.
    pub fn estimates(&self) -> Vec<Option<u64>> {
        self.columns
            .iter()
            .map(|s| s.as_ref().map(DistinctSketch::estimate))
            .collect()
    }

    /// The footer entry holding these sketches.
    pub fn to_key_value(&self) -> KeyValue {
        let present: Vec<bool> = self.columns.iter().map(Option::is_some).collect();
        let registers: Vec<u8> = self
            .columns
            .iter()
            .flatten()
            .flat_map(|s| s.registers.iter().copied())
            .collect();
        let z = zstd::bulk::compress(&registers, ZSTD_LEVEL)
            .map(|z| STANDARD.encode(z))
            .unwrap_or_default();
        let encoded = Encoded {
            v: 2,
            p: P,
            columns: vec![],
            present,
            z,
        };
        let value = serde_json::to_string(&encoded).unwrap_or_default();
        KeyValue::new(KEY.to_string(), value)
    }

    /// The sketches in a footer, for its `columns` top-level columns: `None` when
    /// there are none (an object written before sketches, or by someone else) or
    /// they cannot be read (then the object is described without them; nothing
    /// else depends on them).
    pub fn from_footer(meta: &ParquetMetaData, columns: usize) -> Option<Self> {
        let kv = meta.file_metadata().key_value_metadata()?;
        let value = kv.iter().find(|kv| kv.key == KEY)?.value.as_deref()?;
        let decoded = Self::decode(value, columns);
        if decoded.is_none() {
            tracing::warn!("an object's distinct-count sketches cannot be read; ignored");
        }
        decoded
    }

    fn decode(value: &str, columns: usize) -> Option<Self> {
        let e: Encoded = serde_json::from_str(value).ok()?;
        // Written with more registers (version 1 had 4,096): folded to this many.
        let extra = e.p.checked_sub(P).filter(|x| *x <= 4)?;
        let m = M << extra;
        let registers: Vec<Option<Vec<u8>>> = match e.v {
            1 => e
                .columns
                .into_iter()
                .map(|c| {
                    c.map(|b| STANDARD.decode(b).ok())
                        .map_or(Some(None), |r| r.map(Some))
                })
                .collect::<Option<_>>()?,
            2 => {
                let want = e.present.iter().filter(|p| **p).count() * m;
                let z = STANDARD.decode(&e.z).ok()?;
                let all = zstd::bulk::decompress(&z, want).ok()?;
                if all.len() != want {
                    return None;
                }
                let mut chunks = all.chunks_exact(m);
                e.present
                    .iter()
                    .map(|p| match p {
                        true => chunks.next().map(|c| Some(c.to_vec())),
                        false => Some(None),
                    })
                    .collect::<Option<_>>()?
            }
            _ => return None,
        };
        if registers.len() != columns {
            return None;
        }
        let columns = registers
            .into_iter()
            .map(|c| match c {
                None => Some(None),
                Some(registers) => {
                    let valid = registers.len() == m
                        && registers.iter().all(|r| u32::from(*r) <= 64 - e.p + 1);
                    valid.then(|| Some(folded(&registers, extra)))
                }
            })
            .collect::<Option<Vec<_>>>()?;
        Some(ColumnSketches { columns })
    }
}

/// Registers of a sketch with `extra` more index bits than [`P`], folded to a
/// sketch of [`P`]: the index's low `extra` bits become the first bits of the rank's
/// word (exactly the sketch the same values would have made).
fn folded(registers: &[u8], extra: u32) -> DistinctSketch {
    let mut out = DistinctSketch::default();
    for (i, &r) in registers.iter().enumerate() {
        if r == 0 {
            continue;
        }
        let low = (i as u32) & ((1 << extra) - 1);
        let rank = match low {
            0 => r as u32 + extra,
            b => b.leading_zeros() - (32 - extra) + 1,
        };
        let o = &mut out.registers[i >> extra];
        *o = (*o).max(rank as u8);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Float64Array, Int32Array, Int64Array, StringArray};
    use arrow::datatypes::{Field, Schema};

    use super::*;

    /// The registers of a sketch with `p` index bits over `hashes`.
    fn registers_at(p: u32, hashes: &[u64]) -> Vec<u8> {
        let mut r = vec![0u8; 1 << p];
        for h in hashes {
            let rank = ((h << p) | (1 << (p - 1))).leading_zeros() as u8 + 1;
            let i = (h >> (64 - p)) as usize;
            r[i] = r[i].max(rank);
        }
        r
    }

    fn within(estimate: u64, truth: u64, tolerance: f64) -> bool {
        (estimate as f64 - truth as f64).abs() <= tolerance * truth as f64
    }

    #[test]
    fn estimates_small_and_large_sets() {
        for truth in [1u64, 10, 1_000, 100_000, 2_000_000] {
            let mut s = DistinctSketch::default();
            // Each value three times: duplicates do not count.
            let values: Vec<i64> = (0..truth as i64).flat_map(|v| [v, v, v]).collect();
            assert!(s.update(&Int64Array::from(values)));
            let e = s.estimate();
            // Within two standard errors (linear counting below ~2.5k values).
            let tolerance = if truth <= 10 { 0.0 } else { 0.066 };
            assert!(
                within(e, truth, tolerance),
                "{truth} distinct: estimated {e}"
            );
        }
    }

    #[test]
    fn merged_sketches_count_the_union() {
        let (mut a, mut b) = (DistinctSketch::default(), DistinctSketch::default());
        a.update(&Int64Array::from_iter_values(0..60_000));
        b.update(&Int64Array::from_iter_values(40_000..100_000));
        a.merge(&b);
        assert!(within(a.estimate(), 100_000, 0.05), "{}", a.estimate());
    }

    #[test]
    fn strings_nulls_and_floats() {
        let mut s = DistinctSketch::default();
        let names: Vec<Option<String>> = (0..5_000)
            .map(|i| (i % 7 != 0).then(|| format!("user{}", i % 1_000)))
            .collect();
        s.update(&StringArray::from(names));
        assert!(within(s.estimate(), 1_000, 0.03), "{}", s.estimate());
        let mut f = DistinctSketch::default();
        f.update(&Float64Array::from(vec![
            0.0,
            -0.0,
            f64::NAN,
            -f64::NAN,
            1.5,
        ]));
        assert_eq!(f.estimate(), 3, "0.0 = -0.0, NaNs alike");
    }

    #[test]
    fn a_footer_round_trip_and_bad_footers() {
        let schema = Schema::new(vec![
            Field::new("k", DataType::Int32, false),
            Field::new("s", DataType::Utf8, true),
            Field::new(
                "l",
                DataType::List(Arc::new(Field::new("x", DataType::Int32, true))),
                true,
            ),
        ]);
        let mut s = ColumnSketches::for_schema(&schema);
        assert_eq!(s.estimates(), vec![Some(0), Some(0), None]);
        let batch = RecordBatch::try_new(
            Arc::new(schema.clone()),
            vec![
                Arc::new(Int32Array::from_iter_values(0..100)) as ArrayRef,
                Arc::new(StringArray::from_iter_values(
                    (0..100).map(|i| format!("{}", i % 5)),
                )),
                arrow::array::new_null_array(schema.field(2).data_type(), 100),
            ],
        )
        .unwrap();
        s.update(&batch);
        let kv = s.to_key_value();
        let back = ColumnSketches::decode(kv.value.as_deref().unwrap(), 3).unwrap();
        assert_eq!(back, s);
        let e = back.estimates();
        assert!(matches!(e[0], Some(98..=102)), "{e:?}");
        assert_eq!(e[1..], [Some(5), None]);
        // Another column count, another version, garbage: ignored, never a panic.
        assert!(ColumnSketches::decode(kv.value.as_deref().unwrap(), 2).is_none());
        assert!(ColumnSketches::decode("{\"v\":3,\"p\":12,\"columns\":[]}", 0).is_none());
        // Version 1 (each column's 4,096 registers in base64) still reads, folded
        // to exactly the sketch the same values make now.
        let hashes: Vec<u64> = (0..20_000u64).map(mix).collect();
        let mut now = DistinctSketch::default();
        hashes.iter().for_each(|h| now.insert_hash(*h));
        let v1 = serde_json::json!({
            "v": 1,
            "p": 12,
            "columns": [STANDARD.encode(registers_at(12, &hashes))],
        });
        let read = ColumnSketches::decode(&v1.to_string(), 1).unwrap();
        assert_eq!(read.columns, vec![Some(now)]);
        // Compressed: a column of 100,000 distinct values in a fifth of version 1.
        let mut big =
            ColumnSketches::for_schema(&Schema::new(vec![Field::new("k", DataType::Int64, false)]));
        big.update(
            &RecordBatch::try_new(
                Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)])),
                vec![Arc::new(arrow::array::Int64Array::from_iter_values(0..100_000)) as ArrayRef],
            )
            .unwrap(),
        );
        let len = big.to_key_value().value.unwrap().len();
        // (Version 1 wrote 4,096 registers in base64: 5,462 bytes a column.)
        assert!(len < 5_462 / 5, "{len} bytes");
        assert!(ColumnSketches::decode("not json", 3).is_none());
        let bad = kv.value.unwrap().replacen("A", "*", 1);
        assert!(ColumnSketches::decode(&bad, 3).is_none());
        let union = ColumnSketches::union([Some(&s), Some(&back)].into_iter()).unwrap();
        assert_eq!(union.estimates(), s.estimates());
        assert!(ColumnSketches::union([Some(&s), None].into_iter()).is_none());
    }
}
