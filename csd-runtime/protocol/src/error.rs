//! The storage node's error type, its kinds ([`StatusCode`]), its one mapping to a
//! gRPC status ([`Error::to_status`]), and the typed details a status carries
//! ([`StatusDetail`]), decoded in one place for the node and its clients alike.

use std::fmt::Display;
use std::time::Duration;

use crate::digest::{BadDigest, ModuleDigest};
use crate::messages::PushBack;
use crate::text::cut;
pub use crate::text::{chain, truncated};
use crate::{
    MISSING_ATTACHMENT_METADATA, MISSING_MODULE_METADATA, PUSHBACK_METADATA, RETRY_AFTER_METADATA,
};

/// A boxed error from a library, kept as the cause of ours.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
    pub fn to_tonic(self) -> tonic::Code {
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
    pub fn from_tonic(code: tonic::Code) -> Self {
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
    /// [`PushBack`] in the `csd-pushback` metadata).
    #[error("pushed back to the compute tier: {}", .0.reason)]
    PushedBack(PushBack),
    /// The request names a shipped module this node does not have: send its bytes
    /// (the `put_module` action, or in the request) and ask again (gRPC `NOT_FOUND`
    /// with the digest in the `csd-missing-module` metadata).
    #[error(
        "not found: wasm module not at this node: {0} (send its bytes: the put_module action, or in the request)"
    )]
    ModuleMissing(ModuleDigest),
    /// The request names an attachment this node does not keep (never sent, or let
    /// go of since): send it again (the `put_attachment` action) and ask again (gRPC
    /// `NOT_FOUND` with the digest in the `csd-missing-attachment` metadata).
    #[error(
        "not found: attachment {0} is not at this node (never sent, or let go of since: send it again with put_attachment)"
    )]
    AttachmentMissing(ModuleDigest),
    /// Not even raw reads can be served now (gRPC `RESOURCE_EXHAUSTED` with
    /// `retry-after-ms` metadata).
    #[error("node overloaded, retry in {} ms: {reason}", .retry_after.as_millis())]
    Busy {
        /// Why.
        reason: String,
        /// When to retry.
        retry_after: Duration,
    },
}

/// Result with the node's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Longest message a status carries: well inside the 8 KiB of headers a gRPC client
/// accepts by default.
const STATUS_MESSAGE_LIMIT: usize = 4096;

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
            Error::NotFound(_) | Error::ModuleMissing(_) | Error::AttachmentMissing(_) => {
                StatusCode::NotFound
            }
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
    /// The message is the whole chain of causes, `ours: library's: its cause`; a
    /// refusal's typed detail travels in metadata ([`StatusDetail`]), and an
    /// overloaded node's message is its reason alone (the hint is in metadata).
    pub fn to_status(&self) -> tonic::Status {
        let message = match self {
            Error::Busy { reason, .. } => reason.clone(),
            e => chain(e),
        };
        let message = cut(&message, STATUS_MESSAGE_LIMIT).into_owned();
        let mut s = tonic::Status::new(self.status_code().to_tonic(), message);
        let detail = match self {
            Error::PushedBack(p) => serde_json::to_string(p)
                .ok()
                .map(|v| (PUSHBACK_METADATA, v)),
            Error::Busy { retry_after, .. } => {
                Some((RETRY_AFTER_METADATA, retry_after.as_millis().to_string()))
            }
            Error::ModuleMissing(d) => Some((MISSING_MODULE_METADATA, d.to_string())),
            Error::AttachmentMissing(d) => Some((MISSING_ATTACHMENT_METADATA, d.to_string())),
            _ => None,
        };
        if let Some((key, value)) = detail
            && let Ok(v) = value.parse()
        {
            s.metadata_mut().insert(key, v);
        }
        s
    }

    /// A status a peer answered, as our error: its typed detail if it carries one,
    /// else its kind, with the status kept whole as the cause. `context` says what
    /// was asked of the peer.
    pub fn from_status(context: impl Display, status: tonic::Status) -> Self {
        match StatusDetail::of(&status) {
            Some(StatusDetail::PushedBack(p)) => Error::PushedBack(p),
            Some(StatusDetail::RetryAfter(retry_after)) => Error::Busy {
                reason: status.message().to_string(),
                retry_after,
            },
            Some(StatusDetail::ModuleMissing(d)) => Error::ModuleMissing(d),
            Some(StatusDetail::AttachmentMissing(d)) => Error::AttachmentMissing(d),
            None => Error::external(
                StatusCode::from_tonic(status.code()),
                context,
                PeerStatus(status),
            ),
        }
    }
}

/// What a refusal carries beyond its code and message, in its metadata: the one
/// place statuses are read back (by the node's clients, and by the node of the
/// statuses its own streams carry).
#[derive(Debug, Clone, PartialEq)]
pub enum StatusDetail {
    /// `UNAVAILABLE`: admission handed the request back; evaluate it at the asker.
    PushedBack(PushBack),
    /// `RESOURCE_EXHAUSTED`: the node cannot serve even raw reads now; retry after.
    RetryAfter(Duration),
    /// `NOT_FOUND`: the node lacks this shipped module; send its bytes.
    ModuleMissing(ModuleDigest),
    /// `NOT_FOUND`: the node does not keep this attachment; send it again.
    AttachmentMissing(ModuleDigest),
}

impl StatusDetail {
    /// The detail `status` carries, if any (one a status of its code may carry).
    pub fn of(status: &tonic::Status) -> Option<Self> {
        use tonic::Code;
        let meta = |k: &str| status.metadata().get(k).and_then(|v| v.to_str().ok());
        match status.code() {
            Code::Unavailable => meta(PUSHBACK_METADATA)
                .and_then(|j| serde_json::from_str(j).ok())
                .map(StatusDetail::PushedBack),
            Code::ResourceExhausted => meta(RETRY_AFTER_METADATA)
                .and_then(|v| v.parse::<u64>().ok())
                .map(|ms| StatusDetail::RetryAfter(Duration::from_millis(ms))),
            Code::NotFound => {
                let digest = |k| meta(k).and_then(|d| ModuleDigest::parse(d.as_bytes()).ok());
                digest(MISSING_MODULE_METADATA)
                    .map(StatusDetail::ModuleMissing)
                    .or_else(|| {
                        digest(MISSING_ATTACHMENT_METADATA).map(StatusDetail::AttachmentMissing)
                    })
            }
            _ => None,
        }
    }
}

/// A status a peer answered, kept whole (its metadata too) as the cause of an
/// error; it reads as its message.
#[derive(Debug)]
pub struct PeerStatus(pub tonic::Status);

impl std::fmt::Display for PeerStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.message())
    }
}

impl std::error::Error for PeerStatus {}

impl From<BadDigest> for Error {
    fn from(e: BadDigest) -> Self {
        Error::InvalidArgument(e.to_string())
    }
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
            F::Tonic(s) => Error::from_status("flight", *s),
            e @ (F::ProtocolError(_) | F::DecodeError(_)) => {
                Error::external(StatusCode::InvalidArgument, "flight stream", e)
            }
            e @ F::NotYetImplemented(_) => Error::external(StatusCode::Unimplemented, "flight", e),
            F::ExternalError(inner) => unbox(inner, "flight"),
        }
    }
}

/// Converts our error into parquet's, so it survives a trip through parquet traits.
pub fn to_parquet(e: Error) -> parquet::errors::ParquetError {
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

        // Typed details survive the trip to a status and back.
        let d = ModuleDigest::of(b"module");
        let back = Error::from_status("asking", Error::ModuleMissing(d).to_status());
        assert!(
            matches!(back, Error::ModuleMissing(x) if x == d),
            "{back:?}"
        );
        let busy = Error::Busy {
            reason: "no slot".into(),
            retry_after: Duration::from_millis(300),
        };
        let status = busy.to_status();
        assert_eq!(status.message(), "no slot");
        let back = Error::from_status("asking", status);
        assert!(
            matches!(&back, Error::Busy { reason, retry_after } if reason == "no slot" && retry_after.as_millis() == 300),
            "{back:?}"
        );
        let plain = Error::from_status("asking", tonic::Status::not_found("table t"));
        assert_eq!(plain.status_code(), StatusCode::NotFound);
        assert_eq!(plain.to_string(), "asking: table t");
    }
}
