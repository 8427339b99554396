//! The Python package as a user runs it, against real `csd serve` processes: the
//! extension `cargo test --workspace` built (`deps/lib_native.so` by the `csd` binary)
//! laid out as the package (`csd/*.py` + `csd/_native.abi3.so`) in a temporary folder;
//! two nodes holding TPC-H SF 0.01; then pytest (`client/python/tests/test_*.py`)
//! with the tests' Python (scripts/setup-ml.sh: pyarrow, pandas, polars, numpy,
//! pytest). Without that Python it says so and passes, unless `CSD_REQUIRE_PYTHON` is
//! set. With `CSD_PYTHON=PATH` the tests run on that interpreter's own installed
//! package instead (e.g. a venv after `pip install ./client/python`): nothing is
//! laid out.

#![allow(clippy::unwrap_used)]

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The folder cargo put this test's binaries in (`…/debug`).
fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

/// `CSD_PYTHON`: an interpreter whose installed package the tests run on.
fn installed() -> Option<PathBuf> {
    std::env::var_os("CSD_PYTHON").map(PathBuf::from)
}

/// The tests' Python, or `None` (said) where it is not installed.
fn python() -> Option<PathBuf> {
    let py = installed().unwrap_or_else(|| csd_ml_pushdown::assets_dir().join("venv/bin/python"));
    let ok = py.is_file()
        && Command::new(&py)
            .args(["-c", "import pyarrow, numpy, pytest, pandas"])
            .status()
            .is_ok_and(|s| s.success());
    if ok {
        return Some(py);
    }
    let why = format!(
        "no Python with pyarrow, numpy, pandas and pytest at {} (run scripts/setup-ml.sh)",
        py.display()
    );
    assert!(std::env::var_os("CSD_REQUIRE_PYTHON").is_none(), "{why}");
    eprintln!("skipping the Python package's tests: {why}");
    None
}

struct Node(Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `csd serve` on an emulated device; its URL.
fn serve(csd: &Path, extra: &[&str]) -> (Node, String) {
    let mut child = Command::new(csd)
        .args([
            "serve",
            "--device",
            "emulated:mem",
            "--capacity",
            "512MiB",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", csd.display()));
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("grpc://"))
        .unwrap_or_else(|| panic!("the node said: {line}"))
        .to_string();
    (Node(child), url)
}

/// `n` PNGs of 48² in three class folders, each image different.
fn images(dir: &Path, n: u32) {
    for i in 0..n {
        let class = dir.join(format!("c{}", i % 3));
        std::fs::create_dir_all(&class).unwrap();
        image::RgbImage::from_fn(48, 48, |x, y| {
            let noise = (x.wrapping_mul(7919) ^ y.wrapping_mul(104_729) ^ (i * 31)) % 61;
            image::Rgb([
                ((x * 5 + i * 40) % 256) as u8,
                (((x + y) * (i + 1) * 3 + noise) % 256) as u8,
                ((noise * 3 + (i % 3) * 60) % 256) as u8,
            ])
        })
        .save(class.join(format!("{i}.png")))
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_package_against_two_nodes() {
    let Some(py) = python() else { return };
    let dir = build_dir();
    // `cargo test` leaves the extension in deps/, `cargo build` beside it: the newer.
    let native = [dir.join("deps/lib_native.so"), dir.join("lib_native.so")]
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
        .unwrap_or_else(|| dir.join("lib_native.so"));
    let csd = dir.join("csd");
    for (p, build) in [(&csd, "csd-client"), (&native, "csd-python")] {
        assert!(
            p.is_file(),
            "{} is not built (cargo build -p {build}, or cargo test --workspace)",
            p.display()
        );
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The package as pip would install it (unless the interpreter has its own).
    if installed().is_none() {
        let pkg = tmp.path().join("site/csd");
        std::fs::create_dir_all(&pkg).unwrap();
        for e in std::fs::read_dir(src.join("python/csd")).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), pkg.join(e.file_name())).unwrap();
        }
        std::fs::copy(&native, pkg.join("_native.abi3.so")).unwrap();
    }
    // Two nodes with TPC-H SF 0.01, two partitions each; a folder of images.
    let (a, url_a) = serve(&csd, &[]);
    let (b, url_b) = serve(&csd, &[]);
    let clients = vec![
        csd_runtime::node_client::NodeClient::connect(&url_a)
            .await
            .unwrap(),
        csd_runtime::node_client::NodeClient::connect(&url_b)
            .await
            .unwrap(),
    ];
    csd_testbed::tpch::load(&clients, 0.01, 2, |_, _| {})
        .await
        .unwrap();
    let queries = tmp.path().join("tpch");
    std::fs::create_dir_all(&queries).unwrap();
    for q in 1..=22 {
        let text = csd_testbed::tpch::query(q).unwrap();
        std::fs::write(queries.join(format!("q{q}.sql")), text).unwrap();
    }
    images(&tmp.path().join("imgs"), 12);
    let out = Command::new(&py)
        .args([
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            "--durations=5",
        ])
        .arg(src.join("tests"))
        // e.g. `-k features` while working on them
        .args(
            std::env::var("CSD_PYTEST_ARGS")
                .unwrap_or_default()
                .split_whitespace(),
        )
        .env("PYTHONPATH", tmp.path().join("site"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("CSD_BIN", &csd)
        .env("CSD_NODES", format!("{url_a},{url_b}"))
        .env("CSD_TPCH_QUERIES", &queries)
        .env("CSD_IMAGES", tmp.path().join("imgs"))
        .env("CSD_WORK", tmp.path())
        .env("CSD_EXAMPLES", dir.join("examples"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "pytest failed:\n{text}");
    assert!(text.contains(" passed"), "{text}");
    drop((a, b));
}
