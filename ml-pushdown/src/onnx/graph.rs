//! An ONNX model as surgery needs it: the main graph's nodes with the tensors they
//! read and write, its initializers, inputs, outputs and known tensor types — each
//! kept with its original bytes, so a part of the model is written back exactly as
//! the exporter wrote it.

use std::collections::{HashMap, HashSet};

use super::wire::{self, Field, MAX_DEPTH, malformed};
use crate::Result;

// ModelProto
const MODEL_GRAPH: u32 = 7;
const MODEL_OPSET_IMPORT: u32 = 8;
// GraphProto
const GRAPH_NODE: u32 = 1;
const GRAPH_NAME: u32 = 2;
const GRAPH_INITIALIZER: u32 = 5;
const GRAPH_INPUT: u32 = 11;
const GRAPH_OUTPUT: u32 = 12;
const GRAPH_VALUE_INFO: u32 = 13;
const GRAPH_SPARSE_INITIALIZER: u32 = 15;
// NodeProto
const NODE_INPUT: u32 = 1;
const NODE_OUTPUT: u32 = 2;
const NODE_NAME: u32 = 3;
const NODE_OP_TYPE: u32 = 4;
const NODE_ATTRIBUTE: u32 = 5;
const NODE_DOMAIN: u32 = 7;
// AttributeProto
const ATTR_GRAPH: u32 = 6;
const ATTR_GRAPHS: u32 = 11;
// TensorProto / SparseTensorProto / ValueInfoProto
const TENSOR_NAME: u32 = 8;
const SPARSE_VALUES: u32 = 1;
const VALUE_INFO_NAME: u32 = 1;
const VALUE_INFO_TYPE: u32 = 2;
// TypeProto.tensor_type, its elem_type and shape; TensorShapeProto.dim; Dimension
const TYPE_TENSOR: u32 = 1;
const TENSOR_TYPE_ELEM: u32 = 1;
const TENSOR_TYPE_SHAPE: u32 = 2;
const SHAPE_DIM: u32 = 1;
const DIM_VALUE: u32 = 1;
const DIM_PARAM: u32 = 2;

/// One dimension of a tensor's declared shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dim {
    /// A fixed size.
    Fixed(i64),
    /// A named size (`batch`, `N`): set by each run.
    Symbolic(String),
    /// Not declared.
    Unknown,
}

/// A tensor's declared element type (ONNX's `TensorProto.DataType`) and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorType {
    /// Element type: 1 float, 7 int64, 10 float16, … (ONNX's numbering).
    pub elem: i32,
    /// Shape, when declared.
    pub dims: Option<Vec<Dim>>,
}

/// ONNX's element type number for float32.
pub const FLOAT: i32 = 1;

/// A named graph value (input, output or intermediate) with what is declared of it.
#[derive(Debug, Clone)]
pub struct ValueInfo {
    /// Tensor name.
    pub name: String,
    /// Type, when declared and a tensor.
    pub tensor: Option<TensorType>,
    /// The ValueInfoProto's bytes (without its field key).
    pub(crate) raw: Vec<u8>,
}

/// One operator of the graph.
#[derive(Debug, Clone)]
pub struct Node {
    /// Node name (may be empty).
    pub name: String,
    /// Operator (`Conv`, `Add`, …).
    pub op_type: String,
    /// Operator domain (empty: ONNX's default).
    pub domain: String,
    /// Tensors read (an empty name is an omitted optional input).
    pub inputs: Vec<String>,
    /// Tensors written.
    pub outputs: Vec<String>,
    /// Tensors of the enclosing graph its subgraphs read (`If`, `Loop`, `Scan`).
    pub implicit: Vec<String>,
    pub(crate) raw: Vec<u8>,
}

impl Node {
    /// Every tensor the node needs from the graph around it.
    pub fn reads(&self) -> impl Iterator<Item = &str> {
        self.inputs
            .iter()
            .chain(&self.implicit)
            .map(String::as_str)
            .filter(|n| !n.is_empty())
    }
}

/// A constant of the graph (an initializer, dense or sparse).
#[derive(Debug, Clone)]
pub(crate) struct Initializer {
    pub name: String,
    pub raw: Vec<u8>,
}

/// A decoded ONNX model.
#[derive(Debug, Clone)]
pub struct OnnxModel {
    /// The main graph's name.
    pub graph_name: String,
    /// Nodes, in the file's order (ONNX requires a topological one; checked).
    pub nodes: Vec<Node>,
    /// Graph inputs that are not initializers: what a run must feed.
    pub inputs: Vec<ValueInfo>,
    /// Graph outputs.
    pub outputs: Vec<ValueInfo>,
    /// Declared types of intermediate tensors.
    pub value_info: Vec<ValueInfo>,
    /// Operator sets the model imports: (domain, version).
    pub opsets: Vec<(String, i64)>,
    pub(crate) initializers: Vec<Initializer>,
    /// ModelProto fields other than the graph (IR version, opsets, functions, …).
    pub(crate) model_rest: Vec<u8>,
    /// GraphProto fields surgery does not touch (doc string, annotations, …).
    pub(crate) graph_rest: Vec<u8>,
}

impl OnnxModel {
    /// Decodes and checks a model file's bytes.
    pub fn parse(bytes: &[u8]) -> Result<OnnxModel> {
        if bytes.is_empty() {
            return Err(malformed("the file is empty"));
        }
        let mut graph = None;
        let mut model_rest = Vec::new();
        let mut opsets = Vec::new();
        for f in wire::fields(bytes) {
            let f = f?;
            match f.number {
                MODEL_GRAPH => graph = Some(f.bytes("graph")?),
                MODEL_OPSET_IMPORT => {
                    let (mut domain, mut version) = (String::new(), 0);
                    for g in wire::fields(f.bytes("opset_import")?) {
                        let g = g?;
                        match g.number {
                            1 => domain = g.string("opset domain")?,
                            2 => version = g.int("opset version")?,
                            _ => {}
                        }
                    }
                    opsets.push((domain, version));
                    model_rest.extend_from_slice(f.raw);
                }
                _ => model_rest.extend_from_slice(f.raw),
            }
        }
        let graph = graph.ok_or_else(|| malformed("it has no graph (is this an ONNX model?)"))?;
        if opsets.is_empty() {
            return Err(malformed("it imports no operator set"));
        }
        let mut m = OnnxModel {
            graph_name: String::new(),
            nodes: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            value_info: Vec::new(),
            opsets,
            initializers: Vec::new(),
            model_rest,
            graph_rest: Vec::new(),
        };
        for f in wire::fields(graph) {
            let f = f?;
            match f.number {
                GRAPH_NODE => m.nodes.push(node(f.bytes("node")?, 0)?),
                GRAPH_NAME => m.graph_name = f.string("graph name")?,
                GRAPH_INITIALIZER => m.initializers.push(Initializer {
                    name: name_field(f.bytes("initializer")?, TENSOR_NAME, "initializer")?,
                    raw: f.raw.to_vec(),
                }),
                GRAPH_SPARSE_INITIALIZER => {
                    let values = wire::fields(f.bytes("sparse initializer")?)
                        .find(|g| g.as_ref().map_or(true, |g| g.number == SPARSE_VALUES))
                        .transpose()?
                        .ok_or_else(|| malformed("a sparse initializer has no values"))?;
                    m.initializers.push(Initializer {
                        name: name_field(
                            values.bytes("sparse values")?,
                            TENSOR_NAME,
                            "sparse initializer",
                        )?,
                        raw: f.raw.to_vec(),
                    })
                }
                GRAPH_INPUT => m.inputs.push(value_info(&f)?),
                GRAPH_OUTPUT => m.outputs.push(value_info(&f)?),
                GRAPH_VALUE_INFO => m.value_info.push(value_info(&f)?),
                _ => m.graph_rest.extend_from_slice(f.raw),
            }
        }
        // Older exporters list initializers among the inputs too: those are no inputs
        // a run feeds.
        let constants: HashSet<&str> = m.initializers.iter().map(|i| i.name.as_str()).collect();
        let inputs = std::mem::take(&mut m.inputs);
        m.inputs = inputs
            .into_iter()
            .filter(|i| !constants.contains(i.name.as_str()))
            .collect();
        m.check()?;
        Ok(m)
    }

    /// Every node reads tensors defined before it; every output is defined.
    fn check(&self) -> Result<()> {
        if self.nodes.is_empty() {
            return Err(malformed("its graph has no nodes"));
        }
        if self.outputs.is_empty() {
            return Err(malformed("its graph has no outputs"));
        }
        let mut defined: HashSet<&str> = self
            .inputs
            .iter()
            .map(|i| i.name.as_str())
            .chain(self.initializers.iter().map(|i| i.name.as_str()))
            .collect();
        for (i, n) in self.nodes.iter().enumerate() {
            if let Some(missing) = n.reads().find(|t| !defined.contains(t)) {
                return Err(malformed(format!(
                    "node {i} ({}{}) reads {missing:?}, which no earlier node, input or \
                     initializer defines (the nodes must be in topological order)",
                    n.op_type,
                    if n.name.is_empty() {
                        String::new()
                    } else {
                        format!(" {:?}", n.name)
                    }
                )));
            }
            for o in n.outputs.iter().filter(|o| !o.is_empty()) {
                if !defined.insert(o) {
                    return Err(malformed(format!("tensor {o:?} is defined twice")));
                }
            }
        }
        if let Some(o) = self
            .outputs
            .iter()
            .find(|o| !defined.contains(o.name.as_str()))
        {
            return Err(malformed(format!("output {:?} is never computed", o.name)));
        }
        Ok(())
    }

    /// What is declared of tensor `name` (an input, output or intermediate).
    pub fn declared(&self, name: &str) -> Option<&ValueInfo> {
        self.inputs
            .iter()
            .chain(&self.outputs)
            .chain(&self.value_info)
            .find(|v| v.name == name)
    }

    /// Initializers by name.
    pub(crate) fn initializer_index(&self) -> HashMap<&str, &Initializer> {
        self.initializers
            .iter()
            .map(|i| (i.name.as_str(), i))
            .collect()
    }
}

/// The string field `number` of a message.
fn name_field(msg: &[u8], number: u32, what: &str) -> Result<String> {
    for f in wire::fields(msg) {
        let f = f?;
        if f.number == number {
            return f.string(what);
        }
    }
    Ok(String::new())
}

fn value_info(f: &Field<'_>) -> Result<ValueInfo> {
    let mut v = ValueInfo {
        name: String::new(),
        tensor: None,
        raw: f.bytes("value info")?.to_vec(),
    };
    for g in wire::fields(f.bytes("value info")?) {
        let g = g?;
        match g.number {
            VALUE_INFO_NAME => v.name = g.string("value name")?,
            VALUE_INFO_TYPE => v.tensor = tensor_type(g.bytes("value type")?)?,
            _ => {}
        }
    }
    if v.name.is_empty() {
        return Err(malformed("a graph input or output has no name"));
    }
    Ok(v)
}

fn tensor_type(type_proto: &[u8]) -> Result<Option<TensorType>> {
    let Some(t) = wire::fields(type_proto)
        .find(|f| f.as_ref().map_or(true, |f| f.number == TYPE_TENSOR))
        .transpose()?
    else {
        return Ok(None);
    };
    let mut out = TensorType {
        elem: 0,
        dims: None,
    };
    for f in wire::fields(t.bytes("tensor type")?) {
        let f = f?;
        match f.number {
            TENSOR_TYPE_ELEM => out.elem = f.int("element type")? as i32,
            TENSOR_TYPE_SHAPE => {
                let mut dims = Vec::new();
                for d in wire::fields(f.bytes("shape")?) {
                    let d = d?;
                    if d.number != SHAPE_DIM {
                        continue;
                    }
                    let mut dim = Dim::Unknown;
                    for x in wire::fields(d.bytes("dimension")?) {
                        let x = x?;
                        match x.number {
                            DIM_VALUE => dim = Dim::Fixed(x.int("dimension")?),
                            DIM_PARAM => dim = Dim::Symbolic(x.string("dimension name")?),
                            _ => {}
                        }
                    }
                    dims.push(dim);
                }
                out.dims = Some(dims);
            }
            _ => {}
        }
    }
    Ok(Some(out))
}

fn node(msg: &[u8], depth: usize) -> Result<Node> {
    let mut n = Node {
        name: String::new(),
        op_type: String::new(),
        domain: String::new(),
        inputs: Vec::new(),
        outputs: Vec::new(),
        implicit: Vec::new(),
        raw: Vec::new(),
    };
    let mut implicit = Vec::new();
    for f in wire::fields(msg) {
        let f = f?;
        match f.number {
            NODE_INPUT => n.inputs.push(f.string("node input")?),
            NODE_OUTPUT => n.outputs.push(f.string("node output")?),
            NODE_NAME => n.name = f.string("node name")?,
            NODE_OP_TYPE => n.op_type = f.string("op_type")?,
            NODE_DOMAIN => n.domain = f.string("node domain")?,
            NODE_ATTRIBUTE => {
                for a in wire::fields(f.bytes("attribute")?) {
                    let a = a?;
                    if a.number == ATTR_GRAPH || a.number == ATTR_GRAPHS {
                        implicit.extend(outer_reads(a.bytes("subgraph")?, depth + 1)?);
                    }
                }
            }
            _ => {}
        }
    }
    if n.op_type.is_empty() {
        return Err(malformed("a node has no operator"));
    }
    implicit.sort();
    implicit.dedup();
    n.implicit = implicit;
    let mut raw = Vec::new();
    wire::put_bytes(&mut raw, GRAPH_NODE, msg);
    n.raw = raw;
    Ok(n)
}

/// The tensors a subgraph reads from the scopes around it.
fn outer_reads(graph: &[u8], depth: usize) -> Result<Vec<String>> {
    if depth > MAX_DEPTH {
        return Err(malformed(format!("subgraphs nest deeper than {MAX_DEPTH}")));
    }
    let mut defined = HashSet::new();
    let mut reads = Vec::new();
    for f in wire::fields(graph) {
        let f = f?;
        match f.number {
            GRAPH_NODE => {
                let n = node(f.bytes("node")?, depth)?;
                reads.extend(n.reads().map(str::to_owned));
                defined.extend(n.outputs);
            }
            GRAPH_INITIALIZER => {
                defined.insert(name_field(
                    f.bytes("initializer")?,
                    TENSOR_NAME,
                    "initializer",
                )?);
            }
            GRAPH_INPUT => {
                defined.insert(name_field(f.bytes("input")?, VALUE_INFO_NAME, "input")?);
            }
            GRAPH_OUTPUT => reads.push(name_field(f.bytes("output")?, VALUE_INFO_NAME, "output")?),
            _ => {}
        }
    }
    Ok(reads
        .into_iter()
        .filter(|r| !r.is_empty() && !defined.contains(r))
        .collect())
}

/// A ValueInfoProto naming `name`, a tensor of element type `elem` and shape `dims`
/// (`None`: a named size), for a part's new inputs and outputs whose type the model
/// never declared.
pub(crate) fn tensor_value_info(name: &str, elem: i32, dims: &[Option<i64>]) -> Vec<u8> {
    let mut shape = Vec::new();
    for (i, d) in dims.iter().enumerate() {
        let mut dim = Vec::new();
        match d {
            Some(v) => wire::put_varint(&mut dim, DIM_VALUE, *v as u64),
            None => wire::put_bytes(&mut dim, DIM_PARAM, format!("{name}_d{i}").as_bytes()),
        }
        wire::put_bytes(&mut shape, SHAPE_DIM, &dim);
    }
    let mut tensor = Vec::new();
    wire::put_varint(&mut tensor, TENSOR_TYPE_ELEM, elem as u64);
    wire::put_bytes(&mut tensor, TENSOR_TYPE_SHAPE, &shape);
    let mut ty = Vec::new();
    wire::put_bytes(&mut ty, TYPE_TENSOR, &tensor);
    let mut vi = Vec::new();
    wire::put_bytes(&mut vi, VALUE_INFO_NAME, name.as_bytes());
    wire::put_bytes(&mut vi, VALUE_INFO_TYPE, &ty);
    vi
}

/// A ValueInfoProto that names `name` and nothing else (the runtime infers its type).
pub(crate) fn named_value_info(name: &str) -> Vec<u8> {
    let mut vi = Vec::new();
    wire::put_bytes(&mut vi, VALUE_INFO_NAME, name.as_bytes());
    vi
}

/// The parts of a graph a writer puts together.
pub(crate) struct GraphParts<'a> {
    pub nodes: Vec<&'a Node>,
    pub initializers: Vec<&'a Initializer>,
    /// ValueInfoProto payloads.
    pub inputs: Vec<Vec<u8>>,
    pub outputs: Vec<Vec<u8>>,
    pub value_info: Vec<Vec<u8>>,
}

impl OnnxModel {
    /// A model file with this model's header (IR version, opsets, functions,
    /// metadata) around a graph of `parts`.
    pub(crate) fn write(&self, parts: &GraphParts<'_>) -> Vec<u8> {
        let mut g = Vec::new();
        wire::put_bytes(&mut g, GRAPH_NAME, self.graph_name.as_bytes());
        for n in &parts.nodes {
            g.extend_from_slice(&n.raw);
        }
        for i in &parts.initializers {
            g.extend_from_slice(&i.raw);
        }
        for (number, list) in [
            (GRAPH_INPUT, &parts.inputs),
            (GRAPH_OUTPUT, &parts.outputs),
            (GRAPH_VALUE_INFO, &parts.value_info),
        ] {
            for v in list {
                wire::put_bytes(&mut g, number, v);
            }
        }
        g.extend_from_slice(&self.graph_rest);
        let mut out = self.model_rest.clone();
        wire::put_bytes(&mut out, MODEL_GRAPH, &g);
        out
    }
}
