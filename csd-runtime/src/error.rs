//! The storage node's error type, its kinds ([`StatusCode`]), and its one mapping to a
//! gRPC status ([`Error::to_status`]).

use std::fmt::Display;

use crate::protocol::{PUSHBACK_METADATA, RETRY_AFTER_METADATA};

/// A boxed error from a library, kept as the cause of ours.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What kind of failure an error is, as the caller should read it: each kind is one
/// gRPC code (GreptimeDB's `StatusCode`, in small). Errors of the other crates say
/// their kind with the same type, so a kind survives a trip through any of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatusCode {
    /// The caller asked for something malformed or impossible.
    InvalidArgument,
    /// A named thing does not exist.
    NotFound,
    /// The thing to create exists already.
    AlreadyExists,
    /// Valid once, but the state has moved on.
    FailedPrecondition,
    /// Stored bytes are corrupt.
    DataLoss,
    /// Out of space, memory, CPU budget or a quota.
    ResourceExhausted,
    /// Not available now (or handed back to the compute tier).
    Unavailable,
    /// Not supported by this node.
    Unimplemented,
    /// The caller went away or stopped the request.
    Cancelled,
    /// Took longer than allowed.
    DeadlineExceeded,
    /// The caller did not prove who it is (no token, or one the node does not know).
    Unauthenticated,
    /// The caller is known but may not do this.
    PermissionDenied,
    /// A bug, or a failure that is nobody's fault the caller could fix.
    Internal,
}

impl StatusCode {
    /// The gRPC code.
    pub(crate) fn to_tonic(self) -> tonic::Code {
        use tonic::Code;
        match self {
            StatusCode::InvalidArgument => Code::InvalidArgument,
            StatusCode::NotFound => Code::NotFound,
            StatusCode::AlreadyExists => Code::AlreadyExists,
            StatusCode::FailedPrecondition => Code::FailedPrecondition,
            StatusCode::DataLoss => Code::DataLoss,
            StatusCode::ResourceExhausted => Code::ResourceExhausted,
            StatusCode::Unavailable => Code::Unavailable,
            StatusCode::Unimplemented => Code::Unimplemented,
            StatusCode::Cancelled => Code::Cancelled,
            StatusCode::DeadlineExceeded => Code::DeadlineExceeded,
            StatusCode::Unauthenticated => Code::Unauthenticated,
            StatusCode::PermissionDenied => Code::PermissionDenied,
            StatusCode::Internal => Code::Internal,
        }
    }

    /// The kind of a gRPC code (a peer's answer).
    pub(crate) fn from_tonic(code: tonic::Code) -> Self {
        use tonic::Code;
        match code {
            Code::InvalidArgument | Code::OutOfRange => StatusCode::InvalidArgument,
            Code::NotFound => StatusCode::NotFound,
            Code::AlreadyExists => StatusCode::AlreadyExists,
            Code::FailedPrecondition | Code::Aborted => StatusCode::FailedPrecondition,
            Code::DataLoss => StatusCode::DataLoss,
            Code::ResourceExhausted => StatusCode::ResourceExhausted,
            Code::Unavailable => StatusCode::Unavailable,
            Code::Unimplemented => StatusCode::Unimplemented,
            Code::Cancelled => StatusCode::Cancelled,
            Code::DeadlineExceeded => StatusCode::DeadlineExceeded,
            Code::Unauthenticated => StatusCode::Unauthenticated,
            Code::PermissionDenied => StatusCode::PermissionDenied,
            _ => StatusCode::Internal,
        }
    }
}

/// Errors of the storage node, by meaning. Every variant carries a message a person
/// understands, and a library's error is kept as the [`source`](std::error::Error::source)
/// of ours; [`Error::to_status`] is the only place they become gRPC statuses.
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
    /// The request proves no tenant: no token, a malformed one, or one the node does
    /// not know.
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// The tenant is known but lacks the permission, or the ticket is not its own.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// The node does not implement this (an RPC or option it does not serve).
    #[error("not supported: {0}")]
    Unimplemented(String),
    /// An operating-system I/O error, with what we were doing.
    #[error("I/O error while {context}: {source}")]
    Io {
        /// What the node was doing.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A failure in a library we call (arrow, parquet, tonic, DataFusion), with what we
    /// were doing, its kind, and the library's error as the cause.
    #[error("{context}: {source}")]
    External {
        /// What the node was doing (or which library failed).
        context: String,
        /// How the caller should read it.
        code: StatusCode,
        /// The library's error.
        #[source]
        source: BoxError,
    },
    /// The work was stopped because nobody waits for its answer any more.
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// The work ran past its time limit (shipped code past its CPU-time limit).
    #[error("deadline exceeded: {0}")]
    DeadlineExceeded(String),
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

/// Result with the node's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Longest piece of caller input an error message repeats.
pub(crate) const ECHO_LIMIT: usize = 200;

/// `s` as an error message may repeat it: at most `ECHO_LIMIT` bytes (cut at a
/// character boundary, with the length said), so that a huge name cannot make an
/// error larger than a client accepts as metadata.
pub fn truncated(s: &str) -> std::borrow::Cow<'_, str> {
    cut(s, ECHO_LIMIT)
}

/// Longest message a status carries: well inside the 8 KiB of headers a gRPC client
/// accepts by default.
const STATUS_MESSAGE_LIMIT: usize = 4096;

fn cut(s: &str, limit: usize) -> std::borrow::Cow<'_, str> {
    if s.len() <= limit {
        return s.into();
    }
    let mut end = limit;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &s[..end], s.len()).into()
}

impl Error {
    /// Wraps an I/O error with what the node was doing.
    pub fn io(context: impl Display, source: std::io::Error) -> Self {
        Error::Io {
            context: context.to_string(),
            source,
        }
    }

    /// Wraps a library's error of kind `code`, with what the node was doing.
    pub fn external(code: StatusCode, context: impl Display, source: impl Into<BoxError>) -> Self {
        Error::External {
            context: context.to_string(),
            code,
            source: source.into(),
        }
    }

    /// What kind of failure this is.
    pub fn status_code(&self) -> StatusCode {
        match self {
            Error::InvalidArgument(_) => StatusCode::InvalidArgument,
            Error::NotFound(_) => StatusCode::NotFound,
            Error::AlreadyExists(_) => StatusCode::AlreadyExists,
            Error::FailedPrecondition(_) => StatusCode::FailedPrecondition,
            Error::Corrupt(_) => StatusCode::DataLoss,
            Error::ResourcesExhausted(_) | Error::Busy { .. } => StatusCode::ResourceExhausted,
            Error::Unavailable(_) | Error::PushedBack(_) => StatusCode::Unavailable,
            Error::Unimplemented(_) => StatusCode::Unimplemented,
            Error::DeadlineExceeded(_) => StatusCode::DeadlineExceeded,
            Error::Cancelled(_) => StatusCode::Cancelled,
            Error::Unauthenticated(_) => StatusCode::Unauthenticated,
            Error::PermissionDenied(_) => StatusCode::PermissionDenied,
            Error::External { code, .. } => *code,
            Error::Io { .. } | Error::Internal(_) => StatusCode::Internal,
        }
    }

    /// This error's kind, or that of the first error of ours in `e`'s causes, if any.
    pub fn code_in(e: &(dyn std::error::Error + 'static)) -> Option<StatusCode> {
        let mut cur = Some(e);
        while let Some(c) = cur {
            if let Some(ours) = c.downcast_ref::<Error>() {
                return Some(ours.status_code());
            }
            cur = c.source();
        }
        None
    }

    /// The gRPC status for this error: the single mapping used by the Flight service.
    /// The message is the whole chain of causes, `ours: library's: its cause`.
    pub fn to_status(&self) -> tonic::Status {
        let message = chain(self);
        let message = cut(&message, STATUS_MESSAGE_LIMIT).into_owned();
        let mut s = tonic::Status::new(self.status_code().to_tonic(), message);
        match self {
            Error::PushedBack(p) => {
                if let Ok(v) = serde_json::to_string(p).unwrap_or_default().parse() {
                    s.metadata_mut().insert(PUSHBACK_METADATA, v);
                }
            }
            Error::Busy { retry_after, .. } => {
                if let Ok(v) = retry_after.as_millis().to_string().parse() {
                    s.metadata_mut().insert(RETRY_AFTER_METADATA, v);
                }
            }
            _ => {}
        }
        s
    }
}

/// `e` and its causes, `outer: inner: innermost`, without repeating a cause whose
/// text the outer message already includes.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        e.to_status()
    }
}

/// Our own errors travel through parquet's and arrow's traits boxed as "external":
/// unwrap them again; anything else is kept as the cause of an `External` error.
fn unbox(inner: BoxError, library: &str) -> Error {
    match inner.downcast::<Error>() {
        Ok(ours) => *ours,
        Err(other) => {
            let code = Error::code_in(other.as_ref()).unwrap_or(StatusCode::Internal);
            Error::external(code, library, other)
        }
    }
}

impl From<parquet::errors::ParquetError> for Error {
    fn from(e: parquet::errors::ParquetError) -> Self {
        match e {
            parquet::errors::ParquetError::External(inner) => unbox(inner, "parquet"),
            other => Error::external(StatusCode::Internal, "parquet", other),
        }
    }
}

impl From<arrow::error::ArrowError> for Error {
    fn from(e: arrow::error::ArrowError) -> Self {
        match e {
            arrow::error::ArrowError::ExternalError(inner) => unbox(inner, "arrow"),
            other => Error::external(StatusCode::Internal, "arrow", other),
        }
    }
}

impl From<arrow_flight::error::FlightError> for Error {
    fn from(e: arrow_flight::error::FlightError) -> Self {
        use arrow_flight::error::FlightError as F;
        match e {
            F::Arrow(a) => a.into(),
            F::Tonic(s) => {
                let code = StatusCode::from_tonic(s.code());
                Error::external(code, "flight", *s)
            }
            e @ (F::ProtocolError(_) | F::DecodeError(_)) => {
                Error::external(StatusCode::InvalidArgument, "flight stream", e)
            }
            e @ F::NotYetImplemented(_) => Error::external(StatusCode::Unimplemented, "flight", e),
            F::ExternalError(inner) => unbox(inner, "flight"),
        }
    }
}

/// Converts our error into parquet's, so it survives a trip through parquet traits.
pub(crate) fn to_parquet(e: Error) -> parquet::errors::ParquetError {
    parquet::errors::ParquetError::External(Box::new(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_are_kept_and_kinds_survive_boxing() {
        let ours = Error::NotFound("table t".into());
        let through = arrow::error::ArrowError::ExternalError(Box::new(ours));
        let back = Error::from(through);
        assert!(matches!(back, Error::NotFound(_)), "{back:?}");

        let io = std::io::Error::other("disk on fire");
        let parquet = parquet::errors::ParquetError::External(Box::new(Error::io("reading", io)));
        let e = Error::external(StatusCode::InvalidArgument, "decoding", parquet);
        assert_eq!(e.status_code(), StatusCode::InvalidArgument);
        assert_eq!(Error::code_in(&e), Some(StatusCode::InvalidArgument));
        let status = e.to_status();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().contains("disk on fire"), "{status:?}");

        let long = "x".repeat(100_000);
        let t = truncated(&long);
        assert!(t.len() < 300 && t.contains("100000 bytes"), "{t}");
    }
}
