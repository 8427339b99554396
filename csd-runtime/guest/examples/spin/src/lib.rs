//! Hostile: never returns from its first batch (the node's CPU-time limit ends it).
use csd_guest::{Args, Operator, RecordBatch};

struct Spin(u64);

impl Operator for Spin {
    fn new(_: &Args) -> Result<Self, String> {
        Ok(Spin(0))
    }
    fn batch(&mut self, _b: RecordBatch) -> Result<Option<RecordBatch>, String> {
        loop {
            self.0 = std::hint::black_box(self.0.wrapping_add(1));
        }
    }
    fn finish(&mut self) -> Result<Option<RecordBatch>, String> {
        self.batch(RecordBatch::new_empty(std::sync::Arc::new(
            csd_guest::Schema::empty(),
        )))
    }
}

csd_guest::export_operator!(Spin);
