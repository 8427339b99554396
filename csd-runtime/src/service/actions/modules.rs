//! `put_module`: a WebAssembly module's bytes, checked, compiled once and kept.

use bytes::Bytes;

use super::super::{FlightNode, json_result};
use crate::auth::{Permission, Principal};
use crate::error::Result;
use crate::protocol::actions::PutModuleResponse;
use crate::sandbox::ModuleDigest;

impl FlightNode {
    /// `put_module`: needs the tenant's `code` permission.
    pub(super) async fn put_module(
        &self,
        who: &Principal,
        body: Bytes,
    ) -> Result<arrow_flight::Result> {
        who.check_any(Permission::Code, "ship code (put_module)")?;
        let sandbox = self.state.node.sandbox.clone();
        // Hashing and compiling are CPU work: on the pool, never on the RPC threads.
        let (m, had) = self
            .state
            .node
            .pool
            .spawn(async move {
                let had = sandbox.has(&ModuleDigest::of(&body));
                sandbox.compile(&body).await.map(|m| (m, had))
            })
            .await?;
        json_result(&PutModuleResponse {
            digest: m.digest.to_string(),
            bytes: m.bytes as u64,
            compiled: !had,
        })
    }
}
