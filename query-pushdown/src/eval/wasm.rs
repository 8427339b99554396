//! Running a shipped module over a stream of batches: at the node over a pushed
//! scan, at the compute side over a scan handed back, and for the merge of an
//! aggregate's partial states.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use csd_protocol::{Error, Result};
use csd_sandbox::{CompiledModule, GuestKind, GuestReader, Sandbox};
use futures::StreamExt;
use futures::stream::BoxStream;

/// What a guest run reports when it is over.
#[derive(Debug, Default)]
pub(crate) struct GuestFigures {
    kind: AtomicU8,
    cpu_us: AtomicU64,
}

impl GuestFigures {
    /// The guest's kind (known once it started).
    pub(crate) fn kind(&self) -> GuestKind {
        match self.kind.load(Ordering::Relaxed) {
            1 => GuestKind::Aggregate,
            _ => GuestKind::Rows,
        }
    }

    /// Time spent in the guest, in ms.
    #[cfg(feature = "node")]
    pub(crate) fn cpu_ms(&self) -> f64 {
        self.cpu_us.load(Ordering::Relaxed) as f64 / 1e3
    }
}

/// The arguments a guest sees: the request's, plus the phase.
pub(crate) fn guest_args(
    args: &BTreeMap<String, String>,
    phase: &str,
    extra: &[(&str, String)],
) -> BTreeMap<String, String> {
    let mut a = args.clone();
    a.insert("csd.phase".into(), phase.into());
    for (k, v) in extra {
        a.insert((*k).to_string(), v.clone());
    }
    a
}

/// Runs `module` over `input` on a blocking thread of the current runtime (the
/// guest's host reads wait there; the CPU it uses is the request's one slot); its
/// outputs come back through a two-batch channel. Every output must have the first
/// one's schema.
pub(crate) fn run_guest(
    sandbox: Arc<Sandbox>,
    module: Arc<CompiledModule>,
    args: BTreeMap<String, String>,
    reader: Option<Arc<dyn GuestReader>>,
    mut input: BoxStream<'static, Result<RecordBatch>>,
    figures: Arc<GuestFigures>,
) -> BoxStream<'static, Result<RecordBatch>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<RecordBatch>>(2);
    let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let on_drop = CancelOnDrop(cancel.clone());
    let handle = tokio::runtime::Handle::current();
    let task = tokio::task::spawn_blocking(move || {
        let guest = GuestRun {
            sandbox: &sandbox,
            module: &module,
            args: &args,
            reader,
            cancel,
            figures: &figures,
            drop_later: false,
        };
        let run = guest.drive(
            || handle.block_on(input.next()),
            |b| Ok(tx.blocking_send(Ok(b)).is_ok()),
        );
        if let Err(e) = run {
            let _ = tx.blocking_send(Err(e));
        }
    });
    let out = tokio_stream::wrappers::ReceiverStream::new(rx);
    // The thread ends on its own (its outputs refused once this stream is dropped,
    // or at its CPU-time limit); a panic there is reported, not lost.
    let ended = futures::stream::once(async move {
        let _cancel = on_drop;
        match task.await {
            Err(e) if e.is_panic() => Some(Err(Error::Internal(format!(
                "a wasm guest's thread panicked: {e}"
            )))),
            _ => None,
        }
    })
    .filter_map(futures::future::ready);
    out.chain(ended).boxed()
}

/// Runs `module`, which takes no input rows, to its end on this thread (taken out of
/// the runtime's workers while it runs, so its host reads may wait on the runtime):
/// its outputs, or its error. A guest that reads a few records answers without a
/// hop to another thread and back; the CPU-time limit bounds it as on any thread.
/// `None` on a runtime that cannot lend its thread (a current-thread one).
#[cfg(feature = "node")]
pub(crate) fn run_guest_here(
    sandbox: &Arc<Sandbox>,
    module: &Arc<CompiledModule>,
    args: &BTreeMap<String, String>,
    reader: Option<Arc<dyn GuestReader>>,
    cancel: Arc<std::sync::atomic::AtomicBool>,
    figures: &Arc<GuestFigures>,
) -> Option<Result<Vec<RecordBatch>>> {
    let flavor = tokio::runtime::Handle::try_current().ok()?.runtime_flavor();
    if flavor != tokio::runtime::RuntimeFlavor::MultiThread {
        return None;
    }
    Some(tokio::task::block_in_place(|| {
        let guest = GuestRun {
            sandbox,
            module,
            args,
            reader,
            cancel,
            figures,
            drop_later: true,
        };
        let mut out = Vec::new();
        guest.drive(
            || None,
            |b| {
                out.push(b);
                Ok(true)
            },
        )?;
        Ok(out)
    }))
}

/// One run of a guest, wherever it runs.
struct GuestRun<'a> {
    sandbox: &'a Arc<Sandbox>,
    module: &'a Arc<CompiledModule>,
    args: &'a BTreeMap<String, String>,
    reader: Option<Arc<dyn GuestReader>>,
    cancel: Arc<std::sync::atomic::AtomicBool>,
    figures: &'a GuestFigures,
    /// Whether the instance is dropped on another blocking thread once it is done,
    /// so that the answer does not wait for its memory to be unmapped (its memory
    /// stays counted as held until then).
    drop_later: bool,
}

impl GuestRun<'_> {
    /// Instantiates the guest, feeds it `input`'s batches, then finishes it; every
    /// output goes to `send` (which answers whether more are wanted) and must have
    /// the first one's schema.
    fn drive(
        self,
        mut input: impl FnMut() -> Option<Result<RecordBatch>>,
        mut send: impl FnMut(RecordBatch) -> Result<bool>,
    ) -> Result<()> {
        let module = self.module;
        let mut schema: Option<SchemaRef> = None;
        let mut send = |b: RecordBatch| -> Result<bool> {
            match &schema {
                Some(s) if s != &b.schema() => {
                    return Err(Error::InvalidArgument(format!(
                        "wasm module {:?} broke the guest ABI: its outputs change schema ({} then {})",
                        module.digest,
                        s,
                        b.schema()
                    )));
                }
                Some(_) => {}
                None => schema = Some(b.schema()),
            }
            send(b)
        };
        let mut guest = self
            .sandbox
            .instantiate(module, self.args, self.reader, self.cancel)?;
        self.figures.kind.store(
            u8::from(guest.kind() == GuestKind::Aggregate),
            Ordering::Relaxed,
        );
        let result = (|| {
            while let Some(b) = input() {
                for out in guest.batch(&b?)? {
                    if !send(out)? {
                        return Ok(());
                    }
                }
            }
            for out in guest.finish()? {
                if !send(out)? {
                    return Ok(());
                }
            }
            Ok(())
        })();
        self.figures
            .cpu_us
            .store(guest.cpu_used().as_micros() as u64, Ordering::Relaxed);
        if self.drop_later
            && let Ok(handle) = tokio::runtime::Handle::try_current()
        {
            handle.spawn_blocking(move || drop(guest));
        }
        result
    }
}

/// Stops a guest (within an epoch tick) once its answer's stream is dropped.
pub(crate) use csd_sandbox::CancelOnDrop;

/// `stream`, which sets `cancel`'s flag when it is dropped (its Wasm SQL functions
/// then stop within an epoch tick).
pub(crate) fn cancel_on_drop(
    stream: datafusion::physical_plan::SendableRecordBatchStream,
    cancel: CancelOnDrop,
) -> datafusion::physical_plan::SendableRecordBatchStream {
    let schema = stream.schema();
    let inner = stream.map(move |b| {
        let _keep = &cancel;
        b
    });
    Box::pin(datafusion::physical_plan::stream::RecordBatchStreamAdapter::new(schema, inner))
}

/// The first item of `stream` taken out, to learn the output schema before the
/// answer starts: `Err` if the guest failed before its first output.
#[cfg(feature = "node")]
pub(crate) async fn peek_schema(
    mut stream: BoxStream<'static, Result<RecordBatch>>,
) -> Result<(SchemaRef, BoxStream<'static, Result<RecordBatch>>)> {
    match stream.next().await {
        Some(Err(e)) => Err(e),
        Some(Ok(b)) => Ok((
            b.schema(),
            futures::stream::once(futures::future::ready(Ok(b)))
                .chain(stream)
                .boxed(),
        )),
        None => Ok((
            Arc::new(arrow::datatypes::Schema::empty()),
            futures::stream::empty().boxed(),
        )),
    }
}
