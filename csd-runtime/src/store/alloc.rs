//! Extent allocator over the data region. Never persisted: on open it is rebuilt
//! from the catalog, so it cannot disagree with what is committed.

use std::collections::BTreeMap;

pub use csd_protocol::messages::Extent;

use crate::error::{Error, Result};

/// Free-extent map, coalescing on free.
#[derive(Debug, Default, Clone)]
pub(crate) struct Allocator {
    free: BTreeMap<u64, u64>,
    free_blocks: u64,
}

impl Allocator {
    /// All of `[start, end)` free.
    pub(crate) fn new(start: u64, end: u64) -> Self {
        let mut a = Allocator::default();
        if end > start {
            a.free.insert(start, end - start);
            a.free_blocks = end - start;
        }
        a
    }

    /// Blocks free.
    pub(crate) fn free_blocks(&self) -> u64 {
        self.free_blocks
    }

    /// Number of free runs (fragmentation).
    pub(crate) fn free_runs(&self) -> usize {
        self.free.len()
    }

    /// Marks `e` used; fails if any block of it is not free (a corrupt catalog).
    pub(crate) fn reserve(&mut self, e: Extent) -> Result<()> {
        let (&start, &len) = self
            .free
            .range(..=e.lba)
            .next_back()
            .filter(|&(&s, &l)| s + l >= e.end())
            .ok_or_else(|| {
                Error::Corrupt(format!(
                    "extent {e:?} overlaps another object or lies outside the data region"
                ))
            })?;
        self.free.remove(&start);
        if e.lba > start {
            self.free.insert(start, e.lba - start);
        }
        if start + len > e.end() {
            self.free.insert(e.end(), start + len - e.end());
        }
        self.free_blocks -= e.blocks;
        Ok(())
    }

    /// Allocates `blocks`, contiguous after `hint` if possible, else first fit, else
    /// the largest runs. All or nothing.
    pub(crate) fn allocate(&mut self, blocks: u64, hint: Option<u64>) -> Result<Vec<Extent>> {
        if blocks == 0 {
            return Ok(Vec::new());
        }
        if blocks > self.free_blocks {
            return Err(Error::ResourcesExhausted(format!(
                "device full: {blocks} blocks needed, {} free",
                self.free_blocks
            )));
        }
        if let Some(h) = hint
            && let Some(&len) = self.free.get(&h)
        {
            let take = len.min(blocks);
            let first = Extent {
                lba: h,
                blocks: take,
            };
            self.reserve(first)?;
            if take == blocks {
                return Ok(vec![first]);
            }
            let mut rest = self.allocate(blocks - take, None)?;
            rest.insert(0, first);
            return Ok(rest);
        }
        if let Some((&lba, _)) = self.free.iter().find(|&(_, &len)| len >= blocks) {
            let e = Extent { lba, blocks };
            self.reserve(e)?;
            return Ok(vec![e]);
        }
        let mut runs: Vec<(u64, u64)> = self.free.iter().map(|(&s, &l)| (s, l)).collect();
        runs.sort_by_key(|r| std::cmp::Reverse(r.1));
        let mut out = Vec::new();
        let mut need = blocks;
        for (lba, len) in runs {
            let take = len.min(need);
            let e = Extent { lba, blocks: take };
            self.reserve(e)?;
            out.push(e);
            need -= take;
            if need == 0 {
                break;
            }
        }
        out.sort_by_key(|e| e.lba);
        Ok(out)
    }

    /// Returns `e` to the free map, merging with neighbours.
    pub(crate) fn free(&mut self, e: Extent) {
        if e.blocks == 0 {
            return;
        }
        let mut start = e.lba;
        let mut len = e.blocks;
        if let Some((&ps, &pl)) = self.free.range(..start).next_back()
            && ps + pl == start
        {
            self.free.remove(&ps);
            start = ps;
            len += pl;
        }
        if let Some(&nl) = self.free.get(&(e.end())) {
            self.free.remove(&e.end());
            len += nl;
        }
        self.free.insert(start, len);
        self.free_blocks += e.blocks;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_frees_and_coalesces() {
        let mut a = Allocator::new(10, 110);
        let x = a.allocate(30, None).unwrap();
        let y = a.allocate(30, None).unwrap();
        assert_eq!(
            x,
            vec![Extent {
                lba: 10,
                blocks: 30
            }]
        );
        assert_eq!(a.free_blocks(), 40);
        a.free(x[0]);
        // 30 free at 10, 40 free at 70: 50 needs both runs.
        let z = a.allocate(50, None).unwrap();
        assert_eq!(z.iter().map(|e| e.blocks).sum::<u64>(), 50);
        assert!(a.allocate(21, None).is_err(), "only 20 left");
        for e in y.into_iter().chain(z) {
            a.free(e);
        }
        assert_eq!(a.free_runs(), 1);
        assert_eq!(a.free_blocks(), 100);
        assert!(a.reserve(Extent { lba: 5, blocks: 10 }).is_err());
    }

    #[test]
    fn hint_extends_contiguously() {
        let mut a = Allocator::new(0, 100);
        let x = a.allocate(10, None).unwrap();
        let y = a.allocate(10, Some(x[0].end())).unwrap();
        assert_eq!(y[0].lba, 10);
    }
}
