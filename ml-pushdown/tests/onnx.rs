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
                runtime::environment()
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default()
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
    let a = Analysis::new(&bytes).unwrap();
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
                assert_eq!(
                    tail_inputs, sent,
                    "{name} tail {i} reads only the cut's tensors"
                );
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
    let a = Analysis::new(&bytes).unwrap();
    assert!(
        a.cuts.iter().any(|c| c.point.tensors.len() == 2),
        "some cut inside a block sends the block's input and its branch: {:?}",
        a.cuts.iter().map(|c| &c.point).collect::<Vec<_>>()
    );
}

/// A profile times the stages in a profiled run of the whole model, with no session
/// per stage: its profiling session goes with it, and no session is left idle.
#[test]
fn a_profile_keeps_no_stage_sessions() {
    let Some(dir) = models() else { return };
    let bytes = std::fs::read(dir.join("residual.onnx")).unwrap();
    let m = csd_ml_pushdown::model::OnnxModelStages::load(&bytes, Default::default()).unwrap();
    let png = |i: u8| {
        let mut out = Vec::new();
        image::RgbImage::from_fn(32, 32, |x, y| image::Rgb([x as u8 * 8, y as u8 * 8, i]))
            .write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png)
            .unwrap();
        out
    };
    let imgs: Vec<Vec<u8>> = (0..4).map(png).collect();
    let refs: Vec<&[u8]> = imgs.iter().map(Vec::as_slice).collect();
    let batch = csd_ml_pushdown::dataset::batch(&[0, 1, 2, 3], &[0; 4], &refs).unwrap();
    let p =
        csd_ml_pushdown::features::profile(&m, &[batch], csd_ml_pushdown::request::PROFILE_BATCH)
            .unwrap();
    use csd_ml_pushdown::StagedModel;
    assert_eq!(p.stage_s.len(), m.stages().len());
    assert!(p.stage_s.iter().all(|s| *s >= 0.0));
    assert!(p.stage_s.iter().sum::<f64>() > 0.0, "{:?}", p.stage_s);
    assert_eq!(m.idle_sessions(), 0, "no session stays");
}

/// A batch larger than the profiled one runs in chunks of it, with the same output as
/// one run, in order.
#[test]
fn chunked_runs_equal_one_run() {
    let Some(dir) = models() else { return };
    let bytes = std::fs::read(dir.join("residual.onnx")).unwrap();
    let m = csd_ml_pushdown::model::OnnxModelStages::load(&bytes, Default::default()).unwrap();
    let imgs: Vec<Vec<u8>> = (0..37u8)
        .map(|i| {
            let mut out = Vec::new();
            image::RgbImage::from_fn(32, 32, |x, y| image::Rgb([x as u8 * 7, y as u8 * 5, i * 6]))
                .write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png)
                .unwrap();
            out
        })
        .collect();
    let refs: Vec<&[u8]> = imgs.iter().map(Vec::as_slice).collect();
    let ids: Vec<u64> = (0..refs.len() as u64).collect();
    let batch = csd_ml_pushdown::dataset::batch(&ids, &vec![0; refs.len()], &refs).unwrap();
    let s = csd_ml_pushdown::dataset::Samples::from_batch(&batch).unwrap();
    let x = csd_ml_pushdown::features::inputs(&m, &s).unwrap();
    use csd_ml_pushdown::StagedModel;
    let n = m.stages().len();
    // On one thread: chunks of the profiled batch, the last one short.
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    for (from, to) in [(0, n), (0, 1), (1, n)] {
        let input = m.forward_range(&x, 0, from).unwrap();
        let whole = m.forward_range(&input, from, to).unwrap();
        let chunked = one
            .install(|| csd_ml_pushdown::features::forward_range_chunked(&m, &input, from, to))
            .unwrap();
        assert_eq!(whole.dims(), chunked.dims());
        let diff = (whole - chunked)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 1e-4, "stages {from}..{to}: off by {diff}");
    }
}

#[test]
fn bad_models_are_refused_with_a_reason() {
    let Some(dir) = models() else { return };
    let bytes = std::fs::read(dir.join("chain.onnx")).unwrap();
    for (what, bad, why) in [
        ("empty", vec![], "empty"),
        ("truncated", bytes[..bytes.len() / 2].to_vec(), "truncated"),
        (
            "not onnx",
            b"hello, this is no model at all".to_vec(),
            "malformed",
        ),
    ] {
        let e = OnnxModel::parse(&bad).unwrap_err().to_string();
        assert!(e.contains(why), "{what}: {e}");
        let e = Analysis::new(&bad).unwrap_err();
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
        if let Err(e) = Analysis::new(&b) {
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
    let e = Analysis::new(&b).unwrap_err().to_string();
    assert!(e.contains("onnxruntime refused"), "{e}");
    // A split that is no tensor.
    let a = Analysis::new(&bytes).unwrap();
    let e = a.find("no_such_tensor").unwrap_err().to_string();
    assert!(e.contains("no tensor"), "{e}");
    let e = a.find("999").unwrap_err().to_string();
    assert!(e.contains("out of range"), "{e}");
}

// ---- Features through a node: split ONNX models against Python's onnxruntime ----

mod features {
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};

    use csd_ml_pushdown::dataset::image_folder;
    use csd_ml_pushdown::job::{FeaturesOptions, SplitChoice, features, put_images};
    use csd_ml_pushdown::model::{OnnxModelStages, PixelNorm};
    use csd_ml_pushdown::request::FeatureType;
    use csd_ml_pushdown::stream::KeepFeatures;
    use csd_ml_pushdown::{Arch, StagedModel};
    use csd_runtime::config::{ByteSize, NodeConfig};
    use csd_runtime::node::{self, RunningNode};
    use csd_runtime::node_client::NodeClient;
    use csd_runtime::protocol::Compression;
    use futures::TryStreamExt;

    const NORM: PixelNorm = PixelNorm {
        mean: [0.485, 0.456, 0.406],
        std: [0.229, 0.224, 0.225],
    };

    /// `n` PNGs of `side`² in three class folders: gradients, stripes and noise that
    /// differ per image.
    fn images(dir: &Path, side: u32, n: usize) {
        for i in 0..n {
            let class = dir.join(format!("c{}", i % 3));
            std::fs::create_dir_all(&class).unwrap();
            let img = image::RgbImage::from_fn(side, side, |x, y| {
                let k = i as u32 + 1;
                let noise = (x.wrapping_mul(7919) ^ y.wrapping_mul(104_729) ^ (k * 31)) % 61;
                image::Rgb([
                    ((x * 255 / side + k * 40) % 256) as u8,
                    (((x + y) * k * 3 + noise) % 256) as u8,
                    if (y / (k + 1)).is_multiple_of(2) {
                        200
                    } else {
                        noise as u8 * 3
                    },
                ])
            });
            img.save(class.join(format!("{i}.png"))).unwrap();
        }
    }

    /// Python's onnxruntime on the whole model: features by image path.
    fn reference(model: &Path, dir: &Path) -> HashMap<PathBuf, Vec<f32>> {
        let py = csd_ml_pushdown::assets_dir().join("venv/bin/python");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/onnx_features.py");
        let out = dir.with_extension("json");
        let rgb = |v: [f32; 3]| format!("{},{},{}", v[0], v[1], v[2]);
        let run = std::process::Command::new(py)
            .arg(script)
            .args([model, dir, &out])
            .args([rgb(NORM.mean), rgb(NORM.std)])
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "onnx_features.py: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let found: HashMap<String, Vec<f32>> =
            serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        found.into_iter().map(|(k, v)| (dir.join(k), v)).collect()
    }

    async fn node_with(cpus: usize) -> (RunningNode, NodeClient) {
        node_sized(cpus, ByteSize::gib(1)).await
    }

    /// A node of `cpus` cores and a `memory` budget.
    async fn node_sized(cpus: usize, memory: ByteSize) -> (RunningNode, NodeClient) {
        let node = node::start_with(
            &NodeConfig {
                device: "emulated:mem".into(),
                capacity: ByteSize::mib(512),
                listen: "127.0.0.1:0".into(),
                memory,
                cpus,
                ..NodeConfig::default()
            },
            csd_ml_pushdown::registry(),
        )
        .await
        .expect("start node");
        let client = NodeClient::connect(&node.url).await.unwrap();
        (node, client)
    }

    /// Features of every sample by id, through the nodes at `split`.
    async fn run(
        clients: &[NodeClient],
        model: &[u8],
        split: SplitChoice,
        keep: Option<KeepFeatures>,
    ) -> (usize, HashMap<u64, Vec<f32>>) {
        let (k, _, got) = collect(clients, model, &options(split, keep)).await;
        (k, got)
    }

    fn options(split: SplitChoice, keep: Option<KeepFeatures>) -> FeaturesOptions {
        FeaturesOptions {
            dataset: "imgs".into(),
            arch: Arch::Onnx,
            split,
            train_batch: 5,
            dtype: FeatureType::F32,
            compression: Compression::Lz4Frame,
            pool: None,
            skip_bad_samples: false,
            keep,
            pixels: Some(NORM),
            here: None,
        }
    }

    /// The split run, the partitions run whole here, and every sample's features by id.
    async fn collect(
        clients: &[NodeClient],
        model: &[u8],
        opts: &FeaturesOptions,
    ) -> (usize, Vec<usize>, HashMap<u64, Vec<f32>>) {
        collect_planned(clients, model, opts, false).await
    }

    /// [`collect`], planning (and so probing the link) first when `explain`.
    async fn collect_planned(
        clients: &[NodeClient],
        model: &[u8],
        opts: &FeaturesOptions,
        explain: bool,
    ) -> (usize, Vec<usize>, HashMap<u64, Vec<f32>>) {
        let (stream, r) = features(clients, model, opts, explain).await.unwrap();
        let batches: Vec<_> = stream.try_collect().await.unwrap();
        let mut out = HashMap::new();
        for b in batches {
            let f = b.features.to_vec2::<f32>().unwrap();
            for (id, row) in b.ids.into_iter().zip(f) {
                assert!(out.insert(id, row).is_none(), "sample {id} twice");
            }
        }
        (r.split, r.here, out)
    }

    fn assert_close(
        what: &str,
        got: &HashMap<u64, Vec<f32>>,
        want: &HashMap<PathBuf, Vec<f32>>,
        files: &[(PathBuf, i64)],
        tol: f32,
    ) {
        assert_eq!(got.len(), files.len(), "{what}: every sample once");
        for (id, (path, _)) in files.iter().enumerate() {
            let (g, w) = (&got[&(id as u64)], &want[path]);
            assert_eq!(g.len(), w.len(), "{what}: sample {id}");
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
            let err = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                err <= tol * scale,
                "{what}: sample {id} off by {err} (scale {scale})"
            );
        }
    }

    /// EfficientNet-Lite0 written as ONNX at `path` from its safetensors weights.
    fn effnet_onnx(weights: &Path, path: &Path) -> Vec<u8> {
        let home = csd_ml_pushdown::assets_dir();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/effnet_lite0_onnx.py");
        let out = std::process::Command::new(home.join("venv/bin/python"))
            .arg(script)
            .arg(weights)
            .arg(path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read(path).unwrap()
    }

    /// A stored image dataset: its folder, node, client and files.
    type Dataset = (
        tempfile::TempDir,
        RunningNode,
        NodeClient,
        Vec<(PathBuf, i64)>,
    );

    async fn dataset(side: u32, n: usize) -> Dataset {
        dataset_with(2, side, n).await
    }

    /// `n` images of `side`² in 2 partitions on a node of `cpus` cores.
    async fn dataset_with(cpus: usize, side: u32, n: usize) -> Dataset {
        dataset_on(node_with(cpus).await, side, n).await
    }

    /// `n` images of `side`² in 2 partitions on `node`.
    async fn dataset_on((node, client): (RunningNode, NodeClient), side: u32, n: usize) -> Dataset {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("imgs");
        images(&dir, side, n);
        put_images(
            std::slice::from_ref(&client),
            "imgs",
            &dir,
            None,
            (2, 1),
            1,
            |_| {},
        )
        .await
        .unwrap();
        let files = image_folder(&dir, None).unwrap().samples;
        (tmp, node, client, files)
    }

    /// At every cut point of a small residual network, of the NHWC chain and of a
    /// chain exported with a fixed batch of one: the features equal the unsplit
    /// model's in Python.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn features_at_every_cut_equal_onnxruntime_in_python() {
        let Some(models) = super::models() else {
            return;
        };
        for name in ["residual", "chain_nhwc", "chain_b1"] {
            let path = models.join(format!("{name}.onnx"));
            let bytes = std::fs::read(&path).unwrap();
            let (tmp, _node, client, files) = dataset(32, 9).await;
            let want = reference(&path, &tmp.path().join("imgs"));
            let cuts = OnnxModelStages::load(&bytes, NORM).unwrap().stages().len();
            for k in 0..=cuts {
                let (split, got) = run(
                    std::slice::from_ref(&client),
                    &bytes,
                    SplitChoice::Fixed(k),
                    None,
                )
                .await;
                assert_eq!(split, k);
                assert_close(&format!("{name} split {k}"), &got, &want, &files, 1e-4);
            }
        }
    }

    /// EfficientNet-Lite0 (scripts/effnet_lite0_onnx.py, the ImageNet weights) at three
    /// cut points, one named by its tensor, and with its features kept at the node
    /// across two epochs; the planner's own choice too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn efficientnet_lite0_at_three_cuts_equals_onnxruntime_in_python() {
        let Some(_) = super::models() else { return };
        let home = csd_ml_pushdown::assets_dir();
        let weights = home.join("efficientnet-lite0.safetensors");
        if !weights.is_file() {
            eprintln!("SKIPPED: EfficientNet-Lite0 weights missing (run scripts/setup-ml.sh)");
            return;
        }
        let (tmp, _node, client, files) = dataset(224, 6).await;
        let path = tmp.path().join("effnet.onnx");
        let bytes = effnet_onnx(&weights, &path);
        let want = reference(&path, &tmp.path().join("imgs"));
        let m = OnnxModelStages::load(&bytes, NORM).unwrap();
        let n = m.stages().len();
        let named = m.analysis().cuts[n / 2].point.tensors[0].clone();
        let clients = std::slice::from_ref(&client);
        for split in [
            SplitChoice::Fixed(1),
            SplitChoice::Tensor(named.clone()),
            SplitChoice::Fixed(n - 1),
        ] {
            let (k, got) = run(clients, &bytes, split.clone(), None).await;
            assert_close(
                &format!("effnet {split:?} (split {k})"),
                &got,
                &want,
                &files,
                1e-3,
            );
        }
        // A share: one of the two partitions read raw and run whole here, the other
        // to split n/2 at the node.
        let mut shared = options(SplitChoice::Fixed(n / 2), None);
        shared.here = Some(1);
        let (k, here, got) = collect(clients, &bytes, &shared).await;
        assert_eq!((k, here.len()), (n / 2, 1));
        assert_close(
            "effnet split n/2, one partition here",
            &got,
            &want,
            &files,
            1e-3,
        );
        // Planned first: the link probe read the partition run here, and the stream
        // starts from those rows instead of reading them again.
        let (k, here, got) = collect_planned(clients, &bytes, &shared, true).await;
        assert_eq!((k, here.len()), (n / 2, 1));
        assert_close(
            "effnet split n/2, one partition here, planned",
            &got,
            &want,
            &files,
            1e-3,
        );
        // A split given: the node was sent the head only, named by its content.
        let head = m.analysis().head(1).unwrap();
        assert!(
            head.len() < bytes.len() / 10,
            "{} of {}",
            head.len(),
            bytes.len()
        );
        client
            .table(&csd_ml_pushdown::weights::table_name(&head))
            .await
            .expect("the node holds split 1's head");
        let keep = KeepFeatures::new(std::time::Duration::from_secs(60));
        for epoch in 0..2 {
            let (_, got) = run(
                clients,
                &bytes,
                SplitChoice::Fixed(n / 2),
                Some(keep.clone()),
            )
            .await;
            assert_close(
                &format!("effnet kept, epoch {epoch}"),
                &got,
                &want,
                &files,
                1e-3,
            );
        }
        assert_eq!(keep.references().len(), 2, "one kept result per partition");
        keep.release().await.unwrap();
        let (k, got) = run(clients, &bytes, SplitChoice::Auto, None).await;
        assert!(k <= n);
        assert_close(
            &format!("effnet auto (split {k})"),
            &got,
            &want,
            &files,
            1e-3,
        );
    }

    /// A node whose memory budget is too small for the model's batch of one: a
    /// request estimated before the model was loaded there reserves half the budget
    /// (the ceiling); once admitted and the model loaded, its plan needs more, so
    /// the node hands it back and the compute tier runs it, with the same features
    /// as a node with room computes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_plan_over_the_ceiling_is_handed_back_and_run_here() {
        let Some(models) = super::models() else {
            return;
        };
        let bytes = std::fs::read(models.join("chain.onnx")).unwrap();
        let (_tmp, _node, roomy, files) = dataset(32, 6).await;
        let (_, _, want) = collect(
            std::slice::from_ref(&roomy),
            &bytes,
            &options(SplitChoice::Fixed(1), None),
        )
        .await;
        assert_eq!(want.len(), files.len());
        // Two decode threads' reserve alone (2 x 32 MiB + 8 MiB) is more than half of
        // 128 MiB.
        let (_tmp2, _small, small, _) =
            dataset_on(node_sized(2, ByteSize::mib(128)).await, 32, 6).await;
        let opts = options(SplitChoice::Fixed(1), None);
        let (stream, run) = features(std::slice::from_ref(&small), &bytes, &opts, false)
            .await
            .unwrap();
        let batches: Vec<_> = stream.try_collect().await.unwrap();
        // The first request's estimate came before any open, so before the model
        // was loaded: at least it is handed back (a later one may find the model
        // loaded, its plan known and within the budget, and run at the node).
        assert!(
            run.stats
                .pushed_back
                .load(std::sync::atomic::Ordering::Relaxed)
                >= 1,
            "no partition handed back"
        );
        let mut got = HashMap::new();
        for b in batches {
            for (id, row) in b.ids.into_iter().zip(b.features.to_vec2::<f32>().unwrap()) {
                assert!(got.insert(id, row).is_none(), "sample {id} twice");
            }
        }
        assert_eq!(got.len(), want.len(), "every sample once");
        for (id, w) in &want {
            let g = &got[id];
            let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
            let err = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                err <= 1e-4 * scale,
                "sample {id} off by {err} (scale {scale})"
            );
        }
    }

    /// What the node refuses, with the node still serving afterwards.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_onnx_requests_are_refused_and_the_node_serves_on() {
        let Some(models) = super::models() else {
            return;
        };
        let (_tmp, _node, client, files) = dataset(32, 3).await;
        let clients = std::slice::from_ref(&client);
        let opts = |split| FeaturesOptions {
            dataset: "imgs".into(),
            arch: Arch::Onnx,
            split,
            train_batch: 5,
            dtype: FeatureType::F32,
            compression: Compression::None,
            pool: None,
            skip_bad_samples: false,
            keep: None,
            pixels: None,
            here: None,
        };
        let refused = |e: csd_ml_pushdown::Error| {
            assert_eq!(
                e.status_code(),
                csd_protocol::StatusCode::InvalidArgument,
                "{e}"
            );
            e.to_string()
        };
        for (model, split, why) in [
            ("transformer", SplitChoice::Fixed(1), "RGB images"),
            ("two_inputs", SplitChoice::Fixed(1), "2 inputs"),
            ("chain", SplitChoice::Tensor("no_such".into()), "no tensor"),
            ("chain", SplitChoice::Fixed(99), "past the last cut point"),
        ] {
            let bytes = std::fs::read(models.join(format!("{model}.onnx"))).unwrap();
            let e = match features(clients, &bytes, &opts(split), false).await {
                Ok(_) => panic!("{model}: accepted"),
                Err(e) => refused(e),
            };
            assert!(e.contains(why), "{model}: {e}");
        }
        let chain = std::fs::read(models.join("chain.onnx")).unwrap();
        let mut o = opts(SplitChoice::Fixed(1));
        o.here = Some(3);
        let e = match features(clients, &chain, &o, false).await {
            Ok(_) => panic!("--here 3 of 2 partitions accepted"),
            Err(e) => refused(e),
        };
        assert!(e.contains("has 2 partitions"), "{e}");
        let e = match features(clients, b"not a model", &opts(SplitChoice::Fixed(1)), false).await {
            Ok(_) => panic!("garbage accepted"),
            Err(e) => refused(e),
        };
        assert!(e.contains("malformed"), "{e}");
        // The node itself refuses a stored file that is no model, by name.
        let junk = csd_ml_pushdown::weights::ensure(&client, b"junk bytes, no model")
            .await
            .unwrap();
        let req = csd_ml_pushdown::request::FeatureRequest {
            dataset: "imgs".into(),
            partition: "0".into(),
            model: Arch::Onnx,
            weights: junk,
            split: 1,
            dtype: FeatureType::F32,
            max_batch: None,
            limit: None,
            mode: Default::default(),
            skip_bad_samples: false,
            pixels: None,
        };
        let e = client
            .operator("ml", req.encode(), Compression::None)
            .await
            .err()
            .expect("refused");
        assert_eq!(e.code(), Some(tonic::Code::InvalidArgument), "{e}");
        assert!(e.to_string().contains("malformed"), "{e}");
        let bytes = std::fs::read(models.join("chain.onnx")).unwrap();
        let (_, got) = run(clients, &bytes, SplitChoice::Fixed(3), None).await;
        assert_eq!(got.len(), files.len(), "the node still serves");
    }

    /// A node with one core keeps serving other requests while its ML operator runs
    /// a model: each batch runs off the node's async workers (one, with one core).
    /// Raw reads of another partition, one after another while a stream of model
    /// batches is read: several answer before the stream ends, none waits for half
    /// of it. (Before: the first read was answered after the stream's last batch.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_one_core_node_answers_raw_reads_while_a_model_runs() {
        let weights = csd_ml_pushdown::assets_dir().join("efficientnet-lite0.safetensors");
        if !weights.is_file() {
            eprintln!("SKIPPED: EfficientNet-Lite0 weights missing (run scripts/setup-ml.sh)");
            return;
        }
        let (tmp, _node, client, _) = dataset_with(1, 224, 96).await;
        let bytes = effnet_onnx(&weights, &tmp.path().join("effnet.onnx"));
        let table = csd_ml_pushdown::weights::ensure(&client, &bytes)
            .await
            .unwrap();
        let split = OnnxModelStages::load(&bytes, NORM).unwrap().stages().len();
        let req = csd_ml_pushdown::request::FeatureRequest {
            dataset: "imgs".into(),
            partition: "0".into(),
            model: Arch::Onnx,
            weights: table,
            split,
            dtype: FeatureType::F32,
            max_batch: Some(8),
            limit: None,
            mode: csd_ml_pushdown::request::Mode::Features,
            skip_bad_samples: false,
            pixels: Some(NORM),
        };
        let name = csd_ml_pushdown::request::OPERATOR_NAME;
        // Once first, so the node holds the model and its session.
        let reply = client
            .operator(name, req.encode(), Compression::None)
            .await
            .unwrap();
        let _: Vec<_> = reply.batches.try_collect().await.unwrap();
        let t0 = std::time::Instant::now();
        let ml = tokio::spawn({
            let (c, args) = (client.clone(), req.encode());
            async move {
                let reply = c.operator(name, args, Compression::None).await.unwrap();
                let batches: Vec<_> = reply.batches.try_collect().await.unwrap();
                (batches.len(), t0.elapsed())
            }
        });
        let (mut worst, mut reads) = (std::time::Duration::ZERO, 0);
        while !ml.is_finished() {
            let t = std::time::Instant::now();
            let rows: Vec<_> = client
                .scan_limit("imgs", Some("1"), &[], Some(1))
                .await
                .unwrap()
                .try_collect()
                .await
                .unwrap();
            assert!(!rows.is_empty());
            if !ml.is_finished() {
                worst = worst.max(t.elapsed());
                reads += 1;
            }
        }
        let (batches, took) = ml.await.unwrap();
        assert_eq!(batches, 6, "48 samples in batches of 8");
        assert!(
            reads >= 3,
            "{reads} raw reads answered in the {took:?} of the stream"
        );
        assert!(
            worst < took / 2,
            "a raw read waited {worst:?} of the stream's {took:?}"
        );
    }
}
