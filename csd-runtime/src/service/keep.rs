//! `GetFlightInfo` with a command: an operator ticket whose answer the node keeps
//! instead of streaming it (see [`crate::refs`]), answered with the `FlightInfo` of
//! the kept result (its endpoint a `Ref` ticket with the reference's expiry).

use std::net::IpAddr;
use std::sync::Arc;

use arrow_flight::decode::{DecodedPayload, FlightDataDecoder};
use arrow_flight::error::FlightError;
use arrow_flight::{FlightDescriptor, FlightInfo};
use bytes::Bytes;
use futures::StreamExt;

use super::FlightNode;
use super::operator::OperatorCall;
use super::put::{UPLOAD_PATIENCE, upload_memory};
use crate::auth::Principal;
use crate::error::{Error, Result};
use crate::protocol::{LeaseIds, Ticket};

impl FlightNode {
    /// `GetFlightInfo` with a command: runs the operator ticket in it and keeps its
    /// answer at the node (see [`crate::refs`]).
    pub(super) async fn keep(
        &self,
        who: Principal,
        peer: Option<IpAddr>,
        cmd: &[u8],
        lease: Option<LeaseIds>,
    ) -> Result<FlightInfo> {
        let (ticket, seal) = Ticket::decode_sealed(cmd)?;
        if let Some(seal) = &seal {
            self.state.ticket_key.verify(seal, &who)?;
        }
        let Ticket::Operator {
            name,
            args,
            compression,
            patient: _,
            asker,
            keep_ms: Some(keep_ms),
            keep_group,
        } = ticket
        else {
            return Err(Error::InvalidArgument(
                "a GetFlightInfo command must be an operator ticket with keep_ms (a result to keep); tables are described by a path descriptor".into(),
            ));
        };
        let ttl = self
            .state
            .refs
            .check_ttl(std::time::Duration::from_millis(keep_ms))?;
        let room = match who.tenant().and_then(|t| t.max_stored_bytes) {
            Some(limit) => {
                let stored = self.stored_by(&who);
                who.check_stored(stored, 1)?;
                Some(limit.saturating_sub(stored))
            }
            None => None,
        };
        // Writing the answer as a table holds memory as an upload does, before the
        // operator runs (waiting, then refused with a retry hint, like an upload).
        let memory = &self.state.node.memory;
        let held = memory
            .hold(
                upload_memory(memory.budget()),
                "keeping a result",
                UPLOAD_PATIENCE,
            )
            .await?;
        // A kept result cannot be finished by the asker: it queues rather than being
        // handed back for queueing delay (memory still hands it back).
        let answer = self
            .run_operator(OperatorCall {
                who: who.clone(),
                peer,
                name: name.clone(),
                args,
                compression,
                patient: true,
                asker,
                lease,
            })
            .await?;
        // The operator's encoded answer, decoded back to batches for the table (the
        // trailing report has no IPC header: it is taken out here).
        let report = Arc::new(std::sync::Mutex::new(None::<Bytes>));
        let data = answer.filter_map({
            let report = report.clone();
            move |d| {
                futures::future::ready(match d {
                    Ok(d) if d.data_header.is_empty() => {
                        if !d.app_metadata.is_empty()
                            && let Ok(mut r) = report.lock()
                        {
                            *r = Some(d.app_metadata.clone());
                        }
                        None
                    }
                    Ok(d) => Some(Ok(d)),
                    Err(s) => Some(Err(FlightError::Tonic(Box::new(s)))),
                })
            }
        });
        let mut decoded = FlightDataDecoder::new(data);
        let schema = loop {
            match decoded.next().await {
                Some(Ok(d)) => {
                    if let DecodedPayload::Schema(s) = d.payload {
                        break s;
                    }
                }
                Some(Err(e)) => return Err(e.into()),
                None => {
                    return Err(Error::Internal(
                        "the operator's answer ended before its schema".into(),
                    ));
                }
            }
        };
        let batches = decoded
            .filter_map(|d| {
                futures::future::ready(match d {
                    Ok(d) => match d.payload {
                        DecodedPayload::RecordBatch(b) => Some(Ok(b)),
                        _ => None,
                    },
                    Err(e) => Some(Err(e.into())),
                })
            })
            .boxed();
        let kept = self
            .state
            .refs
            .keep(
                &self.state.node.tables,
                who.name(),
                &name,
                keep_group.as_deref(),
                ttl,
                room,
                held.bytes(),
                schema.clone(),
                batches,
            )
            .await?;
        drop(held);
        tracing::info!(id = %kept.id, table = %kept.table, tenant = %kept.tenant, rows = kept.rows, bytes = kept.bytes, "result kept");
        let report = report.lock().ok().and_then(|mut r| r.take());
        let info = FlightInfo::new()
            .try_with_schema(&schema)?
            .with_endpoint(self.ref_endpoint(&kept.tenant, &kept))
            .with_total_records(kept.rows as i64)
            .with_total_bytes(kept.bytes as i64)
            .with_descriptor(FlightDescriptor::new_cmd(cmd.to_vec()))
            .with_app_metadata(report.unwrap_or_default());
        Ok(info)
    }
}
