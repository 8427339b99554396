//! The storage node's error type, and its one mapping to a gRPC status.

use std::fmt::Display;

/// Errors of the storage node, by meaning. Every variant carries a message a person
/// understands; [`Error::to_status`] is the only place they become gRPC statuses.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller asked for something malformed or impossible.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A named table, partition or object does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// The thing to create exists already.
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// The request was valid when it was made but the node's state has moved on
    /// (e.g. a partition gained objects since the query was planned).
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    /// Stored bytes failed their checksum or are structurally wrong. Never ignored.
    #[error("corrupt data: {0}")]
    Corrupt(String),
    /// Out of device space, catalog space, memory or CPU budget.
    #[error("resources exhausted: {0}")]
    ResourcesExhausted(String),
    /// The operation is not available on this node (e.g. the kernel refused io_uring).
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// An operating-system I/O error, with what we were doing.
    #[error("I/O error while {context}: {source}")]
    Io {
        /// What the node was doing.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A failure in a library we call (arrow, parquet, tonic) that is not the caller's fault.
    #[error("{0}")]
    External(String),
    /// A bug: an invariant of ours did not hold.
    #[error("internal error: {0}")]
    Internal(String),
    /// Admission control hands the request back: the compute tier should read the
    /// byte ranges and evaluate it itself (gRPC `UNAVAILABLE` with the JSON
    /// [`PushBack`](crate::admission::PushBack) in the `csd-pushback` metadata).
    #[error("pushed back to the compute tier: {}", .0.reason)]
    PushedBack(crate::admission::PushBack),
    /// Not even raw reads can be served now (gRPC `RESOURCE_EXHAUSTED` with
    /// `retry-after-ms` metadata).
    #[error("node overloaded, retry in {} ms: {reason}", .retry_after.as_millis())]
    Busy {
        /// Why.
        reason: String,
        /// When to retry.
        retry_after: std::time::Duration,
    },
}

/// Metadata key of a pushed-back request's JSON [`PushBack`](crate::admission::PushBack).
pub const PUSHBACK_METADATA: &str = "csd-pushback";
/// Metadata key of the retry hint (milliseconds) on `RESOURCE_EXHAUSTED`.
pub const RETRY_AFTER_METADATA: &str = "retry-after-ms";

/// Result with the node's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps an I/O error with what the node was doing.
    pub fn io(context: impl Display, source: std::io::Error) -> Self {
        Error::Io {
            context: context.to_string(),
            source,
        }
    }

    /// The gRPC status for this error: the single mapping used by the Flight service.
    pub fn to_status(&self) -> tonic::Status {
        use tonic::Code;
        let code = match self {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::NotFound(_) => Code::NotFound,
            Error::AlreadyExists(_) => Code::AlreadyExists,
            Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::Corrupt(_) => Code::DataLoss,
            Error::ResourcesExhausted(_) => Code::ResourceExhausted,
            Error::Unavailable(_) => Code::Unavailable,
            Error::Io { .. } | Error::External(_) | Error::Internal(_) => Code::Internal,
            Error::PushedBack(p) => {
                let mut s = tonic::Status::unavailable(self.to_string());
                if let Ok(v) = serde_json::to_string(p).unwrap_or_default().parse() {
                    s.metadata_mut().insert(PUSHBACK_METADATA, v);
                }
                return s;
            }
            Error::Busy { retry_after, .. } => {
                let mut s = tonic::Status::resource_exhausted(self.to_string());
                if let Ok(v) = retry_after.as_millis().to_string().parse() {
                    s.metadata_mut().insert(RETRY_AFTER_METADATA, v);
                }
                return s;
            }
        };
        tonic::Status::new(code, self.to_string())
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        e.to_status()
    }
}

/// Our own errors travel through parquet's and arrow's traits boxed as "external":
/// unwrap them again; anything else becomes `External` with `library`'s name.
fn unbox(inner: Box<dyn std::error::Error + Send + Sync>, library: &str) -> Error {
    match inner.downcast::<Error>() {
        Ok(ours) => *ours,
        Err(other) => Error::External(format!("{library}: {other}")),
    }
}

impl From<parquet::errors::ParquetError> for Error {
    fn from(e: parquet::errors::ParquetError) -> Self {
        match e {
            parquet::errors::ParquetError::External(inner) => unbox(inner, "parquet"),
            other => Error::External(format!("parquet: {other}")),
        }
    }
}

impl From<arrow::error::ArrowError> for Error {
    fn from(e: arrow::error::ArrowError) -> Self {
        match e {
            arrow::error::ArrowError::ExternalError(inner) => unbox(inner, "arrow"),
            other => Error::External(format!("arrow: {other}")),
        }
    }
}

impl From<arrow_flight::error::FlightError> for Error {
    fn from(e: arrow_flight::error::FlightError) -> Self {
        use arrow_flight::error::FlightError as F;
        match e {
            F::Arrow(a) => a.into(),
            F::Tonic(s) => Error::External(format!("flight: {}", s.message())),
            F::ProtocolError(m) | F::DecodeError(m) => {
                Error::InvalidArgument(format!("flight stream: {m}"))
            }
            F::NotYetImplemented(m) => Error::InvalidArgument(format!("not implemented: {m}")),
            F::ExternalError(inner) => unbox(inner, "flight"),
        }
    }
}

/// Converts our error into parquet's, so it survives a trip through parquet traits.
pub(crate) fn to_parquet(e: Error) -> parquet::errors::ParquetError {
    parquet::errors::ParquetError::External(Box::new(e))
}
