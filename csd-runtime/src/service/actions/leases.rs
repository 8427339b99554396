//! The actions on leased slots: `lease`, `release_lease`, `touch_lease`, `leases`,
//! and `invoke` (a shipped function called on a lease's slot).

use std::time::Duration;

use arrow::record_batch::RecordBatch;
use bytes::Bytes;

use super::super::{FlightNode, json_result};
use crate::StatusCode;
use crate::auth::{Permission, Principal};
use crate::error::{Error, Result};
use crate::protocol::actions::{
    InvokeAnswer, InvokeRequest, LeaseRequest, LeasesRequest, ReleaseLeaseRequest,
    TouchLeaseRequest,
};
use crate::sandbox::ModuleDigest;

impl FlightNode {
    /// `lease`: slots (and memory) for a while, granted from what admission can
    /// spare; it holds `slots` of its tenant's `max_requests` while it lasts.
    pub(super) fn lease(&self, who: &Principal, r: LeaseRequest) -> Result<arrow_flight::Result> {
        who.check_any(Permission::Code, "lease slots for shipped code")?;
        if !r.seconds.is_finite() || r.seconds <= 0.0 {
            return Err(Error::InvalidArgument(format!(
                "a lease lasts a positive number of seconds, not {}",
                r.seconds
            )));
        }
        let idle = match r.idle_seconds {
            Some(i) if !i.is_finite() || i <= 0.0 => {
                return Err(Error::InvalidArgument(format!(
                    "idle_seconds must be a positive number of seconds, not {i}"
                )));
            }
            i => i.map(|i| Duration::from_secs_f64(i.min(1e9))),
        };
        let mut quota = Vec::new();
        if who.tenant().is_some_and(|t| t.max_requests.is_some()) {
            for _ in 0..r.slots {
                quota.push(who.request_slot().map_err(|e| {
                    Error::ResourcesExhausted(format!(
                        "a lease of {} slots counts as {} requests: {e}",
                        r.slots, r.slots
                    ))
                })?);
            }
        }
        let info = self.state.leases.grant(
            &self.state.admission,
            crate::lease::Grant {
                tenant: who.name().to_string(),
                bucket: self.state.admission.bucket(who.name()),
                slots: r.slots,
                memory: r.memory.map(|m| m.0).unwrap_or(0),
                ttl: Duration::from_secs_f64(r.seconds.min(1e9)),
                max_ttl: self.state.lease_max,
                idle,
                quota,
            },
        )?;
        tracing::info!(lease = %info.id, tenant = %info.tenant, slots = info.slots, "lease granted");
        json_result(&info)
    }

    /// `release_lease`: ends a lease now.
    pub(super) fn release_lease(
        &self,
        who: &Principal,
        r: ReleaseLeaseRequest,
    ) -> Result<arrow_flight::Result> {
        json_result(&self.state.leases.release(
            &self.state.admission,
            &r.lease,
            Self::ref_owner(who),
        )?)
    }

    /// `touch_lease`: the lease's holder is alive.
    pub(super) fn touch_lease(
        &self,
        who: &Principal,
        r: TouchLeaseRequest,
    ) -> Result<arrow_flight::Result> {
        json_result(&self.state.leases.touch(&r.lease, Self::ref_owner(who))?)
    }

    /// `leases`: the caller's leases.
    pub(super) fn leases(&self, who: &Principal, _: LeasesRequest) -> Result<arrow_flight::Result> {
        json_result(&self.state.leases.list(Self::ref_owner(who)))
    }

    /// `invoke`: a function of a shipped module on a lease's slot. The body is a
    /// JSON [`InvokeRequest`], a newline, and the arguments as Arrow IPC.
    pub(super) async fn invoke(
        &self,
        who: &Principal,
        body: Bytes,
    ) -> Result<arrow_flight::Result> {
        who.check_any(Permission::Code, "invoke shipped code")?;
        let split = body.iter().position(|&b| b == b'\n').ok_or_else(|| {
            Error::InvalidArgument(
                "an invoke body is a JSON head, a newline, then Arrow IPC arguments".into(),
            )
        })?;
        let head: InvokeRequest = serde_json::from_slice(&body[..split]).map_err(|e| {
            Error::external(StatusCode::InvalidArgument, "the head of an invoke body", e)
        })?;
        let digest = ModuleDigest::parse(head.module.as_bytes())?;
        let sandbox = self.state.node.sandbox.clone();
        let module = sandbox.module(&digest, None).await?;
        let state = self.state.clone();
        let owner = Self::ref_owner(who).map(String::from);
        let slot = self
            .state
            .leases
            .slot(&head.lease, owner.as_deref())
            .await?;
        // On the lease's slot — a blocking thread, not the admitted work's pool nor
        // the RPC threads — with the arguments' decoding and the answer's encoding.
        let body = tokio::task::spawn_blocking(move || -> Result<Bytes> {
            let _slot = slot;
            let bad = |e| Error::external(StatusCode::InvalidArgument, "invoke arguments", e);
            let mut r = arrow::ipc::reader::StreamReader::try_new(
                std::io::Cursor::new(body.slice(split + 1..)),
                None,
            )
            .map_err(bad)?;
            let args = match r.next() {
                Some(b) => b.map_err(bad)?,
                None => RecordBatch::new_empty(r.schema()),
            };
            let (out, start) = state.leases.invoke(
                &sandbox,
                &module,
                &head.lease,
                owner.as_deref(),
                &head.export,
                &args,
            )?;
            let batch = RecordBatch::try_from_iter([("out", out)])?;
            let mut reply = serde_json::to_vec(&InvokeAnswer { start })
                .map_err(|e| Error::external(StatusCode::Internal, "an invoke answer", e))?;
            reply.push(b'\n');
            let mut w = arrow::ipc::writer::StreamWriter::try_new(reply, &batch.schema())?;
            w.write(&batch)?;
            w.finish()?;
            Ok(w.into_inner()?.into())
        })
        .await
        .map_err(|e| Error::external(StatusCode::Internal, "the invocation thread", e))??;
        Ok(arrow_flight::Result { body })
    }
}
