//! Hostile: grows its memory without bound (the node's memory limit ends it).
use csd_guest::{Args, Operator, RecordBatch};

struct Hog(Vec<Vec<u8>>);

impl Operator for Hog {
    fn new(_: &Args) -> Result<Self, String> {
        Ok(Hog(Vec::new()))
    }
    fn batch(&mut self, _b: RecordBatch) -> Result<Option<RecordBatch>, String> {
        self.finish()
    }
    fn finish(&mut self) -> Result<Option<RecordBatch>, String> {
        loop {
            let mut v = vec![0u8; 16 << 20];
            v[4096] = 1;
            self.0.push(std::hint::black_box(v));
        }
    }
}

csd_guest::export_operator!(Hog);
