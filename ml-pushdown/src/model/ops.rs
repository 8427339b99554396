//! Kernels candle lacks in a fast form.
//!
//! candle runs a grouped convolution as one convolution per group, so a depthwise
//! convolution over 1,152 channels becomes 1,152 tiny im2col + GEMM calls. The direct
//! kernel of `cpu` (row `axpy`s over each padded channel plane) is an order of
//! magnitude faster; it also fuses the (folded batch-norm) bias and ReLU6.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::cpu::{Act, Window, depthwise};

/// Depthwise `k×k` convolution with symmetric zero padding `k / 2`, plus a per-channel
/// bias and an optional ReLU6. `x`: `[N, C, H, W]`, `w`: `[C, 1, k, k]`, `b`: `[C]`.
pub fn depthwise_conv2d(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    stride: usize,
    relu6: bool,
) -> candle_core::Result<Tensor> {
    let (c, _, k, _) = w.dims4()?;
    if !x.device().is_cpu() || !(1..=2).contains(&stride) {
        let y = x.conv2d(w, k / 2, stride, 1, c)?;
        let y = y.broadcast_add(&b.reshape((1, c, 1, 1))?)?;
        return if relu6 { y.clamp(0f32, 6f32) } else { Ok(y) };
    }
    let op = DepthwiseConv {
        w: w.flatten_all()?.to_vec1::<f32>()?,
        b: b.to_vec1::<f32>()?,
        c,
        k,
        stride,
        relu6,
    };
    x.contiguous()?.apply_op1_no_bwd(&op)
}

struct DepthwiseConv {
    w: Vec<f32>,
    b: Vec<f32>,
    c: usize,
    k: usize,
    stride: usize,
    relu6: bool,
}

impl CustomOp1 for DepthwiseConv {
    fn name(&self) -> &'static str {
        "depthwise-conv2d"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, c, h, w) = layout.shape().dims4()?;
        if c != self.c {
            candle_core::bail!("depthwise conv: input has {c} channels, weights {}", self.c);
        }
        let x = match storage {
            CpuStorage::F32(v) => match layout.contiguous_offsets() {
                Some((a, b)) => &v[a..b],
                None => candle_core::bail!("depthwise conv: input must be contiguous"),
            },
            _ => candle_core::bail!("depthwise conv: input must be f32"),
        };
        let g = Window {
            h,
            w,
            k: self.k,
            stride: self.stride,
        };
        let (oh, ow) = g.out();
        let act = if self.relu6 { Act::Relu6 } else { Act::None };
        let mut out = vec![0f32; n * c * oh * ow];
        out.par_chunks_mut(c * oh * ow)
            .zip(x.par_chunks(c * h * w))
            .for_each(|(o, x)| depthwise(o, x, &self.w, &self.b, g, act));
        Ok((CpuStorage::F32(out), Shape::from((n, c, oh, ow))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// The direct kernel against candle's own grouped convolution.
    #[test]
    fn matches_grouped_conv() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for (k, s, h, w) in [
            (3, 1, 7, 9),
            (3, 2, 8, 8),
            (5, 2, 9, 7),
            (5, 1, 6, 5),
            (3, 2, 1, 1),
        ] {
            let c = 4;
            let x = Tensor::randn(0f32, 1., (2, c, h, w), &dev)?;
            let wt = Tensor::randn(0f32, 1., (c, 1, k, k), &dev)?;
            let b = Tensor::randn(0f32, 1., c, &dev)?;
            let ours = depthwise_conv2d(&x, &wt, &b, s, true)?;
            let theirs = x
                .conv2d(&wt, k / 2, s, 1, c)?
                .broadcast_add(&b.reshape((1, c, 1, 1))?)?
                .clamp(0f32, 6f32)?;
            assert_eq!(ours.dims(), theirs.dims(), "k={k} s={s} {h}x{w}");
            let err = (ours - theirs)?
                .abs()?
                .max_all()?
                .to_dtype(DType::F32)?
                .to_scalar::<f32>()?;
            assert!(err < 1e-5, "k={k} s={s} {h}x{w}: max error {err}");
        }
        Ok(())
    }
}
