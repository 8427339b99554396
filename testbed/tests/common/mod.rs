//! What the guest test files share.

use std::sync::Arc;

use arrow::array::{Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use csd_testbed::guest::Kit;

/// The QEMU guest kit, or `None` (saying what is missing) where it is not installed
/// and `CSD_REQUIRE_QEMU` is unset; `scripts/setup-qemu.sh` (run by
/// `scripts/test.sh`) installs it.
pub fn kit() -> Option<Kit> {
    match Kit::find() {
        Ok(k) => Some(k),
        Err(e) if std::env::var_os("CSD_REQUIRE_QEMU").is_none() => {
            eprintln!("skipping this QEMU guest test: {e}");
            None
        }
        Err(e) => panic!("CSD_REQUIRE_QEMU is set: {e}"),
    }
}

/// `rows` rows `(id, text)` made from `seed`: ids `7 i + seed`, text naming both.
pub fn batch(seed: i64, rows: usize) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("text", DataType::Utf8, false),
    ]));
    let ids: Vec<i64> = (0..rows as i64).map(|i| i * 7 + seed).collect();
    let text: Vec<String> = ids.iter().map(|i| format!("row {i} of {seed}")).collect();
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from(ids)),
            Arc::new(StringArray::from(text)),
        ],
    )
    .unwrap()
}
