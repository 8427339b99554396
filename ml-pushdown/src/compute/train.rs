//! Training a head on streamed features (compute side), with candle-nn's AdamW.

use candle_core::{D, DType, Device, Tensor, Var};
use candle_nn::{AdamW, Linear, Module, Optimizer, ParamsAdamW, VarBuilder, VarMap};

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

/// A one-hidden-layer MLP (ReLU) trained one batch at a time with AdamW: the head a
/// transfer-learning job trains on features as they stream in, in its own batch size.
pub struct MlpHead {
    hidden: Linear,
    out: Linear,
    opt: AdamW,
    classes: usize,
    features: usize,
}

impl MlpHead {
    /// A head for `features`-wide inputs, `hidden` units and `classes` outputs,
    /// learning rate `lr`.
    pub fn new(features: usize, hidden: usize, classes: usize, lr: f64) -> Result<Self> {
        if features == 0 || hidden == 0 || classes < 2 {
            return Err(Error::InvalidArgument(format!(
                "an MLP head needs features, hidden units and 2+ classes \
                 (got {features}, {hidden}, {classes})"
            )));
        }
        let vars = VarMap::new();
        let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
        let hidden_layer = candle_nn::linear(features, hidden, vb.pp("hidden"))?;
        let out = candle_nn::linear(hidden, classes, vb.pp("out"))?;
        let opt = AdamW::new(
            vars.all_vars(),
            ParamsAdamW {
                lr,
                weight_decay: 1e-4,
                ..Default::default()
            },
        )?;
        Ok(MlpHead {
            hidden: hidden_layer,
            out,
            opt,
            classes,
            features,
        })
    }

    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let (_, d) = x.dims2()?;
        if d != self.features {
            return Err(Error::InvalidArgument(format!(
                "the head takes {} features, the batch has {d}",
                self.features
            )));
        }
        Ok(self.out.forward(&self.hidden.forward(x)?.relu()?)?)
    }

    /// One AdamW step on a batch; returns its loss before the step.
    pub fn step(&mut self, x: &Tensor, y: &[i64]) -> Result<f32> {
        let (n, _) = x.dims2()?;
        if n != y.len() || n == 0 {
            return Err(Error::InvalidArgument(format!(
                "{n} feature rows for {} labels",
                y.len()
            )));
        }
        let yt = labels_u32(y, self.classes, x.device())?;
        let loss = candle_nn::loss::cross_entropy(&self.logits(x)?, &yt)?;
        self.opt.backward_step(&loss)?;
        Ok(loss.to_scalar::<f32>()?)
    }

    /// Predicted classes of `x`.
    pub fn predict(&self, x: &Tensor) -> Result<Vec<u32>> {
        Ok(self.logits(x)?.argmax(D::Minus1)?.to_vec1::<u32>()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two Gaussian blobs in 32 dimensions: the MLP learns them batch by batch and
    /// classifies fresh points from the same blobs; bad input is an error.
    #[test]
    fn mlp_head_learns_batch_by_batch() -> Result<()> {
        let dev = Device::Cpu;
        let blobs = |n: usize| -> Result<(Tensor, Vec<i64>)> {
            let y: Vec<i64> = (0..n as i64).map(|i| i % 2).collect();
            let centre = Tensor::new(
                y.iter()
                    .map(|&l| if l == 1 { 1.5f32 } else { -1.5 })
                    .collect::<Vec<_>>(),
                &dev,
            )?
            .reshape((n, 1))?;
            let x = Tensor::randn(0f32, 1., (n, 32), &dev)?.broadcast_add(&centre)?;
            Ok((x, y))
        };
        let mut head = MlpHead::new(32, 16, 2, 1e-2)?;
        let mut first = None;
        let mut last = 0.0;
        for _ in 0..30 {
            let (x, y) = blobs(16)?;
            last = head.step(&x, &y)?;
            first.get_or_insert(last);
        }
        assert!(
            last < first.unwrap_or(0.0),
            "loss did not fall: {first:?} -> {last}"
        );
        let (x, y) = blobs(200)?;
        let p = head.predict(&x)?;
        let right = p.iter().zip(&y).filter(|(p, y)| **p as i64 == **y).count();
        assert!(right > 180, "{right}/200 right");
        assert!(head.step(&x, &y[..10]).is_err());
        assert!(
            head.step(&Tensor::zeros((2, 5), DType::F32, &dev)?, &[0, 1])
                .is_err()
        );
        assert!(head.step(&x.narrow(0, 0, 2)?, &[0, 7]).is_err());
        Ok(())
    }
}
