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
        let digest = self.state.node.attachments.put(body).await?;
        json_result(&PutAttachmentResponse {
            digest: digest.to_string(),
            bytes,
            kept_secs: KEEP.as_secs(),
        })
    }
}
