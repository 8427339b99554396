//! What the node answers: a table's description ([`TableInfo`]) and an operator's
//! (or a kept result's) answer, its batches with its bytes and trailing report
//! counted as they arrive ([`OperatorReply`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use arrow_flight::decode::{DecodedPayload, FlightDataDecoder};
use arrow_flight::error::FlightError;
use arrow_flight::{FlightData, FlightInfo};
use futures::StreamExt;
use futures::stream::BoxStream;

use super::error::{Error, Result};
use crate::messages::{OperatorReport, TableDescription};

/// A table as a node describes it.
#[derive(Debug, Clone)]
pub struct TableInfo {
    /// Name.
    pub name: String,
    /// Arrow schema.
    pub schema: SchemaRef,
    /// Rows.
    pub rows: u64,
    /// Stored bytes.
    pub bytes: u64,
    /// Partitions and their objects.
    pub description: TableDescription,
}

impl TryFrom<FlightInfo> for TableInfo {
    type Error = Error;
    fn try_from(info: FlightInfo) -> Result<Self> {
        let schema = std::sync::Arc::new(info.clone().try_decode_schema()?);
        let description: TableDescription = serde_json::from_slice(&info.app_metadata)
            .map_err(|e| Error::Protocol(format!("table description: {e}")))?;
        Ok(TableInfo {
            name: description.table.clone(),
            schema,
            rows: info.total_records.max(0) as u64,
            bytes: info.total_bytes.max(0) as u64,
            description,
        })
    }
}

/// An operator's (or a kept result's) answer: its batches, and its bytes and
/// trailing report counted as they arrive.
pub(super) fn reply_of(inner: tonic::Streaming<FlightData>) -> OperatorReply {
    let stats = Arc::new(ReplyStats::default());
    // The trailing report has no IPC header (arrow-flight's decoder would refuse
    // it): take it out here.
    let counted = inner.filter_map({
        let stats = stats.clone();
        move |d| {
            let out = match d {
                Ok(d) => {
                    stats.bytes_received.fetch_add(
                        (d.data_header.len() + d.data_body.len()) as u64,
                        Ordering::Relaxed,
                    );
                    if d.data_header.is_empty() && !d.app_metadata.is_empty() {
                        match serde_json::from_slice(&d.app_metadata) {
                            Ok(r) => {
                                if let Ok(mut g) = stats.report.lock() {
                                    *g = Some(r);
                                }
                                None
                            }
                            Err(e) => Some(Err(FlightError::ProtocolError(format!(
                                "request report: {e}"
                            )))),
                        }
                    } else {
                        Some(Ok(d))
                    }
                }
                Err(s) => Some(Err(FlightError::Tonic(Box::new(s)))),
            };
            futures::future::ready(out)
        }
    });
    let batches = FlightDataDecoder::new(counted)
        .filter_map(|d| {
            futures::future::ready(match d {
                Err(e) => Some(Err(Error::from(e))),
                Ok(d) => match d.payload {
                    DecodedPayload::RecordBatch(b) => Some(Ok(b)),
                    DecodedPayload::Schema(_) | DecodedPayload::None => None,
                },
            })
        })
        .boxed();
    OperatorReply { batches, stats }
}

/// The answer of [`NodeClient::operator`]: a stream of batches and, once it has
/// ended, the node's [`OperatorReport`].
pub struct OperatorReply {
    /// The batches.
    pub batches: BoxStream<'static, Result<RecordBatch>>,
    /// Bytes received and the node's report (filled as the stream is read).
    pub stats: Arc<ReplyStats>,
}

/// What a client learns about one operator request.
#[derive(Debug, Default)]
pub struct ReplyStats {
    /// Bytes of `FlightData` headers and bodies received.
    pub bytes_received: AtomicU64,
    /// The node's report, once the stream has ended.
    pub report: Mutex<Option<OperatorReport>>,
}

impl ReplyStats {
    /// The node's report, if it has arrived.
    pub fn report(&self) -> Option<OperatorReport> {
        self.report.lock().ok().and_then(|g| g.clone())
    }
}
