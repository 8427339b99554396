//! Incoming Arrow IPC (`DoPut`): every message is checked before arrow decodes it,
//! and a decoder panic is a refused put, not a task ending without a status. The
//! service and the `do_put` fuzz target run the same functions.

use arrow_flight::FlightData;
use arrow_flight::decode::{DecodedPayload, FlightDataDecoder};
use arrow_flight::error::FlightError;
use futures::StreamExt;
use tonic::Status;

use crate::error::{Error, PeerStatus, Result, StatusCode};

/// Checks that an incoming Arrow IPC message is readable before arrow decodes it:
/// its header is a valid flatbuffer, and every buffer a record or dictionary batch
/// declares lies inside the body that came with it (arrow's decoder assumes so and
/// panics on a short body).
pub fn check_message(m: &FlightData) -> Result<()> {
    if m.data_header.is_empty() {
        return Ok(());
    }
    let bad =
        |why: String| Error::InvalidArgument(format!("DoPut data is not valid Arrow IPC: {why}"));
    let msg = arrow::ipc::root_as_message(&m.data_header)
        .map_err(|e| bad(format!("the message header does not parse ({e})")))?;
    let batch = msg
        .header_as_record_batch()
        .or_else(|| msg.header_as_dictionary_batch().and_then(|d| d.data()));
    let body = m.data_body.len() as u64;
    if msg.bodyLength() < 0 || msg.bodyLength() as u64 > body {
        return Err(bad(format!(
            "the header declares a {} byte body, {body} bytes came",
            msg.bodyLength()
        )));
    }
    if let Some(b) = batch {
        if b.length() < 0 {
            return Err(bad(format!("a batch of {} rows", b.length())));
        }
        for buf in b.buffers().iter().flatten() {
            let end = (buf.offset() as i128) + (buf.length() as i128);
            if buf.offset() < 0 || buf.length() < 0 || end > body as i128 {
                return Err(bad(format!(
                    "a buffer at [{}, {}) lies outside the {body} byte body",
                    buf.offset(),
                    end
                )));
            }
        }
        for node in b.nodes().iter().flatten() {
            if node.length() < 0 || node.null_count() < 0 || node.null_count() > node.length() {
                return Err(bad(format!(
                    "a column of {} rows with {} nulls",
                    node.length(),
                    node.null_count()
                )));
            }
        }
    }
    Ok(())
}

/// The next decoded message of a `DoPut` stream. Messages are checked before arrow
/// decodes them ([`check_message`]); should arrow's decoder still panic on one, the put
/// is refused as malformed rather than its task ending without a status.
pub async fn next_decoded(
    decoder: &mut FlightDataDecoder,
) -> Option<Result<arrow_flight::decode::DecodedFlightData>> {
    use futures::FutureExt;
    match std::panic::AssertUnwindSafe(decoder.next())
        .catch_unwind()
        .await
    {
        Ok(next) => next.map(|r| r.map_err(map_flight)),
        Err(_) => Some(Err(Error::InvalidArgument(
            "DoPut data is not valid Arrow IPC: a message does not match its header".into(),
        ))),
    }
}

/// Tonic answers an over-limit message with OUT_OF_RANGE; to the user that is an
/// exhausted resource (the message size limit).
pub fn map_incoming(s: Status) -> Error {
    if s.code() == tonic::Code::OutOfRange && s.message().contains("too large") {
        Error::external(
            StatusCode::ResourceExhausted,
            "message too large",
            PeerStatus(s),
        )
    } else {
        Error::external(
            StatusCode::InvalidArgument,
            "DoPut stream failed",
            PeerStatus(s),
        )
    }
}

fn map_flight(e: FlightError) -> Error {
    match e {
        FlightError::Tonic(s) => map_incoming(*s),
        FlightError::Arrow(a) => Error::external(
            StatusCode::InvalidArgument,
            "DoPut data is not valid Arrow IPC",
            a,
        ),
        other => Error::from(other),
    }
}

/// A `DoPut` stream decoded as the node's service stores it: every message checked
/// ([`check_message`]) before arrow decodes it, the schema first, then record
/// batches; anything else is refused as `InvalidArgument`. The service's `DoPut`
/// and the `do_put` fuzz target both decode through it.
pub struct PutDecoder {
    decoder: FlightDataDecoder,
}

impl PutDecoder {
    /// Decodes `messages` (the client's, after whatever the caller counts or
    /// limits).
    pub fn new(
        messages: impl futures::Stream<Item = std::result::Result<FlightData, FlightError>>
        + Send
        + 'static,
    ) -> PutDecoder {
        let checked = messages.map(|m| {
            let m = m?;
            check_message(&m).map_err(|e| FlightError::ExternalError(Box::new(e)))?;
            Ok(m)
        });
        PutDecoder {
            decoder: FlightDataDecoder::new(checked),
        }
    }

    /// The stream's schema, which comes first.
    pub async fn schema(&mut self) -> Result<arrow::datatypes::SchemaRef> {
        loop {
            match next_decoded(&mut self.decoder).await {
                Some(Ok(d)) => match d.payload {
                    DecodedPayload::Schema(s) => return Ok(s),
                    DecodedPayload::None => continue,
                    DecodedPayload::RecordBatch(_) => {
                        return Err(Error::InvalidArgument(
                            "DoPut sent a record batch before its schema".into(),
                        ));
                    }
                },
                Some(Err(e)) => return Err(e),
                None => {
                    return Err(Error::InvalidArgument(
                        "DoPut stream ended without a schema".into(),
                    ));
                }
            }
        }
    }

    /// The next record batch after the schema; `None` at the stream's end.
    pub async fn next_batch(&mut self) -> Option<Result<arrow::record_batch::RecordBatch>> {
        loop {
            return match next_decoded(&mut self.decoder).await? {
                Ok(d) => match d.payload {
                    DecodedPayload::RecordBatch(b) => Some(Ok(b)),
                    DecodedPayload::None => continue,
                    DecodedPayload::Schema(_) => Some(Err(Error::InvalidArgument(
                        "DoPut sent a second schema".into(),
                    ))),
                },
                Err(e) => Some(Err(e)),
            };
        }
    }
}

/// Frames `messages` for the `do_put` fuzz target: per message a little-endian u32
/// header length, u32 body length, then the header and body bytes.
pub fn frame(messages: &[FlightData]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in messages {
        out.extend((m.data_header.len() as u32).to_le_bytes());
        out.extend((m.data_body.len() as u32).to_le_bytes());
        out.extend(&m.data_header[..]);
        out.extend(&m.data_body[..]);
    }
    out
}

/// The messages [`frame`] wrote (a short tail is dropped; lengths are clamped to
/// what is left).
pub fn unframe(mut data: &[u8]) -> Vec<FlightData> {
    let mut out = Vec::new();
    while data.len() >= 8 {
        let h = u32::from_le_bytes([data[0], data[1], data[2], data[3]]) as usize;
        let b = u32::from_le_bytes([data[4], data[5], data[6], data[7]]) as usize;
        data = &data[8..];
        let h = h.min(data.len());
        let header = data[..h].to_vec();
        data = &data[h..];
        let b = b.min(data.len());
        let body = data[..b].to_vec();
        data = &data[b..];
        out.push(FlightData {
            data_header: header.into(),
            data_body: body.into(),
            ..Default::default()
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::record_batch::RecordBatch;
    use arrow_flight::encode::FlightDataEncoderBuilder;
    use futures::TryStreamExt;

    use super::*;

    /// The schema and rows of a whole stream, decoded as the service does.
    async fn decode(messages: Vec<FlightData>) -> Result<(arrow::datatypes::SchemaRef, usize)> {
        let mut d = PutDecoder::new(futures::stream::iter(messages.into_iter().map(Ok)));
        let schema = d.schema().await?;
        let mut rows = 0;
        while let Some(b) = d.next_batch().await {
            rows += b?.num_rows();
        }
        Ok((schema, rows))
    }

    async fn good() -> Vec<FlightData> {
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int64, false),
            Field::new("s", DataType::Utf8, true),
        ]));
        let b = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from_iter_values(0..50)),
                Arc::new(StringArray::from_iter(
                    (0..50).map(|i| (i % 3 > 0).then(|| format!("v{i}"))),
                )),
            ],
        )
        .unwrap();
        FlightDataEncoderBuilder::new()
            .build(futures::stream::iter([Ok(b.clone()), Ok(b)]))
            .try_collect()
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn framing_round_trips_and_a_good_stream_decodes() {
        let msgs = good().await;
        let again = unframe(&frame(&msgs));
        assert_eq!(again.len(), msgs.len());
        let (schema, rows) = decode(again).await.unwrap();
        assert_eq!((schema.fields().len(), rows), (2, 100));
    }

    /// Every truncation and byte flip of a good stream decodes or is refused as
    /// INVALID_ARGUMENT: no panic, no other status.
    #[tokio::test]
    async fn mangled_streams_are_refused_as_invalid_argument() {
        let bytes = frame(&good().await);
        let mut refused = 0;
        let mut tried = 0;
        for cut in (0..bytes.len()).step_by(7) {
            tried += 1;
            if let Err(e) = decode(unframe(&bytes[..cut])).await {
                assert_eq!(e.status_code(), crate::StatusCode::InvalidArgument, "{e}");
                refused += 1;
            }
        }
        for i in 8..bytes.len() {
            for bit in [0u8, 3, 7] {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                tried += 1;
                if let Err(e) = decode(unframe(&b)).await {
                    assert_eq!(e.status_code(), crate::StatusCode::InvalidArgument, "{e}");
                    refused += 1;
                }
            }
        }
        assert!(refused > tried / 4, "{refused} of {tried} refused");
    }

    /// Found by the fuzz target in its first second: a schema field of type NONE,
    /// on which arrow's IPC schema conversion panics. Refused, not a crash.
    #[tokio::test]
    async fn a_schema_field_of_no_type_is_refused() {
        let data = include_bytes!("../../fuzz/seeds/do_put/schema_type_none");
        let e = decode(unframe(data)).await.unwrap_err();
        assert_eq!(e.status_code(), crate::StatusCode::InvalidArgument, "{e}");
    }

    /// Writes the fuzz target's seed (`cargo test -p csd-runtime -- --ignored`).
    #[tokio::test]
    #[ignore]
    async fn write_fuzz_seed() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/seeds/do_put");
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(format!("{dir}/two_batches"), frame(&good().await)).unwrap();
    }
}
