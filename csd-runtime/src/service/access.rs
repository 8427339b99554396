//! Who may do what to which table, object or kept result: the checks every RPC
//! makes before it touches anything, and the tickets handed out to a tenant.

use arrow_flight::{FlightEndpoint, Ticket as FlightTicket};
use base64::Engine as _;

use super::FlightNode;
use crate::auth::{Permission, Principal};
use crate::error::{Error, Result, truncated};
use crate::protocol::Ticket;
use crate::table::Table;

impl FlightNode {
    /// A ticket to hand out to `who`: sealed (bound to its tenant, expiring) when the
    /// node has tenants.
    pub(super) fn ticket_for(&self, who: &Principal, ticket: &Ticket) -> Vec<u8> {
        match who.tenant() {
            Some(_) => {
                self.state
                    .ticket_key
                    .seal(ticket.encode(), who.name(), self.state.ticket_ttl)
            }
            None => ticket.encode(),
        }
    }

    /// `Ok` if `who` may read raw bytes of `object`: an object of a table it may
    /// read, or any table's with `admin`. The node's own objects are never served.
    pub(super) fn check_range(&self, who: &Principal, object: &str) -> Result<()> {
        match crate::table::parse_object_name(object) {
            Some((table, _, _)) if crate::refs::is_ref_table(table) => {
                self.check_table(who, Permission::Read, table)
            }
            _ => who.check_object_read(object),
        }
    }

    /// `Ok` if `who` may do `p` to `table`: the tenant's permissions, and for kept
    /// results' tables, reading only, by the tenant that kept them (or an admin).
    pub(super) fn check_table(&self, who: &Principal, p: Permission, table: &str) -> Result<()> {
        if !crate::refs::is_ref_table(table) {
            return who.check(p, table);
        }
        if p != Permission::Read {
            return Err(who.refuse(format!(
                "table {} holds kept results: it is read-only (release them with the `release` action)",
                truncated(table)
            )));
        }
        self.state.refs.check_table(table, Self::ref_owner(who))
    }

    /// Whose references `who` may use: its own when the node has tenants (all, for
    /// an admin); on an open node a reference's ticket is the capability.
    pub(super) fn ref_owner(who: &Principal) -> Option<&str> {
        match who.tenant() {
            Some(t) if !t.has(Permission::Admin) => Some(who.name()),
            _ => None,
        }
    }

    /// The kept result a ticket of an endpoint names (its seal checked for `who`).
    pub(super) fn ref_of(&self, who: &Principal, ticket: &[u8]) -> Result<String> {
        let (t, seal) = Ticket::decode_sealed(ticket)?;
        if let Some(seal) = &seal {
            self.state.ticket_key.verify(seal, who)?;
        }
        match t {
            Ticket::Ref { id } => Ok(id),
            _ => Err(Error::InvalidArgument(
                "the endpoint's ticket is not a kept result's (only those can be renewed or released)".into(),
            )),
        }
    }

    /// Bytes stored now in the tables `who` may write and its kept results (its
    /// quota's measure).
    pub(super) fn stored_by(&self, who: &Principal) -> u64 {
        self.state
            .node
            .tables
            .tables()
            .iter()
            .filter(|t| !crate::refs::is_ref_table(&t.name) && who.may(Permission::Write, &t.name))
            .map(Table::bytes)
            .sum::<u64>()
            + self.state.refs.bytes_of(who.name())
    }

    /// The endpoint of a kept result for tenant `holder` (its owner or a grantee): a
    /// `Ref` ticket (sealed for `holder` when the node has tenants, the seal lasting
    /// as long as the reference does, renewals included), this node, and the
    /// reference's expiry.
    pub(super) fn ref_endpoint(&self, holder: &str, r: &crate::refs::RefInfo) -> FlightEndpoint {
        let ticket = Ticket::Ref { id: r.id.clone() }.encode();
        let ticket = match self.state.auth.enabled() {
            true => self.state.ticket_key.seal_until(ticket, holder, u64::MAX),
            false => ticket,
        };
        FlightEndpoint::new()
            .with_ticket(FlightTicket::new(ticket))
            .with_location(self.state.location.clone())
            .with_expiration_time(crate::refs::timestamp(r.expires_unix_ms))
            .with_app_metadata(r.table.clone())
    }

    /// A kept result as `refs` and `grant` describe it, with its ticket for `holder`.
    pub(super) fn ref_description(
        &self,
        holder: &str,
        r: &crate::refs::RefInfo,
    ) -> crate::protocol::actions::RefDescription {
        crate::protocol::actions::RefDescription {
            info: r.clone(),
            ticket: base64::engine::general_purpose::STANDARD.encode(
                self.ref_endpoint(holder, r)
                    .ticket
                    .map(|t| t.ticket)
                    .unwrap_or_default(),
            ),
            location: self.state.location.clone(),
        }
    }
}
