//! A built-in image model run on onnxruntime: its weights loaded and folded as for
//! csd's own kernels, written as an ONNX graph whose stage outputs carry the stages'
//! names, and run between those stage boundaries as an ONNX model is between its cut
//! points ([`OnnxModelStages`]). The model keeps its name, stages, preprocessing and
//! classifier: splits, requests and profiles mean what they mean for the kernels.
//!
//! Used where onnxruntime loads ([`Kernels`]); onnxruntime ran these models faster
//! than csd's kernels on the same core (benches/RESULTS.md, `ml`).

use candle_core::Tensor;

use super::{Arch, OnnxModelStages, PixelNorm, StageInfo, StagedModel, classify};
use crate::onnx::write::GraphWriter;
use crate::{Error, Result};

/// A model's ImageNet classifier (weights `[1000, features]`, bias), when its weights
/// include one.
pub(crate) type Classifier = Option<(Tensor, Tensor)>;

/// The environment variable choosing what runs the built-in models.
pub const KERNELS_VAR: &str = "CSD_ML_KERNELS";

/// What runs the built-in models (MiniLM: its encoder layers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    /// onnxruntime, where it loads (the default), else csd's own.
    Onnxruntime,
    /// csd's own kernels (`CSD_ML_KERNELS=csd`).
    Csd,
}

impl Kernels {
    /// The choice made by `CSD_ML_KERNELS` (`onnxruntime`, the default, or `csd`).
    pub fn from_env() -> Result<Kernels> {
        match std::env::var(KERNELS_VAR).as_deref() {
            Err(_) | Ok("") | Ok("onnxruntime") => Ok(Kernels::Onnxruntime),
            Ok("csd") => Ok(Kernels::Csd),
            Ok(other) => Err(Error::InvalidArgument(format!(
                "{KERNELS_VAR}={other:?}: expected \"onnxruntime\" or \"csd\""
            ))),
        }
    }
}

/// Writes `conv` (`[out, in / groups, k, k]`, or `[out, in]` for a 1×1 one, and its
/// bias) as an ONNX convolution padded by `k / 2`.
pub(crate) fn conv(
    g: &mut GraphWriter,
    x: &str,
    (w, b): (&Tensor, &Tensor),
    stride: usize,
    groups: usize,
    out: Option<&str>,
) -> Result<String> {
    let mut dims = w.dims().to_vec();
    dims.resize(4, 1);
    let data = w.flatten_all()?.to_vec1::<f32>()?;
    let bias = b.to_vec1::<f32>()?;
    Ok(g.conv(x, (&dims, &data), &bias, stride, groups, out))
}

/// A built-in image model on onnxruntime.
pub struct Exported {
    arch: Arch,
    inner: OnnxModelStages,
    /// The inner model's cut index at each stage boundary (0: the input).
    cut_of: Vec<usize>,
    info: Vec<StageInfo>,
    fc: Classifier,
}

impl std::fmt::Debug for Exported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exported")
            .field("arch", &self.arch)
            .finish()
    }
}

impl Exported {
    /// `onnx` (written by the model's `into_onnx`, stage outputs named after
    /// `arch`'s stages) ready to run.
    pub(crate) fn new(arch: Arch, onnx: &[u8], fc: Classifier) -> Result<Exported> {
        let info = arch.stages();
        // Preprocessing is the built-in's (resize, crop, ImageNet statistics); the
        // inner model's own is not used.
        let inner = OnnxModelStages::load(onnx, PixelNorm::default())?;
        let mut cut_of = vec![0];
        for s in &info {
            cut_of.push(inner.analysis().find(&s.name).map_err(|_| {
                Error::Node(csd_protocol::Error::Internal(format!(
                    "{arch}'s ONNX export has no cut at stage {}",
                    s.name
                )))
            })?);
        }
        Ok(Exported {
            arch,
            inner,
            cut_of,
            info,
            fc,
        })
    }
}

impl StagedModel for Exported {
    fn arch(&self) -> Arch {
        self.arch
    }

    fn stages(&self) -> &[StageInfo] {
        &self.info
    }

    fn forward_stage(&self, i: usize, x: &Tensor) -> Result<Tensor> {
        self.forward_range(x, i, i + 1)
    }

    fn forward_range(&self, x: &Tensor, from: usize, to: usize) -> Result<Tensor> {
        let (Some(&a), Some(&b)) = (self.cut_of.get(from), self.cut_of.get(to)) else {
            return Err(Error::InvalidArgument(format!(
                "stages {from}..{to} of {}, which has {}",
                self.arch,
                self.info.len()
            )));
        };
        self.inner.forward_range(x, a, b)
    }

    fn weight_bytes(&self) -> u64 {
        self.inner.weight_bytes()
    }

    fn classify(&self, features: &Tensor) -> Result<Option<Tensor>> {
        classify(&self.fc, features)
    }

    fn runs_ranges_fused(&self) -> bool {
        true
    }

    fn stage_times(&self, x: &Tensor) -> Option<Result<(f64, Vec<f64>)>> {
        let (per_sample, cuts) = match self.inner.cut_times(x) {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        Some(Ok((
            per_sample,
            self.cut_of
                .windows(2)
                .map(|w| cuts[w[0]..w[1]].iter().sum())
                .collect(),
        )))
    }

    fn engine(&self) -> &'static str {
        "onnxruntime"
    }
}
