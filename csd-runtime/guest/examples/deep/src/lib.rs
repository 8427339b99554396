//! Hostile: recurses without bound (the node's stack limit ends it).
use csd_guest::{Args, Operator, RecordBatch};

struct Deep;

#[inline(never)]
#[allow(unconditional_recursion)]
fn down(n: u64, pad: &mut [u64; 16]) -> u64 {
    pad[(n % 16) as usize] = n;
    let mut next = [0u64; 16];
    down(std::hint::black_box(n + 1), &mut next) + std::hint::black_box(pad[0])
}

impl Operator for Deep {
    fn new(_: &Args) -> Result<Self, String> {
        Ok(Deep)
    }
    fn batch(&mut self, _b: RecordBatch) -> Result<Option<RecordBatch>, String> {
        self.finish()
    }
    fn finish(&mut self) -> Result<Option<RecordBatch>, String> {
        let mut pad = [0u64; 16];
        Err(format!("{}", down(0, &mut pad)))
    }
}

csd_guest::export_operator!(Deep);
