//! The pointer chase (X-RDMA at storage): follows `hops` pointers through a linked
//! structure of fixed 16-byte records held in an object, in one request. Record `i`
//! sits at byte `base + 16 i` of `object` and holds two little-endian u64: the index
//! of the next record and a value. Arguments: `object`, `base`, `start`, `hops`.
//! Output: one row (`hops`, `last`: the index reached, `sum`: of the values visited).

use std::sync::Arc;

use csd_guest::arrow_array::Int64Array;
use csd_guest::{Args, DataType, Field, Operator, RecordBatch, Schema};

struct Chase {
    object: String,
    base: u64,
    start: u64,
    hops: u64,
    done: bool,
}

impl Operator for Chase {
    fn new(args: &Args) -> Result<Self, String> {
        Ok(Chase {
            object: args.required("object")?.to_string(),
            base: args.parse_or("base", 0)?,
            start: args.parse_or("start", 0)?,
            hops: args.parse_or("hops", 1)?,
            done: false,
        })
    }

    fn batch(&mut self, _b: RecordBatch) -> Result<Option<RecordBatch>, String> {
        Ok(None)
    }

    fn finish(&mut self) -> Result<Option<RecordBatch>, String> {
        if self.done {
            return Ok(None);
        }
        self.done = true;
        let (mut at, mut sum) = (self.start, 0u64);
        let mut rec = [0u8; 16];
        for _ in 0..self.hops {
            let n = csd_guest::read(&self.object, self.base + 16 * at, &mut rec);
            if n < 16 {
                return Err(format!("record {at} lies past the end of {}", self.object));
            }
            let next = u64::from_le_bytes(rec[..8].try_into().map_err(|_| "record")?);
            sum = sum.wrapping_add(u64::from_le_bytes(
                rec[8..].try_into().map_err(|_| "record")?,
            ));
            at = next;
        }
        let schema = Arc::new(Schema::new(vec![
            Field::new("hops", DataType::Int64, false),
            Field::new("last", DataType::Int64, false),
            Field::new("sum", DataType::Int64, false),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(vec![self.hops as i64])),
                Arc::new(Int64Array::from(vec![at as i64])),
                Arc::new(Int64Array::from(vec![sum as i64])),
            ],
        )
        .map(Some)
        .map_err(|e| e.to_string())
    }
}

csd_guest::export_operator!(Chase);
