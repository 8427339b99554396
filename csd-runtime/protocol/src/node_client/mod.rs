//! [`NodeClient`] talks Arrow Flight to one storage node: store tables
//! ([`NodeClient::put`]), list them, scan them back, read object bytes by range, run
//! pushed-down operators ([`NodeClient::operator`]), delete, and read node figures.
//! It lives with the protocol, not the node: a program that only talks to nodes
//! builds it without the node's own code.

mod client;
mod copies;
mod credentials;
mod error;
mod leases;
mod refs;
mod reply;

pub use client::NodeClient;
pub use copies::{Copies, Declined, Next, Tried};
pub use credentials::Credentials;
pub use error::{Error, RETRY_BUDGET, Result};
pub use leases::{HeldLease, Invoked};
pub use refs::Kept;
pub use reply::{OperatorReply, ReplyStats, TableInfo};
