//! `DoGet`: a ticket, decoded (and its seal checked) once, then served: a scan, a
//! byte range or a kept result under a raw-read permit, or an operator request
//! ([`super::operator`]).

use arrow_flight::{FlightData, Ticket as FlightTicket};
use futures::StreamExt;
use futures::stream::BoxStream;
use tonic::{Request, Status};

use super::operator::OperatorCall;
use super::stream::{holding, metered};
use super::{FlightNode, lease_header};
use crate::auth::{Permission, Principal};
use crate::error::{Error, Result};
use crate::protocol::Ticket;

impl FlightNode {
    /// The answer to `DoGet` of `request` by `who`.
    pub(super) async fn get(
        &self,
        who: Principal,
        request: &Request<FlightTicket>,
    ) -> Result<BoxStream<'static, Result<FlightData, Status>>> {
        let (ticket, seal) = Ticket::decode_sealed(&request.get_ref().ticket)?;
        if let Some(seal) = &seal {
            self.state.ticket_key.verify(seal, &who)?;
        }
        let peer = request.remote_addr().map(|a| a.ip());
        // An operator request takes its request slot where it is admitted (on a
        // lease it runs within the slots the lease holds); the others here.
        let slot = match &ticket {
            Ticket::Operator { .. } => None,
            _ => Some(who.request_slot()?),
        };
        let stream = match ticket {
            Ticket::Operator {
                keep_ms: Some(_), ..
            } => {
                return Err(Error::InvalidArgument(
                    "an operator ticket with keep_ms asks to keep the result: send it as the command of GetFlightInfo, not to DoGet".into(),
                ));
            }
            Ticket::Operator {
                name,
                args,
                compression,
                patient,
                asker,
                keep_ms: None,
                keep_group: _,
            } => self
                .run_operator(OperatorCall {
                    who,
                    peer,
                    name,
                    args,
                    compression,
                    patient,
                    asker,
                    lease: lease_header(request.metadata())?,
                })
                .await?
                .boxed(),
            Ticket::Ref { id } => {
                let r = self.state.refs.get_readable(&id, Self::ref_owner(&who))?;
                let scan = self.scan_request(&r.table, Some(&r.id), &[], 0, None)?;
                let slot = self
                    .read_slot(self.scan_memory(&scan), "a kept result's stream")
                    .await?;
                // Kept results are read over links: LZ4, cheap and about 2x.
                let lz4 = Some(arrow::ipc::CompressionType::LZ4_FRAME);
                holding(self.scan(scan, lz4)?, slot)
            }
            Ticket::Scan {
                table,
                partition,
                columns,
                skip,
                limit,
            } => {
                self.check_table(&who, Permission::Read, &table)?;
                let scan =
                    self.scan_request(&table, partition.as_deref(), &columns, skip, limit)?;
                let slot = self.read_slot(self.scan_memory(&scan), "a scan").await?;
                holding(self.scan(scan, None)?, slot)
            }
            Ticket::Range {
                object,
                offset,
                length,
                compression,
            } => {
                self.check_range(&who, &object)?;
                let slot = self
                    .read_slot(self.range_memory(length), "a range read")
                    .await?;
                let stream = self.range(&object, offset, length, compression)?;
                match peer {
                    Some(p) => holding(metered(stream, self.state.links.of(p)), slot),
                    None => holding(stream, slot),
                }
            }
        };
        Ok(holding(stream, slot))
    }
}
