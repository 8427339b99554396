//! A running node's shared state: what its operators use ([`NodeResources`]), its
//! admission control, operators and counters. The service, the metrics endpoint and
//! the start-up code share it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::admission::{Admission, AdmissionConfig};
use crate::memory::{MemoryLedger, peak_resident_bytes, resident_bytes};
use crate::operator::{NodeResources, OperatorRegistry};
use crate::pool::CpuPool;
use crate::protocol::stats::{DeviceReport, NodeStats, RequestReport};
use crate::store::ObjectStore;
use crate::table::TableStore;

/// Request counters of the service.
#[derive(Debug, Default)]
pub struct ServiceCounters {
    pub(crate) do_get: AtomicU64,
    pub(crate) do_put: AtomicU64,
    pub(crate) bytes_sent: Arc<AtomicU64>,
    pub(crate) bytes_received: AtomicU64,
    pub(crate) rows_received: AtomicU64,
}

/// Everything a node's service works with.
pub struct NodeState {
    /// What operators use: tables, CPU pool, memory budget.
    pub node: Arc<NodeResources>,
    /// The URL clients use to reach this node (`grpc://host:port`).
    pub location: String,
    /// Counters.
    pub counters: ServiceCounters,
    /// Pushed-down operators this node runs.
    pub operators: OperatorRegistry,
    /// Admission control for operator requests and raw reads.
    pub admission: Arc<Admission>,
    /// Bytes per message of a raw range stream.
    pub range_chunk: u64,
    /// Size an operator answer's batches are cut to (see
    /// [`wire_pieces`](crate::operator::wire_pieces)).
    pub wire_piece: u64,
    /// Each peer's link, learned from the raw ranges it read (prices handing back).
    pub links: crate::link::LinkMeters,
    /// This node's host and cores (does an asker run on them? prices handing back).
    pub host: crate::protocol::host::HostCores,
    /// Tenants and their permissions (open when the node has none).
    pub auth: Arc<crate::auth::Auth>,
    /// Seals the tickets this node hands out.
    pub ticket_key: crate::auth::TicketKey,
    /// How long they stay valid.
    pub ticket_ttl: std::time::Duration,
    /// Results kept by reference.
    pub refs: Arc<crate::refs::RefStore>,
    /// Leased slots.
    pub leases: crate::lease::Leases,
    /// Longest lease.
    pub lease_max: std::time::Duration,
    started: Instant,
}

impl NodeState {
    /// Assembles a node's state.
    pub fn new(
        tables: TableStore,
        pool: CpuPool,
        location: String,
        memory_budget: u64,
        sandbox: crate::sandbox::SandboxLimits,
        refs: Arc<crate::refs::RefStore>,
    ) -> crate::Result<Self> {
        let memory = MemoryLedger::new(memory_budget);
        // Idle DMA buffers are resident too: at most 1/32 of the budget of them.
        crate::device::limit_idle_buffers(
            usize::try_from(memory_budget / 32).unwrap_or(usize::MAX),
        );
        let sandbox = Arc::new(crate::sandbox::Sandbox::new(
            sandbox,
            memory.clone(),
            Some(tables.object_store().clone()),
        )?);
        let attachments = Arc::new(crate::attachments::Attachments::new(memory.clone()));
        let host = workers_host(&pool);
        Ok(NodeState {
            admission: Admission::new(AdmissionConfig::new(pool.threads(), memory_budget)),
            node: Arc::new(NodeResources {
                tables,
                pool,
                memory_budget,
                memory,
                sandbox,
                attachments,
            }),
            location,
            counters: ServiceCounters::default(),
            operators: OperatorRegistry::new(),
            range_chunk: 1 << 20,
            wire_piece: 2 << 20,
            links: crate::link::LinkMeters::default(),
            host,
            auth: Arc::new(crate::auth::Auth::open()),
            ticket_key: crate::auth::TicketKey::random(),
            ticket_ttl: std::time::Duration::from_secs(3600),
            refs,
            leases: crate::lease::Leases::default(),
            lease_max: std::time::Duration::from_secs(3600),
            started: Instant::now(),
        })
    }

    /// Checks requests against `auth`, sealing tickets with `key` for `ttl`.
    pub(crate) fn with_auth(
        mut self,
        auth: Arc<crate::auth::Auth>,
        key: crate::auth::TicketKey,
        ttl: std::time::Duration,
    ) -> Self {
        self.auth = auth;
        self.ticket_key = key;
        self.ticket_ttl = ttl;
        self
    }

    /// Leases last at most `max`.
    pub(crate) fn with_lease_max(mut self, max: std::time::Duration) -> Self {
        self.lease_max = max;
        self
    }

    /// Uses `admission` (built from the node's flags) instead of the defaults.
    pub(crate) fn with_admission(mut self, admission: Arc<Admission>) -> Self {
        self.admission = admission;
        self
    }

    /// Sends raw ranges in `range_chunk`-byte messages and operator answers in
    /// pieces of about `wire_piece` bytes.
    pub(crate) fn with_wire(mut self, range_chunk: u64, wire_piece: u64) -> Self {
        self.range_chunk = range_chunk.max(4096);
        self.wire_piece = wire_piece.max(64 << 10);
        self
    }

    /// Serves `operators` too.
    pub(crate) fn with_operators(mut self, operators: OperatorRegistry) -> Self {
        self.operators = operators;
        self
    }

    pub(crate) fn store(&self) -> &ObjectStore {
        self.node.tables.object_store()
    }

    /// The JSON returned by `DoAction stats`.
    pub async fn stats(&self) -> NodeStats {
        let dev = self.store().device();
        let c = &self.counters;
        NodeStats {
            location: self.location.clone(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            cpus: self.node.pool.threads(),
            memory_budget: self.node.memory_budget,
            device: DeviceReport {
                geometry: dev.geometry().clone(),
                stats: dev.stats(),
            },
            store: self.store().stats().await,
            tables: self.node.tables.tables().len(),
            admission: self.admission.stats(),
            operator_memory_used: self.operators.memory_used(),
            operator_memory_limit: self.node.memory.operator_limit(),
            resident_bytes: resident_bytes(),
            peak_resident_bytes: peak_resident_bytes(),
            requests: RequestReport {
                do_get: c.do_get.load(Ordering::Relaxed),
                do_put: c.do_put.load(Ordering::Relaxed),
                bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
                bytes_received: c.bytes_received.load(Ordering::Relaxed),
                rows_received: c.rows_received.load(Ordering::Relaxed),
                unauthenticated: self.auth.counters.unauthenticated.load(Ordering::Relaxed),
                permission_denied: self.auth.counters.permission_denied.load(Ordering::Relaxed),
                quota_refused: self.auth.counters.quota_refused.load(Ordering::Relaxed),
            },
            sandbox: self.node.sandbox.stats(),
            refs: self.refs.stats(),
            leases: self.leases.stats(),
            attachments: self.node.attachments.stats(),
        }
    }
}

/// Ends expired leases and frees expired references every `period` while the
/// node lives.
pub(crate) async fn sweep_every(state: std::sync::Weak<NodeState>, period: std::time::Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(state) = state.upgrade() else { return };
        let ended = state.leases.sweep(&state.admission);
        if ended > 0 {
            tracing::info!(ended, "expired leases ended");
        }
        let n = state.refs.sweep(&state.node.tables).await;
        if n > 0 {
            tracing::info!(freed = n, "expired references freed");
        }
    }
}

/// This host, and the cores the node's workers run on: those they are pinned to,
/// else every core the process may use.
fn workers_host(pool: &CpuPool) -> crate::protocol::host::HostCores {
    let mut host = crate::protocol::host::HostCores::this();
    if let Some(cores) = pool.cores() {
        host.cpus = cores.iter().map(|&c| c as u32).collect();
        host.cpus.sort_unstable();
        host.cpus.dedup();
    }
    host
}
