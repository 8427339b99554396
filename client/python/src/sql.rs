//! `csd.sql`: a query over the nodes' tables, pushed down or not, with `csd sql`'s
//! session settings; its answer as Arrow and its plan with metrics.

use std::collections::HashMap;

use arrow::record_batch::{RecordBatch, RecordBatchIterator, RecordBatchReader};
use arrow_pyarrow::PyArrowType;
use csd_query_pushdown::{Cluster, SessionOptions};
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
    let run = runtime::wait(py, async move {
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
