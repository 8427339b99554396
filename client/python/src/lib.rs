//! The `csd` Python package's native module (`csd._native`): the Rust client under
//! Python, Arrow handed over through the C data interface (pyarrow imports the
//! buffers, nothing is copied). The Python side (`python/csd/`) shapes it: tables in
//! and out, training batches, exceptions.
//!
//! | file | what |
//! |---|---|
//! | [`runtime`] | one tokio runtime; every wait releases the GIL and stops on Ctrl-C |
//! | [`error`] | `csd.CsdError`: the gRPC status and the node's message |
//! | [`creds`] | a bearer token and TLS files, as `csd --token/--tls-*` take them |
//! | [`sql`] | `sql`, `sql_stream`: a query with or without pushdown: its answer and plan, or its answer as computed |
//! | [`put`] | `put`, `put_images`: a table or an image folder stored at the nodes |
//! | [`features`] | `feature_job`: epochs of feature streams of training batches |

mod creds;
mod error;
mod features;
mod put;
mod runtime;
mod sql;

use pyo3::prelude::*;

/// The native part of the `csd` package (use `import csd`).
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("CsdError", m.py().get_type::<error::CsdError>())?;
    m.add_function(wrap_pyfunction!(sql::sql, m)?)?;
    m.add_function(wrap_pyfunction!(sql::sql_stream, m)?)?;
    m.add_function(wrap_pyfunction!(put::put, m)?)?;
    m.add_function(wrap_pyfunction!(put::put_images, m)?)?;
    m.add_function(wrap_pyfunction!(features::feature_job, m)?)?;
    m.add_class::<features::FeatureJob>()?;
    m.add_class::<features::FeatureStream>()?;
    m.add_class::<sql::AnswerStream>()?;
    Ok(())
}
