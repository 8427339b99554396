//! `csd features --model FILE.onnx` as a user runs it, against `csd serve` processes:
//! one whose onnxruntime is missing (refuses with a status naming it, serves on) and
//! one that has it (the user's split, the planner's, and the cut point list).

use super::processes::spawn_listening_with;
use super::*;

/// The test models and a Python that has onnxruntime, or `None` (said) when
/// scripts/setup-ml.sh has not run.
fn onnx_models(dir: &Path) -> Option<std::path::PathBuf> {
    let home = csd_ml_pushdown::assets_dir();
    let py = home.join("venv/bin/python");
    if !py.is_file() || !csd_ml_pushdown::onnx::runtime::available() {
        eprintln!("SKIPPED: onnxruntime or the ML Python is missing (run scripts/setup-ml.sh)");
        return None;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/onnx_test_models.py");
    let out = Command::new(py).arg(script).arg(dir).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(dir.join("chain.onnx"))
}

fn images(dir: &Path) {
    for i in 0..6u32 {
        let class = dir.join(format!("c{}", i % 2));
        std::fs::create_dir_all(&class).unwrap();
        image::RgbImage::from_fn(40, 30, |x, y| {
            image::Rgb([(x * 6) as u8, (y * 8) as u8, (i * 40) as u8])
        })
        .save(class.join(format!("{i}.png")))
        .unwrap();
    }
}

fn serve(env: &[(&str, &str)]) -> (std::process::Child, String) {
    spawn_listening_with(
        &[
            "serve",
            "--device",
            "emulated:mem",
            "--capacity",
            "128MiB",
            "--listen",
            "127.0.0.1:0",
        ],
        env,
    )
}

/// `csd features --dataset imgs --model MODEL --split SPLIT` against `node`.
async fn features_split(node: &str, model: &str, split: &str) -> Output {
    csd(args(
        &[
            "features",
            "--dataset",
            "imgs",
            "--model",
            model,
            "--split",
            split,
        ],
        node,
    ))
    .await
}

fn put(node: &str, dir: &Path) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_csd"))
        .args(args(
            &[
                "put",
                "--table",
                "imgs",
                "--images",
                dir.to_str().unwrap(),
                "--partitions",
                "2",
            ],
            node,
        ))
        .output()
        .unwrap();
    assert!(o.status.success(), "{:?}", text(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_onnxruntime_refuses_onnx_by_name_and_serves_on() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(model) = onnx_models(tmp.path()) else {
        return;
    };
    images(&tmp.path().join("imgs"));
    let missing = tmp.path().join("nowhere/libonnxruntime.so");
    let (mut child, url) = serve(&[("ORT_DYLIB_PATH", missing.to_str().unwrap())]);
    put(&url, &tmp.path().join("imgs"));
    let m = model.to_str().unwrap();
    let o = features_split(&url, m, "3").await;
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("onnxruntime is not installed") && err.contains("nowhere/libonnxruntime.so"),
        "{err}"
    );
    // Without pushdown the node needs no onnxruntime; the rest of the node works.
    let o = features_split(&url, m, "0").await;
    assert!(o.status.success(), "{:?}", text(&o));
    let o = csd(args(&["ls"], &url)).await;
    assert!(text(&o).0.contains("imgs"), "{:?}", text(&o));
    child.kill().unwrap();
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn onnx_features_from_the_cli_split_by_the_user_and_by_the_planner() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(model) = onnx_models(tmp.path()) else {
        return;
    };
    images(&tmp.path().join("imgs"));
    let (mut child, url) = serve(&[]);
    put(&url, &tmp.path().join("imgs"));
    let m = model.to_str().unwrap();
    let o = csd(vec![
        "features".into(),
        "--model".into(),
        m.into(),
        "--list-splits".into(),
        "--dataset".into(),
        "imgs".into(),
    ])
    .await;
    let (list, _) = text(&o);
    assert!(
        o.status.success() && list.contains("the whole model at the node"),
        "{list}"
    );
    let tensor = list
        .lines()
        .nth(3)
        .and_then(|l| l.split_whitespace().nth(3))
        .unwrap()
        .to_string();
    let mut outs = Vec::new();
    for split in ["auto", "2", tensor.as_str(), "none", "full"] {
        let out = tmp.path().join(format!("f-{}.parquet", outs.len()));
        let o = csd(args(
            &[
                "features",
                "--dataset",
                "imgs",
                "--model",
                m,
                "--split",
                split,
                "--mean",
                "0.5,0.5,0.5",
                "--std",
                "0.25,0.25,0.25",
                "--out",
                out.to_str().unwrap(),
            ],
            &url,
        ))
        .await;
        let (_, err) = text(&o);
        assert!(o.status.success(), "--split {split}: {err}");
        assert!(err.contains("6 samples through"), "{err}");
        outs.push(read_features(&out));
    }
    for (i, o) in outs.iter().enumerate().skip(1) {
        assert_eq!(o.len(), 6);
        for (id, f) in o {
            let base = &outs[0][id];
            let err = f
                .iter()
                .zip(base)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err < 1e-4, "run {i}: sample {id} off by {err}");
        }
    }
    // Bad input, plainly refused: weights for an ONNX model, a mean of two values.
    for (extra, why) in [
        (["--weights", m], "leave out --weights"),
        (["--mean", "1,2"], "three values"),
    ] {
        let mut a = vec!["features", "--dataset", "imgs", "--model", m];
        a.extend(extra);
        let o = csd(args(&a, &url)).await;
        assert!(text(&o).1.contains(why), "{:?}", text(&o));
    }
    child.kill().unwrap();
    let _ = child.wait();
}

/// `id → features` of a `csd features --out` file.
fn read_features(path: &Path) -> std::collections::HashMap<u64, Vec<f32>> {
    use arrow::array::{Array, AsArray};
    use arrow::datatypes::{Float32Type, UInt64Type};
    let file = std::fs::File::open(path).unwrap();
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .unwrap()
        .build()
        .unwrap();
    let mut out = std::collections::HashMap::new();
    for b in reader {
        let b = b.unwrap();
        let ids = b
            .column_by_name("id")
            .unwrap()
            .as_primitive::<UInt64Type>()
            .clone();
        let f = b.column_by_name("features").unwrap();
        for i in 0..b.num_rows() {
            let row = match f.data_type() {
                arrow::datatypes::DataType::FixedSizeList(..) => f.as_fixed_size_list().value(i),
                _ => f.as_list::<i32>().value(i),
            };
            let v = row.as_primitive::<Float32Type>().values().to_vec();
            assert_eq!(row.null_count(), 0);
            out.insert(ids.value(i), v);
        }
    }
    out
}
