//! `csd.sql`: a query over the nodes' tables, pushed down or not, with `csd sql`'s
//! session settings; its answer as Arrow and its plan with metrics.

use std::collections::HashMap;

use arrow::datatypes::{Schema, SchemaRef};
use arrow::record_batch::{RecordBatch, RecordBatchIterator, RecordBatchReader};
use arrow_pyarrow::PyArrowType;
use csd_query_pushdown::{Cluster, CsdSession, SessionOptions};
use datafusion::physical_plan::SendableRecordBatchStream;
use futures::StreamExt;
use pyo3::prelude::*;

use crate::{creds, error, runtime};

/// What a query returned: its batches, and the plan that ran with its metrics.
type Answer = (PyArrowType<Box<dyn RecordBatchReader + Send>>, String, u64);

/// Runs `query` on the cluster of `nodes`: `pushdown` as `csd sql` (or, false, as
/// `csd sql --no-pushdown`), each of `settings` applied first as `SET key = value`
/// (e.g. `csd.direct_unfiltered`). Returns (a reader of the answer, the plan with its
/// metrics, bytes that crossed the network).
#[pyfunction]
#[pyo3(signature = (nodes, query, *, pushdown = true, settings = None, auth = None))]
pub(crate) fn sql(
    py: Python<'_>,
    nodes: Vec<String>,
    query: String,
    pushdown: bool,
    settings: Option<Vec<(String, String)>>,
    auth: Option<HashMap<String, String>>,
) -> PyResult<Answer> {
    let open = open(nodes, pushdown, settings, auth)?;
    let run = runtime::wait(py, async move {
        let session = open.await?;
        Ok::<_, csd_client::Error>(session.run(&query).await?)
    })?
    .map_err(error::client)?;
    let plan = run.plan_with_metrics();
    let reader: Box<dyn RecordBatchReader + Send> = Box::new(RecordBatchIterator::new(
        run.batches.into_iter().map(Ok::<RecordBatch, _>),
        run.schema,
    ));
    Ok((PyArrowType(reader), plan, run.bytes_moved))
}

/// Runs `query` as [`sql`] does, its answer read batch by batch as it is computed
/// (no plan, no figures): an iterator of record batches with the answer's `schema`.
/// Ctrl-C while a batch is awaited stops the query and raises `KeyboardInterrupt`;
/// a failure raises `CsdError`; `close()` or dropping it stops the query.
#[pyfunction]
#[pyo3(signature = (nodes, query, *, pushdown = true, settings = None, auth = None))]
pub(crate) fn sql_stream(
    py: Python<'_>,
    nodes: Vec<String>,
    query: String,
    pushdown: bool,
    settings: Option<Vec<(String, String)>>,
    auth: Option<HashMap<String, String>>,
) -> PyResult<AnswerStream> {
    let open = open(nodes, pushdown, settings, auth)?;
    let (session, stream) = runtime::wait(py, async move {
        let session = open.await?;
        let stream = session.stream(&query).await?;
        Ok::<_, csd_client::Error>((session, stream))
    })?
    .map_err(error::client)?;
    Ok(AnswerStream {
        schema: stream.schema(),
        stream: std::sync::Mutex::new(Some((stream, session))),
    })
}

/// An answer read as it is computed.
#[pyclass(module = "csd._native")]
pub(crate) struct AnswerStream {
    schema: SchemaRef,
    /// The query's batches and the session it runs in; `None` once it ended,
    /// failed or was stopped.
    stream: std::sync::Mutex<Option<(SendableRecordBatchStream, CsdSession)>>,
}

#[pymethods]
impl AnswerStream {
    /// The answer's schema.
    #[getter]
    fn schema(&self) -> PyArrowType<Schema> {
        PyArrowType(self.schema.as_ref().clone())
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyArrowType<RecordBatch>>> {
        // Not `lock`: a second thread waiting here would hold the GIL that the
        // first one needs to look for Ctrl-C.
        let Ok(mut slot) = self.stream.try_lock() else {
            return Err(error::invalid(
                "this answer is being read by another thread; read it from one",
            ));
        };
        let Some((stream, _)) = slot.as_mut() else {
            return Ok(None);
        };
        match runtime::wait_here(py, stream.next()) {
            Ok(Some(Ok(b))) => Ok(Some(PyArrowType(b))),
            Ok(None) => {
                *slot = None;
                Ok(None)
            }
            Ok(Some(Err(e))) => {
                *slot = None;
                Err(error::client(e.into()))
            }
            Err(interrupted) => {
                *slot = None;
                Err(interrupted)
            }
        }
    }

    /// Stops the query.
    fn close(&self) {
        if let Ok(mut slot) = self.stream.try_lock() {
            slot.take();
        }
    }
}

/// Checks what can be checked here and returns the future that opens a session on
/// `nodes` with `settings` applied.
fn open(
    nodes: Vec<String>,
    pushdown: bool,
    settings: Option<Vec<(String, String)>>,
    auth: Option<HashMap<String, String>>,
) -> PyResult<
    impl std::future::Future<Output = Result<CsdSession, csd_client::Error>> + Send + 'static,
> {
    if nodes.is_empty() {
        return Err(error::invalid("no storage nodes given"));
    }
    let credentials = creds::credentials(auth)?;
    let settings = settings.unwrap_or_default();
    for (k, v) in &settings {
        if k.is_empty()
            || !k
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '_')
        {
            return Err(error::invalid(format!(
                "setting {k:?}: names are letters, digits, '.' and '_' (e.g. csd.direct_unfiltered)"
            )));
        }
        if v.contains('\'') {
            return Err(error::invalid(format!(
                "setting {k}: a value cannot hold a quote"
            )));
        }
    }
    Ok(async move {
        let cluster = Cluster::connect_with(&nodes, &credentials).await?;
        let session = cluster
            .session(SessionOptions {
                pushdown,
                ..Default::default()
            })
            .await?;
        for (k, v) in &settings {
            session.run(&format!("SET {k} = '{v}'")).await?;
        }
        Ok(session)
    })
}
