//! What the node sends, compressed piece by piece with the codec its moment calls
//! for ([`Compression::Auto`](crate::protocol::Compression::Auto)): LZ4 while the
//! answer leaves as fast as the node makes it, zstd while earlier pieces still wait
//! to be sent — the link, or the asker, is what holds the answer back, so the
//! node's extra compression costs it no time and the link carries fewer bytes. An
//! operator's answer ([`encode`]) learns this from its queue; a byte range
//! ([`Behind`]) from whether the next piece was ready when the network asked for it.
//! Every piece names its own codec (in its IPC header, or a range piece's
//! `app_metadata`), so a stream may mix them.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow::ipc::CompressionType;
use arrow::ipc::writer::{DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions};
use arrow::record_batch::RecordBatch;
use arrow_flight::error::FlightError;
use arrow_flight::{FlightData, SchemaAsIpc};
use futures::{Stream, StreamExt};

use crate::protocol::Compression;

/// zstd's fastest standard level: the piece waits for the link either way, and the
/// node's cores are its scarcest resource.
const ZSTD_LEVEL: i32 = 1;

/// A piece's codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Codec {
    Lz4,
    Zstd,
}

impl Codec {
    /// As the protocol names it.
    pub(super) fn compression(self) -> Compression {
        match self {
            Codec::Lz4 => Compression::Lz4Frame,
            Codec::Zstd => Compression::Zstd,
        }
    }

    /// The codec of the next piece, after this one, when `waiting` encoded pieces are
    /// queued of at most `capacity`: zstd from half full, LZ4 once the queue has
    /// drained, as before in between (so one late send does not flip every piece).
    pub(super) fn next(self, waiting: usize, capacity: usize) -> Codec {
        if waiting * 2 >= capacity.max(1) {
            Codec::Zstd
        } else if waiting == 0 {
            Codec::Lz4
        } else {
            self
        }
    }
}

/// Whether a stream's receiver finds its pieces waiting: set by [`Behind::watch`]
/// as the network takes each piece, read by the code making the next ones.
#[derive(Clone, Default)]
pub(super) struct Behind(Arc<AtomicBool>);

impl Behind {
    /// The codec for the next piece made.
    pub(super) fn codec(&self) -> Codec {
        if self.0.load(Ordering::Relaxed) {
            Codec::Zstd
        } else {
            Codec::Lz4
        }
    }

    /// `stream`, telling this gauge for every piece whether it was ready at the first
    /// ask (sending lags making: behind) or had to be waited for (making lags).
    pub(super) fn watch<S: Stream + Unpin>(&self, stream: S) -> Watched<S> {
        Watched {
            inner: stream,
            asked: false,
            behind: self.clone(),
        }
    }
}

/// See [`Behind::watch`].
pub(super) struct Watched<S> {
    inner: S,
    /// The current piece was asked for before and was not ready.
    asked: bool,
    behind: Behind,
}

impl<S: Stream + Unpin> Stream for Watched<S> {
    type Item = S::Item;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let first = !self.asked;
        let p = self.inner.poll_next_unpin(cx);
        match &p {
            Poll::Pending => {
                if first {
                    self.behind.0.store(false, Ordering::Relaxed);
                }
                self.asked = true;
            }
            Poll::Ready(_) => {
                if first {
                    self.behind.0.store(true, Ordering::Relaxed);
                }
                self.asked = false;
            }
        }
        p
    }
}

/// Whether `schema` can be encoded piece by piece here: it has no dictionary
/// anywhere (dictionaries need the Flight encoder's hydration; such an answer goes
/// LZ4 throughout).
pub(super) fn adaptable(schema: &Schema) -> bool {
    fn plain(t: &DataType) -> bool {
        match t {
            DataType::Dictionary(..) => false,
            DataType::List(f)
            | DataType::LargeList(f)
            | DataType::ListView(f)
            | DataType::LargeListView(f)
            | DataType::FixedSizeList(f, _)
            | DataType::Map(f, _) => plain(f.data_type()),
            DataType::Struct(fs) => fs.iter().all(|f| plain(f.data_type())),
            DataType::Union(fs, _) => fs.iter().all(|(_, f)| plain(f.data_type())),
            DataType::RunEndEncoded(a, b) => plain(a.data_type()) && plain(b.data_type()),
            _ => true,
        }
    }
    schema.fields().iter().all(|f| plain(f.data_type()))
}

/// Encodes pieces of one schema, each with the codec asked for it.
struct Encoder {
    lz4: IpcWriteOptions,
    zstd: IpcWriteOptions,
    data: IpcDataGenerator,
    dictionaries: DictionaryTracker,
    context: IpcWriteContext,
}

impl Encoder {
    fn new() -> Result<Encoder, FlightError> {
        Ok(Encoder {
            lz4: IpcWriteOptions::default()
                .try_with_compression(Some(CompressionType::LZ4_FRAME))?,
            zstd: IpcWriteOptions::default()
                .try_with_compression(Some(CompressionType::ZSTD))?
                .try_with_compression_level(Some(ZSTD_LEVEL))?,
            data: IpcDataGenerator::default(),
            dictionaries: DictionaryTracker::new(true),
            context: IpcWriteContext::default(),
        })
    }

    fn schema(&self, schema: &Schema) -> FlightData {
        SchemaAsIpc::new(schema, &self.lz4).into()
    }

    fn piece(&mut self, batch: &RecordBatch, codec: Codec) -> Result<FlightData, FlightError> {
        let options = match codec {
            Codec::Lz4 => &self.lz4,
            Codec::Zstd => &self.zstd,
        };
        let (dictionaries, encoded) =
            self.data
                .encode(batch, &mut self.dictionaries, options, &mut self.context)?;
        if !dictionaries.is_empty() {
            return Err(FlightError::protocol(
                "an answer with dictionaries reached the adaptive encoder",
            ));
        }
        Ok(encoded.into())
    }
}

/// `batches` (pieces already cut to the node's wire size, of `schema`, which must be
/// [`adaptable`]) as Flight messages: the schema, then one message per piece, its
/// codec chosen by [`Codec::next`] from `waiting()`, the number of messages queued
/// ahead of it of at most `capacity`.
pub(super) fn encode<S, W>(
    schema: SchemaRef,
    batches: S,
    waiting: W,
    capacity: usize,
) -> Result<impl Stream<Item = Result<FlightData, FlightError>> + Send, FlightError>
where
    S: Stream<Item = Result<RecordBatch, FlightError>> + Send,
    W: Fn() -> usize + Send,
{
    let mut encoder = Encoder::new()?;
    let first = encoder.schema(&schema);
    let mut codec = Codec::Lz4;
    let pieces = batches.map(move |b| {
        codec = codec.next(waiting(), capacity);
        encoder.piece(&b?, codec)
    });
    Ok(futures::stream::once(async move { Ok(first) }).chain(pieces))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use arrow::array::{ArrayRef, Int64Array, StringArray};
    use arrow::datatypes::{Field, Fields};
    use arrow_flight::decode::FlightRecordBatchStream;
    use futures::TryStreamExt;

    use super::*;

    fn batch(seed: i64) -> RecordBatch {
        let n = 4096;
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values((0..n).map(|i| seed * n + i)));
        let names: ArrayRef =
            Arc::new(StringArray::from_iter((0..n).map(|i| {
                (i % 7 != 0).then(|| format!("name-{}", (seed + i) % 100))
            })));
        RecordBatch::try_from_iter([("id", ids), ("name", names)]).unwrap()
    }

    /// Each message's codec, read back from its IPC header (`None`: not compressed).
    fn codecs(messages: &[FlightData]) -> Vec<Option<CompressionType>> {
        messages
            .iter()
            .filter_map(|m| {
                let message = arrow::ipc::root_as_message(&m.data_header).unwrap();
                let batch = message.header_as_record_batch()?;
                Some(batch.compression().map(|c| c.codec()))
            })
            .collect()
    }

    async fn run(waiting: Vec<usize>) -> (Vec<FlightData>, Vec<RecordBatch>) {
        let input: Vec<RecordBatch> = (0..waiting.len() as i64).map(batch).collect();
        let schema = input[0].schema();
        let step = Arc::new(AtomicUsize::new(0));
        let w = {
            let step = step.clone();
            move || waiting[step.fetch_add(1, Ordering::Relaxed)]
        };
        let s = futures::stream::iter(input.clone().into_iter().map(Ok));
        let messages: Vec<FlightData> = encode(schema, s, w, 4)
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        (messages, input)
    }

    #[tokio::test]
    async fn pieces_go_zstd_while_the_queue_backs_up_and_lz4_once_it_drains() {
        let (messages, input) = run(vec![0, 3, 1, 4, 1, 0, 1]).await;
        let lz4 = Some(CompressionType::LZ4_FRAME);
        let zstd = Some(CompressionType::ZSTD);
        assert_eq!(
            codecs(&messages),
            vec![lz4, zstd, zstd, zstd, zstd, lz4, lz4]
        );
        // Read back by Arrow's own Flight decoder, the pieces are the batches sent.
        let decoded: Vec<RecordBatch> = FlightRecordBatchStream::new_from_flight_data(
            futures::stream::iter(messages.into_iter().map(Ok)),
        )
        .try_collect()
        .await
        .unwrap();
        assert_eq!(decoded, input);
    }

    #[tokio::test]
    async fn zstd_pieces_are_smaller_than_lz4_ones_of_the_same_rows() {
        let size = |m: &[FlightData]| m.iter().map(|d| d.data_body.len()).sum::<usize>();
        let (lz4, _) = run(vec![0; 3]).await;
        let (zstd, _) = run(vec![4; 3]).await;
        assert!(
            size(&zstd) < size(&lz4),
            "{} vs {}",
            size(&zstd),
            size(&lz4)
        );
    }

    #[tokio::test]
    async fn a_range_goes_zstd_while_its_pieces_wait_for_the_network() {
        let behind = Behind::default();
        let (tx, rx) = tokio::sync::mpsc::channel::<u32>(8);
        let mut watched = behind.watch(tokio_stream::wrappers::ReceiverStream::new(rx));
        // Asked before anything is made: the network waits, LZ4.
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut watched).poll_next(&mut cx).is_pending());
        tx.send(1).await.unwrap();
        assert_eq!(watched.next().await, Some(1));
        assert_eq!(behind.codec(), Codec::Lz4);
        // Pieces made before the network asks: zstd.
        tx.send(2).await.unwrap();
        tx.send(3).await.unwrap();
        assert_eq!(watched.next().await, Some(2));
        assert_eq!(behind.codec(), Codec::Zstd);
        assert_eq!(watched.next().await, Some(3));
        assert!(Pin::new(&mut watched).poll_next(&mut cx).is_pending());
        assert_eq!(behind.codec(), Codec::Lz4);
    }

    #[test]
    fn only_answers_without_dictionaries_are_adaptable() {
        let dict = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
        let plain = Schema::new(vec![Field::new("a", DataType::Int64, true)]);
        let top = Schema::new(vec![Field::new("d", dict.clone(), true)]);
        let nested = Schema::new(vec![Field::new(
            "s",
            DataType::Struct(Fields::from(vec![Field::new("d", dict, true)])),
            true,
        )]);
        assert!(adaptable(&plain));
        assert!(!adaptable(&top));
        assert!(!adaptable(&nested));
    }
}
