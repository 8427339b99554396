//! onnxruntime, loaded at run time.
//!
//! The library is the `libonnxruntime.so` of the PyPI `onnxruntime` wheel (1.31 or
//! newer), found through `ORT_DYLIB_PATH` or at `$CSD_ML_HOME/lib/libonnxruntime.so`,
//! where `scripts/setup-ml.sh` links it. Nothing is downloaded at build time; a
//! process without the library refuses ONNX work with a message naming what is
//! missing, and everything else works as before.
//!
//! Sessions run on the caller's thread with one intra-op thread and no spinning, so
//! onnxruntime uses exactly the cores the node's admission gave the request (one
//! session per admitted slot; see [`OnnxSession`]).

use std::path::PathBuf;
use std::sync::Mutex;

use ort::environment::Environment;
use ort::session::Session;
use ort::session::builder::{GraphOptimizationLevel, SessionBuilder};
use ort::value::{TensorElementType, TensorRef, ValueType};

use super::graph::FLOAT;
use crate::{Error, Result};

/// The environment variable naming the library.
pub const LIBRARY_VAR: &str = "ORT_DYLIB_PATH";

/// Where the library is looked for: `ORT_DYLIB_PATH`, else the link
/// `scripts/setup-ml.sh` makes.
pub fn library_path() -> PathBuf {
    match std::env::var_os(LIBRARY_VAR).filter(|v| !v.is_empty()) {
        Some(p) => p.into(),
        None => crate::assets_dir().join("lib/libonnxruntime.so"),
    }
}

static ENVIRONMENT: Mutex<Option<Environment>> = Mutex::new(None);

/// The process's onnxruntime environment, loading the library on first use (a
/// failed load is tried again on the next call).
pub fn environment() -> Result<Environment> {
    let mut env = ENVIRONMENT
        .lock()
        .map_err(|_| unavailable("the onnxruntime environment's lock is poisoned".into()))?;
    if let Some(e) = env.as_ref() {
        return Ok(e.clone());
    }
    let path = library_path();
    if !path.exists() {
        return Err(unavailable(format!(
            "onnxruntime is not installed here: {} does not exist (install the PyPI \
             `onnxruntime` wheel, 1.31 or newer, and set {LIBRARY_VAR} to its \
             libonnxruntime.so, or run scripts/setup-ml.sh)",
            path.display()
        )));
    }
    let built = ort::init_from(&path)
        .map_err(|e| unavailable(format!("onnxruntime could not be loaded: {e}")))?
        .with_name("csd")
        .with_telemetry(false)
        .build()
        .map_err(|e| unavailable(format!("onnxruntime could not start: {e}")))?;
    *env = Some(built.clone());
    Ok(built)
}

/// Whether onnxruntime can be loaded in this process.
pub fn available() -> bool {
    environment().is_ok()
}

fn unavailable(why: String) -> Error {
    Error::Node(csd_protocol::Error::FailedPrecondition(why))
}

/// One input or output of a session.
#[derive(Debug, Clone, PartialEq)]
pub struct Io {
    /// Tensor name.
    pub name: String,
    /// ONNX element type number (1 = float32); 0 for what is not a tensor.
    pub elem: i32,
    /// Shape; -1 where a run decides.
    pub dims: Vec<i64>,
}

/// A tensor of floats, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct FloatTensor {
    /// Shape.
    pub dims: Vec<i64>,
    /// Elements.
    pub data: Vec<f32>,
}

/// A loaded model. Runs are serialised per session (`ort` runs take `&mut`); a
/// caller that runs several batches at once keeps one session per slot.
pub struct OnnxSession {
    session: Mutex<Session>,
    /// Inputs, in the model's order.
    pub inputs: Vec<Io>,
    /// Outputs, in the model's order.
    pub outputs: Vec<Io>,
}

impl std::fmt::Debug for OnnxSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnnxSession")
            .field("inputs", &self.inputs)
            .field("outputs", &self.outputs)
            .finish()
    }
}

fn io(name: &str, t: &ValueType) -> Io {
    match t {
        ValueType::Tensor { ty, shape, .. } => Io {
            name: name.to_string(),
            elem: elem_number(*ty),
            dims: shape.to_vec(),
        },
        _ => Io {
            name: name.to_string(),
            elem: 0,
            dims: vec![],
        },
    }
}

/// ONNX's element type number for `ty` (0 for types surgery never sends).
fn elem_number(ty: TensorElementType) -> i32 {
    use TensorElementType::*;
    match ty {
        Float32 => FLOAT,
        Uint8 => 2,
        Int8 => 3,
        Uint16 => 4,
        Int16 => 5,
        Int32 => 6,
        Int64 => 7,
        Bool => 9,
        Float16 => 10,
        Float64 => 11,
        Uint32 => 12,
        Uint64 => 13,
        Bfloat16 => 16,
        _ => 0,
    }
}

/// A session builder: `threads` intra-op threads, sequential, no spinning.
fn builder(env: &Environment, threads: usize) -> ort::Result<SessionBuilder> {
    Ok(Session::builder(env)?
        .with_optimization_level(GraphOptimizationLevel::All)?
        .with_intra_threads(threads.max(1))?
        .with_inter_threads(1)?
        .with_parallel_execution(false)?
        .with_intra_op_spinning(false)?
        .with_inter_op_spinning(false)?)
}

impl OnnxSession {
    /// Loads a model from its bytes, with `threads` intra-op threads and no spinning.
    /// A model onnxruntime refuses (malformed, an operator it lacks) is an invalid
    /// argument naming onnxruntime's reason.
    pub fn new(model: &[u8], threads: usize) -> Result<OnnxSession> {
        let env = environment()?;
        let refused = |e: ort::Error| {
            Error::InvalidArgument(format!("onnxruntime refused the model: {}", e.message()))
        };
        let session = builder(&env, threads)
            .and_then(|mut b| b.commit_from_memory(model))
            .map_err(refused)?;
        Ok(OnnxSession::of(session))
    }

    /// Loads `model` as [`new`](Self::new) does (one intra-op thread), with
    /// onnxruntime's profiler on: it records every run until
    /// [`end_profiling`](Self::end_profiling) writes the trace to `{prefix}_{time}.json`.
    pub(crate) fn profiling(model: &[u8], prefix: &std::path::Path) -> Result<OnnxSession> {
        let env = environment()?;
        let session = builder(&env, 1)
            .and_then(|b| Ok(b.with_profiling(prefix)?))
            .and_then(|mut b| b.commit_from_memory(model))
            .map_err(|e| {
                Error::InvalidArgument(format!("onnxruntime refused the model: {}", e.message()))
            })?;
        Ok(OnnxSession::of(session))
    }

    /// Ends a [`profiling`](Self::profiling) session's profile; returns the trace's path.
    pub(crate) fn end_profiling(&self) -> Result<String> {
        self.session
            .lock()
            .map_err(|_| Error::Node(csd_protocol::Error::Internal("a session panicked".into())))?
            .end_profiling()
            .map_err(|e| {
                Error::Node(csd_protocol::Error::Internal(format!(
                    "onnxruntime's profiler failed: {}",
                    e.message()
                )))
            })
    }

    fn of(session: Session) -> OnnxSession {
        let inputs = session
            .inputs()
            .iter()
            .map(|o| io(o.name(), o.dtype()))
            .collect();
        let outputs = session
            .outputs()
            .iter()
            .map(|o| io(o.name(), o.dtype()))
            .collect();
        OnnxSession {
            session: Mutex::new(session),
            inputs,
            outputs,
        }
    }

    /// Runs the model on float inputs (in the model's input order); returns every
    /// output, which must be float.
    pub fn run(&self, inputs: &[FloatTensor]) -> Result<Vec<FloatTensor>> {
        if inputs.len() != self.inputs.len() {
            return Err(Error::InvalidArgument(format!(
                "the model takes {} inputs, {} given",
                self.inputs.len(),
                inputs.len()
            )));
        }
        let failed = |e: ort::Error| {
            Error::Node(csd_protocol::Error::Internal(format!(
                "onnxruntime failed: {}",
                e.message()
            )))
        };
        // The feeds borrow the caller's buffers, which outlive the outputs: an output
        // may be an input passed through (a cut that sends a model input on).
        let mut feeds = Vec::with_capacity(inputs.len());
        for (spec, t) in self.inputs.iter().zip(inputs) {
            let value =
                TensorRef::from_array_view((t.dims.clone(), t.data.as_slice())).map_err(|e| {
                    Error::InvalidArgument(format!("input {}: {}", spec.name, e.message()))
                })?;
            feeds.push((spec.name.clone(), value));
        }
        let mut session = self
            .session
            .lock()
            .map_err(|_| Error::Node(csd_protocol::Error::Internal("a session panicked".into())))?;
        let outs = session.run(feeds).map_err(failed)?;
        let mut out = Vec::with_capacity(self.outputs.len());
        for spec in &self.outputs {
            let v = outs.get(spec.name.as_str()).ok_or_else(|| {
                Error::Node(csd_protocol::Error::Internal(format!(
                    "onnxruntime returned no {}",
                    spec.name
                )))
            })?;
            let (shape, data) = v.try_extract_tensor::<f32>().map_err(|_| {
                Error::InvalidArgument(format!(
                    "output {} is not a float tensor ({})",
                    spec.name,
                    v.dtype()
                ))
            })?;
            out.push(FloatTensor {
                dims: shape.to_vec(),
                data: data.to_vec(),
            });
        }
        Ok(out)
    }
}
