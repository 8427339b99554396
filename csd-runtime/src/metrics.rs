//! Prometheus text metrics over HTTP (`--metrics-listen`): `GET /metrics`.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::error::{Error, Result};
use crate::state::NodeState;

/// Binds `addr` and serves `/metrics` until the returned task is aborted.
pub(crate) async fn serve(
    addr: SocketAddr,
    state: Arc<NodeState>,
) -> Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| Error::io(format!("binding the metrics address {addr}"), e))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Error::io("reading the metrics address", e))?;
    let task = tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                // Out of descriptors and the like: back off instead of spinning.
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let state = state.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<_>| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(respond(&state, req.uri().path())) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok((bound, task))
}

fn respond(state: &NodeState, path: &str) -> Response<Full<Bytes>> {
    let (status, body) = match path {
        "/metrics" | "/" => (StatusCode::OK, render(state)),
        _ => (
            StatusCode::NOT_FOUND,
            "not found: try /metrics\n".to_string(),
        ),
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = "text/plain; version=0.0.4".parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

/// The node's figures in the Prometheus text format.
#[rustfmt::skip]
pub(crate) fn render(state: &NodeState) -> String {
    let a = state.admission.stats();
    let c = &a.counters;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    const C: &str = "counter";
    const G: &str = "gauge";
    let single: [(&str, &str, &str, f64); 25] = [
        ("csd_admitted_total", C, "Operator requests run at the node.", c.admitted as f64),
        ("csd_queued_total", C, "Admitted requests that waited in the queue first.", c.queued as f64),
        ("csd_pushed_back_total", C, "Operator requests pushed back to the compute tier.", c.pushed_back as f64),
        ("csd_patient_total", C, "Requests queued past the delay bound because the compute tier was saturated.", c.patient as f64),
        ("csd_kept_for_link_total", C, "Requests queued past the delay bound because handing them back would cost the asker more over its link and cores.", c.kept_for_link as f64),
        ("csd_kept_shared_cores_total", C, "Requests queued past the delay bound because the asker runs on the node's own cores.", c.kept_shared_cores as f64),
        ("csd_unauthenticated_total", C, "Requests refused with UNAUTHENTICATED (no token, or an unknown one).", state.auth.counters.unauthenticated.load(std::sync::atomic::Ordering::Relaxed) as f64),
        ("csd_permission_denied_total", C, "Requests refused with PERMISSION_DENIED (a permission, or another tenant's or an expired ticket).", state.auth.counters.permission_denied.load(std::sync::atomic::Ordering::Relaxed) as f64),
        ("csd_quota_refused_total", C, "Requests refused by a tenant's quota.", state.auth.counters.quota_refused.load(std::sync::atomic::Ordering::Relaxed) as f64),
        ("csd_rejected_total", C, "Requests refused with RESOURCE_EXHAUSTED.", c.rejected as f64),
        ("csd_abandoned_total", C, "Queued requests whose client went away.", c.abandoned as f64),
        ("csd_queue_delay_seconds_sum", C, "Total queueing delay of admitted requests.", c.queue_delay_us_sum as f64 / 1e6),
        ("csd_queue_delay_seconds_count", C, "Admitted requests (queueing delay samples).", c.admitted as f64),
        ("csd_queue_delay_p99_seconds", G, "p99 queueing delay of the last 1024 admitted requests.", a.queue_delay_p99_ms / 1e3),
        ("csd_queue_prediction_scale", G, "What queueing predictions are multiplied by: the p90 of actual over predicted queueing lately.", a.queue_prediction_scale),
        ("csd_running", G, "Operator requests running now.", a.running as f64),
        ("csd_waiting", G, "Operator requests waiting now.", a.waiting as f64),
        ("csd_cpu_slots", G, "CPU workers for operator work (--cpus).", a.slots as f64),
        ("csd_cpu_busy_seconds_total", C, "Slot time used by finished operator requests.", c.busy_us as f64 / 1e6),
        ("csd_memory_budget_bytes", G, "Memory budget (--memory).", a.memory_budget as f64),
        ("csd_memory_reserved_bytes", G, "Memory reserved by admitted requests.", a.memory_reserved as f64),
        ("csd_operator_memory_used_bytes", G, "Memory operators hold now.", state.operators.memory_used() as f64),
        ("csd_reads_in_flight", G, "Raw reads being served.", a.io_in_flight as f64),
        ("csd_reads_waiting", G, "Raw reads waiting.", a.io_waiting as f64),
        ("csd_bytes_sent_total", C, "Bytes sent by DoGet.", state.counters.bytes_sent.load(Ordering::Relaxed) as f64),
    ];
    for (name, kind, help, v) in single {
        metric(name, kind, help, &[(String::new(), v)]);
    }
    let rc = state.node.tables.object_store().read_cache_stats();
    let cache: [(&str, &str, &str, f64); 4] = [
        ("csd_read_cache_capacity_bytes", G, "Bytes the read cache may hold (--read-cache).", rc.capacity as f64),
        ("csd_read_cache_bytes", G, "Verified object bytes the read cache holds.", rc.bytes as f64),
        ("csd_read_cache_hits_total", C, "Object reads answered from the read cache.", rc.hits as f64),
        ("csd_read_cache_misses_total", C, "Object reads that went to the device.", rc.misses as f64),
    ];
    for (name, kind, help, v) in cache {
        metric(name, kind, help, &[(String::new(), v)]);
    }
    let per_op = |f: &dyn Fn(&crate::admission::CostModel) -> f64| -> Vec<(String, f64)> {
        a.costs
            .iter()
            .map(|(op, m)| (format!("{{operator=\"{op}\"}}"), f(m)))
            .collect()
    };
    metric(
        "csd_cost_ns_per_byte",
        "gauge",
        "Learned cost per byte read, per operator.",
        &per_op(&|m| m.ns_per_byte),
    );
    metric(
        "csd_estimate_error_ratio",
        "gauge",
        "Mean absolute relative error of run-time estimates.",
        &per_op(&|m| m.mean_abs_error),
    );
    let per_tenant = |f: &dyn Fn(&crate::admission::TenantStats) -> f64| -> Vec<(String, f64)> {
        a.tenants
            .iter()
            .map(|(t, s)| (format!("{{tenant=\"{t}\"}}"), f(s)))
            .collect()
    };
    metric(
        "csd_tenant_admitted_total",
        "counter",
        "Admitted requests per tenant.",
        &per_tenant(&|s| s.admitted as f64),
    );
    metric(
        "csd_tenant_pushed_back_total",
        "counter",
        "Pushed-back requests per tenant.",
        &per_tenant(&|s| s.pushed_back as f64),
    );
    out
}
