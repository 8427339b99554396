//! SQL workloads: closed-loop clients or open-loop Poisson arrivals of queries over
//! DataFusion sessions on the cluster, with or without pushdown.

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::tpch;
use arrow::array::{Array, ArrayRef};
use arrow::datatypes::DataType;
use arrow::record_batch::RecordBatch;
use arrow::util::display::{ArrayFormatter, FormatOptions};
use csd_query_pushdown::{CsdSession, SessionOptions};
use indicatif::ProgressBar;

use crate::cluster::{Cluster, Links};
use crate::report::{Done, RunResult};
use crate::scenario::{PolicyName, QueryRef, Scenario, WorkloadSpec};
use crate::{Error, Result};

/// The query mix of `s`, as SQL (with `{selectivity}` filled in), with short names.
pub fn mix(s: &Scenario) -> Vec<(String, String)> {
    let WorkloadSpec::Sql {
        queries,
        selectivity,
        ..
    } = &s.workload
    else {
        return vec![];
    };
    queries
        .iter()
        .enumerate()
        .map(|(i, q)| match q {
            QueryRef::Tpch(n) => (
                format!("Q{n}"),
                tpch::query(*n).unwrap_or_default().to_string(),
            ),
            QueryRef::Sql(sql) => (
                format!("sql{}", i + 1),
                sql.replace("{selectivity}", &selectivity.unwrap_or(1.0).to_string()),
            ),
        })
        .collect()
}

/// A session over the links, for `policy`.
pub async fn session(s: &Scenario, links: &Links, policy: PolicyName) -> Result<CsdSession> {
    let cluster =
        csd_query_pushdown::Cluster::connect_with(&links.urls(), links.credentials()).await?;
    let opts = SessionOptions {
        pushdown: policy != PolicyName::None,
        target_partitions: s.compute.partitions,
        ..SessionOptions::default()
    };
    let workers = links.worker_urls();
    let session = if workers.is_empty() || !opts.pushdown {
        cluster.session(opts).await?
    } else {
        cluster
            .distributed_session(opts, &csd_query_pushdown::Workers::new(workers))
            .await?
    };
    if let WorkloadSpec::Sql { wasm_functions, .. } = &s.workload {
        for f in wasm_functions {
            let path = crate::scenario::expand(&f.module);
            let module = std::fs::read(&path).map_err(|e| {
                Error::Scenario(format!(
                    "workload.wasm_functions: {} ({}): {e}{}",
                    f.name,
                    path.display(),
                    if e.kind() == std::io::ErrorKind::NotFound {
                        "; build the example guests with scripts/build-wasm-examples.sh"
                    } else {
                        ""
                    }
                ))
            })?;
            let export = f.export.as_deref().unwrap_or(&f.name);
            session.register_wasm_udf(&f.name, &module, export).await?;
        }
    }
    Ok(session)
}

/// The cluster's capacity in queries/s: nodes × CPUs ÷ the mean latency of the mix
/// run one query at a time with pushdown (after one warm-up round).
pub async fn capacity(s: &Scenario, links: &Links) -> Result<f64> {
    let session = session(s, links, PolicyName::Full).await?;
    let mix = mix(s);
    for (_, q) in &mix {
        session.run(q).await?;
    }
    let mut total = 0.0;
    let mut n = 0;
    for _ in 0..2 {
        for (_, q) in &mix {
            total += session.run(q).await?.elapsed.as_secs_f64();
            n += 1;
        }
    }
    Ok((s.nodes.count * s.nodes.settings.cpus) as f64 / (total / n as f64).max(1e-6))
}

/// Results of the baseline policy per query text: a hash of the sorted rows.
pub(crate) type References = HashMap<String, u64>;

struct Shared {
    t0: Instant,
    done: Mutex<Vec<Done>>,
    checked: Mutex<HashSet<usize>>,
    /// First answers, compared after the run so the comparison is not timed.
    answers: Mutex<Vec<(usize, Vec<RecordBatch>)>>,
}

async fn one(
    session: Arc<CsdSession>,
    shared: Arc<Shared>,
    mix: Arc<Vec<(String, String)>>,
    k: usize,
) {
    let (name, sql) = &mix[k];
    let started = shared.t0.elapsed();
    let r = session.run(sql).await;
    let latency = shared.t0.elapsed() - started;
    let mut d = Done {
        query: name.clone(),
        start_s: started.as_secs_f64(),
        latency_ms: latency.as_secs_f64() * 1e3,
        ok: false,
        error: None,
        fragments: 0,
        pushed_back: 0,
    };
    match r {
        Ok(run) => {
            d.ok = true;
            d.fragments = run.node_runs.len() as u64;
            d.pushed_back = run
                .node_runs
                .iter()
                .filter(|r| r.work_pushed_back())
                .count() as u64;
            let first = shared
                .checked
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(k);
            if first {
                shared
                    .answers
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((k, run.batches));
            }
        }
        Err(e) => d.error = Some(e.to_string()),
    }
    shared
        .done
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(d);
}

/// Compares each query's first answer with the baseline's (or records it, when this
/// is the baseline).
fn check(
    baseline: bool,
    references: &mut References,
    mix: &[(String, String)],
    answers: Vec<(usize, Vec<RecordBatch>)>,
) -> Vec<String> {
    let mut out = Vec::new();
    for (k, batches) in answers {
        let (name, sql) = &mix[k];
        match canonical_hash(&batches) {
            Err(e) => out.push(format!("{name}: cannot compare the answer: {e}")),
            Ok(h) if baseline => {
                references.insert(sql.clone(), h);
            }
            Ok(h) => {
                if references.get(sql).is_some_and(|r| *r != h) {
                    out.push(format!("{name}: the answer differs from the baseline's"));
                }
            }
        }
    }
    out
}

/// A hash of the answer's rows, sorted; floats rounded to 9 significant digits
/// (partial aggregates add in another order).
pub(crate) fn canonical_hash(
    batches: &[RecordBatch],
) -> std::result::Result<u64, arrow::error::ArrowError> {
    let rows = canonical_rows(batches)?;
    let mut h = std::hash::DefaultHasher::new();
    rows.hash(&mut h);
    Ok(h.finish())
}

/// The answer's rows as text, sorted; floats rounded to 9 significant digits
/// (partial aggregates add in another order), so two correct executions of one
/// query compare equal.
pub fn canonical_rows(
    batches: &[RecordBatch],
) -> std::result::Result<Vec<String>, arrow::error::ArrowError> {
    let opts = FormatOptions::default().with_null("NULL");
    let mut rows: Vec<String> = Vec::new();
    for b in batches {
        let cols: Vec<ArrayRef> = b
            .columns()
            .iter()
            .map(|c| match c.data_type() {
                DataType::Float16 | DataType::Float32 | DataType::Float64 => {
                    arrow::compute::cast(c, &DataType::Float64)
                }
                _ => Ok(c.clone()),
            })
            .collect::<std::result::Result<_, _>>()?;
        let fmts: Vec<Option<ArrayFormatter>> = cols
            .iter()
            .map(|c| match c.data_type() {
                DataType::Float64 => Ok(None),
                _ => ArrayFormatter::try_new(c.as_ref(), &opts).map(Some),
            })
            .collect::<std::result::Result<_, _>>()?;
        for r in 0..b.num_rows() {
            let mut row = String::new();
            for (c, f) in cols.iter().zip(&fmts) {
                match f {
                    Some(f) => row.push_str(&f.value(r).to_string()),
                    None => {
                        let a = c
                            .as_any()
                            .downcast_ref::<arrow::array::Float64Array>()
                            .filter(|a| a.is_valid(r));
                        match a {
                            Some(a) => row.push_str(&format!("{:.8e}", a.value(r))),
                            None => row.push_str("NULL"),
                        }
                    }
                }
                row.push('|');
            }
            rows.push(row);
        }
    }
    rows.sort_unstable();
    Ok(rows)
}

/// Exponential inter-arrival times from a splitmix64 stream: Poisson arrivals at
/// `rate` per second, the same for the same seed.
pub struct Poisson {
    state: u64,
    rate: f64,
}

impl Poisson {
    /// A stream at `rate` per second.
    pub fn new(rate: f64, seed: u64) -> Self {
        Poisson {
            state: seed.max(1),
            rate,
        }
    }
}

impl Iterator for Poisson {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let u = ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        Some(Duration::from_secs_f64(-u.ln() / self.rate))
    }
}

/// Runs the workload of `s` (one sweep point) under `policy`.
pub async fn run(
    s: &Scenario,
    cluster: &Cluster,
    links: &Links,
    policy: PolicyName,
    references: &mut References,
    capacity_qps: &mut Option<f64>,
    bar: &ProgressBar,
) -> Result<RunResult> {
    let WorkloadSpec::Sql {
        clients,
        rate_qps,
        load,
        duration_s,
        repetitions,
        ..
    } = s.workload.clone()
    else {
        return Err(Error::Scenario("workload.kind: expected \"sql\"".into()));
    };
    let mix = Arc::new(mix(s));
    let rate = match (rate_qps, load) {
        (Some(r), _) => Some(r),
        (None, Some(l)) => {
            let cap = match *capacity_qps {
                Some(c) => c,
                None => {
                    bar.set_message("measuring capacity");
                    let c = capacity(s, links).await?;
                    *capacity_qps = Some(c);
                    c
                }
            };
            Some(l * cap)
        }
        (None, None) => None,
    };
    let session = Arc::new(session(s, links, policy).await?);
    let bytes_before = links.bytes();
    let shared = Arc::new(Shared {
        t0: Instant::now(),
        done: Mutex::new(Vec::new()),
        checked: Mutex::new(HashSet::new()),
        answers: Mutex::new(Vec::new()),
    });
    let sampler = cluster.sample_cpu(Duration::from_millis(100));
    let mut tasks = tokio::task::JoinSet::new();
    let deadline = duration_s.map(Duration::from_secs_f64);
    let timeout = Duration::from_secs_f64(s.timeout_s);
    let ticker = {
        let (shared, bar, policy) = (shared.clone(), bar.clone(), policy);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let n = shared.done.lock().map(|d| d.len()).unwrap_or(0);
                bar.set_message(format!("{policy}: {n} queries done"));
            }
        })
    };
    let work = async {
        match rate {
            None => {
                let reps = repetitions.unwrap_or(if deadline.is_some() { usize::MAX } else { 1 });
                for c in 0..clients {
                    let (session, shared, mix) = (session.clone(), shared.clone(), mix.clone());
                    tasks.spawn(async move {
                        let mut k = c % mix.len();
                        for _ in 0..reps.saturating_mul(mix.len()) {
                            if deadline.is_some_and(|d| shared.t0.elapsed() >= d) {
                                break;
                            }
                            one(session.clone(), shared.clone(), mix.clone(), k).await;
                            k = (k + 1) % mix.len();
                        }
                    });
                }
            }
            Some(rate) => {
                let until = deadline.unwrap_or(Duration::from_secs(10));
                let mut at = Duration::ZERO;
                let mut gaps = Poisson::new(rate, 7);
                let mut k = 0;
                while at < until {
                    if let Some(wait) = at.checked_sub(shared.t0.elapsed()) {
                        tokio::time::sleep(wait).await;
                    }
                    tasks.spawn(one(
                        session.clone(),
                        shared.clone(),
                        mix.clone(),
                        k % mix.len(),
                    ));
                    k += 1;
                    at += gaps.next().unwrap_or(until);
                }
            }
        }
        while tasks.join_next().await.is_some() {}
    };
    let timed_out = tokio::time::timeout(timeout, work).await.is_err();
    ticker.abort();
    let wall_s = shared.t0.elapsed().as_secs_f64();
    let cut = tasks.len();
    tasks.shutdown().await;
    let cpu = sampler.finish().await;
    let (up0, down0) = bytes_before;
    let (up1, down1) = links.bytes();
    let done = std::mem::take(&mut *shared.done.lock().unwrap_or_else(|p| p.into_inner()));
    let answers = std::mem::take(&mut *shared.answers.lock().unwrap_or_else(|p| p.into_inner()));
    bar.set_message(format!("{policy}: comparing answers"));
    let mismatches = check(policy == s.baseline(), references, &mix, answers);
    Ok(RunResult::new(
        policy,
        wall_s,
        done,
        cut,
        timed_out,
        (up1 - up0, down1 - down0),
        cpu,
        mismatches,
        rate,
    ))
}
