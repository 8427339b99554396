//! The node's own actions: `stats`, `scrub`, `delete`, `objects`.

use crate::auth::{Permission, Principal};
use crate::error::Result;
use crate::protocol::actions::{
    DeleteRequest, DeleteResponse, ObjectsRequest, ScrubRequest, StatsRequest,
};
use crate::protocol::messages::ObjectEntry;

use super::super::{FlightNode, json_result};

impl FlightNode {
    /// `stats`: the node's figures (admins only).
    pub(super) async fn stats(
        &self,
        who: &Principal,
        _: StatsRequest,
    ) -> Result<arrow_flight::Result> {
        who.check_admin("read the node's figures (stats)")?;
        json_result(&self.state.stats().await)
    }

    /// `scrub`: every stored object (or those under a prefix) read from the device
    /// and checked (admins only).
    pub(super) async fn scrub(
        &self,
        who: &Principal,
        r: ScrubRequest,
    ) -> Result<arrow_flight::Result> {
        who.check_admin("scrub the node's objects")?;
        json_result(&self.state.store().scrub(&r.prefix).await?)
    }

    /// `delete`: a table, or one partition of it.
    pub(super) async fn delete(
        &self,
        who: &Principal,
        r: DeleteRequest,
    ) -> Result<arrow_flight::Result> {
        self.check_table(who, Permission::Delete, &r.table)?;
        let n = self
            .state
            .node
            .tables
            .delete(&r.table, r.partition.as_deref(), &r.remember)
            .await?;
        json_result(&DeleteResponse {
            deleted_objects: n as u64,
        })
    }

    /// `objects`: the stored objects whose names start with a prefix (admins only).
    pub(super) fn objects(
        &self,
        who: &Principal,
        r: ObjectsRequest,
    ) -> Result<arrow_flight::Result> {
        who.check_admin("list the node's objects")?;
        let list: Vec<ObjectEntry> = self
            .state
            .store()
            .list(&r.prefix)
            .iter()
            .map(|o| o.entry())
            .collect();
        json_result(&list)
    }
}
