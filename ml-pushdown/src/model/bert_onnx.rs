//! MiniLM's encoder layers on onnxruntime: each layer written as an ONNX graph over
//! one sample's tokens (`[1, T, HIDDEN]`, `T` left to each run), so that a text still
//! runs on its own token count, with no padding work. Used where onnxruntime loads
//! ([`Kernels`](super::Kernels)): on the same weights, core and texts onnxruntime ran
//! the model faster than csd's layers on candle (benches/RESULTS.md, `minilm`).
//! Embedding and pooling (a gather and a mean) stay csd's.

use std::sync::Mutex;

use candle_core::{Device, Tensor};
use candle_nn::Linear;

use crate::onnx::write::{Attr, GraphWriter};
use crate::onnx::{FloatTensor, OnnxSession};
use crate::{Error, Result};

/// One encoder layer's weights, borrowed from the model (`Linear`: `[out, in]` and
/// a bias; layer norms: gain and bias).
pub(crate) struct LayerWeights<'a> {
    pub q: &'a Linear,
    pub k: &'a Linear,
    pub v: &'a Linear,
    pub o: &'a Linear,
    pub ln1: &'a (Tensor, Tensor),
    pub up: &'a Linear,
    pub down: &'a Linear,
    pub ln2: &'a (Tensor, Tensor),
}

/// The encoder's sizes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub hidden: usize,
    pub heads: usize,
    /// Layer normalisation's epsilon.
    pub eps: f32,
}

/// The encoder layers as onnxruntime sessions, idle ones kept per layer (one per
/// sample running at once).
pub(crate) struct OrtLayers {
    hidden: usize,
    graphs: Vec<Vec<u8>>,
    idle: Vec<Mutex<Vec<OnnxSession>>>,
}

impl OrtLayers {
    /// Writes every layer as a graph and opens one session of each (so that a model
    /// onnxruntime refuses fails here, at load).
    pub(crate) fn new(layers: &[LayerWeights<'_>], dims: Dims) -> Result<OrtLayers> {
        let graphs = layers
            .iter()
            .map(|l| layer_graph(l, dims))
            .collect::<Result<Vec<_>>>()?;
        let idle = graphs
            .iter()
            .map(|g| Ok(Mutex::new(vec![OnnxSession::new(g, 1)?])))
            .collect::<Result<Vec<_>>>()?;
        Ok(OrtLayers {
            hidden: dims.hidden,
            graphs,
            idle,
        })
    }

    /// Bytes of the layers' graphs (onnxruntime's copy of their weights).
    pub(crate) fn weight_bytes(&self) -> u64 {
        self.graphs.iter().map(|g| g.len() as u64).sum()
    }

    /// Layer `i` on one sample's tokens (`[len, hidden]`).
    pub(crate) fn run(&self, i: usize, h: &Tensor) -> Result<Tensor> {
        let (Some(graph), Some(idle)) = (self.graphs.get(i), self.idle.get(i)) else {
            return Err(Error::InvalidArgument(format!("no encoder layer {i}")));
        };
        let len = h.dim(0)?;
        let input = FloatTensor {
            dims: vec![1, len as i64, self.hidden as i64],
            data: h.flatten_all()?.to_vec1::<f32>()?,
        };
        let taken = idle.lock().ok().and_then(|mut v| v.pop());
        let session = match taken {
            Some(s) => s,
            None => OnnxSession::new(graph, 1)?,
        };
        let out = session.run(&[input]);
        if let Ok(mut v) = idle.lock() {
            v.push(session);
        }
        let mut out = out?;
        let y = out.pop().ok_or_else(|| {
            Error::Node(csd_protocol::Error::Internal(
                "an encoder layer returned nothing".into(),
            ))
        })?;
        Ok(Tensor::from_vec(y.data, (len, self.hidden), &Device::Cpu)?)
    }
}

/// `x @ W^T + b` for a candle `Linear` (`W`: `[out, in]`).
fn linear(g: &mut GraphWriter, x: &str, l: &Linear) -> Result<String> {
    let w = l.weight().t()?.contiguous()?;
    let dims = w.dims().to_vec();
    let wn = g.weight("w", &dims, &w.flatten_all()?.to_vec1::<f32>()?);
    let b = l
        .bias()
        .ok_or_else(|| Error::InvalidArgument("an encoder layer has no bias".into()))?
        .to_vec1::<f32>()?;
    let bn = g.weight("b", &[b.len()], &b);
    let m = g.node("MatMul", &[x, &wn], &[], None);
    Ok(g.node("Add", &[&m, &bn], &[], None))
}

/// Layer normalisation over the last axis, written out (onnxruntime fuses it back
/// into one kernel; `LayerNormalization` itself needs opset 17).
fn layer_norm(g: &mut GraphWriter, x: &str, (w, b): &(Tensor, Tensor), eps: f32) -> Result<String> {
    let last = [Attr::Ints("axes", &[-1])];
    let mu = g.node("ReduceMean", &[x], &last, None);
    let d = g.node("Sub", &[x, &mu], &[], None);
    let sq = g.node("Mul", &[&d, &d], &[], None);
    let var = g.node("ReduceMean", &[&sq], &last, None);
    let eps = g.scalar("eps", eps);
    let v = g.node("Add", &[&var, &eps], &[], None);
    let sd = g.node("Sqrt", &[&v], &[], None);
    let n = g.node("Div", &[&d, &sd], &[], None);
    let (w, b) = (w.to_vec1::<f32>()?, b.to_vec1::<f32>()?);
    let gain = g.weight("gain", &[w.len()], &w);
    let bias = g.weight("bias", &[b.len()], &b);
    let scaled = g.node("Mul", &[&n, &gain], &[], None);
    Ok(g.node("Add", &[&scaled, &bias], &[], None))
}

/// One post-LayerNorm BERT layer (masked attention needs no mask: a sample's tokens
/// only), exact-erf GELU, as csd's `bert::MiniLm::layer`.
fn layer_graph(l: &LayerWeights<'_>, d: Dims) -> Result<Vec<u8>> {
    let mut g = GraphWriter::default();
    let x = "x";
    let head_dim = d.hidden / d.heads;
    let split = g.ints("heads", &[0, 0, d.heads as i64, head_dim as i64]);
    let heads = |g: &mut GraphWriter, lin: &Linear, perm: &[i64]| -> Result<String> {
        let y = linear(g, x, lin)?;
        let r = g.node("Reshape", &[&y, &split], &[], None);
        Ok(g.node("Transpose", &[&r], &[Attr::Ints("perm", perm)], None))
    };
    let q = heads(&mut g, l.q, &[0, 2, 1, 3])?;
    let k = heads(&mut g, l.k, &[0, 2, 3, 1])?;
    let v = heads(&mut g, l.v, &[0, 2, 1, 3])?;
    let scores = g.node("MatMul", &[&q, &k], &[], None);
    let scale = g.scalar("scale", 1.0 / (head_dim as f32).sqrt());
    let scaled = g.node("Mul", &[&scores, &scale], &[], None);
    let p = g.node("Softmax", &[&scaled], &[Attr::Int("axis", -1)], None);
    let ctx = g.node("MatMul", &[&p, &v], &[], None);
    let ctx = g.node(
        "Transpose",
        &[&ctx],
        &[Attr::Ints("perm", &[0, 2, 1, 3])],
        None,
    );
    let merge = g.ints("hidden", &[0, 0, d.hidden as i64]);
    let ctx = g.node("Reshape", &[&ctx, &merge], &[], None);
    let o = linear(&mut g, &ctx, l.o)?;
    let res = g.node("Add", &[&o, x], &[], None);
    let a = layer_norm(&mut g, &res, l.ln1, d.eps)?;
    let up = linear(&mut g, &a, l.up)?;
    let root2 = g.scalar("sqrt2", std::f32::consts::SQRT_2);
    let (half, one) = (g.scalar("half", 0.5), g.scalar("one", 1.0));
    let z = g.node("Div", &[&up, &root2], &[], None);
    let e = g.node("Erf", &[&z], &[], None);
    let e1 = g.node("Add", &[&e, &one], &[], None);
    let h = g.node("Mul", &[&up, &half], &[], None);
    let gelu = g.node("Mul", &[&h, &e1], &[], None);
    let down = linear(&mut g, &gelu, l.down)?;
    let res = g.node("Add", &[&down, &a], &[], None);
    let y = layer_norm(&mut g, &res, l.ln2, d.eps)?;
    let y = g.node("Identity", &[&y], &[], Some("y"));
    let dims = [None, Some(d.hidden)];
    Ok(g.finish_with(x, &dims, &y, &dims))
}
