//! Training a head on streamed features (compute side), with candle-nn's AdamW.

use candle_core::{D, DType, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};

use crate::{Error, Result};

/// A linear classifier over standardised features.
pub struct LinearHead {
    w: Var,
    b: Var,
    mean: Tensor,
    std: Tensor,
}

fn labels_u32(y: &[i64], classes: usize, dev: &candle_core::Device) -> Result<Tensor> {
    let v: Vec<u32> = y
        .iter()
        .map(|&l| {
            if l < 0 || l as usize >= classes {
                Err(Error::InvalidArgument(format!(
                    "label {l} is outside 0..{classes}"
                )))
            } else {
                Ok(l as u32)
            }
        })
        .collect::<Result<_>>()?;
    Ok(Tensor::new(v, dev)?)
}

impl LinearHead {
    /// Fits `classes`-way logistic regression on `x` (`[N, D]`) with full-batch AdamW
    /// (zero init, so runs are deterministic).
    pub fn fit(x: &Tensor, y: &[i64], classes: usize, steps: usize) -> Result<Self> {
        let dev = x.device();
        let (n, d) = x.dims2()?;
        if n != y.len() || n == 0 {
            return Err(Error::InvalidArgument(format!(
                "{n} feature rows for {} labels",
                y.len()
            )));
        }
        let mean = x.mean_keepdim(0)?;
        let std = (x.broadcast_sub(&mean)?.sqr()?.mean_keepdim(0)? + 1e-6)?.sqrt()?;
        let xs = x.broadcast_sub(&mean)?.broadcast_div(&std)?;
        let yt = labels_u32(y, classes, dev)?;
        let w = Var::zeros((classes, d), DType::F32, dev)?;
        let b = Var::zeros(classes, DType::F32, dev)?;
        let mut opt = AdamW::new(
            vec![w.clone(), b.clone()],
            ParamsAdamW {
                lr: 1e-2,
                weight_decay: 1e-2,
                ..Default::default()
            },
        )?;
        for _ in 0..steps {
            let logits = xs
                .matmul(&w.as_tensor().t()?)?
                .broadcast_add(b.as_tensor())?;
            let loss = candle_nn::loss::cross_entropy(&logits, &yt)?;
            opt.backward_step(&loss)?;
        }
        Ok(LinearHead { w, b, mean, std })
    }

    /// Predicted classes of `x`.
    pub fn predict(&self, x: &Tensor) -> Result<Vec<u32>> {
        let xs = x.broadcast_sub(&self.mean)?.broadcast_div(&self.std)?;
        let logits = xs
            .matmul(&self.w.as_tensor().t()?)?
            .broadcast_add(self.b.as_tensor())?;
        Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
    }

    /// Fraction of `x` classified as `y`.
    pub fn accuracy(&self, x: &Tensor, y: &[i64]) -> Result<f64> {
        let p = self.predict(x)?;
        let right = p.iter().zip(y).filter(|(p, y)| **p as i64 == **y).count();
        Ok(right as f64 / y.len().max(1) as f64)
    }
}
