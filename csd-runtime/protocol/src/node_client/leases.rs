//! Leased slots through a node: lease, hold (touched while held), release, and
//! invoke a shipped function on a lease.

use std::time::Duration;

use arrow::record_batch::RecordBatch;
use bytes::Bytes;
use futures::TryStreamExt;

use super::client::NodeClient;
use super::error::{Error, Result};
use crate::actions::{
    INVOKE, InvokeAnswer, InvokeRequest, LeaseInfo, LeaseRequest, ReleaseLeaseRequest, Start,
    TouchLeaseRequest,
};
use crate::digest::ModuleDigest;

impl NodeClient {
    /// Leases `slots` of the node's CPU slots for `ttl` (`csd_runtime::lease` at the node); a
    /// node that cannot spare them refuses with [`Error::Busy`] and when to retry.
    pub async fn lease(&self, slots: usize, ttl: Duration) -> Result<LeaseInfo> {
        self.lease_with(&LeaseRequest {
            slots,
            seconds: ttl.as_secs_f64(),
            idle_seconds: None,
            memory: None,
        })
        .await
    }

    /// A lease as `request` asks (memory, an idle limit).
    pub async fn lease_with(&self, request: &LeaseRequest) -> Result<LeaseInfo> {
        self.action(request).await
    }

    /// Like [`Self::lease`], held by this process: the node ends the lease once it
    /// has heard nothing from its holder for `idle`, and the returned [`HeldLease`]
    /// keeps telling it (`touch_lease`) until dropped. A holder that crashes or
    /// drops it gives the slots back within `idle`.
    pub async fn hold_lease(
        &self,
        slots: usize,
        ttl: Duration,
        idle: Duration,
    ) -> Result<HeldLease> {
        self.hold_lease_with(&LeaseRequest {
            slots,
            seconds: ttl.as_secs_f64(),
            idle_seconds: Some(idle.as_secs_f64()),
            memory: None,
        })
        .await
    }

    /// [`Self::hold_lease`] as `request` asks; its idle limit defaults to 10 s.
    pub async fn hold_lease_with(&self, request: &LeaseRequest) -> Result<HeldLease> {
        let mut request = request.clone();
        let idle = Duration::from_secs_f64(
            request
                .idle_seconds
                .filter(|i| i.is_finite() && *i > 0.0)
                .unwrap_or(10.0)
                .min(1e9),
        );
        request.idle_seconds = Some(idle.as_secs_f64());
        let info: LeaseInfo = self.action(&request).await?;
        let (client, id) = (self.clone(), info.id.clone());
        let every = (idle / 3).max(Duration::from_millis(10));
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let touch = TouchLeaseRequest { lease: id.clone() };
                if let Err(e) = client.action(&touch).await {
                    tracing::debug!("lease {id} no longer held: {e}");
                    if e.code() == Some(tonic::Code::NotFound) {
                        return;
                    }
                }
            }
        });
        Ok(HeldLease { info, task })
    }

    /// Ends a lease now.
    pub async fn release_lease(&self, lease: &str) -> Result<LeaseInfo> {
        self.action(&ReleaseLeaseRequest {
            lease: lease.into(),
        })
        .await
    }

    /// Calls `export` of `module` (named by `digest`, its SHA-256) on `args`, on a
    /// lease's slot: hot on the instance the lease keeps, warm on a new one, cold
    /// when the node lacks the module (sent here once, then called).
    pub async fn invoke(
        &self,
        lease: &str,
        digest: &ModuleDigest,
        module: &[u8],
        export: &str,
        args: &RecordBatch,
    ) -> Result<Invoked> {
        let mut body = serde_json::to_vec(&InvokeRequest {
            lease: lease.into(),
            module: digest.to_string(),
            export: export.into(),
        })
        .map_err(|e| Error::Protocol(e.to_string()))?;
        body.push(b'\n');
        let mut w = arrow::ipc::writer::StreamWriter::try_new(body, &args.schema())
            .map_err(|e| Error::InvalidInput(e.to_string()))?;
        w.write(args)
            .map_err(|e| Error::InvalidInput(e.to_string()))?;
        w.finish().map_err(|e| Error::InvalidInput(e.to_string()))?;
        let body = Bytes::from(
            w.into_inner()
                .map_err(|e| Error::InvalidInput(e.to_string()))?,
        );
        let mut cold = false;
        let reply = loop {
            let action = arrow_flight::Action::new(INVOKE, body.clone());
            let r = async {
                self.flight()
                    .do_action(action)
                    .await?
                    .try_next()
                    .await?
                    .ok_or_else(|| Error::Protocol("invoke returned nothing".into()))
            }
            .await;
            match r {
                Err(Error::ModuleMissing(d)) if !cold && d == *digest => {
                    self.put_module(module).await?;
                    cold = true;
                }
                r => break r?,
            }
        };
        let split = reply
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| Error::Protocol("an invoke answer without its head".into()))?;
        let head: InvokeAnswer = serde_json::from_slice(&reply[..split])
            .map_err(|e| Error::Protocol(format!("invoke answer: {e}")))?;
        let batch = arrow::ipc::reader::StreamReader::try_new(
            std::io::Cursor::new(reply.slice(split + 1..)),
            None,
        )
        .map_err(|e| Error::Protocol(format!("invoke answer: {e}")))?
        .next()
        .ok_or_else(|| Error::Protocol("invoke answer without a batch".into()))?
        .map_err(|e| Error::Protocol(format!("invoke answer: {e}")))?;
        let start = if cold { Start::Cold } else { head.start };
        Ok(Invoked {
            out: batch.column(0).clone(),
            start,
        })
    }
}

/// A lease this process holds (see [`NodeClient::hold_lease`]); dropping it stops
/// telling the node, which then ends the lease within its idle limit.
#[derive(Debug)]
pub struct HeldLease {
    /// The lease.
    pub info: LeaseInfo,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What [`NodeClient::invoke`] answers.
#[derive(Debug, Clone)]
pub struct Invoked {
    /// The function's result.
    pub out: arrow::array::ArrayRef,
    /// Hot, warm or cold (see [`NodeClient::invoke`]).
    pub start: Start,
}
