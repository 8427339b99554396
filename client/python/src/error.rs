//! `csd.CsdError`: what failed, as the gRPC status a node or the client gives it
//! (`.code`, e.g. `"NotFound"`) and the message a person reads (`.message`).

use csd_protocol::StatusCode;
use pyo3::prelude::*;

pyo3::create_exception!(
    csd,
    CsdError,
    pyo3::exceptions::PyException,
    "A csd call failed: `.code` is the gRPC status (e.g. \"Unavailable\", \"NotFound\"), \
     `.message` says what happened and what to do."
);

/// `e` as a `CsdError` carrying its status and message.
pub(crate) fn to_py(code: StatusCode, message: String) -> PyErr {
    let code = format!("{code:?}");
    Python::attach(|py| {
        let err = CsdError::new_err(format!("{code}: {message}"));
        let value = err.value(py);
        let _ = value.setattr("code", code);
        let _ = value.setattr("message", message);
        err
    })
}

/// A client error as a `CsdError`.
pub(crate) fn client(e: csd_client::Error) -> PyErr {
    to_py(e.status_code(), e.to_string())
}

/// Bad input caught here, before any node is asked.
pub(crate) fn invalid(message: impl Into<String>) -> PyErr {
    to_py(StatusCode::InvalidArgument, message.into())
}
