//! A running node's shared state: what its operators use ([`NodeResources`]), its
//! admission control, operators and counters. The service, the metrics endpoint and
//! the start-up code share it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::admission::Admission;
use crate::memory::{MemoryLedger, peak_resident_bytes, resident_bytes};
use crate::operator::{NodeResources, OperatorRegistry};
use crate::pool::CpuPool;
use crate::protocol::stats::{DeviceReport, NodeStats, RequestReport};
use crate::settings::NodeSettings;
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

/// What start-up opened and made for a node's state, beside its settings.
pub struct NodeParts {
    /// The tables on the node's store.
    pub tables: TableStore,
    /// The CPU workers.
    pub pool: CpuPool,
    /// The URL clients use.
    pub location: String,
    /// Results kept by reference.
    pub refs: Arc<crate::refs::RefStore>,
    /// The operators the node serves.
    pub operators: OperatorRegistry,
    /// Tenants and their permissions.
    pub auth: Arc<crate::auth::Auth>,
    /// Seals the tickets the node hands out.
    pub ticket_key: crate::auth::TicketKey,
}

impl NodeState {
    /// Assembles a node's state from `parts` under `settings` (every figure it
    /// keeps comes from them: it has no defaults of its own).
    pub fn new(settings: &NodeSettings, parts: NodeParts) -> crate::Result<Self> {
        let NodeParts {
            tables,
            pool,
            location,
            refs,
            operators,
            auth,
            ticket_key,
        } = parts;
        let memory_budget = settings.memory;
        let memory = MemoryLedger::new(memory_budget);
        // Idle DMA buffers are resident too: at most 1/32 of the budget of them.
        crate::device::limit_idle_buffers(
            usize::try_from(memory_budget / 32).unwrap_or(usize::MAX),
        );
        let sandbox = Arc::new(crate::sandbox::on_device(
            settings.sandbox,
            memory.clone(),
            tables.object_store().clone(),
        )?);
        let attachments = Arc::new(crate::attachments::Attachments::new(memory.clone()));
        let host = workers_host(&pool);
        Ok(NodeState {
            admission: Admission::new(settings.admission.clone()),
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
            operators,
            range_chunk: settings.range_chunk,
            wire_piece: settings.wire_piece,
            links: crate::link::LinkMeters::default(),
            host,
            auth,
            ticket_key,
            ticket_ttl: settings.ticket_ttl,
            refs,
            leases: crate::lease::Leases::default(),
            lease_max: settings.lease_max,
            started: Instant::now(),
        })
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
