//! Writes an ONNX model from scratch: a graph of nodes over float32 weights held in
//! memory, with one float input and one float output whose first dimension is the
//! batch. This is how the built-in image models (whose weights csd loads and folds
//! itself) become models onnxruntime runs.

use super::wire::{put_bytes, put_varint};

/// The opset written models declare (Conv, Clip with tensor bounds, Add, Relu,
/// MaxPool, GlobalAveragePool, Flatten: all in opset 13).
const OPSET: u64 = 13;
/// ONNX IR version 8 (onnxruntime reads 3..=10).
const IR_VERSION: u64 = 8;
const FLOAT: u64 = 1;
const INT64: u64 = 7;
const ATTR_INT: u64 = 2;
const ATTR_INTS: u64 = 7;

/// A node attribute.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Attr<'a> {
    Int(&'a str, i64),
    Ints(&'a str, &'a [i64]),
}

/// A graph being written, node by node in topological order.
#[derive(Debug, Default)]
pub(crate) struct GraphWriter {
    nodes: Vec<u8>,
    inits: Vec<u8>,
    count: usize,
}

impl GraphWriter {
    /// A fresh tensor name starting with `prefix`.
    fn fresh(&mut self, prefix: &str) -> String {
        self.count += 1;
        format!("{prefix}_{}", self.count)
    }

    /// A float32 initializer of `dims` (row-major `data`); returns its name.
    pub(crate) fn weight(&mut self, prefix: &str, dims: &[usize], data: &[f32]) -> String {
        debug_assert_eq!(dims.iter().product::<usize>(), data.len());
        let raw: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.initializer(prefix, dims, FLOAT, &raw)
    }

    /// An int64 initializer of `data` (one dimension); returns its name.
    pub(crate) fn ints(&mut self, prefix: &str, data: &[i64]) -> String {
        let raw: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.initializer(prefix, &[data.len()], INT64, &raw)
    }

    /// An initializer of `dims` and element type `elem` from its little-endian bytes.
    fn initializer(&mut self, prefix: &str, dims: &[usize], elem: u64, raw: &[u8]) -> String {
        let name = self.fresh(prefix);
        let mut t = Vec::with_capacity(raw.len() + 64);
        for d in dims {
            put_varint(&mut t, 1, *d as u64);
        }
        put_varint(&mut t, 2, elem);
        put_bytes(&mut t, 8, name.as_bytes());
        put_bytes(&mut t, 9, raw);
        put_bytes(&mut self.inits, 5, &t);
        name
    }

    /// A float32 scalar initializer; returns its name.
    pub(crate) fn scalar(&mut self, prefix: &str, v: f32) -> String {
        self.weight(prefix, &[], &[v])
    }

    /// A node `op` reading `inputs`; its one output is named `out` when given (a
    /// stage boundary), else a fresh name. Returns the output's name.
    pub(crate) fn node(
        &mut self,
        op: &str,
        inputs: &[&str],
        attrs: &[Attr<'_>],
        out: Option<&str>,
    ) -> String {
        let out = out.map_or_else(|| self.fresh(&op.to_lowercase()), str::to_string);
        let mut n = Vec::new();
        for i in inputs {
            put_bytes(&mut n, 1, i.as_bytes());
        }
        put_bytes(&mut n, 2, out.as_bytes());
        put_bytes(&mut n, 3, self.fresh(op).as_bytes());
        put_bytes(&mut n, 4, op.as_bytes());
        for a in attrs {
            let mut m = Vec::new();
            match *a {
                Attr::Int(name, v) => {
                    put_bytes(&mut m, 1, name.as_bytes());
                    put_varint(&mut m, 3, v as u64);
                    put_varint(&mut m, 20, ATTR_INT);
                }
                Attr::Ints(name, vs) => {
                    put_bytes(&mut m, 1, name.as_bytes());
                    for v in vs {
                        put_varint(&mut m, 8, *v as u64);
                    }
                    put_varint(&mut m, 20, ATTR_INTS);
                }
            }
            put_bytes(&mut n, 5, &m);
        }
        put_bytes(&mut self.nodes, 1, &n);
        out
    }

    /// A 2-D convolution with bias (`w`: `[out, in / groups, k, k]`), padded by
    /// `k / 2` on every side.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn conv(
        &mut self,
        x: &str,
        w: (&[usize], &[f32]),
        b: &[f32],
        stride: usize,
        groups: usize,
        out: Option<&str>,
    ) -> String {
        let k = w.0[2];
        let (wn, bn) = (self.weight("w", w.0, w.1), self.weight("b", &[b.len()], b));
        let (k, s, p) = (k as i64, stride as i64, (k / 2) as i64);
        self.node(
            "Conv",
            &[x, &wn, &bn],
            &[
                Attr::Ints("kernel_shape", &[k, k]),
                Attr::Ints("strides", &[s, s]),
                Attr::Ints("pads", &[p, p, p, p]),
                Attr::Int("group", groups as i64),
            ],
            out,
        )
    }

    /// `min(max(x, 0), 6)`.
    pub(crate) fn relu6(&mut self, x: &str, out: Option<&str>) -> String {
        let lo = self.weight("zero", &[], &[0.0]);
        let hi = self.weight("six", &[], &[6.0]);
        self.node("Clip", &[x, &lo, &hi], &[], out)
    }

    /// The mean of each channel's plane, flattened to `[N, C]`.
    pub(crate) fn global_pool(&mut self, x: &str, out: Option<&str>) -> String {
        let p = self.node("GlobalAveragePool", &[x], &[], None);
        self.node("Flatten", &[&p], &[Attr::Int("axis", 1)], out)
    }

    /// The model: `input` (`[N, input_dims…]`) to `output` (`[N, output_dims…]`).
    pub(crate) fn finish(
        self,
        input: &str,
        input_dims: &[usize],
        output: &str,
        output_dims: &[usize],
    ) -> Vec<u8> {
        let fixed = |d: &[usize]| d.iter().map(|d| Some(*d)).collect::<Vec<_>>();
        self.finish_with(input, &fixed(input_dims), output, &fixed(output_dims))
    }

    /// [`finish`](Self::finish) with some dimensions after the batch left to each
    /// run (`None`: named `T`, the same size in the input and the output).
    pub(crate) fn finish_with(
        self,
        input: &str,
        input_dims: &[Option<usize>],
        output: &str,
        output_dims: &[Option<usize>],
    ) -> Vec<u8> {
        let mut g = self.nodes;
        put_bytes(&mut g, 2, b"csd");
        g.extend_from_slice(&self.inits);
        put_bytes(&mut g, 11, &value_info(input, input_dims));
        put_bytes(&mut g, 12, &value_info(output, output_dims));
        let mut m = Vec::with_capacity(g.len() + 64);
        put_varint(&mut m, 1, IR_VERSION);
        put_bytes(&mut m, 2, b"csd");
        put_bytes(&mut m, 7, &g);
        let mut opset = Vec::new();
        put_bytes(&mut opset, 1, b"");
        put_varint(&mut opset, 2, OPSET);
        put_bytes(&mut m, 8, &opset);
        m
    }
}

/// A float tensor's `ValueInfoProto`: a batch dimension `N`, then `dims` (`None`:
/// named `T`).
fn value_info(name: &str, dims: &[Option<usize>]) -> Vec<u8> {
    let mut shape = Vec::new();
    let mut batch = Vec::new();
    put_bytes(&mut batch, 2, b"N");
    put_bytes(&mut shape, 1, &batch);
    for d in dims {
        let mut dim = Vec::new();
        match d {
            Some(d) => put_varint(&mut dim, 1, *d as u64),
            None => put_bytes(&mut dim, 2, b"T"),
        }
        put_bytes(&mut shape, 1, &dim);
    }
    let mut tensor = Vec::new();
    put_varint(&mut tensor, 1, FLOAT);
    put_bytes(&mut tensor, 2, &shape);
    let mut ty = Vec::new();
    put_bytes(&mut ty, 1, &tensor);
    let mut v = Vec::new();
    put_bytes(&mut v, 1, name.as_bytes());
    put_bytes(&mut v, 2, &ty);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::onnx::graph::OnnxModel;
    use crate::onnx::runtime::{FloatTensor, OnnxSession};

    /// A written convolution + ReLU6 + pool reads back and runs on onnxruntime with
    /// the answer worked out by hand.
    #[test]
    fn a_written_model_runs_on_onnxruntime() -> crate::Result<()> {
        let mut g = GraphWriter::default();
        // One output channel summing a 3×3 window of the one input channel, bias -1.
        let c = g.conv("x", (&[1, 1, 3, 3], &[1.0; 9]), &[-1.0], 1, 1, Some("conv"));
        let r = g.relu6(&c, None);
        let y = g.global_pool(&r, Some("y"));
        let bytes = g.finish("x", &[1, 3, 3], &y, &[1]);
        let m = OnnxModel::parse(&bytes)?;
        assert_eq!(m.nodes.len(), 4);
        if !crate::onnx::runtime::available() {
            eprintln!("onnxruntime is not installed: the run is skipped (scripts/setup-ml.sh)");
            return Ok(());
        }
        let s = OnnxSession::new(&bytes, 1)?;
        let out = s.run(&[FloatTensor {
            dims: vec![1, 1, 3, 3],
            data: vec![1.0; 9],
        }])?;
        // Window sums with zero padding: corners 4, edges 6, centre 9; minus 1, capped
        // at 6: [3, 5, 3, 5, 6, 5, 3, 5, 3], whose mean is 38 / 9.
        assert_eq!(out[0].dims, vec![1, 1]);
        assert!(
            (out[0].data[0] - 38.0 / 9.0).abs() < 1e-5,
            "{:?}",
            out[0].data
        );
        Ok(())
    }
}
