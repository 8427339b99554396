//! Staged models: every stage boundary is a split point.
//!
//! A model is a list of stages (`stem`, `block3`, `pool`, …). A split `k` runs stages
//! `[0, k)` at the storage node and `[k, n)` on the compute tier; `k = 0` ships raw
//! samples, `k = n` ships the final features. Each stage knows its output shape, its
//! FLOPs and the activation memory it needs per sample, so the planner can price every
//! split and the node can size its batches from its memory budget before running.

mod cpu;
mod efficientnet;
mod ops;
mod resnet;

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

pub use efficientnet::EfficientNetLite0;
pub use ops::depthwise_conv2d;
pub use resnet::ResNet;

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
}

impl Arch {
    /// Every architecture, for messages.
    pub const ALL: [Arch; 3] = [Arch::EfficientNetLite0, Arch::ResNet18, Arch::ResNet50];

    /// The name used on the command line and in requests.
    pub fn name(self) -> &'static str {
        match self {
            Arch::EfficientNetLite0 => "efficientnet-lite0",
            Arch::ResNet18 => "resnet18",
            Arch::ResNet50 => "resnet50",
        }
    }

    /// What the model's samples are.
    pub fn input(self) -> InputKind {
        match self {
            Arch::EfficientNetLite0 | Arch::ResNet18 | Arch::ResNet50 => {
                InputKind::Image(ImageSpec::IMAGENET_224)
            }
        }
    }

    /// The stages: shapes, FLOPs and activation sizes per sample (no weights needed).
    pub fn stages(self) -> Vec<StageInfo> {
        match self {
            Arch::EfficientNetLite0 => efficientnet::layout(),
            Arch::ResNet18 => resnet::layout(resnet::Depth::R18),
            Arch::ResNet50 => resnet::layout(resnet::Depth::R50),
        }
    }

    /// Builds the model from safetensors weights.
    pub fn load(self, weights: &[u8], device: &Device) -> Result<Box<dyn StagedModel>> {
        let tensors = candle_core::safetensors::load_buffer(weights, &Device::Cpu)
            .map_err(|e| Error::InvalidArgument(format!("weights are not safetensors: {e}")))?;
        let w = Weights::new(tensors, self);
        match self {
            Arch::EfficientNetLite0 => Ok(Box::new(EfficientNetLite0::from_tensors(&w, device)?)),
            Arch::ResNet18 => Ok(Box::new(ResNet::from_tensors(
                resnet::Depth::R18,
                &w,
                device,
            )?)),
            Arch::ResNet50 => Ok(Box::new(ResNet::from_tensors(
                resnet::Depth::R50,
                &w,
                device,
            )?)),
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
}

/// Image preprocessing: resize the shorter side to `resize`, center-crop `crop`²,
/// scale to [0, 1], subtract `mean` and divide by `std` per channel (CHW layout).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ImageSpec {
    /// Shorter side after resizing.
    pub resize: u32,
    /// Side of the center crop.
    pub crop: u32,
    /// Per-channel mean (RGB).
    pub mean: [f32; 3],
    /// Per-channel standard deviation (RGB).
    pub std: [f32; 3],
}

impl ImageSpec {
    /// torchvision's ImageNet evaluation transform.
    pub const IMAGENET_224: ImageSpec = ImageSpec {
        resize: 256,
        crop: 224,
        mean: [0.485, 0.456, 0.406],
        std: [0.229, 0.224, 0.225],
    };

    /// Per-sample input shape (C, H, W).
    pub fn shape(&self) -> [usize; 3] {
        [3, self.crop as usize, self.crop as usize]
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
    pub fn out_bytes(&self) -> u64 {
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
            match self.arch().input() {
                InputKind::Image(s) => s.shape().to_vec(),
            }
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

    /// Whether tensor `name` is present.
    pub(crate) fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}
