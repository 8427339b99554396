//! `put_attachment`: bytes several requests share, kept by their digest.

use bytes::Bytes;

use super::super::{FlightNode, json_result};
use crate::attachments::KEEP;
use crate::auth::{Permission, Principal};
use crate::error::Result;
use crate::protocol::actions::PutAttachmentResponse;

impl FlightNode {
    /// `put_attachment`: needs the tenant's `read` permission on some table (what
    /// the requests that name an attachment need).
    pub(super) async fn put_attachment(
        &self,
        who: &Principal,
        body: Bytes,
    ) -> Result<arrow_flight::Result> {
        who.check_any(Permission::Read, "send attachments (put_attachment)")?;
        let bytes = body.len() as u64;
        // Hashing up to 4 MiB is CPU work: on the pool, never on the RPC threads.
        let attachments = self.state.node.attachments.clone();
        let digest = self
            .state
            .node
            .pool
            .spawn(async move { attachments.put(body).await })
            .await?;
        json_result(&PutAttachmentResponse {
            digest: digest.to_string(),
            bytes,
            kept_secs: KEEP.as_secs(),
        })
    }
}
