//! A user's ONNX image model as a staged model: its cut points
//! ([`crate::onnx::split`]) are the stage boundaries, and every range of stages runs
//! as one onnxruntime session of the model between two cuts.
//!
//! What crosses a cut of several tensors travels as one row per sample: the tensors
//! flattened and concatenated in the cut's order, split again on the other side by
//! their known per-sample shapes.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{Device, Tensor};

use super::{Arch, StageInfo, StagedModel};
use crate::onnx::{Analysis, FloatTensor, OnnxSession};
use crate::preprocess::TensorImage;
use crate::{Error, Result};

/// Per-channel normalisation of an ONNX model's pixels (after scaling to [0, 1]).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PixelNorm {
    /// Subtracted, per channel (RGB).
    pub mean: [f32; 3],
    /// Divided by, per channel.
    pub std: [f32; 3],
}

impl Default for PixelNorm {
    fn default() -> Self {
        PixelNorm {
            mean: [0.0; 3],
            std: [1.0; 3],
        }
    }
}

/// An ONNX model staged at its cut points.
pub struct OnnxModelStages {
    analysis: Analysis,
    input: TensorImage,
    /// The batch the model was exported with, when it is fixed (often 1): larger
    /// batches run in pieces of this size.
    fixed_batch: Option<usize>,
    stages: Vec<StageInfo>,
    bytes: u64,
    /// Idle sessions by (first stage, end stage): one per batch running at once.
    sessions: Mutex<HashMap<(usize, usize), Vec<OnnxSession>>>,
}

impl std::fmt::Debug for OnnxModelStages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnnxModelStages")
            .field("input", &self.input)
            .field("stages", &self.stages.len())
            .finish()
    }
}

impl OnnxModelStages {
    /// Loads `bytes` (an ONNX model taking one image batch, `N,3,H,W` or `N,H,W,3`
    /// with fixed `H` and `W`), finds its cut points and what each sends.
    pub fn load(bytes: &[u8], norm: PixelNorm) -> Result<OnnxModelStages> {
        if norm.std.iter().any(|s| !s.is_finite() || *s == 0.0)
            || norm.mean.iter().any(|m| !m.is_finite())
        {
            return Err(Error::InvalidArgument(format!(
                "--std must be finite and non-zero and --mean finite: {norm:?}"
            )));
        }
        let analysis = Analysis::new(bytes)?;
        let input = image_input(&analysis, norm)?;
        let fixed_batch = match analysis
            .model
            .inputs
            .first()
            .and_then(|i| i.tensor.as_ref())
            .and_then(|t| t.dims.as_ref())
            .and_then(|d| d.first())
        {
            Some(crate::onnx::Dim::Fixed(b)) if *b > 0 => Some(*b as usize),
            _ => None,
        };
        let cuts = &analysis.cuts;
        let stages = (1..cuts.len())
            .map(|i| {
                let (before, after) = (&cuts[i - 1], &cuts[i]);
                let out_shape = match after.shapes.as_slice() {
                    [one] => one.clone(),
                    _ => vec![after.elems()],
                };
                StageInfo {
                    name: after.point.tensors.join("+"),
                    out_shape,
                    // Not counted for ONNX models: the planner weighs measured times.
                    flops: 0,
                    // The tensors in and out, and as much again for what the stage's
                    // nodes keep alive in between.
                    peak_bytes: 8 * (before.elems() + after.elems()) as u64,
                }
            })
            .collect();
        Ok(OnnxModelStages {
            analysis,
            input,
            fixed_batch,
            stages,
            bytes: bytes.len() as u64,
            sessions: Mutex::default(),
        })
    }

    /// The model's analysis (cut points, what each sends).
    pub fn analysis(&self) -> &Analysis {
        &self.analysis
    }

    /// How its images are prepared.
    pub fn input(&self) -> &TensorImage {
        &self.input
    }

    /// Its pixel normalisation.
    pub fn pixels(&self) -> PixelNorm {
        PixelNorm {
            mean: self.input.mean,
            std: self.input.std,
        }
    }

    /// One run of the whole model on `x` (`[B, ...]`, the model's input; at most its
    /// fixed batch of it) under onnxruntime's profiler ([`Analysis::stage_times`]):
    /// seconds per sample, and each cut-to-cut stage's seconds inside the run.
    pub(crate) fn cut_times(&self, x: &Tensor) -> Result<(f64, Vec<f64>)> {
        let b = x.dim(0)?;
        let x = match self.fixed_batch.filter(|f| *f < b) {
            Some(fixed) => x.narrow(0, 0, fixed)?,
            None => x.clone(),
        };
        let (secs, stages) = self.analysis.stage_times(&self.unpack(0, &x)?)?;
        Ok((secs / x.dim(0)?.max(1) as f64, stages))
    }

    /// Idle sessions held.
    pub fn idle_sessions(&self) -> usize {
        self.sessions
            .lock()
            .map(|m| m.values().map(Vec::len).sum())
            .unwrap_or(0)
    }

    fn session(&self, from: usize, to: usize) -> Result<OnnxSession> {
        if let Some(s) = self
            .sessions
            .lock()
            .ok()
            .and_then(|mut m| m.get_mut(&(from, to)).and_then(Vec::pop))
        {
            return Ok(s);
        }
        OnnxSession::new(&self.analysis.segment(from, to)?, 1)
    }

    fn give_back(&self, from: usize, to: usize, s: OnnxSession) {
        if let Ok(mut m) = self.sessions.lock() {
            m.entry((from, to)).or_default().push(s);
        }
    }

    /// Runs cuts `from..to` on `x` in one session.
    fn run_range(&self, x: &Tensor, from: usize, to: usize) -> Result<Tensor> {
        let b = x.dim(0)?;
        let inputs = self.unpack(from, x)?;
        let s = self.session(from, to)?;
        let out = s.run(&inputs);
        self.give_back(from, to, s);
        self.pack(to, b, out?)
    }

    /// `x` (`[B, ...]`, as cut `i` sends it) as the cut's tensors.
    fn unpack(&self, i: usize, x: &Tensor) -> Result<Vec<FloatTensor>> {
        let cut = self.analysis.cut(i)?;
        let b = x.dim(0)?;
        let flat = x.flatten_all()?.to_vec1::<f32>()?;
        let row = cut.elems();
        if flat.len() != b * row {
            return Err(Error::InvalidArgument(format!(
                "{} floats for {b} samples of cut {i}, which sends {row} per sample",
                flat.len()
            )));
        }
        if let [shape] = cut.shapes.as_slice() {
            return Ok(vec![tensor(b, shape, flat)]);
        }
        let mut at = 0;
        let mut out = Vec::with_capacity(cut.shapes.len());
        for shape in &cut.shapes {
            let n: usize = shape.iter().product();
            let mut data = Vec::with_capacity(b * n);
            for r in 0..b {
                data.extend_from_slice(&flat[r * row + at..r * row + at + n]);
            }
            at += n;
            out.push(tensor(b, shape, data));
        }
        Ok(out)
    }

    /// Cut `i`'s tensors as one `[B, ...]` tensor (see the module docs).
    fn pack(&self, i: usize, b: usize, ts: Vec<FloatTensor>) -> Result<Tensor> {
        let cut = self.analysis.cut(i)?;
        if let ([shape], [t]) = (cut.shapes.as_slice(), ts.as_slice()) {
            let mut dims = vec![b];
            dims.extend(shape);
            return Ok(Tensor::from_slice(&t.data, dims, &Device::Cpu)?);
        }
        let row = cut.elems();
        let mut data = vec![0f32; b * row];
        let mut at = 0;
        for (t, shape) in ts.iter().zip(&cut.shapes) {
            let n: usize = shape.iter().product();
            if t.data.len() != b * n {
                return Err(Error::InvalidArgument(format!(
                    "cut {i} sent {} floats where {b} samples of {shape:?} were expected",
                    t.data.len()
                )));
            }
            for r in 0..b {
                data[r * row + at..r * row + at + n].copy_from_slice(&t.data[r * n..(r + 1) * n]);
            }
            at += n;
        }
        Ok(Tensor::from_vec(data, (b, row), &Device::Cpu)?)
    }
}

fn tensor(b: usize, shape: &[usize], data: Vec<f32>) -> FloatTensor {
    let mut dims = vec![b as i64];
    dims.extend(shape.iter().map(|d| *d as i64));
    FloatTensor { dims, data }
}

/// The model's one image input, or why it has none `csd features` can feed.
fn image_input(a: &Analysis, norm: PixelNorm) -> Result<TensorImage> {
    let first = &a.cuts[0];
    let refuse = |why: String| {
        Error::InvalidArgument(format!(
            "csd features feeds a model one batch of RGB images (N,3,H,W or N,H,W,3 with a \
             fixed H and W); {why}"
        ))
    };
    let [shape] = first.shapes.as_slice() else {
        return Err(refuse(format!(
            "this model takes {} inputs ({})",
            first.shapes.len(),
            first.point.tensors.join(", ")
        )));
    };
    let declared = a
        .model
        .inputs
        .first()
        .and_then(|i| i.tensor.as_ref())
        .and_then(|t| t.dims.clone())
        .unwrap_or_default();
    let fixed = |i: usize| matches!(declared.get(i), Some(crate::onnx::Dim::Fixed(d)) if *d > 0);
    match shape.as_slice() {
        [3, h, w] if fixed(2) && fixed(3) => Ok(TensorImage {
            channels_last: false,
            height: *h as u32,
            width: *w as u32,
            mean: norm.mean,
            std: norm.std,
        }),
        [h, w, 3] if fixed(1) && fixed(2) => Ok(TensorImage {
            channels_last: true,
            height: *h as u32,
            width: *w as u32,
            mean: norm.mean,
            std: norm.std,
        }),
        _ => Err(refuse(format!(
            "its input {} is declared {declared:?}",
            first.point.tensors.join(", ")
        ))),
    }
}

impl StagedModel for OnnxModelStages {
    fn arch(&self) -> Arch {
        Arch::Onnx
    }

    fn stages(&self) -> &[StageInfo] {
        &self.stages
    }

    fn forward_stage(&self, i: usize, x: &Tensor) -> Result<Tensor> {
        self.forward_range(x, i, i + 1)
    }

    /// One session for the whole range (onnxruntime optimises across the stages).
    fn forward_range(&self, x: &Tensor, from: usize, to: usize) -> Result<Tensor> {
        if from == to {
            return Ok(x.clone());
        }
        if from > to || to > self.stages.len() {
            return Err(Error::InvalidArgument(format!(
                "stages {from}..{to} of a model of {}",
                self.stages.len()
            )));
        }
        let b = x.dim(0)?;
        if let Some(fixed) = self.fixed_batch.filter(|f| *f < b) {
            if b % fixed != 0 {
                return Err(Error::InvalidArgument(format!(
                    "the model runs batches of exactly {fixed}; {b} samples do not divide"
                )));
            }
            let pieces = (0..b / fixed)
                .map(|i| self.forward_range(&x.narrow(0, i * fixed, fixed)?, from, to))
                .collect::<Result<Vec<_>>>()?;
            return Ok(Tensor::cat(&pieces, 0)?);
        }
        // One session runs one thread (the node's CPU budget counts threads): a batch
        // runs in as many pieces as the pool it runs in has threads, as csd's own
        // kernels run one image per task.
        let threads = rayon::current_num_threads().min(b);
        if threads > 1 {
            use rayon::prelude::*;
            let per = b.div_ceil(threads);
            let pieces = (0..b)
                .step_by(per)
                .collect::<Vec<_>>()
                .into_par_iter()
                .map(|at| self.run_range(&x.narrow(0, at, per.min(b - at))?, from, to))
                .collect::<Result<Vec<_>>>()?;
            return Ok(Tensor::cat(&pieces, 0)?);
        }
        self.run_range(x, from, to)
    }

    fn weight_bytes(&self) -> u64 {
        self.bytes
    }

    fn classify(&self, _: &Tensor) -> Result<Option<Tensor>> {
        Ok(None)
    }

    fn prepare(&self, samples: &[&[u8]]) -> Result<Tensor> {
        crate::preprocess::tensor_images(samples, &self.input, &Device::Cpu)
    }

    fn input_shape(&self) -> Vec<usize> {
        self.input.shape()
    }

    fn onnx(&self) -> Option<&OnnxModelStages> {
        Some(self)
    }

    fn runs_ranges_fused(&self) -> bool {
        true
    }

    fn stage_times(&self, x: &Tensor) -> Option<Result<(f64, Vec<f64>)>> {
        Some(self.cut_times(x))
    }

    fn engine(&self) -> &'static str {
        "onnxruntime"
    }
}
