//! Rows at the split boundary, as a partition's stream yields them.

use std::collections::HashSet;

use candle_core::Tensor;

use crate::Result;

/// Rows at the split boundary: `x` is `[B, ...]` entering stage `split`.
pub(crate) struct Boundary {
    pub(crate) ids: Vec<u64>,
    pub(crate) labels: Vec<i64>,
    pub(crate) x: Tensor,
}

impl Boundary {
    /// These rows without the samples in `passed` (recording the rest there);
    /// `None` when none is new.
    pub(crate) fn without(self, passed: &mut HashSet<u64>) -> Result<Option<Boundary>> {
        let b = self;
        let keep: Vec<u32> = (0..b.ids.len())
            .filter(|&i| passed.insert(b.ids[i]))
            .map(|i| i as u32)
            .collect();
        if keep.len() == b.ids.len() {
            return Ok(Some(b));
        }
        if keep.is_empty() {
            return Ok(None);
        }
        let idx = Tensor::new(keep.as_slice(), b.x.device())?;
        Ok(Some(Boundary {
            ids: keep.iter().map(|&i| b.ids[i as usize]).collect(),
            labels: keep.iter().map(|&i| b.labels[i as usize]).collect(),
            x: b.x.index_select(&idx, 0)?,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passed_samples_are_left_out_once() {
        let x = Tensor::new(&[[1f32, 1.], [2., 2.], [3., 3.]], &candle_core::Device::Cpu).unwrap();
        let b = |x: &Tensor| Boundary {
            ids: vec![10, 11, 12],
            labels: vec![0, 1, 0],
            x: x.clone(),
        };
        let mut passed: HashSet<u64> = [11].into();
        let rest = b(&x).without(&mut passed).unwrap().unwrap();
        assert_eq!(
            (rest.ids.clone(), rest.labels.clone()),
            (vec![10, 12], vec![0, 0])
        );
        assert_eq!(rest.x.to_vec2::<f32>().unwrap(), [[1., 1.], [3., 3.]]);
        assert!(b(&x).without(&mut passed).unwrap().is_none());
    }
}
