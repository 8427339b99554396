//! What the node holds, described: `ListFlights`, `GetFlightInfo` of a table and
//! `GetSchema`. Each table is a `FlightInfo` with its schema, size, one endpoint per
//! partition (a scan ticket, sealed for the asker) and a [`TableDescription`].

use arrow::ipc::writer::IpcWriteOptions;
use arrow_flight::{
    Criteria, FlightDescriptor, FlightEndpoint, FlightInfo, SchemaAsIpc, SchemaResult,
    Ticket as FlightTicket,
};
use tonic::Status;

use super::FlightNode;
use crate::auth::{Permission, Principal};
use crate::error::{Error, Result};
use crate::protocol::{ObjectDescription, PartitionDescription, TableDescription, Ticket};
use crate::table::{ParquetObject, Table};

impl FlightNode {
    /// `ListFlights`: the tables `who` may read whose names start with the
    /// criteria's expression.
    pub(super) fn list(
        &self,
        who: &Principal,
        criteria: &Criteria,
    ) -> Result<Vec<Result<FlightInfo, Status>>> {
        let prefix = std::str::from_utf8(&criteria.expression).map_err(|_| {
            Error::InvalidArgument("criteria expression must be a UTF-8 table-name prefix".into())
        })?;
        let tables = &self.state.node.tables;
        // A table whose partitions are all deleted here is listed with its
        // remembered deletes alone: a node out of reach may still hold a copy.
        let deleted_only = tables.deleted_tables().into_iter().map(|name| Table {
            name,
            schema: std::sync::Arc::new(arrow::datatypes::Schema::empty()),
            partitions: Default::default(),
            damaged: Default::default(),
        });
        Ok(tables
            .tables()
            .into_iter()
            .chain(deleted_only)
            .filter(|t| {
                t.name.starts_with(prefix)
                    && if crate::refs::is_ref_table(&t.name) {
                        self.check_table(who, Permission::Read, &t.name).is_ok()
                    } else {
                        who.may(Permission::Read, &t.name)
                    }
            })
            .map(|t| self.flight_info(&t, who).map_err(|e| e.to_status()))
            .collect())
    }

    /// `GetFlightInfo` of a path descriptor: one table.
    pub(super) fn describe(&self, who: &Principal, desc: &FlightDescriptor) -> Result<FlightInfo> {
        let table = table_of(desc)?;
        self.check_table(who, Permission::Read, &table)?;
        self.flight_info(&self.state.node.tables.table(&table)?, who)
    }

    /// `GetSchema`: one table's schema.
    pub(super) fn schema(&self, who: &Principal, desc: &FlightDescriptor) -> Result<SchemaResult> {
        let table = table_of(desc)?;
        self.check_table(who, Permission::Read, &table)?;
        let t = self.state.node.tables.table(&table)?;
        Ok(SchemaAsIpc::new(&t.schema, &IpcWriteOptions::default()).try_into()?)
    }

    pub(super) fn flight_info(&self, t: &Table, who: &Principal) -> Result<FlightInfo> {
        let desc = TableDescription {
            table: t.name.clone(),
            deleted: self.state.node.tables.deleted_of(&t.name),
            distinct: t.distinct(t.partitions.values().flatten()),
            partitions: t
                .partitions
                .iter()
                .map(|(name, objects)| PartitionDescription {
                    name: name.clone(),
                    distinct: t.distinct(objects.iter()),
                    lost: t.damaged.get(name).cloned().unwrap_or_default(),
                    rows: objects.iter().map(ParquetObject::rows).sum(),
                    copies: objects.iter().map(ParquetObject::copies).min().unwrap_or(1),
                    bytes: objects.iter().map(|o| o.object.len).sum(),
                    objects: objects
                        .iter()
                        .map(|o| ObjectDescription {
                            name: o.object.name.clone(),
                            len: o.object.len,
                            rows: o.rows(),
                            row_groups: o.metadata.metadata().num_row_groups(),
                            int_ranges: o.int_ranges(),
                            digest: Some(o.object.digest()),
                        })
                        .collect(),
                })
                .collect(),
        };
        let mut info = FlightInfo::new()
            .try_with_schema(&t.schema)?
            .with_descriptor(FlightDescriptor::new_path(vec![t.name.clone()]))
            .with_total_records(t.rows() as i64)
            .with_total_bytes(t.bytes() as i64)
            .with_app_metadata(serde_json::to_vec(&desc).map_err(|e| {
                Error::external(crate::StatusCode::Internal, "a table description", e)
            })?);
        for p in t.partitions.keys() {
            let ticket = Ticket::Scan {
                table: t.name.clone(),
                partition: Some(p.clone()),
                columns: vec![],
                skip: 0,
                limit: None,
            };
            info = info.with_endpoint(
                FlightEndpoint::new()
                    .with_ticket(FlightTicket::new(self.ticket_for(who, &ticket)))
                    .with_location(self.state.location.clone())
                    .with_app_metadata(p.clone()),
            );
        }
        Ok(info)
    }
}

/// The table a path descriptor names.
fn table_of(desc: &FlightDescriptor) -> Result<String> {
    match desc.path.as_slice() {
        [t] => Ok(t.clone()),
        _ => Err(Error::InvalidArgument(
            "descriptor must be a path naming one table".into(),
        )),
    }
}
