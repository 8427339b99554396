//! Hostile: executes `unreachable` on its first batch (or at the end).
use csd_guest::{Args, Operator, RecordBatch};

struct Trap;

impl Operator for Trap {
    fn new(_: &Args) -> Result<Self, String> {
        Ok(Trap)
    }
    fn batch(&mut self, _b: RecordBatch) -> Result<Option<RecordBatch>, String> {
        self.finish()
    }
    fn finish(&mut self) -> Result<Option<RecordBatch>, String> {
        #[cfg(target_arch = "wasm32")]
        core::arch::wasm32::unreachable();
        #[cfg(not(target_arch = "wasm32"))]
        unreachable!()
    }
}

csd_guest::export_operator!(Trap);
