//! `--pipeline`: a three-step pipeline with each step's answer kept at the node
//! against the same steps brought back and stored again.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use csd_benches::pipeline_steps::{STEP1, step2, step3};
use csd_benches::{csd_binary, default_json_path, write_json};
use serde::Serialize;

use crate::answers::same_answer;
use crate::{Args, Ctx, with_node};
use csd_benches::median;
use csd_benches::net::Net;

/// `csd ARGS… --node NODE…`, output checked.
pub(crate) fn csd_out(ctx: &Ctx, a: &[&str]) -> String {
    let mut cmd = Command::new(csd_binary());
    cmd.args(a);
    for n in &ctx.nodes {
        cmd.args(["--node", n]);
    }
    let out = cmd.output().expect("csd");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "csd {a:?} failed: {stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The kept table a `csd sql --keep` printed.
pub(crate) fn kept_table(refs: &str) -> String {
    let first = refs.lines().next().expect("a reference");
    let r: serde_json::Value = serde_json::from_str(first).expect("a reference is JSON");
    r["table"].as_str().expect("its table").to_string()
}

/// One pipeline, kept: its final answer (CSV); its references are released after.
pub(crate) fn pipeline_kept(ctx: &Ctx, work: &Path) -> (String, PathBuf) {
    let refs1 = csd_out(ctx, &["sql", "--keep", "--ttl", "10m", STEP1]);
    let refs2 = csd_out(
        ctx,
        &["sql", "--keep", "--ttl", "10m", &step2(&kept_table(&refs1))],
    );
    let answer = csd_out(
        ctx,
        &["sql", "--format", "csv", &step3(&kept_table(&refs2))],
    );
    let refs = work.join("pipeline-refs.jsonl");
    std::fs::write(&refs, format!("{refs1}{refs2}")).expect("refs file");
    (answer, refs)
}

/// One pipeline, shipped: its final answer (CSV); tables `NAME_a`, `NAME_b` are
/// deleted after.
pub(crate) fn pipeline_shipped(ctx: &Ctx, work: &Path, name: &str) -> String {
    let mut input = String::from("lineitem");
    for (k, step) in [("a", STEP1.to_string()), ("b", String::new())] {
        let sql = if k == "a" { step } else { step2(&input) };
        let file = work.join(format!("{name}_{k}.csv"));
        std::fs::write(&file, csd_out(ctx, &["sql", "--format", "csv", &sql])).expect("csv");
        input = format!("{name}_{k}");
        csd_out(
            ctx,
            &["put", "--table", &input, file.to_str().expect("utf-8 path")],
        );
    }
    csd_out(ctx, &["sql", "--format", "csv", &step3(&input)])
}

#[derive(Serialize)]
pub(crate) struct PipelineFigures {
    pub(crate) rate_mbit: f64,
    pub(crate) kept_secs: f64,
    pub(crate) kept_bytes: u64,
    pub(crate) shipped_secs: f64,
    pub(crate) shipped_bytes: u64,
}

/// The pipeline mode: both pipelines at every rate, medians, answers compared.
pub(crate) fn run_pipelines(
    net: &mut Net,
    ctx: &mut Ctx,
    devices: &[PathBuf],
    work: &Path,
    args: &Args,
) {
    println!(
        "pipeline filter -> key filter -> aggregate over lineitem SF {}, csd processes over a tc-shaped veth, median of {}",
        args.scale, args.runs
    );
    println!(
        "{:>8} {:>10} {:>12} {:>12} {:>14} {:>8} {:>8}",
        "Mbit/s", "kept s", "kept bytes", "shipped s", "shipped bytes", "speedup", "bytes"
    );
    let mut figures = Vec::new();
    let mut mismatches = 0;
    for &rate in &args.rates {
        net.shape(rate);
        let (mut ks, mut kb, mut ss, mut sb) = (vec![], vec![], vec![], vec![]);
        with_node(net, ctx, devices, "adaptive", args, |ctx, net| {
            for run in 0..args.runs {
                let (b0, t) = (net.bytes(), Instant::now());
                let (kept, refs) = pipeline_kept(ctx, work);
                ks.push(t.elapsed().as_secs_f64());
                kb.push((net.bytes() - b0) as f64);
                let name = format!("pipe{run}");
                let (b0, t) = (net.bytes(), Instant::now());
                let shipped = pipeline_shipped(ctx, work, &name);
                ss.push(t.elapsed().as_secs_f64());
                sb.push((net.bytes() - b0) as f64);
                if !same_answer(&kept, &shipped) {
                    eprintln!("the two pipelines disagree at {rate} Mbit/s:\n{kept}\n{shipped}");
                    mismatches += 1;
                }
                csd_out(ctx, &["release", refs.to_str().expect("utf-8 path")]);
                for k in ["a", "b"] {
                    csd_out(ctx, &["rm", &format!("{name}_{k}")]);
                }
            }
        });
        let f = PipelineFigures {
            rate_mbit: rate,
            kept_secs: median(ks),
            kept_bytes: median(kb) as u64,
            shipped_secs: median(ss),
            shipped_bytes: median(sb) as u64,
        };
        println!(
            "{:>8} {:>10.3} {:>12} {:>12.3} {:>14} {:>7.2}x {:>7.0}x",
            rate,
            f.kept_secs,
            f.kept_bytes,
            f.shipped_secs,
            f.shipped_bytes,
            f.shipped_secs / f.kept_secs,
            f.shipped_bytes as f64 / f.kept_bytes.max(1) as f64
        );
        figures.push(f);
    }
    let path = args
        .json
        .clone()
        .unwrap_or_else(|| default_json_path("shaped-pipeline"));
    write_json(&path, &figures).expect("json");
    if mismatches > 0 {
        std::process::exit(1);
    }
}
