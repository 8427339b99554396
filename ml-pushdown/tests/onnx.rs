//! ONNX graph surgery against onnxruntime: at every cut point of models of the graph
//! shapes users bring (a chain, a residual and branching network, a transformer, a
//! model of two inputs, an NHWC model), the head and the tail run one after the other
//! equal the whole model; bad files are refused with a reason.
//!
//! The models are written by `scripts/onnx_test_models.py` (onnx.helper, random
//! weights); onnxruntime's library and the Python come from `scripts/setup-ml.sh`.
//! Each test says so and skips when they are absent; CI runs the script first.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use csd_ml_pushdown::onnx::{Analysis, FloatTensor, OnnxModel, OnnxSession, runtime};

/// The test models' directory, written once per test process.
fn models() -> Option<&'static Path> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let py = csd_ml_pushdown::assets_dir().join("venv/bin/python");
        if !py.is_file() || !runtime::available() {
            eprintln!(
                "SKIPPED: onnxruntime or the ML Python is missing (run scripts/setup-ml.sh): {}",
                runtime::environment().err().map(|e| e.to_string()).unwrap_or_default()
            );
            return None;
        }
        let dir = std::env::temp_dir().join(format!("csd-onnx-models-{}", std::process::id()));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/onnx_test_models.py");
        let out = std::process::Command::new(py)
            .arg(script)
            .arg(&dir)
            .output()
            .expect("python runs");
        assert!(
            out.status.success(),
            "onnx_test_models.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(dir)
    })
    .as_deref()
}

/// Deterministic inputs for `session` with a batch of `batch`.
fn inputs(session: &OnnxSession, batch: i64) -> Vec<FloatTensor> {
    session
        .inputs
        .iter()
        .enumerate()
        .map(|(k, io)| {
            let dims: Vec<i64> = io
                .dims
                .iter()
                .enumerate()
                .map(|(i, d)| if i == 0 { batch } else { *d })
                .collect();
            let n: i64 = dims.iter().product();
            let data = (0..n)
                .map(|i| (((i * 7919 + k as i64 * 31) % 1000) as f32 / 500.0) - 1.0)
                .collect();
            FloatTensor { dims, data }
        })
        .collect()
}

fn max_abs_diff(a: &FloatTensor, b: &FloatTensor) -> f32 {
    assert_eq!(a.dims, b.dims);
    a.data
        .iter()
        .zip(&b.data)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Runs the head, then the tail on what it sent (and nothing else), for every cut.
fn composes_at_every_cut(name: &str, min_cuts: usize) {
    let Some(dir) = models() else { return };
    let bytes = std::fs::read(dir.join(format!("{name}.onnx"))).unwrap();
    let whole = OnnxSession::new(&bytes, 1).unwrap();
    let x = inputs(&whole, 3);
    let want = whole.run(&x).unwrap();
    let a = Analysis::new(&bytes, None).unwrap();
    assert!(
        a.cuts.len() >= min_cuts,
        "{name}: {} cut points, expected at least {min_cuts}: {:?}",
        a.cuts.len(),
        a.cuts.iter().map(|c| &c.point).collect::<Vec<_>>()
    );
    assert_eq!(a.cuts[0].point.at, 0);
    assert_eq!(a.cuts.last().unwrap().point.at, a.model.nodes.len());
    for i in 1..a.cuts.len() {
        let cut = &a.cuts[i];
        let head = OnnxSession::new(&a.head(i).unwrap(), 1)
            .unwrap_or_else(|e| panic!("{name} head {i} ({:?}): {e}", cut.point));
        let names: Vec<&str> = head.outputs.iter().map(|o| o.name.as_str()).collect();
        let sent: Vec<&str> = cut.point.tensors.iter().map(String::as_str).collect();
        assert_eq!(names, sent, "{name} head {i} writes the cut's tensors");
        let feed: Vec<FloatTensor> = head
            .inputs
            .iter()
            .map(|io| {
                let k = whole.inputs.iter().position(|w| w.name == io.name).unwrap();
                x[k].clone()
            })
            .collect();
        let mid = head.run(&feed).unwrap();
        for (t, shape) in mid.iter().zip(&cut.shapes) {
            assert_eq!(t.dims[0], 3, "{name} cut {i}: the batch dimension leads");
            let per: Vec<usize> = t.dims[1..].iter().map(|d| *d as usize).collect();
            assert_eq!(&per, shape, "{name} cut {i}: the analysed per-sample shape");
        }
        let got = match a.tail(i).unwrap() {
            None => {
                assert_eq!(i, a.cuts.len() - 1, "only the last cut has no tail");
                mid
            }
            Some(tail) => {
                let tail = OnnxSession::new(&tail, 1)
                    .unwrap_or_else(|e| panic!("{name} tail {i} ({:?}): {e}", cut.point));
                let tail_inputs: Vec<&str> = tail.inputs.iter().map(|o| o.name.as_str()).collect();
                assert_eq!(tail_inputs, sent, "{name} tail {i} reads only the cut's tensors");
                tail.run(&mid).unwrap()
            }
        };
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            let d = max_abs_diff(g, w);
            assert!(d <= 1e-4, "{name} cut {i} ({:?}): off by {d}", cut.point);
        }
    }
}

#[test]
fn a_chain_composes_at_every_layer() {
    composes_at_every_cut("chain", 8);
}

#[test]
fn an_nhwc_chain_composes() {
    composes_at_every_cut("chain_nhwc", 8);
}

#[test]
fn a_residual_branching_network_composes_at_block_boundaries() {
    composes_at_every_cut("residual", 5);
}

#[test]
fn a_transformer_composes_at_layer_boundaries() {
    composes_at_every_cut("transformer", 4);
}

#[test]
fn a_two_input_model_composes() {
    composes_at_every_cut("two_inputs", 4);
}

/// Inside a residual block the skip connection crosses too: no cut there sends a
/// single tensor, and a cut's tensors are exactly what the rest reads.
#[test]
fn residual_cuts_carry_the_skip_connection() {
    let Some(dir) = models() else { return };
    let bytes = std::fs::read(dir.join("residual.onnx")).unwrap();
    let a = Analysis::new(&bytes, None).unwrap();
    assert!(
        a.cuts
            .iter()
            .any(|c| c.point.tensors.len() == 2),
        "some cut inside a block sends the block's input and its branch: {:?}",
        a.cuts.iter().map(|c| &c.point).collect::<Vec<_>>()
    );
}

#[test]
fn bad_models_are_refused_with_a_reason() {
    let Some(dir) = models() else { return };
    let bytes = std::fs::read(dir.join("chain.onnx")).unwrap();
    for (what, bad, why) in [
        ("empty", vec![], "empty"),
        ("truncated", bytes[..bytes.len() / 2].to_vec(), "truncated"),
        ("not onnx", b"hello, this is no model at all".to_vec(), "malformed"),
    ] {
        let e = OnnxModel::parse(&bad).unwrap_err().to_string();
        assert!(e.contains(why), "{what}: {e}");
        let e = Analysis::new(&bad, None).unwrap_err();
        assert_eq!(
            e.status_code(),
            csd_protocol::StatusCode::InvalidArgument,
            "{what}: {e}"
        );
    }
    // Every byte flipped in turn (a sample of them): refused or still a model, never a
    // panic.
    for i in (0..bytes.len()).step_by(97) {
        let mut b = bytes.clone();
        b[i] ^= 0xff;
        if let Err(e) = Analysis::new(&b, None) {
            assert_eq!(
                e.status_code(),
                csd_protocol::StatusCode::InvalidArgument,
                "byte {i}: {e}"
            );
        }
    }
    // An operator onnxruntime does not have.
    let m = OnnxModel::parse(&bytes).unwrap();
    let op = &m.nodes[1].op_type;
    let pos = bytes
        .windows(op.len())
        .position(|w| w == op.as_bytes())
        .unwrap();
    let mut b = bytes.clone();
    b[pos..pos + op.len()].fill(b'Z');
    let e = Analysis::new(&b, None).unwrap_err().to_string();
    assert!(e.contains("onnxruntime refused"), "{e}");
    // A split that is no tensor.
    let a = Analysis::new(&bytes, None).unwrap();
    let e = a.find("no_such_tensor").unwrap_err().to_string();
    assert!(e.contains("no tensor"), "{e}");
    let e = a.find("999").unwrap_err().to_string();
    assert!(e.contains("out of range"), "{e}");
}
