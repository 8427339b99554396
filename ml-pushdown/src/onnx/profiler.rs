//! How long each stage of an ONNX model takes, from one run of the whole model under
//! onnxruntime's own profiler — instead of one session per stage.
//!
//! Timing stages one by one costs a session per stage (EfficientNet-Lite0 as a
//! user's file has 93 cut points, ResNet-50 121), each created, optimised and run
//! alone; and a stage alone is not what it is inside the fused whole. The profiler
//! reports every kernel the optimised whole ran, in execution order, and each is
//! charged to a node of the file, hence to the stage holding that node:
//!
//! - onnxruntime names a kernel after the node it came from or, when it fused
//!   several, after the fused group's output (`relu6_6`, `conv_11`), with suffixes of
//!   its own (`_nchwc`, `_token_3`); the longest node name or output name the kernel's
//!   name starts with (at a `_` or its end) identifies the node;
//! - a fused group is charged to the first node of the file not yet charged before
//!   it (a convolution fused with the activation after it is the convolution's cost:
//!   a split between them runs the convolution at the node);
//! - a kernel of onnxruntime's own (layout reorders, copies) is charged with the
//!   kernel before it.
//!
//! Execution order is topological and a cut separates the graph, so every kernel of
//! a stage runs after every kernel of the stages before it: the charge never moves
//! time across a cut but for a group fused across one.

use std::collections::HashMap;

use super::graph::OnnxModel;
use super::runtime::{FloatTensor, OnnxSession};
use crate::{Error, Result};

/// One run of a model under onnxruntime's profiler.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ProfiledRun {
    /// Its kernels, in the order they ran.
    pub kernels: Vec<Kernel>,
    /// Its seconds, as the caller waited for it.
    pub secs: f64,
}

/// The last of `runs` runs of `model` on `inputs`: its seconds, and each kernel's as
/// onnxruntime's profiler reports them, in the order they ran (one intra-op thread,
/// as every session). The runs before it are untimed: the first grows onnxruntime's
/// memory arena to the batch, which an epoch pays once.
pub(crate) fn profiled_run(
    model: &[u8],
    inputs: &[FloatTensor],
    runs: usize,
) -> Result<ProfiledRun> {
    let prefix = std::env::temp_dir().join(format!(
        "csd-ort-profile-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let session = OnnxSession::profiling(model, &prefix)?;
    let mut secs = 0.0;
    let ran = (0..runs.max(1)).try_for_each(|_| {
        let t = std::time::Instant::now();
        session.run(inputs)?;
        secs = t.elapsed().as_secs_f64();
        Ok::<_, Error>(())
    });
    let ended = session.end_profiling()?;
    // A relative name is relative to this process's working directory.
    let trace = std::fs::read(&ended);
    let _ = std::fs::remove_file(&ended);
    ran?;
    let trace = trace.map_err(|e| {
        Error::Node(csd_protocol::Error::Internal(format!(
            "onnxruntime's profile {ended}: {e}"
        )))
    })?;
    Ok(ProfiledRun {
        kernels: last_run(&trace)?,
        secs,
    })
}

/// One kernel run: the name onnxruntime gave it and its seconds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Kernel {
    pub name: String,
    pub secs: f64,
}

/// The kernels of the last run recorded in a profile (onnxruntime's JSON trace: an
/// array of events; `Session`'s `model_run` spans a run, `Node`'s
/// `…_kernel_time` a kernel), in the order they ran.
pub(crate) fn last_run(trace: &[u8]) -> Result<Vec<Kernel>> {
    #[derive(serde::Deserialize)]
    struct Event {
        #[serde(default)]
        cat: String,
        #[serde(default)]
        name: String,
        #[serde(default)]
        ts: f64,
        #[serde(default)]
        dur: f64,
    }
    let events: Vec<Event> = serde_json::from_slice(trace).map_err(|e| {
        Error::Node(csd_protocol::Error::Internal(format!(
            "onnxruntime's profile could not be read: {e}"
        )))
    })?;
    let run = events
        .iter()
        .filter(|e| e.cat == "Session" && e.name == "model_run")
        .max_by(|a, b| a.ts.total_cmp(&b.ts))
        .ok_or_else(|| {
            Error::Node(csd_protocol::Error::Internal(
                "onnxruntime's profile holds no run".into(),
            ))
        })?;
    let (from, to) = (run.ts, run.ts + run.dur);
    let mut kernels: Vec<(f64, Kernel)> = events
        .iter()
        .filter(|e| e.cat == "Node" && e.ts >= from && e.ts <= to)
        .filter_map(|e| {
            let name = e.name.strip_suffix("_kernel_time")?;
            Some((
                e.ts,
                Kernel {
                    name: name.to_string(),
                    secs: e.dur / 1e6,
                },
            ))
        })
        .collect();
    kernels.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(kernels.into_iter().map(|(_, k)| k).collect())
}

/// Seconds of each stage (stage `s` holds nodes `[ats[s], ats[s + 1])` of `m`;
/// `ats` ascending, from a cut's `at`), charging `kernels` as the module says.
pub(crate) fn charge(m: &OnnxModel, ats: &[usize], kernels: &[Kernel]) -> Vec<f64> {
    let mut named: HashMap<&str, usize> = HashMap::new();
    for (i, n) in m.nodes.iter().enumerate() {
        for o in n.outputs.iter().filter(|o| !o.is_empty()) {
            named.entry(o.as_str()).or_insert(i);
        }
        if !n.name.is_empty() {
            named.entry(n.name.as_str()).or_insert(i);
        }
    }
    let stages = ats.len().saturating_sub(1);
    let mut secs = vec![0f64; stages];
    // The first node not yet charged, and the node the last kernel was charged to.
    let mut next = 0usize;
    let mut last: Option<usize> = None;
    for k in kernels {
        let node = match node_of(&named, &k.name) {
            Some(j) if j >= next => {
                let first = next;
                next = j + 1;
                Some(first)
            }
            Some(j) => Some(j),
            None => last.or(Some(next)),
        };
        last = node;
        let Some(node) = node else { continue };
        // The stage holding `node`: the last whose first node is at or before it.
        let s = ats[1..]
            .partition_point(|&at| at <= node)
            .min(stages.max(1) - 1);
        if let Some(slot) = secs.get_mut(s) {
            *slot += k.secs;
        }
    }
    secs
}

/// The node whose name or output `kernel` is named after: the longest such name it
/// starts with, ending at a `_` of it or at its end.
fn node_of(named: &HashMap<&str, usize>, kernel: &str) -> Option<usize> {
    let mut end = kernel.len();
    loop {
        if let Some(&i) = named.get(&kernel[..end]) {
            return Some(i);
        }
        end = kernel[..end].rfind('_')?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(name: &str, secs: f64) -> Kernel {
        Kernel {
            name: name.into(),
            secs,
        }
    }

    #[test]
    fn the_last_run_is_read_in_the_order_it_ran() {
        let trace = br#"[
          {"cat":"Session","name":"session_initialization","ts":0,"dur":50},
          {"cat":"Node","name":"a_kernel_time","ts":100,"dur":10},
          {"cat":"Session","name":"model_run","ts":95,"dur":30},
          {"cat":"Node","name":"b_fence_before","ts":200,"dur":0},
          {"cat":"Node","name":"c_kernel_time","ts":230,"dur":7},
          {"cat":"Node","name":"b_kernel_time","ts":210,"dur":20},
          {"cat":"Session","name":"model_run","ts":205,"dur":40}
        ]"#;
        assert_eq!(
            last_run(trace).unwrap(),
            vec![kernel("b", 20e-6), kernel("c", 7e-6)]
        );
        assert!(last_run(b"[]").is_err());
        assert!(last_run(b"{ not json").is_err());
    }

    /// Two convolutions each followed by a ReLU6, then a pool: nodes conv 0, clip 1,
    /// conv 2, clip 3, pool 4, flatten 5.
    fn two_convs() -> (Vec<u8>, OnnxModel) {
        use crate::onnx::write::GraphWriter;
        let mut g = GraphWriter::default();
        let w = [0.5f32; 9];
        let c = g.conv("x", (&[1, 1, 3, 3], &w), &[0.0], 1, 1, Some("conv_a"));
        let r = g.relu6(&c, None);
        let c = g.conv(&r, (&[1, 1, 3, 3], &w), &[0.0], 1, 1, Some("conv_b"));
        let r = g.relu6(&c, None);
        let y = g.global_pool(&r, Some("y"));
        let bytes = g.finish("x", &[1, 256, 256], &y, &[1]);
        let m = OnnxModel::parse(&bytes).unwrap();
        (bytes, m)
    }

    #[test]
    fn fused_kernels_are_charged_to_their_first_node_and_own_kernels_ride_along() {
        let (_, m) = two_convs();
        let ops: Vec<&str> = m.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(
            ops,
            [
                "Conv",
                "Clip",
                "Conv",
                "Clip",
                "GlobalAveragePool",
                "Flatten"
            ]
        );
        let out = |i: usize| m.nodes[i].outputs[0].clone();
        // What onnxruntime runs: each convolution fused with its clip and named
        // after the clip's output, a layout reorder of its own, the pool, and the
        // flatten under its node's name.
        let kernels = [
            kernel(&format!("{}_nchwc", out(1)), 4.0),
            kernel("ReorderOutput", 0.5),
            kernel(&format!("{}_nchwc", out(3)), 2.0),
            kernel(&out(4), 0.25),
            kernel(&m.nodes[5].name, 0.125),
        ];
        // Stages: [conv a], [clip a], [conv b, clip b], [pool, flatten].
        assert_eq!(
            charge(&m, &[0, 1, 2, 4, 6], &kernels),
            vec![4.5, 0.0, 2.0, 0.375]
        );
        // One stage for the whole model: everything.
        assert_eq!(charge(&m, &[0, 6], &kernels), vec![6.875]);
        // A kernel named after nothing the file has, first: the first node's.
        assert_eq!(
            charge(&m, &[0, 1, 6], &[kernel("MemcpyToHost", 1.0)]),
            vec![1.0, 0.0]
        );
    }

    /// The real profiler on a real run: every stage that computes gets time, and the
    /// stages add up to every kernel of the run.
    #[test]
    fn a_profiled_run_charges_every_kernel_to_a_stage() -> Result<()> {
        if !crate::onnx::runtime::available() {
            eprintln!("onnxruntime is not installed: skipped (scripts/setup-ml.sh)");
            return Ok(());
        }
        let (bytes, m) = two_convs();
        let x = FloatTensor {
            dims: vec![2, 1, 256, 256],
            data: (0..2 * 256 * 256).map(|i| (i % 7) as f32).collect(),
        };
        let run = profiled_run(&bytes, &[x], 2)?;
        let kernels = run.kernels;
        assert!(!kernels.is_empty());
        let total: f64 = kernels.iter().map(|k| k.secs).sum();
        let stages = charge(&m, &[0, 2, 6], &kernels);
        assert!(
            stages.iter().all(|s| *s > 0.0),
            "{stages:?} from {kernels:?}"
        );
        assert!((stages.iter().sum::<f64>() - total).abs() < 1e-9);
        assert!(
            run.secs >= total,
            "the run ({} s) spans its kernels ({total} s)",
            run.secs
        );
        Ok(())
    }
}
