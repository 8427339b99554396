//! ResNet-18 and ResNet-50 (He et al.; torchvision's layout, stride on the 3×3 of a
//! bottleneck) as stages: stem (7×7 convolution and max pool), one stage per residual
//! block, global pool.
//!
//! Weights use torchvision's names (`conv1`, `bn1`, `layer1.0.conv1`,
//! `layer2.0.downsample.0`, `fc`, …) in a safetensors file. Batch norms (eps 1e-5) are
//! folded into the convolutions at load time.

use candle_core::{D, Device, Tensor};

use super::cpu::{self, Act, Host, Window};
use super::exported::{self, Classifier};
use super::{Arch, StageInfo, StagedModel, Weights, bytes_of, classify};
use crate::Result;
use crate::onnx::write::{Attr, GraphWriter};

const EPS: f64 = 1e-5;
const INPUT: usize = 224;
const WIDTHS: [usize; 4] = [64, 128, 256, 512];

/// The two depths csd stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Depth {
    R18,
    R50,
}

impl Depth {
    fn blocks(self) -> [usize; 4] {
        match self {
            Depth::R18 => [2, 2, 2, 2],
            Depth::R50 => [3, 4, 6, 3],
        }
    }
    fn expansion(self) -> usize {
        match self {
            Depth::R18 => 1,
            Depth::R50 => 4,
        }
    }
    fn arch(self) -> Arch {
        match self {
            Depth::R18 => Arch::ResNet18,
            Depth::R50 => Arch::ResNet50,
        }
    }
    /// Feature width after the last block.
    pub(crate) fn features(self) -> usize {
        512 * self.expansion()
    }
}

/// One convolution of a block: (in, out, kernel, stride).
type ConvShape = (usize, usize, usize, usize);

/// One residual block: its weights' prefix (`layer2.0`), its convolutions
/// (`{prefix}.conv{j + 1}`, `{prefix}.bn{j + 1}`) and its downsample convolution
/// (`{prefix}.downsample.0`, `.1`), if any.
struct BlockShape {
    prefix: String,
    convs: Vec<ConvShape>,
    down: Option<ConvShape>,
}

/// The residual blocks in order.
fn block_shapes(depth: Depth) -> Vec<BlockShape> {
    let mut out = Vec::new();
    let mut cin = 64;
    for (li, (&n, &width)) in depth.blocks().iter().zip(&WIDTHS).enumerate() {
        for r in 0..n {
            let s = if r == 0 && li > 0 { 2 } else { 1 };
            let cout = width * depth.expansion();
            let convs = match depth {
                Depth::R18 => vec![(cin, width, 3, s), (width, width, 3, 1)],
                Depth::R50 => vec![
                    (cin, width, 1, 1),
                    (width, width, 3, s),
                    (width, cout, 1, 1),
                ],
            };
            out.push(BlockShape {
                prefix: format!("layer{}.{r}", li + 1),
                convs,
                down: (s != 1 || cin != cout).then_some((cin, cout, 1, s)),
            });
            cin = cout;
        }
    }
    out
}

fn out_side(side: usize, k: usize, s: usize) -> usize {
    (side + 2 * (k / 2) - k) / s + 1
}

/// The stages' shapes, FLOPs and activation sizes (no weights needed).
pub(crate) fn layout(depth: Depth) -> Vec<StageInfo> {
    let f4 = 4u64;
    let mut info = Vec::new();
    let conv_side = out_side(INPUT, 7, 2);
    let side = out_side(conv_side, 3, 2);
    let conv_elems = (64 * conv_side * conv_side) as u64;
    info.push(StageInfo {
        name: "stem".into(),
        out_shape: vec![64, side, side],
        flops: 2 * conv_elems * 147 + (64 * side * side * 9) as u64,
        // input, im2col columns, convolution output (+bias, ReLU), pooled output
        peak_bytes: f4
            * (3 * (INPUT * INPUT) as u64
                + 147 * (conv_side * conv_side) as u64
                + 3 * conv_elems
                + (64 * side * side) as u64),
    });
    let mut side = side;
    let mut cout_last = 64;
    for (i, BlockShape { convs, down, .. }) in block_shapes(depth).into_iter().enumerate() {
        let mut flops = 0u64;
        // Input, the widest im2col columns, every intermediate and the output (with its
        // bias and residual sums).
        let mut peak = (convs[0].0 * side * side) as u64;
        let mut widest_cols = 0u64;
        let mut s = side;
        for &(cin, cout, k, st) in &convs {
            let o = out_side(s, k, st);
            flops += 2 * (cout * cin * k * k * o * o) as u64;
            widest_cols = widest_cols.max((cin * k * k * o * o) as u64);
            peak += 2 * (cout * o * o) as u64;
            s = o;
        }
        if let Some((cin, cout, _, st)) = down {
            let o = out_side(side, 1, st);
            flops += 2 * (cout * cin * o * o) as u64;
            peak += 2 * (cout * o * o) as u64;
        }
        cout_last = convs[convs.len() - 1].1;
        info.push(StageInfo {
            name: format!("block{i}"),
            out_shape: vec![cout_last, s, s],
            flops,
            peak_bytes: f4 * (peak + widest_cols),
        });
        side = s;
    }
    let elems = (cout_last * side * side) as u64;
    info.push(StageInfo {
        name: "pool".into(),
        out_shape: vec![cout_last],
        flops: elems,
        peak_bytes: f4 * (2 * elems + cout_last as u64),
    });
    info
}

/// A convolution with its batch norm folded in, and its geometry.
struct Conv {
    /// `[out, in, k, k]`.
    w: Tensor,
    b: Tensor,
    k: usize,
    stride: usize,
}

impl Conv {
    fn load(w: &Weights, conv: &str, bn: &str, s: ConvShape, dev: &Device) -> Result<Self> {
        let (cin, cout, k, stride) = s;
        let (w, b) = w.conv_bn(conv, bn, &[cout, cin, k, k], EPS, dev)?;
        Ok(Conv { w, b, k, stride })
    }

    /// candle's ops: convolution plus bias.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let c = self.b.dim(0)?;
        x.conv2d(&self.w, self.k / 2, self.stride, 1, 1)?
            .broadcast_add(&self.b.reshape((1, c, 1, 1))?)
    }
}

struct Block {
    convs: Vec<Conv>,
    down: Option<Conv>,
}

enum Stage {
    Stem(Conv),
    Block(Block),
    Pool,
}

/// ResNet-18 or ResNet-50 with ImageNet preprocessing (224×224).
pub struct ResNet {
    depth: Depth,
    stages: Vec<Stage>,
    info: Vec<StageInfo>,
    fc: Option<(Tensor, Tensor)>,
    weight_bytes: u64,
    /// Run on the CPU with the kernels of `cpu` (else candle's ops).
    fused: bool,
}

impl ResNet {
    pub(crate) fn from_tensors(depth: Depth, w: &Weights, dev: &Device) -> Result<Self> {
        let mut stages = vec![Stage::Stem(Conv::load(
            w,
            "conv1",
            "bn1",
            (3, 64, 7, 2),
            dev,
        )?)];
        for blk in block_shapes(depth) {
            let p = &blk.prefix;
            let convs = (blk.convs.iter().enumerate())
                .map(|(j, &s)| {
                    let (conv, bn) = (format!("{p}.conv{}", j + 1), format!("{p}.bn{}", j + 1));
                    Conv::load(w, &conv, &bn, s, dev)
                })
                .collect::<Result<Vec<_>>>()?;
            let down = match blk.down {
                Some(s) => {
                    let (conv, bn) = (format!("{p}.downsample.0"), format!("{p}.downsample.1"));
                    Some(Conv::load(w, &conv, &bn, s, dev)?)
                }
                None => None,
            };
            stages.push(Stage::Block(Block { convs, down }));
        }
        stages.push(Stage::Pool);
        let fc = w.linear("fc", 1000, depth.features(), dev)?;
        let mut convs: Vec<&Conv> = Vec::new();
        for s in &stages {
            match s {
                Stage::Stem(c) => convs.push(c),
                Stage::Block(b) => convs.extend(b.convs.iter().chain(&b.down)),
                Stage::Pool => {}
            }
        }
        let weight_bytes = bytes_of(
            convs
                .into_iter()
                .flat_map(|c| [&c.w, &c.b])
                .chain(fc.iter().flat_map(|(w, b)| [w, b])),
        );
        Ok(ResNet {
            depth,
            stages,
            info: layout(depth),
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
        let conv = |g: &mut GraphWriter, x: &str, c: &Conv, out: Option<&str>| {
            exported::conv(g, x, (&c.w, &c.b), c.stride, 1, out)
        };
        let mut x = "input".to_string();
        for (s, info) in self.stages.iter().zip(&self.info) {
            let out = Some(info.name.as_str());
            x = match s {
                Stage::Stem(c) => {
                    let y = conv(&mut g, &x, c, None)?;
                    let y = g.node("Relu", &[&y], &[], None);
                    g.node(
                        "MaxPool",
                        &[&y],
                        &[
                            Attr::Ints("kernel_shape", &[3, 3]),
                            Attr::Ints("strides", &[2, 2]),
                            Attr::Ints("pads", &[1, 1, 1, 1]),
                        ],
                        out,
                    )
                }
                Stage::Block(b) => {
                    let mut h = x.clone();
                    let last = b.convs.len() - 1;
                    for c in &b.convs[..last] {
                        let y = conv(&mut g, &h, c, None)?;
                        h = g.node("Relu", &[&y], &[], None);
                    }
                    let shortcut = match &b.down {
                        Some(d) => conv(&mut g, &x, d, None)?,
                        None => x.clone(),
                    };
                    let y = conv(&mut g, &h, &b.convs[last], None)?;
                    let sum = g.node("Add", &[&y, &shortcut], &[], None);
                    g.node("Relu", &[&sum], &[], out)
                }
                Stage::Pool => g.global_pool(&x, out),
            };
        }
        let out = [self.depth.features()];
        Ok((g.finish("input", &[3, INPUT, INPUT], &x, &out), self.fc))
    }

    /// Uses candle's ops even on the CPU (to check the kernels against them).
    #[cfg(test)]
    pub(crate) fn with_candle_ops(mut self) -> Self {
        self.fused = false;
        self
    }

    /// Stage `i` with the CPU kernels, one image per task.
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
                    k: 7,
                    stride: 2,
                };
                let (ch, cw) = g.out();
                let pool = Window {
                    h: ch,
                    w: cw,
                    k: 3,
                    stride: 2,
                };
                let (oh, ow) = pool.out();
                cpu::per_image(x, &[64, oh, ow], |o, x| {
                    let mut conv = vec![0f32; 64 * ch * cw];
                    cpu::conv(&mut conv, x, wt, b, g, Act::Relu, None);
                    cpu::max_pool(o, &conv, pool);
                })
            }
            Stage::Block(blk) => {
                let hosts: Vec<(Host<'_>, Host<'_>)> = blk
                    .convs
                    .iter()
                    .chain(&blk.down)
                    .map(|c| (Host::new(&c.w), Host::new(&c.b)))
                    .collect();
                let mut ws = Vec::with_capacity(hosts.len());
                for (w, b) in &hosts {
                    ws.push((w.slice()?, b.slice()?));
                }
                let mut windows = Vec::new();
                let (mut sh, mut sw) = (h, w);
                for c in &blk.convs {
                    let g = Window {
                        h: sh,
                        w: sw,
                        k: c.k,
                        stride: c.stride,
                    };
                    (sh, sw) = g.out();
                    windows.push(g);
                }
                let down = blk.down.as_ref().map(|c| Window {
                    h,
                    w,
                    k: c.k,
                    stride: c.stride,
                });
                let last = blk.convs.len() - 1;
                let cout = self.info[i].out_shape[0];
                cpu::per_image(x, &[cout, sh, sw], |o, x| {
                    // The shortcut: the input, or its 1×1 (strided) projection.
                    let shortcut = down.map(|g| {
                        let (w, b) = ws[last + 1];
                        let mut s = vec![0f32; cout * sh * sw];
                        cpu::conv(&mut s, x, w, b, g, Act::None, None);
                        s
                    });
                    let mut prev: Option<Vec<f32>> = None;
                    for (j, (w, b)) in ws.iter().take(last).enumerate() {
                        let (a, c) = windows[j].out();
                        let mut y = vec![0f32; b.len() * a * c];
                        cpu::conv(
                            &mut y,
                            prev.as_deref().unwrap_or(x),
                            w,
                            b,
                            windows[j],
                            Act::Relu,
                            None,
                        );
                        prev = Some(y);
                    }
                    let (w, b) = ws[last];
                    let residual = shortcut.as_deref().unwrap_or(x);
                    let input = prev.as_deref().unwrap_or(x);
                    cpu::conv(o, input, w, b, windows[last], Act::Relu, Some(residual));
                })
            }
            Stage::Pool => cpu::per_image(x, &[ch], cpu::mean_planes),
        }
    }
}

impl StagedModel for ResNet {
    fn arch(&self) -> Arch {
        self.depth.arch()
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
                // Zero padding equals -inf padding here: the pool's input is a ReLU's.
                c.forward(x)?
                    .relu()?
                    .pad_with_zeros(D::Minus2, 1, 1)?
                    .pad_with_zeros(D::Minus1, 1, 1)?
                    .max_pool2d_with_stride(3, 2)?
            }
            Stage::Block(b) => {
                let mut h = x.clone();
                let last = b.convs.len() - 1;
                for c in &b.convs[..last] {
                    h = c.forward(&h)?.relu()?;
                }
                let shortcut = match &b.down {
                    Some(d) => d.forward(x)?,
                    None => x.clone(),
                };
                (b.convs[last].forward(&h)? + shortcut)?.relu()?
            }
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

    /// Random weights with torchvision's ResNet names and shapes.
    fn random_weights(depth: Depth) -> candle_core::Result<Weights> {
        let mut m = HashMap::new();
        random_conv_bn(&mut m, "conv1", "bn1", &[64, 3, 7, 7])?;
        for blk in block_shapes(depth) {
            let p = &blk.prefix;
            for (j, &(cin, cout, k, _)) in blk.convs.iter().enumerate() {
                let (conv, bn) = (format!("{p}.conv{}", j + 1), format!("{p}.bn{}", j + 1));
                random_conv_bn(&mut m, &conv, &bn, &[cout, cin, k, k])?;
            }
            if let Some((cin, cout, k, _)) = blk.down {
                let (conv, bn) = (format!("{p}.downsample.0"), format!("{p}.downsample.1"));
                random_conv_bn(&mut m, &conv, &bn, &[cout, cin, k, k])?;
            }
        }
        Ok(Weights::new(m, depth.arch()))
    }

    /// The CPU kernels against candle's ops, stage by stage, for both depths, on an
    /// odd image size and a batch of two.
    #[test]
    fn kernels_match_candle_ops() -> crate::Result<()> {
        for depth in [Depth::R18, Depth::R50] {
            let w = random_weights(depth)?;
            let fast = ResNet::from_tensors(depth, &w, &Device::Cpu)?;
            let plain = ResNet::from_tensors(depth, &w, &Device::Cpu)?.with_candle_ops();
            assert_eq!(fast.stages.len(), layout(depth).len());
            let x = Tensor::randn(0f32, 1., (2, 3, 69, 69), &Device::Cpu)?;
            assert_stages_match(&fast, &plain, x, &format!("{depth:?}"))?;
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
        let w = random_weights(Depth::R18)?;
        let ours = ResNet::from_tensors(Depth::R18, &w, &Device::Cpu)?;
        let (onnx, fc) = ResNet::from_tensors(Depth::R18, &w, &Device::Cpu)?.into_onnx()?;
        let ort = crate::model::Exported::new(Arch::ResNet18, &onnx, fc)?;
        assert_onnx_export_matches(&ort, &ours, INPUT, "ResNet-18")
    }
}
