//! Staged models: every stage boundary is a split point.
//!
//! A model is a list of stages (`stem`, `block3`, `pool`, …). A split `k` runs stages
//! `[0, k)` at the storage node and `[k, n)` on the compute tier; `k = 0` ships raw
//! samples, `k = n` ships the final features. Each stage knows its output shape, its
//! FLOPs and the activation memory it needs per sample, so the planner can price every
//! split and the node can size its batches from its memory budget before running.

mod bert;
mod bert_onnx;
mod cpu;
mod efficientnet;
mod exported;
mod onnx;
mod ops;
mod resnet;

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

pub use bert::MiniLm;
pub use efficientnet::EfficientNetLite0;
pub use exported::{Exported, KERNELS_VAR, Kernels};
pub use onnx::{OnnxModelStages, PixelNorm};
pub use ops::depthwise_conv2d;
pub use resnet::ResNet;

pub use crate::preprocess::ImageSpec;
use crate::{Error, Result};

/// The model architectures csd can stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Arch {
    /// EfficientNet-Lite0 (ImageNet, 224×224): stem, 16 MBConv blocks, head, pool.
    EfficientNetLite0,
    /// ResNet-18 (ImageNet, 224×224): stem, 8 basic blocks, pool.
    #[serde(rename = "resnet18")]
    ResNet18,
    /// ResNet-50 (ImageNet, 224×224): stem, 16 bottleneck blocks, pool.
    #[serde(rename = "resnet50")]
    ResNet50,
    /// all-MiniLM-L6-v2 (text, 128 tokens): embed, 6 BERT layers, mean pool.
    #[serde(rename = "minilm-l6")]
    MiniLmL6,
    /// A user's ONNX image model (the "weights" are the model file), staged at its
    /// cut points ([`OnnxModelStages`]).
    #[serde(rename = "onnx")]
    Onnx,
}

impl Arch {
    /// Every architecture, for messages.
    pub(crate) const ALL: [Arch; 4] = [
        Arch::EfficientNetLite0,
        Arch::ResNet18,
        Arch::ResNet50,
        Arch::MiniLmL6,
    ];

    /// The name used on the command line and in requests.
    pub fn name(self) -> &'static str {
        match self {
            Arch::EfficientNetLite0 => "efficientnet-lite0",
            Arch::ResNet18 => "resnet18",
            Arch::ResNet50 => "resnet50",
            Arch::MiniLmL6 => "minilm-l6",
            Arch::Onnx => "onnx",
        }
    }

    /// What the model's samples are.
    pub fn input(self) -> InputKind {
        match self {
            Arch::EfficientNetLite0 | Arch::ResNet18 | Arch::ResNet50 => {
                InputKind::Image(ImageSpec::IMAGENET_224)
            }
            Arch::MiniLmL6 => InputKind::Text { tokens: bert::SEQ },
            Arch::Onnx => InputKind::Model,
        }
    }

    /// The stages: shapes, FLOPs and activation sizes per sample (no weights needed;
    /// none for an ONNX model, whose file says: [`StagedModel::stages`]).
    pub fn stages(self) -> Vec<StageInfo> {
        match self {
            Arch::Onnx => vec![],
            Arch::EfficientNetLite0 => efficientnet::layout(),
            Arch::ResNet18 => resnet::layout(resnet::Depth::R18),
            Arch::ResNet50 => resnet::layout(resnet::Depth::R50),
            Arch::MiniLmL6 => bert::layout(),
        }
    }

    /// Builds the model from safetensors weights (for a text model, with its tokenizer
    /// in the metadata: [`weights::with_tokenizer`](crate::weights::with_tokenizer)),
    /// on the kernels `CSD_ML_KERNELS` chooses ([`Kernels`]).
    pub fn load(self, weights: &[u8], device: &Device) -> Result<Box<dyn StagedModel>> {
        self.load_with(weights, device, Kernels::from_env()?)
    }

    /// [`load`](Self::load) on the given kernels (onnxruntime where it loads, on the
    /// CPU; else csd's own).
    pub fn load_with(
        self,
        weights: &[u8],
        device: &Device,
        kernels: Kernels,
    ) -> Result<Box<dyn StagedModel>> {
        if self == Arch::Onnx {
            return Ok(Box::new(OnnxModelStages::load(
                weights,
                PixelNorm::default(),
            )?));
        }
        let tensors = candle_core::safetensors::load_buffer(weights, &Device::Cpu)
            .map_err(|e| Error::InvalidArgument(format!("weights are not safetensors: {e}")))?;
        let w = Weights::new(tensors, self);
        // The image models run on onnxruntime where it loads (on the CPU), else on
        // csd's kernels.
        if let Some(m) = ImageModel::build(self, &w, device)? {
            let on_ort = device.is_cpu()
                && kernels == Kernels::Onnxruntime
                && crate::onnx::runtime::available();
            if !on_ort {
                return Ok(m.into_kernels());
            }
            let (onnx, fc) = m.into_onnx()?;
            return Ok(Box::new(Exported::new(self, &onnx, fc)?));
        }
        match self {
            Arch::EfficientNetLite0 | Arch::ResNet18 | Arch::ResNet50 | Arch::Onnx => {
                unreachable!("built above")
            }
            Arch::MiniLmL6 => {
                let tokenizer = crate::weights::tokenizer(weights)?.ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "weights for {self} carry no tokenizer: give the model's tokenizer.json \
                         too (csd features --tokenizer FILE)"
                    ))
                })?;
                Ok(Box::new(MiniLm::from_tensors(
                    &w,
                    tokenizer.as_bytes(),
                    device,
                    kernels,
                )?))
            }
        }
    }
}

/// A built-in image model (`arch`, from safetensors `weights`) as the ONNX graph csd
/// runs on onnxruntime: batch norms folded, each stage's output named after the stage.
pub fn export_onnx(arch: Arch, weights: &[u8]) -> Result<Vec<u8>> {
    let tensors = candle_core::safetensors::load_buffer(weights, &Device::Cpu)
        .map_err(|e| Error::InvalidArgument(format!("weights are not safetensors: {e}")))?;
    let w = Weights::new(tensors, arch);
    let m = ImageModel::build(arch, &w, &Device::Cpu)?.ok_or_else(|| {
        Error::InvalidArgument(format!("{arch} has no ONNX export (the image models have)"))
    })?;
    Ok(m.into_onnx()?.0)
}

/// A built-in image model on csd's kernels, before it runs there or is written as
/// ONNX.
enum ImageModel {
    EfficientNet(EfficientNetLite0),
    ResNet(ResNet),
}

impl ImageModel {
    /// `arch` from `w`, when it is an image model.
    fn build(arch: Arch, w: &Weights, device: &Device) -> Result<Option<ImageModel>> {
        Ok(Some(match arch {
            Arch::EfficientNetLite0 => {
                ImageModel::EfficientNet(EfficientNetLite0::from_tensors(w, device)?)
            }
            Arch::ResNet18 => {
                ImageModel::ResNet(ResNet::from_tensors(resnet::Depth::R18, w, device)?)
            }
            Arch::ResNet50 => {
                ImageModel::ResNet(ResNet::from_tensors(resnet::Depth::R50, w, device)?)
            }
            Arch::MiniLmL6 | Arch::Onnx => return Ok(None),
        }))
    }

    fn into_kernels(self) -> Box<dyn StagedModel> {
        match self {
            ImageModel::EfficientNet(m) => Box::new(m),
            ImageModel::ResNet(m) => Box::new(m),
        }
    }

    fn into_onnx(self) -> Result<(Vec<u8>, exported::Classifier)> {
        match self {
            ImageModel::EfficientNet(m) => m.into_onnx(),
            ImageModel::ResNet(m) => m.into_onnx(),
        }
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Arch {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Arch::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Arch::ALL.iter().map(|a| a.name()).collect();
                Error::InvalidArgument(format!("unknown model {s:?} (known: {})", names.join(", ")))
            })
    }
}

/// The samples a model takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum InputKind {
    /// Decoded, resized, center-cropped and normalised RGB images.
    Image(ImageSpec),
    /// UTF-8 text, tokenised into this many token ids per sample.
    Text {
        /// Tokens per sample.
        tokens: usize,
    },
    /// What the model file declares (an ONNX model's input).
    Model,
}

impl InputKind {
    /// Per-sample shape of the model input.
    pub fn shape(&self) -> Vec<usize> {
        match self {
            InputKind::Image(s) => s.shape().to_vec(),
            InputKind::Text { tokens } => vec![*tokens],
            InputKind::Model => vec![],
        }
    }
}

/// What the planner and the node know of one stage, per sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageInfo {
    /// Name (`stem`, `block3`, `head`, `pool`).
    pub name: String,
    /// Output shape of one sample (no batch dimension).
    pub out_shape: Vec<usize>,
    /// Floating-point operations for one sample (a multiply-add counts two).
    pub flops: u64,
    /// Peak bytes of activations alive while the stage runs, for one sample
    /// (input, intermediates and output, float32).
    pub peak_bytes: u64,
}

impl StageInfo {
    /// Elements in one sample's output.
    pub fn out_elems(&self) -> usize {
        self.out_shape.iter().product()
    }
    /// Bytes of one sample's output as float32.
    #[cfg(feature = "node")]
    pub(crate) fn out_bytes(&self) -> u64 {
        self.out_elems() as u64 * 4
    }
}

/// A model split into stages.
pub trait StagedModel: Send + Sync {
    /// Architecture.
    fn arch(&self) -> Arch;
    /// Stages, in order.
    fn stages(&self) -> &[StageInfo];
    /// Runs stage `i` on a batch (`[N, ...]`).
    fn forward_stage(&self, i: usize, x: &Tensor) -> Result<Tensor>;
    /// Bytes of the model's weights in memory.
    fn weight_bytes(&self) -> u64;
    /// ImageNet (or pretraining) logits from the last stage's output, when the weights
    /// include the classifier.
    fn classify(&self, features: &Tensor) -> Result<Option<Tensor>>;

    /// Decodes and preprocesses encoded samples (images, or text) into the model's
    /// input `[N, ...]`.
    fn prepare(&self, samples: &[&[u8]]) -> Result<Tensor> {
        match self.arch().input() {
            InputKind::Image(spec) => crate::preprocess::images(samples, &spec, &Device::Cpu),
            InputKind::Text { .. } | InputKind::Model => Err(Error::InvalidArgument(format!(
                "{} must prepare its samples itself",
                self.arch()
            ))),
        }
    }

    /// Whether [`forward_range`](Self::forward_range) runs a range faster than its
    /// stages one by one (fused), so that a profile must time the whole model and
    /// share it among the stages as [`stage_times`](Self::stage_times) says.
    fn runs_ranges_fused(&self) -> bool {
        false
    }

    /// One run of the whole model on `x` (`[B, ...]`, prepared samples), for a model
    /// whose ranges run fused (a stage alone is not what it is inside the whole):
    /// seconds per sample, and each stage's seconds inside that run (its share);
    /// `None` where stages are timed one by one.
    fn stage_times(&self, _x: &Tensor) -> Option<Result<(f64, Vec<f64>)>> {
        None
    }

    /// What runs the model (`csd`: csd's kernels on candle; `onnxruntime`): part of
    /// a profile's key, since the same weights run at different speeds on each.
    fn engine(&self) -> &'static str {
        "csd"
    }

    /// The ONNX model this is, when it is one (its cut points by name).
    fn onnx(&self) -> Option<&OnnxModelStages> {
        None
    }

    /// Per-sample shape of the model's input.
    fn input_shape(&self) -> Vec<usize> {
        self.arch().input().shape()
    }

    /// Runs stages `[from, to)`.
    fn forward_range(&self, x: &Tensor, from: usize, to: usize) -> Result<Tensor> {
        let mut x = x.clone();
        for i in from..to {
            x = self.forward_stage(i, &x)?;
        }
        Ok(x)
    }

    /// Per-sample shape entering stage `i` (`i = 0`: the model input).
    fn shape_before(&self, i: usize) -> Vec<usize> {
        if i == 0 {
            self.input_shape()
        } else {
            self.stages()[i - 1].out_shape.clone()
        }
    }
}

/// Named tensors from a safetensors file, with errors that say which tensor is wrong.
pub(crate) struct Weights {
    tensors: HashMap<String, Tensor>,
    arch: Arch,
}

impl Weights {
    fn new(tensors: HashMap<String, Tensor>, arch: Arch) -> Self {
        Weights { tensors, arch }
    }

    /// The float32 tensor `name` with exactly `shape`.
    pub(crate) fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.tensors.get(name).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "weights for {} lack tensor {name:?} (is this the right model?)",
                self.arch
            ))
        })?;
        if t.dims() != shape {
            return Err(Error::InvalidArgument(format!(
                "weights for {}: tensor {name:?} has shape {:?}, expected {shape:?}",
                self.arch,
                t.dims()
            )));
        }
        Ok(t.to_dtype(candle_core::DType::F32)?)
    }

    /// Convolution `conv` (`shape`: `[out, in / groups, k, k]`) with batch norm `bn`
    /// (epsilon `eps`) folded in: its weights and bias, on `dev`.
    pub(crate) fn conv_bn(
        &self,
        conv: &str,
        bn: &str,
        shape: &[usize],
        eps: f64,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let out = shape[0];
        let w = self.get(&format!("{conv}.weight"), shape)?;
        let g = self.get(&format!("{bn}.weight"), &[out])?;
        let beta = self.get(&format!("{bn}.bias"), &[out])?;
        let mean = self.get(&format!("{bn}.running_mean"), &[out])?;
        let var = self.get(&format!("{bn}.running_var"), &[out])?;
        let scale = (g / (var + eps)?.sqrt()?)?;
        let w = w.broadcast_mul(&scale.reshape((out, 1, 1, 1))?)?;
        let b = (beta - (mean * &scale)?)?;
        Ok((w.to_device(dev)?, b.to_device(dev)?))
    }

    /// The classifier `{name}.weight` (`[out, inp]`) and `{name}.bias` on `dev`, when
    /// the weights include it.
    pub(crate) fn linear(
        &self,
        name: &str,
        out: usize,
        inp: usize,
        dev: &Device,
    ) -> Result<Option<(Tensor, Tensor)>> {
        if !self.tensors.contains_key(&format!("{name}.weight")) {
            return Ok(None);
        }
        Ok(Some((
            self.get(&format!("{name}.weight"), &[out, inp])?
                .to_device(dev)?,
            self.get(&format!("{name}.bias"), &[out])?.to_device(dev)?,
        )))
    }
}

/// Bytes of float32 `tensors`.
pub(crate) fn bytes_of<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    tensors.into_iter().map(|t| t.elem_count() as u64 * 4).sum()
}

/// Logits of the classifier `fc`, when there is one.
pub(crate) fn classify(fc: &Option<(Tensor, Tensor)>, features: &Tensor) -> Result<Option<Tensor>> {
    match fc {
        Some((w, b)) => Ok(Some(features.matmul(&w.t()?)?.broadcast_add(b)?)),
        None => Ok(None),
    }
}

/// Helpers for the models' unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::collections::HashMap;

    use candle_core::{DType, Device, Tensor};

    use super::StagedModel;

    /// He-initialised weights `{conv}.weight` of `shape` (`[out, in, k, k]`) and random
    /// batch-norm parameters and statistics `{bn}.*`.
    pub(crate) fn random_conv_bn(
        m: &mut HashMap<String, Tensor>,
        conv: &str,
        bn: &str,
        shape: &[usize],
    ) -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (out, fan_in) = (shape[0], shape[1..].iter().product::<usize>() as f64);
        let w = (Tensor::randn(0f32, 1., shape, &dev)? * (2.0 / fan_in).sqrt())?;
        m.insert(format!("{conv}.weight"), w);
        m.insert(
            format!("{bn}.weight"),
            Tensor::rand(0.5f32, 1.0, out, &dev)?,
        );
        let small = |dev| Tensor::randn(0f32, 1., out, dev)? * 0.1;
        m.insert(format!("{bn}.bias"), small(&dev)?);
        m.insert(format!("{bn}.running_mean"), small(&dev)?);
        m.insert(
            format!("{bn}.running_var"),
            Tensor::rand(0.5f32, 1.5, out, &dev)?,
        );
        Ok(())
    }

    /// `ort` (a model's ONNX export on onnxruntime) against `ours` (csd's kernels) on
    /// two random images of `side`: the whole model within 1e-4 of the largest
    /// feature, and stage by stage.
    pub(crate) fn assert_onnx_export_matches(
        ort: &dyn StagedModel,
        ours: &dyn StagedModel,
        side: usize,
        what: &str,
    ) -> crate::Result<()> {
        let x = Tensor::randn(0f32, 1., (2, 3, side, side), &Device::Cpu)?;
        let n = ours.stages().len();
        let (a, b) = (ort.forward_range(&x, 0, n)?, ours.forward_range(&x, 0, n)?);
        let err = (a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = b.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            err <= 1e-4 * scale,
            "{what} whole: max error {err}, scale {scale}"
        );
        assert_stages_match(ort, ours, x, &format!("{what} on onnxruntime"))
    }

    /// Runs `x` through every stage of `fast` and `plain`, feeding `plain`'s output
    /// on, and checks each stage's outputs agree within 1e-5 of their largest value.
    pub(crate) fn assert_stages_match(
        fast: &dyn StagedModel,
        plain: &dyn StagedModel,
        mut h: Tensor,
        what: &str,
    ) -> crate::Result<()> {
        let max_abs = |t: &Tensor| -> candle_core::Result<f32> {
            t.abs()?.max_all()?.to_dtype(DType::F32)?.to_scalar()
        };
        for i in 0..plain.stages().len() {
            let theirs = plain.forward_stage(i, &h)?;
            let ours = fast.forward_stage(i, &h)?;
            assert_eq!(ours.dims(), theirs.dims(), "{what}: stage {i}");
            let scale = max_abs(&theirs)?;
            let err = max_abs(&(&ours - &theirs)?)?;
            assert!(
                scale > 0.0,
                "{what}: stage {i} is all zeros, the test says nothing"
            );
            assert!(
                err <= 1e-5 * scale.max(1.0),
                "{what}: stage {i}: max error {err}, scale {scale}"
            );
            h = theirs;
        }
        Ok(())
    }
}
