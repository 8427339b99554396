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
use crate::service::NodeState;

/// Binds `addr` and serves `/metrics` until the returned task is aborted.
pub async fn serve(addr: &str, state: Arc<NodeState>) -> Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| Error::io(format!("binding the metrics address {addr}"), e))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Error::io("reading the metrics address", e))?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
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
pub fn render(state: &NodeState) -> String {
    let a = state.admission.stats();
    let c = &a.counters;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    let one = |v: f64| vec![(String::new(), v)];
    metric(
        "csd_admitted_total",
        "counter",
        "Operator requests run at the node.",
        &one(c.admitted as f64),
    );
    metric(
        "csd_queued_total",
        "counter",
        "Admitted requests that waited in the queue first.",
        &one(c.queued as f64),
    );
    metric(
        "csd_pushed_back_total",
        "counter",
        "Operator requests pushed back to the compute tier.",
        &one(c.pushed_back as f64),
    );
    metric(
        "csd_rejected_total",
        "counter",
        "Requests refused with RESOURCE_EXHAUSTED.",
        &one(c.rejected as f64),
    );
    metric(
        "csd_abandoned_total",
        "counter",
        "Queued requests whose client went away.",
        &one(c.abandoned as f64),
    );
    metric(
        "csd_queue_delay_seconds_sum",
        "counter",
        "Total queueing delay of admitted requests.",
        &one(c.queue_delay_us_sum as f64 / 1e6),
    );
    metric(
        "csd_queue_delay_seconds_count",
        "counter",
        "Admitted requests (queueing delay samples).",
        &one(c.admitted as f64),
    );
    metric(
        "csd_queue_delay_p99_seconds",
        "gauge",
        "p99 queueing delay of the last 1024 admitted requests.",
        &one(a.queue_delay_p99_ms / 1e3),
    );
    metric(
        "csd_running",
        "gauge",
        "Operator requests running now.",
        &one(a.running as f64),
    );
    metric(
        "csd_waiting",
        "gauge",
        "Operator requests waiting now.",
        &one(a.waiting as f64),
    );
    metric(
        "csd_cpu_slots",
        "gauge",
        "CPU workers for operator work (--cpus).",
        &one(a.slots as f64),
    );
    metric(
        "csd_cpu_busy_seconds_total",
        "counter",
        "Slot time used by finished operator requests.",
        &one(c.busy_us as f64 / 1e6),
    );
    metric(
        "csd_memory_budget_bytes",
        "gauge",
        "Memory budget (--memory).",
        &one(a.memory_budget as f64),
    );
    metric(
        "csd_memory_reserved_bytes",
        "gauge",
        "Memory reserved by admitted requests.",
        &one(a.memory_reserved as f64),
    );
    metric(
        "csd_operator_memory_used_bytes",
        "gauge",
        "Memory operators hold now.",
        &one(state.operators.memory_used() as f64),
    );
    metric(
        "csd_reads_in_flight",
        "gauge",
        "Raw reads being served.",
        &one(a.io_in_flight as f64),
    );
    metric(
        "csd_reads_waiting",
        "gauge",
        "Raw reads waiting.",
        &one(a.io_waiting as f64),
    );
    metric(
        "csd_bytes_sent_total",
        "counter",
        "Bytes sent by DoGet.",
        &one(state.counters.bytes_sent.load(Ordering::Relaxed) as f64),
    );
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
