//! all-MiniLM-L6-v2 as csd runs it (each text on its own token count; its encoder
//! layers on onnxruntime by default, or on csd's own kernels with
//! `CSD_ML_KERNELS=csd`) against onnxruntime in Python on the same weights and core
//! (the model written as ONNX by `scripts/minilm_onnx.py`; batches padded to their
//! longest text, as Hugging Face pipelines run them, and one text per run).
//! Tokenising is inside every rate. Rounds alternate which side goes first; ratios
//! are the median of the rounds'.
//!
//! Needs `scripts/setup-ml.sh` (MiniLM's weights and tokenizer, onnxruntime, onnx,
//! tokenizers).
//!
//! `cargo run --release -p csd-benches --bin minilm -- [--cores 1] [--batch 16] [--repeat 4]`

use std::path::PathBuf;
use std::time::Instant;

use candle_core::Device;
use clap::Parser;
use csd_benches::{RateOpts, default_json_path, median, repo_root, write_json};
use csd_ml_pushdown::model::{Arch, Kernels, StagedModel};
use csd_runtime::pool::{available_cores, parse_core_list};
use serde::Serialize;

/// MiniLM as csd runs it against onnxruntime in Python, on the same weights and cores.
#[derive(Parser)]
struct Args {
    #[command(flatten)]
    rate: RateOpts,
    /// Rounds (each side once per round).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Texts: the tests' 25 sentences (9 to 36 tokens), each this many times, in
    /// that order.
    #[arg(long, default_value_t = 4)]
    repeat: usize,
    /// JSON output path.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Out {
    cores: Vec<usize>,
    batch: usize,
    texts: usize,
    onnxruntime: String,
    /// Each round's texts/s: onnxruntime in Python (padded batches), csd (on
    /// onnxruntime), onnxruntime one text per run, csd's kernels.
    rounds: Vec<(f64, f64, f64, f64)>,
    ort_texts_per_s: f64,
    ort_one_at_a_time_texts_per_s: f64,
    csd_texts_per_s: f64,
    csd_vs_ort: f64,
    kernels_texts_per_s: f64,
    kernels_vs_ort: f64,
    max_abs_err_vs_ort: f64,
}

fn die(msg: impl std::fmt::Display) -> ! {
    eprintln!("minilm bench: {msg}");
    std::process::exit(1)
}

fn main() {
    let args = Args::parse();
    let home = args
        .rate
        .home
        .clone()
        .unwrap_or_else(csd_ml_pushdown::assets_dir);
    let (wpath, tpath) = (
        home.join("minilm-l6/model.safetensors"),
        home.join("minilm-l6/tokenizer.json"),
    );
    let read = |p: &PathBuf| {
        std::fs::read(p)
            .unwrap_or_else(|e| die(format!("{}: {e} (run scripts/setup-ml.sh)", p.display())))
    };
    let weights = csd_ml_pushdown::weights::with_tokenizer(&read(&wpath), &read(&tpath))
        .unwrap_or_else(|e| die(e));
    let cores = match &args.rate.cores {
        Some(c) => parse_core_list(c).unwrap_or_else(|e| die(e)),
        None => vec![*available_cores().last().unwrap_or(&0)],
    };
    let py = home.join("venv/bin/python");
    let dir = tempfile::tempdir().unwrap_or_else(|e| die(e));
    let onnx = dir.path().join("minilm.onnx");
    let st = std::process::Command::new(&py)
        .arg(repo_root().join("scripts/minilm_onnx.py"))
        .arg(&wpath)
        .arg(&onnx)
        .status()
        .unwrap_or_else(|e| die(format!("{}: {e}", py.display())));
    if !st.success() {
        die("writing the ONNX model failed; run scripts/setup-ml.sh (installs onnx)");
    }
    let csv = repo_root().join("ml-pushdown/tests/data/sentences.csv");
    let sentences = csd_ml_pushdown::dataset::text_file(&csv, "text", "topic")
        .unwrap_or_else(|e| die(e))
        .texts;
    let texts: Vec<String> = (0..args.repeat.max(1))
        .flat_map(|_| sentences.iter().cloned())
        .collect();
    let tfile = dir.path().join("texts.json");
    std::fs::write(&tfile, serde_json::to_vec(&texts).unwrap_or_default())
        .unwrap_or_else(|e| die(e));

    let load = |k| {
        Arch::MiniLmL6
            .load_with(&weights, &Device::Cpu, k)
            .unwrap_or_else(|e| die(e))
    };
    let (model, kernels) = (load(Kernels::Onnxruntime), load(Kernels::Csd));
    if model.engine() != "onnxruntime" {
        die("onnxruntime did not load (run scripts/setup-ml.sh)");
    }
    let n = model.stages().len();
    let pool =
        csd_ml_pushdown::thread_pool("bench", cores.len(), Some(&cores)).unwrap_or_else(|e| die(e));
    let batches: Vec<Vec<&[u8]>> = texts
        .chunks(args.rate.batch.max(1))
        .map(|c| c.iter().map(|t| t.as_bytes()).collect())
        .collect();
    let embed = |model: &dyn StagedModel, b: &[&[u8]]| -> candle_core::Tensor {
        let x = model.prepare(b).unwrap_or_else(|e| die(e));
        model.forward_range(&x, 0, n).unwrap_or_else(|e| die(e))
    };
    let first = pool.install(|| embed(model.as_ref(), &batches[0]));
    let run_csd = |model: &dyn StagedModel| {
        pool.install(|| {
            for b in &batches {
                embed(model, b);
            }
            let (t, mut done, mut i) = (Instant::now(), 0usize, 0usize);
            while t.elapsed().as_secs_f64() < args.rate.seconds {
                let b = &batches[i % batches.len()];
                embed(model, b);
                done += b.len();
                i += 1;
            }
            done as f64 / t.elapsed().as_secs_f64()
        })
    };
    let run_ort = || {
        args.rate
            .baseline(&py, &cores, "minilm_ort.py", &[&onnx, &tpath, &tfile])
            .unwrap_or_else(|e| die(e))
    };
    let mut rounds = Vec::new();
    let mut ort = serde_json::Value::Null;
    for r in 0..args.rounds.max(1) {
        let (o, c, k) = if r % 2 == 0 {
            let o = run_ort();
            (o, run_csd(model.as_ref()), run_csd(kernels.as_ref()))
        } else {
            let k = run_csd(kernels.as_ref());
            let c = run_csd(model.as_ref());
            (run_ort(), c, k)
        };
        let o_rate = o["texts_per_s"].as_f64().unwrap_or(0.0);
        let alone = o["texts_per_s_one_at_a_time"].as_f64().unwrap_or(0.0);
        println!(
            "round {}: onnxruntime {o_rate:.1} texts/s ({alone:.1} one at a time), csd {c:.1} \
             ({:.2}), csd's kernels {k:.1} ({:.2})",
            r + 1,
            c / o_rate,
            k / o_rate
        );
        rounds.push((o_rate, c, alone, k));
        ort = o;
    }
    let mine: Vec<Vec<f32>> = first.to_vec2().unwrap_or_else(|e| die(e));
    let mut err = 0f64;
    let theirs = ort["features"]
        .as_array()
        .unwrap_or_else(|| die("minilm_ort.py printed no features"));
    for (row, m) in theirs.iter().zip(&mine) {
        for (a, b) in row.as_array().into_iter().flatten().zip(m) {
            err = err.max((a.as_f64().unwrap_or(f64::NAN) - *b as f64).abs());
        }
    }
    let out = Out {
        cores,
        batch: args.rate.batch,
        texts: texts.len(),
        onnxruntime: ort["onnxruntime"].as_str().unwrap_or("?").into(),
        ort_texts_per_s: median(rounds.iter().map(|r| r.0).collect()),
        csd_texts_per_s: median(rounds.iter().map(|r| r.1).collect()),
        ort_one_at_a_time_texts_per_s: median(rounds.iter().map(|r| r.2).collect()),
        csd_vs_ort: median(rounds.iter().map(|r| r.1 / r.0).collect()),
        kernels_texts_per_s: median(rounds.iter().map(|r| r.3).collect()),
        kernels_vs_ort: median(rounds.iter().map(|r| r.3 / r.0).collect()),
        rounds,
        max_abs_err_vs_ort: err,
    };
    println!(
        "\n| cores {:?}, batch {} | texts/s | vs onnxruntime |\n|---|---|---|",
        out.cores, out.batch
    );
    println!(
        "| onnxruntime {} (Python, padded batches) | {:.1} | 1.00 |",
        out.onnxruntime, out.ort_texts_per_s
    );
    println!(
        "| onnxruntime, one text per run (no padding) | {:.1} | {:.2} |",
        out.ort_one_at_a_time_texts_per_s,
        out.ort_one_at_a_time_texts_per_s / out.ort_texts_per_s
    );
    println!(
        "| csd, layers on onnxruntime (the default; each text its own length) | {:.1} | {:.2} |",
        out.csd_texts_per_s, out.csd_vs_ort
    );
    println!(
        "| csd's kernels on candle (CSD_ML_KERNELS=csd) | {:.1} | {:.2} |",
        out.kernels_texts_per_s, out.kernels_vs_ort
    );
    println!(
        "embeddings vs onnxruntime: max absolute error {:.2e} (unit vectors)",
        out.max_abs_err_vs_ort
    );
    let path = args
        .json
        .clone()
        .unwrap_or_else(|| default_json_path("minilm"));
    write_json(&path, &out).unwrap_or_else(|e| die(e));
}
