//! `csd.put` and `csd.put_images`: data stored at the nodes from Python.

use std::collections::HashMap;
use std::path::PathBuf;

use arrow::record_batch::RecordBatchReader;
use arrow_array::ffi_stream::ArrowArrayStreamReader;
use arrow_pyarrow::PyArrowType;
use csd_client::NodeClient;
use pyo3::prelude::*;

use crate::{creds, error, runtime};

/// Stores `data` (any Arrow stream: a pyarrow Table's or reader's) as partition
/// `partition` of `table` on `node`; returns the rows the node says it stored.
#[pyfunction]
#[pyo3(signature = (node, table, data, *, partition = "0".to_string(), auth = None))]
pub(crate) fn put(
    py: Python<'_>,
    node: String,
    table: String,
    data: PyArrowType<ArrowArrayStreamReader>,
    partition: String,
    auth: Option<HashMap<String, String>>,
) -> PyResult<u64> {
    let credentials = creds::credentials(auth)?;
    let reader = data.0;
    let schema = reader.schema();
    // The upload runs on the runtime while this thread reads the stream: a few
    // batches in flight, never the whole table in memory.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let upload = runtime::runtime().spawn(async move {
        let c = NodeClient::connect_with(&node, &credentials).await?;
        let batches = tokio_stream::wrappers::ReceiverStream::new(rx);
        Ok::<_, csd_client::Error>(c.put(&table, &partition, schema, batches).await?)
    });
    // Read with Python attached: a Python-backed stream calls back into it.
    for batch in reader {
        let stop = |e: PyErr| {
            // Dropping the upload cancels the put: the node stores none of it.
            upload.abort();
            e
        };
        py.check_signals().map_err(stop)?;
        let batch = batch.map_err(|e| stop(error::client(e.into())))?;
        if py.detach(|| tx.blocking_send(Ok(batch))).is_err() {
            break; // the upload ended early: its error is below
        }
    }
    drop(tx);
    let summary = runtime::wait(py, upload)?
        .map_err(|e| {
            error::to_py(
                csd_protocol::StatusCode::Internal,
                format!("the upload: {e}"),
            )
        })?
        .map_err(error::client)?;
    Ok(summary.rows)
}

/// Stores the images under `folder` (one subfolder per class, or `labels`: a CSV of
/// file,label) as dataset `table`, spread over `nodes` in `partitions` partitions,
/// each kept `copies` times; returns (samples stored, class names).
#[pyfunction]
#[pyo3(signature = (nodes, table, folder, *, labels = None, partitions = 4, copies = 1, auth = None))]
#[allow(clippy::too_many_arguments)] // Python's keyword arguments
pub(crate) fn put_images(
    py: Python<'_>,
    nodes: Vec<String>,
    table: String,
    folder: PathBuf,
    labels: Option<PathBuf>,
    partitions: usize,
    copies: usize,
    auth: Option<HashMap<String, String>>,
) -> PyResult<(usize, Vec<String>)> {
    if nodes.is_empty() {
        return Err(error::invalid("no storage nodes given"));
    }
    if partitions == 0 || copies == 0 || copies > nodes.len() {
        return Err(error::invalid(format!(
            "partitions {partitions}, copies {copies} on {} nodes: at least one partition, \
             and 1 to {} copies",
            nodes.len(),
            nodes.len()
        )));
    }
    let credentials = creds::credentials(auth)?;
    runtime::wait(py, async move {
        let mut clients = Vec::new();
        for n in &nodes {
            clients.push(NodeClient::connect_with(n, &credentials).await?);
        }
        Ok::<_, csd_client::Error>(
            csd_client::features::put_images(
                &clients,
                &table,
                &folder,
                labels.as_deref(),
                (partitions, copies),
                1,
                |_| {},
            )
            .await?,
        )
    })?
    .map_err(error::client)
}
