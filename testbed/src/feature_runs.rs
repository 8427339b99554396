//! Feature-extraction workloads (HAPI-style): one job streams the data set's features
//! to the compute node under a split policy, epoch after epoch.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use csd_ml_pushdown::job::{self, FeaturesOptions, SplitChoice};
use csd_ml_pushdown::request::FeatureType;
use csd_runtime::protocol::Compression;
use futures::TryStreamExt;
use indicatif::ProgressBar;

use crate::cluster::{Cluster, DATASET, Links};
use crate::report::{Done, RunResult};
use crate::scenario::{PolicyName, Scenario, WorkloadSpec};
use crate::{Error, Result};

/// Samples compared with the baseline per run (the first ids).
const COMPARED: u64 = 256;

/// The baseline's features of the first samples, by id.
pub(crate) type References = HashMap<u64, Vec<f32>>;

/// Runs the feature job of `s` (one sweep point) under `policy`.
pub(crate) async fn run(
    s: &Scenario,
    cluster: &Cluster,
    links: &Links,
    policy: PolicyName,
    references: &mut References,
    bar: &ProgressBar,
) -> Result<RunResult> {
    let WorkloadSpec::Features { batch, f16, epochs } = s.workload else {
        return Err(Error::Scenario(
            "workload.kind: expected \"features\"".into(),
        ));
    };
    // Weights are set-up, not traffic: the cluster stored them with the data.
    let Some((arch, weights_bytes)) = &cluster.model else {
        return Err(Error::Scenario("data.kind: expected \"images\"".into()));
    };
    let arch = *arch;
    let split = match policy {
        PolicyName::ComputeOnly => SplitChoice::None,
        PolicyName::Full => SplitChoice::Full,
        PolicyName::Auto => SplitChoice::Auto,
        PolicyName::Split(k) => SplitChoice::Fixed(k),
        other => {
            return Err(Error::Scenario(format!(
                "policies: {other} does not apply to feature jobs"
            )));
        }
    };
    let opts = FeaturesOptions {
        dataset: DATASET.into(),
        arch,
        split,
        train_batch: batch,
        dtype: if f16 {
            FeatureType::F16
        } else {
            FeatureType::F32
        },
        compression: Compression::None,
        pool: cluster.compute_pool.clone(),
        skip_bad_samples: false,
        keep: None,
        pixels: None,
        here: None,
    };
    let clients = links.clients().await?;
    let baseline = policy == s.baseline();
    let sampler = cluster.sample_cpu(Duration::from_millis(100));
    let bytes_before = links.bytes();
    let t0 = Instant::now();
    let mut done = Vec::new();
    let mut mismatches = Vec::new();
    let mut max_err = 0.0f64;
    let mut splits = Vec::new();
    // The first epoch's plan, when the split was chosen: what it predicted, and what
    // planning cost (to tell a wrong prediction from planning overhead).
    let mut planned: Option<(f64, csd_ml_pushdown::planner::Candidate)> = None;
    let mut pushed_back = 0;
    let timeout = Duration::from_secs_f64(s.timeout_s);
    let mut timed_out = false;
    for epoch in 0..epochs {
        let started = t0.elapsed();
        let work = async {
            let (mut stream, run) = job::features(&clients, weights_bytes, &opts, false).await?;
            let mut n = 0u64;
            while let Some(b) = stream.try_next().await? {
                if epoch == 0 {
                    let rows = b.features.to_vec2::<f32>()?;
                    for (id, row) in b.ids.iter().zip(rows) {
                        if *id >= COMPARED {
                            continue;
                        }
                        if baseline {
                            references.insert(*id, row);
                        } else if let Some(r) = references.get(id) {
                            max_err = max_err.max(rel_err(r, &row));
                        }
                    }
                }
                n += b.ids.len() as u64;
                bar.set_message(format!("{policy}: epoch {} {n} samples", epoch + 1));
            }
            Ok::<_, Error>((n, run))
        };
        let (n, run) = match tokio::time::timeout(timeout.saturating_sub(t0.elapsed()), work).await
        {
            Ok(r) => r?,
            Err(_) => {
                timed_out = true;
                break;
            }
        };
        let latency = t0.elapsed() - started;
        splits.push(run.split);
        if planned.is_none() {
            planned = run
                .plan
                .as_ref()
                .map(|p| (run.plan_s, p.candidates[p.best].clone()));
        }
        pushed_back += run.stats.pushed_back.load(Ordering::Relaxed);
        done.push(Done {
            query: format!("epoch {} ({n} samples)", epoch + 1),
            start_s: started.as_secs_f64(),
            latency_ms: latency.as_secs_f64() * 1e3,
            ok: n == cluster.loaded,
            error: (n != cluster.loaded)
                .then(|| format!("{n} samples streamed, {} stored", cluster.loaded)),
            fragments: run
                .stats
                .reports
                .lock()
                .map(|r| r.len() as u64)
                .unwrap_or(0),
            pushed_back: run.stats.pushed_back.load(Ordering::Relaxed),
        });
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let cpu = sampler.finish().await;
    let tolerance = if f16 { 2e-3 } else { 1e-4 };
    if max_err > tolerance {
        mismatches.push(format!(
            "features differ from the baseline's by {max_err:.2e} (relative; tolerance {tolerance:.0e})"
        ));
    }
    let (up0, down0) = bytes_before;
    let (up1, down1) = links.bytes();
    let mut r = RunResult::new(
        policy,
        wall_s,
        done,
        0,
        timed_out,
        (up1 - up0, down1 - down0),
        cpu,
        mismatches,
        None,
    );
    r.extra.insert("samples".into(), cluster.loaded as f64);
    if let Some(k) = splits.first() {
        r.extra.insert("split".into(), *k as f64);
    }
    r.extra
        .insert("pushed_back_partitions".into(), pushed_back as f64);
    if let Some((plan_s, c)) = planned {
        r.extra.insert("plan_s".into(), plan_s);
        r.extra.insert("predicted_epoch_s".into(), c.epoch_s);
        r.extra.insert("predicted_node_s".into(), c.node_s);
        r.extra.insert("predicted_link_s".into(), c.link_s);
        r.extra.insert("predicted_compute_s".into(), c.compute_s);
    }
    if !baseline {
        r.extra.insert("max_rel_err_vs_baseline".into(), max_err);
    }
    Ok(r)
}

/// max |a - b| ÷ max |a| (0 when both are zero).
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let scale = a.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
    let diff = a
        .iter()
        .zip(b)
        .fold(0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()));
    if scale == 0.0 { diff } else { diff / scale }
}
