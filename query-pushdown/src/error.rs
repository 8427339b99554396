//! DataFusion errors ↔ node errors (which the service maps to gRPC statuses) and
//! client errors (which the compute side wraps into DataFusion errors).

use csd_runtime::Error;
use datafusion::arrow::error::ArrowError;
use datafusion::common::DataFusionError;
use datafusion::parquet::errors::ParquetError;

/// A DataFusion error as the node reports it: bad plans and bad data are the
/// caller's (`INVALID_ARGUMENT`), memory is `RESOURCE_EXHAUSTED`, our own node errors
/// keep their kind.
pub fn to_runtime(e: DataFusionError) -> Error {
    let msg = e.to_string();
    match e.find_root() {
        DataFusionError::External(inner) => match inner.downcast_ref::<Error>() {
            Some(n) => clone_kind(n, msg),
            None => match inner.downcast_ref::<ParquetError>() {
                Some(p) => from_parquet(p, msg),
                None => Error::Internal(msg),
            },
        },
        DataFusionError::ResourcesExhausted(_) => Error::ResourcesExhausted(msg),
        DataFusionError::Plan(_)
        | DataFusionError::SchemaError(..)
        | DataFusionError::NotImplemented(_)
        | DataFusionError::Substrait(_)
        | DataFusionError::Execution(_) => Error::InvalidArgument(msg),
        DataFusionError::ArrowError(a, _) => match a.as_ref() {
            ArrowError::ExternalError(inner) => match inner.downcast_ref::<Error>() {
                Some(n) => clone_kind(n, msg),
                None => Error::Internal(msg),
            },
            ArrowError::DivideByZero
            | ArrowError::CastError(_)
            | ArrowError::ComputeError(_)
            | ArrowError::ArithmeticOverflow(_)
            | ArrowError::InvalidArgumentError(_)
            | ArrowError::ParseError(_) => Error::InvalidArgument(msg),
            _ => Error::Internal(msg),
        },
        DataFusionError::ParquetError(p) => from_parquet(p, msg),
        _ => Error::Internal(msg),
    }
}

fn from_parquet(p: &ParquetError, msg: String) -> Error {
    match p {
        ParquetError::External(inner) => match inner.downcast_ref::<Error>() {
            Some(n) => clone_kind(n, msg),
            None => Error::Internal(msg),
        },
        _ => Error::Internal(msg),
    }
}

fn clone_kind(e: &Error, msg: String) -> Error {
    match e {
        Error::InvalidArgument(_) => Error::InvalidArgument(msg),
        Error::NotFound(_) => Error::NotFound(msg),
        Error::ResourcesExhausted(_) => Error::ResourcesExhausted(msg),
        Error::Corrupt(_) => Error::Corrupt(msg),
        Error::FailedPrecondition(_) => Error::FailedPrecondition(msg),
        _ => Error::Internal(msg),
    }
}

/// A client-side error inside DataFusion.
pub fn to_datafusion(e: csd_runtime::client::Error) -> DataFusionError {
    DataFusionError::External(Box::new(e))
}
