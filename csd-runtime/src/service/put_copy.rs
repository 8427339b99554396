//! `DoPut` of an object copy ([`PUT_OBJECT_COPY`]): another node's Parquet object of
//! a partition, stored byte for byte (never decoded as Arrow) so that the two copies
//! stay replicas — how `csd repair` gives a partition its copies back. Like any
//! upload it needs `write` on the table, counts against the tenant's quota, and
//! stores nothing unless the stream ends with its end marker.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arrow_flight::FlightData;
use futures::StreamExt;
use tonic::Streaming;

use super::FlightNode;
use crate::auth::{Permission, Principal};
use crate::error::{Error, Result};
use crate::protocol::ipc::map_incoming;
use crate::protocol::{PUT_END, PUT_OBJECT_COPY, PutSummary};

impl FlightNode {
    /// Stores the object copy whose first message is `first`.
    pub(super) async fn put_object_copy(
        &self,
        first: FlightData,
        input: Streaming<FlightData>,
        who: &Principal,
    ) -> Result<PutSummary> {
        debug_assert_eq!(first.app_metadata.as_ref(), PUT_OBJECT_COPY);
        let path = first
            .flight_descriptor
            .as_ref()
            .map(|d| d.path.clone())
            .unwrap_or_default();
        let [table, partition] = path.as_slice() else {
            return Err(Error::InvalidArgument(
                "an object copy's DoPut descriptor must be the path [table, partition]".into(),
            ));
        };
        crate::table::validate_table_name(table)?;
        crate::table::validate_partition_name(partition)?;
        self.check_table(who, Permission::Write, table)?;
        let quota = who.tenant().and_then(|t| t.max_stored_bytes).is_some();
        let stored = quota.then(|| self.stored_by(who));
        who.check_stored(stored.unwrap_or(0), 0)?;
        let ended = Arc::new(AtomicBool::new(false));
        let seen_end = ended.clone();
        let counters = self.state.clone();
        let mut received = 0u64;
        let who = who.clone();
        let pieces = futures::stream::once(async { Ok(first) })
            .chain(input)
            .map(move |m| {
                let m = m.map_err(map_incoming)?;
                if seen_end.load(Ordering::Acquire) {
                    return Err(Error::InvalidArgument(
                        "DoPut sent messages after its end marker".into(),
                    ));
                }
                if m.app_metadata.as_ref() == PUT_END {
                    seen_end.store(true, Ordering::Release);
                }
                received += m.data_body.len() as u64;
                if let Some(stored) = stored {
                    who.check_stored(stored, received)?;
                }
                counters
                    .counters
                    .bytes_received
                    .fetch_add(m.data_body.len() as u64, Ordering::Relaxed);
                Ok(m.data_body)
            })
            .chain(futures::stream::once(async move {
                if ended.load(Ordering::Acquire) {
                    Ok(bytes::Bytes::new())
                } else {
                    Err(Error::InvalidArgument(
                        "the object copy's DoPut stream was cut off before its end; nothing \
                         was stored"
                            .into(),
                    ))
                }
            }))
            .boxed();
        let summary = self
            .state
            .node
            .tables
            .adopt(table, partition, pieces)
            .await?;
        tracing::info!(table = %summary.table, partition = %summary.partition, bytes = summary.bytes, "stored a copy of another node's object");
        Ok(summary)
    }
}
