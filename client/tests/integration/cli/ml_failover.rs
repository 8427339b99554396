//! `csd features` over a dataset put with `--replicas 2`, a node killed (SIGKILL)
//! during the epoch: the same samples and features as an undisturbed epoch.

use std::collections::BTreeMap;

use arrow::array::{Array, AsArray};
use arrow::datatypes::Float32Type;

use super::processes::{on_all, serve_on_drive, spawn_listening_with};
use super::*;

/// The efficientnet weights and the texture images, or `None` (said) when
/// scripts/setup-ml.sh has not run.
fn assets() -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    let home = csd_ml_pushdown::assets_dir();
    let (w, images) = (
        home.join("efficientnet-lite0.safetensors"),
        home.join("textures/train"),
    );
    if w.is_file() && images.is_dir() {
        Some((w, images))
    } else {
        eprintln!("SKIPPED: ML assets missing (run scripts/setup-ml.sh)");
        None
    }
}

/// `s` without its terminal colour codes.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `--out FILE`'s rows: id → (label, features).
fn read_features(path: &Path) -> BTreeMap<u64, (i64, Vec<f32>)> {
    let file = std::fs::File::open(path).unwrap();
    let reader =
        parquet::arrow::arrow_reader::ParquetRecordBatchReader::try_new(file, 1024).unwrap();
    let mut out = BTreeMap::new();
    for b in reader {
        let b = b.unwrap();
        let ids = b.column_by_name("id").unwrap();
        let ids = arrow::compute::cast(ids, &arrow::datatypes::DataType::UInt64).unwrap();
        let labels = b.column_by_name("label").unwrap();
        let labels = arrow::compute::cast(labels, &arrow::datatypes::DataType::Int64).unwrap();
        let features = b.column_by_name("features").unwrap();
        for i in 0..b.num_rows() {
            let row = match features.data_type() {
                arrow::datatypes::DataType::FixedSizeList(..) => {
                    features.as_fixed_size_list().value(i)
                }
                _ => features.as_list::<i32>().value(i),
            };
            let v: Vec<f32> = row.as_primitive::<Float32Type>().values().to_vec();
            let id = ids.as_primitive::<arrow::datatypes::UInt64Type>().value(i);
            let label = labels
                .as_primitive::<arrow::datatypes::Int64Type>()
                .value(i);
            assert!(out.insert(id, (label, v)).is_none(), "sample {id} twice");
        }
    }
    out
}

/// Every sample in both, with the same label and features (to float rounding:
/// the compute tier's batches are cut differently after a failover).
fn assert_same(got: &BTreeMap<u64, (i64, Vec<f32>)>, want: &BTreeMap<u64, (i64, Vec<f32>)>) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (id, (label, f)) in got {
        let (l, w) = &want[id];
        assert_eq!(label, l, "sample {id}");
        assert_eq!(f.len(), w.len(), "sample {id}");
        let scale = w.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
        let worst = f.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            worst <= 1e-3 * scale,
            "sample {id}: off by {worst} (scale {scale})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_mid_epoch_costs_no_sample() {
    let Some((weights, images)) = assets() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let drives = ["a.img", "b.img", "c.img"];
    let on = |name: &str| serve_on_drive(dir.path(), name);
    let mut nodes: Vec<(Kill, String)> = drives.map(on).into();
    let mut urls: Vec<String> = nodes.iter().map(|(_, u)| u.clone()).collect();
    let put = csd(on_all(
        &[
            "put",
            "--table",
            "imgs",
            "--images",
            images.to_str().unwrap(),
            "--partitions",
            "1",
            "--replicas",
            "2",
        ],
        &urls,
    ))
    .await;
    assert!(put.status.success(), "{:?}", text(&put));
    let features = |out: &Path, urls: &[String]| {
        on_all(
            &[
                "features",
                "--dataset",
                "imgs",
                "--weights",
                weights.to_str().unwrap(),
                "--split",
                "2",
                "--batch",
                "8",
                "--out",
                out.to_str().unwrap(),
            ],
            urls,
        )
    };
    let base = dir.path().join("base.parquet");
    let o = csd(features(&base, &urls)).await;
    assert!(o.status.success(), "{:?}", text(&o));
    let want = read_features(&base);
    assert_eq!(want.len(), 72);

    // The one partition (72 samples, node batches of 32) is read from node 0, the
    // first of its copies; node 0 is killed a moment into the epoch, later each
    // try, until it was cut off after samples had passed (then the rest comes from
    // node 1, without them).
    let mut mid_stream = false;
    for (attempt, wait_ms) in [500u64, 900, 1300, 1800, 2500, 3500]
        .into_iter()
        .enumerate()
    {
        let out = dir.path().join(format!("try{attempt}.parquet"));
        let child = Command::new(env!("CARGO_BIN_EXE_csd"))
            .args(features(&out, &urls))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(wait_ms)).await;
        let (mut killed, _) = nodes.remove(0);
        killed.0.kill().unwrap(); // SIGKILL
        let _ = killed.0.wait();
        let o = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
            .await
            .unwrap();
        let (stdout, stderr) = text(&o);
        assert!(o.status.success(), "try {attempt}: {stdout}\n{stderr}");
        assert_same(&read_features(&out), &want);
        let plain = strip_ansi(&stderr);
        let passed = plain
            .lines()
            .filter(|l| l.contains("asking the next copy"))
            .filter_map(|l| {
                l.split("passed=")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .max();
        eprintln!(
            "try {attempt}: node 0 killed after {wait_ms} ms, samples passed before: {passed:?}"
        );
        // Node 0 back on its drive, for the next try.
        let back = on(drives[0]);
        urls[0] = back.1.clone();
        nodes.insert(0, back);
        if passed.is_some_and(|n| n > 0 && n < 72) {
            mid_stream = true;
            break;
        }
    }
    assert!(mid_stream, "no try killed node 0 while it was streaming");

    // Node 0 dead before the epoch starts: its partitions come from their other
    // copies.
    let (mut killed, _) = nodes.remove(0);
    killed.0.kill().unwrap();
    let _ = killed.0.wait();
    let out = dir.path().join("dead.parquet");
    let o = csd(features(&out, &urls)).await;
    assert!(o.status.success(), "{:?}", text(&o));
    assert_same(&read_features(&out), &want);
    // The planner's split (`--split auto`) too: it probes and plans over the copies
    // that answer.
    let auto = dir.path().join("auto.parquet");
    let mut args = features(&auto, &urls);
    let split = args.iter().position(|a| a == "--split").unwrap();
    args[split + 1] = "auto".into();
    let o = csd(args).await;
    assert!(o.status.success(), "{:?}", text(&o));
    assert_same(&read_features(&auto), &want);

    // Node 0 back, busy (admission policy `never`): the partition it hands back
    // runs at its other copy's node, not here; with that node busy too, here.
    let busy = |name: &str| {
        let device = format!("uring:{}", dir.path().join(name).display());
        let (child, url) = spawn_listening_with(
            &[
                "serve",
                "--device",
                &device,
                "--capacity",
                "256MiB",
                "--listen",
                "127.0.0.1:0",
            ],
            &[("CSD_POLICY", "never")],
        );
        (Kill(child), url)
    };
    let mut busy_nodes = vec![busy(drives[0])];
    urls[0] = busy_nodes[0].1.clone();
    for (handed_back, name) in [(0, "busy0.parquet"), (1, "busy1.parquet")] {
        if handed_back == 1 {
            let (mut one, _) = nodes.remove(0);
            one.0.kill().unwrap();
            let _ = one.0.wait();
            busy_nodes.push(busy(drives[1]));
            urls[1] = busy_nodes[1].1.clone();
        }
        let out = dir.path().join(name);
        let o = csd(features(&out, &urls)).await;
        let err = strip_ansi(&text(&o).1);
        assert!(o.status.success(), "{err}");
        let said = format!(" {handed_back} partitions pushed back");
        assert!(err.contains(&said), "{err}");
        assert_same(&read_features(&out), &want);
    }
}
