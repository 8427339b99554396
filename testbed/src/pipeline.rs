//! Pipeline workloads (ProxyStore's question): SQL steps, each reading the previous
//! step's answer (`{input}` in its text), run two ways —
//!
//! - `kept`: each step but the last keeps its answer at the nodes
//!   (`CsdSession::keep`); the next step reads it there as table `csd_ref_…`, so
//!   only the last answer crosses the link;
//! - `shipped`: each step's answer comes back to the compute node, which sends it to
//!   the first node again (`put`) as the next step's input — a pipeline without
//!   references.
//!
//! Both push their steps down; the final answers are compared with the baseline's.
//! Kept results and shipped tables are freed after each pipeline, outside its time.

use std::time::{Duration, Instant};

use indicatif::ProgressBar;

use crate::cluster::{Cluster, Links};
use crate::report::{Done, RunResult};
use crate::scenario::{PolicyName, Scenario, WorkloadSpec};
use crate::{Error, Result};

/// How long kept steps live (they are released at the end of each pipeline).
const KEEP_TTL: Duration = Duration::from_secs(3600);

/// What a pipeline left at the nodes, freed after it.
enum Leftover {
    Ref(csd_runtime::refs::Reference),
    Table(String),
}

/// Runs the pipeline of `s` (one sweep point) under `policy`.
pub(crate) async fn run(
    s: &Scenario,
    cluster: &Cluster,
    links: &Links,
    policy: PolicyName,
    reference: &mut Option<u64>,
    bar: &ProgressBar,
) -> Result<RunResult> {
    let WorkloadSpec::Pipeline { steps, repetitions } = &s.workload else {
        return Err(Error::Scenario(
            "workload.kind: expected \"pipeline\"".into(),
        ));
    };
    if !matches!(policy, PolicyName::Kept | PolicyName::Shipped) {
        return Err(Error::Scenario(format!(
            "policies: {policy} does not apply to pipelines (kept, shipped)"
        )));
    }
    let clients = links.clients().await?;
    let baseline = policy == s.baseline();
    let sampler = cluster.sample_cpu(Duration::from_millis(100));
    let bytes_before = links.bytes();
    let t0 = Instant::now();
    let timeout = Duration::from_secs_f64(s.timeout_s);
    let (mut done, mut mismatches, mut leftovers) = (Vec::new(), Vec::new(), Vec::new());
    let mut timed_out = false;
    for rep in 0..*repetitions {
        bar.set_message(format!("{policy}: pipeline {}", rep + 1));
        let started = t0.elapsed();
        let work = one(s, links, &clients, policy, steps, rep, &mut leftovers);
        let outcome = match tokio::time::timeout(timeout.saturating_sub(t0.elapsed()), work).await {
            Ok(r) => r,
            Err(_) => {
                timed_out = true;
                break;
            }
        };
        let latency = t0.elapsed() - started;
        let (ok, error, fragments, pushed_back) = match outcome {
            Ok((batches, fragments, pushed_back)) => {
                match crate::sql::canonical_hash(&batches) {
                    Ok(h) if baseline => {
                        reference.get_or_insert(h);
                    }
                    Ok(h) => {
                        if reference.is_some_and(|r| r != h) && mismatches.is_empty() {
                            mismatches
                                .push("pipeline: the answer differs from the baseline's".into());
                        }
                    }
                    Err(e) => mismatches.push(format!("pipeline: cannot compare the answer: {e}")),
                }
                (true, None, fragments, pushed_back)
            }
            Err(e) => (false, Some(e.to_string()), 0, 0),
        };
        done.push(Done {
            query: "pipeline".into(),
            start_s: started.as_secs_f64(),
            latency_ms: latency.as_secs_f64() * 1e3,
            ok,
            error,
            fragments,
            pushed_back,
        });
        free(&clients, &mut leftovers).await;
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let cpu = sampler.finish().await;
    let (up0, down0) = bytes_before;
    let (up1, down1) = links.bytes();
    free(&clients, &mut leftovers).await;
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
    r.extra.insert("steps".into(), steps.len() as f64);
    Ok(r)
}

/// One pipeline: its final answer, fragments and fragments handed back.
async fn one(
    s: &Scenario,
    links: &Links,
    clients: &[csd_runtime::node_client::NodeClient],
    policy: PolicyName,
    steps: &[String],
    rep: usize,
    leftovers: &mut Vec<Leftover>,
) -> Result<(Vec<arrow::record_batch::RecordBatch>, u64, u64)> {
    let mut input = String::new();
    let (mut fragments, mut pushed_back) = (0u64, 0u64);
    for (i, step) in steps.iter().enumerate() {
        let sql = step.replace("{input}", &input);
        // A session per step: the next one lists the table the last step made.
        let session = crate::sql::session(s, links, PolicyName::Full).await?;
        let last = i + 1 == steps.len();
        if last {
            let r = session.run(&sql).await?;
            fragments += r.node_runs.len() as u64;
            pushed_back += r.node_runs.iter().filter(|n| n.work_pushed_back()).count() as u64;
            return Ok((r.batches, fragments, pushed_back));
        }
        match policy {
            PolicyName::Kept => {
                let kept = session.keep(&sql, KEEP_TTL).await?;
                fragments += kept.len() as u64;
                input = kept
                    .first()
                    .map(|k| k.reference.table.clone())
                    .ok_or_else(|| Error::Scenario(format!("workload.steps[{i}]: kept nothing")))?;
                leftovers.extend(kept.into_iter().map(|k| Leftover::Ref(k.reference)));
            }
            _ => {
                let r = session.run(&sql).await?;
                fragments += r.node_runs.len() as u64;
                pushed_back += r.node_runs.iter().filter(|n| n.work_pushed_back()).count() as u64;
                input = format!("tb_pipeline_{rep}_{i}");
                let schema = r.schema.clone();
                let target = clients.first().ok_or_else(|| {
                    Error::Scenario("nodes.count: a pipeline needs a node".into())
                })?;
                leftovers.push(Leftover::Table(input.clone()));
                target
                    .put(
                        &input,
                        "0",
                        schema,
                        futures::stream::iter(r.batches.into_iter().map(Ok)),
                    )
                    .await?;
            }
        }
    }
    Err(Error::Scenario(
        "workload.steps: expected at least two steps".into(),
    ))
}

/// Frees what pipelines left at the nodes (kept results, shipped tables).
async fn free(clients: &[csd_runtime::node_client::NodeClient], leftovers: &mut Vec<Leftover>) {
    for l in leftovers.drain(..) {
        let r = match &l {
            // A reference names its node's own address, not the link's: whichever
            // node holds it frees it.
            Leftover::Ref(r) => {
                let mut freed = Err(csd_runtime::node_client::Error::InvalidInput(
                    "no node holds it".into(),
                ));
                for c in clients {
                    freed = c.release(r).await.map(drop);
                    if freed.is_ok() {
                        break;
                    }
                }
                freed
            }
            Leftover::Table(t) => match clients.first() {
                Some(c) => c.delete(t, None).await.map(drop),
                None => Ok(()),
            },
        };
        if let Err(e) = r {
            tracing::warn!("freeing what a pipeline left: {e}");
        }
    }
}
