//! Users' own models: any ONNX graph, cut where few tensors cross, its head run at
//! the storage node and its tail at the compute tier, both on onnxruntime.
//!
//! | file | what |
//! |---|---|
//! | [`wire`] | protobuf's wire format, field by field (unknown fields kept) |
//! | [`graph`] | a model as surgery sees it: nodes, initializers, inputs, outputs, types |
//! | [`split`] | cut points; the head and tail models of a cut |
//! | [`runtime`] | onnxruntime through `ort`, loaded at run time |
//! | `profiler` | each stage's seconds from onnxruntime's profile of one run |
//! | `write` | a model written from scratch (the built-in image models' export) |
//!
//! [`Analysis`] puts them together: a model's cut points with the type, shape and
//! size per sample of what each sends, learned from one onnxruntime run.

pub mod graph;
pub(crate) mod profiler;
pub mod runtime;
pub mod split;
mod wire;
pub(crate) mod write;

use std::collections::HashMap;

pub use graph::{Dim, OnnxModel, TensorType};
pub use runtime::{FloatTensor, OnnxSession};
pub use split::{CutPoint, MAX_CUT_TENSORS};

use crate::{Error, Result};

/// A cut point with what it sends per sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Cut {
    /// Where the graph is cut.
    pub point: CutPoint,
    /// Per-sample shape of each tensor sent (without the batch dimension).
    pub shapes: Vec<Vec<usize>>,
}

impl Cut {
    /// Floats sent per sample.
    pub fn elems(&self) -> usize {
        self.shapes
            .iter()
            .map(|s| s.iter().product::<usize>())
            .sum()
    }
}

/// A model ready to split: its graph, its cut points (only those sending float
/// tensors with a batch dimension: what a feature column can carry), and the types
/// onnxruntime inferred for the tensors they send.
#[derive(Debug, Clone)]
pub struct Analysis {
    /// The model.
    pub model: OnnxModel,
    /// Cut points; the first sends the model's inputs, the last its outputs.
    pub cuts: Vec<Cut>,
    types: split::Types,
}

impl Analysis {
    /// Decodes `bytes`, finds the cut points and runs the model once on zeros (a
    /// batch of one) with every cut tensor as an output, to learn each one's type
    /// and size.
    pub fn new(bytes: &[u8]) -> Result<Analysis> {
        let model = OnnxModel::parse(bytes)?;
        let points = split::cut_points(&model);
        let mut wanted: Vec<String> = points.iter().flat_map(|c| c.tensors.clone()).collect();
        wanted.sort();
        wanted.dedup();
        let probe = OnnxSession::new(&split::with_outputs(&model, &wanted), 1)?;
        let inputs: Vec<FloatTensor> = probe.inputs.iter().map(zeros).collect::<Result<_>>()?;
        // What each tensor of the probe run looks like, the inputs first.
        let mut found: HashMap<String, FloatTensor> = probe
            .inputs
            .iter()
            .map(|i| i.name.clone())
            .zip(inputs.iter().cloned())
            .collect();
        if probe.inputs.iter().any(|i| i.elem != graph::FLOAT) {
            return Err(Error::InvalidArgument(format!(
                "the model's inputs must be float tensors ({})",
                probe
                    .inputs
                    .iter()
                    .map(|i| format!("{}: element type {}", i.name, i.elem))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        // Every output must be float to be read back; cut tensors that are not
        // (shapes, indices) disqualify their cut and are left out of the probe.
        let float_outputs: Vec<String> = probe
            .outputs
            .iter()
            .filter(|o| o.elem == graph::FLOAT)
            .map(|o| o.name.clone())
            .collect();
        let probe = if float_outputs.len() == probe.outputs.len() {
            probe
        } else {
            OnnxSession::new(&split::with_outputs(&model, &float_outputs), 1)?
        };
        let outs = probe.run(&inputs)?;
        let mut types = split::Types::new();
        for (io, t) in probe.outputs.iter().zip(outs) {
            types.insert(
                io.name.clone(),
                TensorType {
                    elem: io.elem,
                    dims: Some(
                        io.dims
                            .iter()
                            .enumerate()
                            .map(|(i, d)| match *d {
                                // The batch dimension stays open, whatever the probe ran.
                                _ if i == 0 => Dim::Unknown,
                                d if d >= 0 => Dim::Fixed(d),
                                _ => Dim::Unknown,
                            })
                            .collect(),
                    ),
                },
            );
            found.insert(io.name.clone(), t);
        }
        let cuts = points
            .into_iter()
            .filter_map(|point| {
                let shapes: Option<Vec<Vec<usize>>> = point
                    .tensors
                    .iter()
                    .map(|t| {
                        let t = found.get(t)?;
                        // A batch of one in, a batch of one out: the first dimension is
                        // the batch.
                        (t.dims.first() == Some(&1))
                            .then(|| t.dims[1..].iter().map(|d| *d as usize).collect())
                    })
                    .collect();
                Some(Cut {
                    point,
                    shapes: shapes?,
                })
            })
            .collect();
        Ok(Analysis { model, cuts, types })
    }

    /// The head model of cut `i` (what the node runs).
    pub fn head(&self, i: usize) -> Result<Vec<u8>> {
        split::head(&self.model, &self.cut(i)?.point, &self.types)
    }

    /// The tail model of cut `i` (what the compute tier runs); `None` for the last.
    pub fn tail(&self, i: usize) -> Result<Option<Vec<u8>>> {
        split::tail(&self.model, &self.cut(i)?.point, &self.types)
    }

    /// The model between cuts `from` and `to` (`from < to`): reads what `from`
    /// sends, writes what `to` sends.
    pub fn segment(&self, from: usize, to: usize) -> Result<Vec<u8>> {
        split::segment(
            &self.model,
            &self.cut(from)?.point,
            &self.cut(to)?.point,
            &self.types,
        )
    }

    /// One run of the whole model on `inputs` (what cut 0 sends) under onnxruntime's
    /// profiler (see [`profiler`]), after an untimed one (which grows onnxruntime's
    /// memory arena to the batch, as an epoch does once): the run's seconds, and the
    /// seconds of each stage (from cut `i` to cut `i + 1`) inside it.
    pub(crate) fn stage_times(&self, inputs: &[FloatTensor]) -> Result<(f64, Vec<f64>)> {
        let whole = self.segment(0, self.cuts.len() - 1)?;
        let run = profiler::profiled_run(&whole, inputs, 2)?;
        let ats: Vec<usize> = self.cuts.iter().map(|c| c.point.at).collect();
        Ok((run.secs, profiler::charge(&self.model, &ats, &run.kernels)))
    }

    /// Cut `i`.
    pub fn cut(&self, i: usize) -> Result<&Cut> {
        self.cuts.get(i).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "split {i} is out of range: the model has cut points 0..={}",
                self.cuts.len().saturating_sub(1)
            ))
        })
    }

    /// The cut a user named: its number, or the first cut that sends that tensor.
    pub fn find(&self, name: &str) -> Result<usize> {
        if let Ok(i) = name.parse::<usize>() {
            return self.cut(i).map(|_| i);
        }
        self.cuts
            .iter()
            .position(|c| c.point.at > 0 && c.point.tensors.iter().any(|t| t == name))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "split {name:?} is no tensor a cut point sends (list them with \
                     `csd features --model FILE --list-splits`)"
                ))
            })
    }
}

/// Zeros of input `io`'s shape with a batch of one (open dimensions: 1).
fn zeros(io: &runtime::Io) -> Result<FloatTensor> {
    let dims: Vec<i64> = io
        .dims
        .iter()
        .map(|d| if *d > 0 { *d } else { 1 })
        .collect();
    let n: i64 = dims.iter().product();
    if n > 1 << 28 {
        return Err(Error::InvalidArgument(format!(
            "input {} of shape {:?} is too large to probe",
            io.name, io.dims
        )));
    }
    Ok(FloatTensor {
        data: vec![0.0; n as usize],
        dims,
    })
}
