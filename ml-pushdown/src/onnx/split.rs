//! Where a graph can be cut, and the two models a cut makes.
//!
//! Nodes run in the file's (topological) order. Cutting after node `i` leaves a
//! *head* (nodes `[0, i)`, run at the storage node) and a *tail* (the rest, run at
//! the compute tier); the tensors the head computes that the tail still reads are
//! what crosses the link. A cut point is a place where few tensors cross
//! ([`MAX_CUT_TENSORS`]): a chain's every layer boundary, a residual network's
//! block boundaries (inside a block the skip connection crosses too), a
//! transformer's layer boundaries.
//!
//! Constants (initializers, and nodes that read nothing, such as `Constant`) never
//! cross: each part keeps a copy of those it reads.

use std::collections::{HashMap, HashSet};

use super::graph::{Dim, GraphParts, OnnxModel, TensorType, named_value_info, tensor_value_info};
use crate::{Error, Result};

/// Most tensors a cut point may send across.
pub const MAX_CUT_TENSORS: usize = 4;

/// One place the graph may be cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CutPoint {
    /// The head runs nodes `[0, at)`; `0` sends the model's inputs (nothing runs at
    /// the node), `nodes.len()` runs the whole model at the node.
    pub at: usize,
    /// The tensors crossing the cut, in the order the head writes them.
    pub tensors: Vec<String>,
}

/// Whether node `i` computes a constant (reads nothing, runs no subgraph).
fn is_constant(m: &OnnxModel, i: usize) -> bool {
    let n = &m.nodes[i];
    n.reads().next().is_none()
}

/// The cut points of `m`, in topological order: first the model's inputs, last its
/// outputs.
pub fn cut_points(m: &OnnxModel) -> Vec<CutPoint> {
    let n = m.nodes.len();
    // The last node reading each tensor (graph outputs: read "after" every node).
    let mut last_read: HashMap<&str, usize> = HashMap::new();
    for (i, node) in m.nodes.iter().enumerate() {
        for t in node.reads() {
            last_read.insert(t, i);
        }
    }
    for o in &m.outputs {
        last_read.insert(&o.name, n);
    }
    let constants: HashSet<&str> = m
        .initializer_index()
        .into_keys()
        .chain(
            (0..n)
                .filter(|i| is_constant(m, *i))
                .flat_map(|i| m.nodes[i].outputs.iter().map(String::as_str)),
        )
        .collect();
    // Tensors alive after the head, in the order they were defined.
    let mut live: Vec<&str> = m.inputs.iter().map(|i| i.name.as_str()).collect();
    let mut cuts = vec![CutPoint {
        at: 0,
        tensors: live.iter().map(|s| s.to_string()).collect(),
    }];
    for at in 1..=n {
        for o in &m.nodes[at - 1].outputs {
            if !o.is_empty() && !constants.contains(o.as_str()) {
                live.push(o);
            }
        }
        live.retain(|t| last_read.get(t).is_some_and(|r| *r >= at));
        let computed = live.iter().any(|t| !m.inputs.iter().any(|i| i.name == *t));
        let tensors: Vec<String> = live.iter().map(|s| s.to_string()).collect();
        let repeat = cuts.last().is_some_and(|c| c.tensors == tensors);
        if at == n {
            // The whole model at the node is always a cut, even when its last nodes
            // wrote nothing an earlier cut does not already send.
            if repeat && cuts.len() > 1 {
                cuts.pop();
            }
            cuts.push(CutPoint { at, tensors });
        } else if computed && !live.is_empty() && live.len() <= MAX_CUT_TENSORS && !repeat {
            cuts.push(CutPoint { at, tensors });
        }
    }
    cuts
}

/// Where the types of cut tensors come from when the model does not declare them.
pub type Types = HashMap<String, TensorType>;

fn value_info_of(m: &OnnxModel, name: &str, types: &Types) -> Vec<u8> {
    if let Some(v) = m.declared(name).filter(|v| v.tensor.is_some()) {
        return v.raw.clone();
    }
    match types.get(name) {
        Some(t) => {
            let dims: Vec<Option<i64>> = t
                .dims
                .iter()
                .flatten()
                .map(|d| match d {
                    Dim::Fixed(v) if *v >= 0 => Some(*v),
                    _ => None,
                })
                .collect();
            tensor_value_info(name, t.elem, &dims)
        }
        None => named_value_info(name),
    }
}

/// The head of `cut`: the model's first nodes, reading the model's inputs, writing
/// the cut's tensors.
pub fn head(m: &OnnxModel, cut: &CutPoint, types: &Types) -> Result<Vec<u8>> {
    if cut.at == 0 {
        return Err(Error::InvalidArgument(
            "split 0 runs nothing at the node: read the dataset instead".into(),
        ));
    }
    segment(m, &inputs_cut(m), cut, types)
}

/// The tail of `cut`: the rest of the model, reading the cut's tensors; `None` when
/// the head is the whole model.
pub fn tail(m: &OnnxModel, cut: &CutPoint, types: &Types) -> Result<Option<Vec<u8>>> {
    if cut.at == m.nodes.len() {
        return Ok(None);
    }
    let end = CutPoint {
        at: m.nodes.len(),
        tensors: m.outputs.iter().map(|o| o.name.clone()).collect(),
    };
    segment(m, cut, &end, types).map(Some)
}

/// The cut before the first node: the model's inputs.
fn inputs_cut(m: &OnnxModel) -> CutPoint {
    CutPoint {
        at: 0,
        tensors: m.inputs.iter().map(|i| i.name.clone()).collect(),
    }
}

/// The model between two cuts: nodes `[from.at, to.at)` (and copies of the constants
/// before `from` they read), reading `from`'s tensors and nothing else, writing
/// `to`'s (a tensor of both passes through).
pub fn segment(m: &OnnxModel, from: &CutPoint, to: &CutPoint, types: &Types) -> Result<Vec<u8>> {
    if from.at > to.at || to.at > m.nodes.len() {
        return Err(Error::InvalidArgument(format!(
            "no segment from node {} to node {}",
            from.at, to.at
        )));
    }
    let rest = &m.nodes[from.at..to.at];
    let reads: HashSet<&str> = rest.iter().flat_map(|n| n.reads()).collect();
    // Constants computed before `from` that this segment reads: it computes them too.
    let mut nodes: Vec<_> = (0..from.at)
        .filter(|i| {
            is_constant(m, *i)
                && m.nodes[*i]
                    .outputs
                    .iter()
                    .any(|o| reads.contains(o.as_str()))
        })
        .map(|i| &m.nodes[i])
        .collect();
    nodes.extend(rest);
    let inputs: Vec<Vec<u8>> = from
        .tensors
        .iter()
        .map(|t| {
            if m.declared(t).is_none_or(|v| v.tensor.is_none()) && !types.contains_key(t) {
                return Err(Error::InvalidArgument(format!(
                    "the type of {t:?} is unknown: a part of the model cannot declare it \
                     as an input"
                )));
            }
            Ok(value_info_of(m, t, types))
        })
        .collect::<Result<_>>()?;
    let outputs: Vec<Vec<u8>> = to
        .tensors
        .iter()
        .map(|t| match m.outputs.iter().find(|o| o.name == *t) {
            Some(o) => o.raw.clone(),
            None => value_info_of(m, t, types),
        })
        .collect();
    Ok(m.write(&part(m, nodes, inputs, outputs)))
}

/// The model with `extra` tensors among its outputs (untyped: the runtime infers
/// them), to learn the cut tensors' types and sizes from one session.
pub fn with_outputs(m: &OnnxModel, extra: &[String]) -> Vec<u8> {
    let mut outputs: Vec<Vec<u8>> = m.outputs.iter().map(|o| o.raw.clone()).collect();
    for t in extra {
        if !m.outputs.iter().any(|o| o.name == *t) {
            outputs.push(named_value_info(t));
        }
    }
    let nodes = m.nodes.iter().collect();
    let inputs = m.inputs.iter().map(|i| i.raw.clone()).collect();
    m.write(&part(m, nodes, inputs, outputs))
}

/// The graph of `nodes` reading `inputs` and writing `outputs` (ValueInfoProto
/// payloads): the initializers the nodes read, the declared types of what they
/// compute.
fn part<'a>(
    m: &'a OnnxModel,
    nodes: Vec<&'a super::graph::Node>,
    inputs: Vec<Vec<u8>>,
    outputs: Vec<Vec<u8>>,
) -> GraphParts<'a> {
    let reads: HashSet<&str> = nodes.iter().flat_map(|n| n.reads()).collect();
    let written: HashSet<&str> = nodes
        .iter()
        .flat_map(|n| n.outputs.iter().map(String::as_str))
        .collect();
    let initializers = m
        .initializers
        .iter()
        .filter(|i| reads.contains(i.name.as_str()))
        .collect();
    let value_info = m
        .value_info
        .iter()
        .filter(|v| written.contains(v.name.as_str()))
        .map(|v| v.raw.clone())
        .collect();
    GraphParts {
        nodes,
        initializers,
        inputs,
        outputs,
        value_info,
    }
}
