//! DataFusion errors ↔ node errors (which the service maps to gRPC statuses) and
//! client errors (which the compute side wraps into DataFusion errors). Nothing is
//! flattened to a string: a node error inside a DataFusion error comes back out as
//! it was, and any other DataFusion error becomes the cause of a node error of its
//! kind ([`status_code`]).

use csd_protocol::{Error, StatusCode};
use datafusion::arrow::error::ArrowError;
use datafusion::common::DataFusionError;
use datafusion::parquet::errors::ParquetError;

/// What kind of failure a DataFusion error is: the kind of the first node or client
/// error among its causes, else by DataFusion's own classification (bad plans and bad
/// data are the caller's, memory is a resource, the rest internal).
pub fn status_code(e: &DataFusionError) -> StatusCode {
    if let Some(code) = ours_in(e) {
        return code;
    }
    match e.find_root() {
        DataFusionError::ResourcesExhausted(_) => StatusCode::ResourceExhausted,
        DataFusionError::Plan(_)
        | DataFusionError::SchemaError(..)
        | DataFusionError::Substrait(_)
        | DataFusionError::Execution(_)
        | DataFusionError::SQL(..) => StatusCode::InvalidArgument,
        DataFusionError::NotImplemented(_) => StatusCode::Unimplemented,
        DataFusionError::ArrowError(a, _) => match a.as_ref() {
            ArrowError::DivideByZero
            | ArrowError::CastError(_)
            | ArrowError::ComputeError(_)
            | ArrowError::ArithmeticOverflow(_)
            | ArrowError::InvalidArgumentError(_)
            | ArrowError::ParseError(_) => StatusCode::InvalidArgument,
            _ => StatusCode::Internal,
        },
        _ => StatusCode::Internal,
    }
}

/// The pushback among `e`'s causes, if the first node error there is one.
fn pushback_in(e: &(dyn std::error::Error + 'static)) -> Option<csd_protocol::PushBack> {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(n) = c.downcast_ref::<Error>() {
            return match n {
                Error::PushedBack(p) => Some(p.clone()),
                _ => None,
            };
        }
        cur = c.source();
    }
    None
}

/// Whether the first node client error among `e`'s causes says its node (or the
/// node's copy of the data) is lost (see `node_client::Error::node_lost`).
pub(crate) fn node_lost(e: &DataFusionError) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cur {
        if let Some(n) = c.downcast_ref::<csd_protocol::node_client::Error>() {
            return n.node_lost();
        }
        cur = c.source();
    }
    false
}

/// The kind of the first node or client error among `e`'s causes.
fn ours_in(e: &(dyn std::error::Error + 'static)) -> Option<StatusCode> {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(n) = c.downcast_ref::<Error>() {
            return Some(n.status_code());
        }
        if let Some(n) = c.downcast_ref::<csd_protocol::node_client::Error>() {
            return Some(n.status_code());
        }
        cur = c.source();
    }
    None
}

/// A DataFusion error as the node reports it: a node error carried inside comes back
/// out whole (its kind and pushback details intact); anything else is kept as the
/// cause of an error of its kind.
pub(crate) fn to_runtime(e: DataFusionError) -> Error {
    // A pushback deep in the chain (raised inside a plan, wrapped on its way up)
    // still hands the work back, with its details.
    if let Some(p) = pushback_in(&e) {
        return Error::PushedBack(p);
    }
    let code = status_code(&e);
    match e {
        DataFusionError::External(inner) => unbox(inner, code),
        DataFusionError::ParquetError(p) => match *p {
            ParquetError::External(inner) => unbox(inner, code),
            other => Error::external(code, "parquet", other),
        },
        DataFusionError::ArrowError(a, ctx) => match *a {
            ArrowError::ExternalError(inner) => unbox(inner, code),
            other => Error::external(
                code,
                "datafusion",
                DataFusionError::ArrowError(Box::new(other), ctx),
            ),
        },
        other => Error::external(code, "datafusion", other),
    }
}

fn unbox(inner: Box<dyn std::error::Error + Send + Sync>, code: StatusCode) -> Error {
    match inner.downcast::<Error>() {
        Ok(ours) => *ours,
        Err(other) => Error::external(code, "datafusion", other),
    }
}

/// A client-side error inside DataFusion.
pub(crate) fn to_datafusion(e: csd_protocol::node_client::Error) -> DataFusionError {
    DataFusionError::External(Box::new(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_and_causes_survive_datafusion() {
        let ours = Error::FailedPrecondition("table t changed".into());
        let df = DataFusionError::Context(
            "running the fragment".into(),
            Box::new(DataFusionError::External(Box::new(ours))),
        );
        assert_eq!(status_code(&df), StatusCode::FailedPrecondition);
        let back = to_runtime(df);
        assert_eq!(back.status_code(), StatusCode::FailedPrecondition);
        assert!(back.to_string().contains("table t changed"), "{back}");

        let plan = DataFusionError::Plan("no such column x".into());
        let e = to_runtime(plan);
        assert_eq!(e.status_code(), StatusCode::InvalidArgument);
        assert!(std::error::Error::source(&e).is_some(), "the cause is kept");

        let pushed = Error::AlreadyExists("t".into());
        let df = DataFusionError::External(Box::new(pushed));
        assert!(matches!(to_runtime(df), Error::AlreadyExists(_)));
    }
}
