//! The client's error: what a node answered (its typed refusals decoded by
//! [`StatusDetail`]), or why it could not be asked.

use std::time::Duration;

use arrow_flight::error::FlightError;

use crate::digest::ModuleDigest;
use crate::error::{StatusCode, StatusDetail, chain};
use crate::messages::PushBack;

/// Client errors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The node answered with an error status.
    #[error("node error ({code:?}): {message}")]
    Rpc {
        /// gRPC code.
        code: tonic::Code,
        /// The node's message.
        message: String,
    },
    /// The node could not be reached.
    #[error("cannot reach {url}: {}", chain(.source))]
    Connect {
        /// Node URL.
        url: String,
        /// Why (tonic's transport error and its causes).
        #[source]
        source: tonic::transport::Error,
    },
    /// Bad input from the user (file, arguments).
    #[error("{0}")]
    InvalidInput(String),
    /// A local file could not be read or written, with what we were doing.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The node sent something we cannot read.
    #[error("unexpected reply: {0}")]
    Protocol(String),
    /// A Flight stream failed in a way that is not the node's status.
    #[error("flight stream: {0}")]
    Flight(#[source] FlightError),
    /// Arrow data that could not be encoded or decoded.
    #[error("arrow: {0}")]
    Arrow(#[from] arrow::error::ArrowError),
    /// From the runtime (embedded node).
    #[error(transparent)]
    Runtime(#[from] crate::Error),
    /// The node lacks the shipped module the request names: send its bytes
    /// ([`NodeClient::put_module`](super::NodeClient::put_module)) and ask again.
    #[error("the node does not have wasm module {0}: send its bytes")]
    ModuleMissing(ModuleDigest),
    /// The node does not keep the attachment the request names: send it again
    /// ([`NodeClient::put_attachment`](super::NodeClient::put_attachment)) and ask
    /// again.
    #[error("the node does not keep attachment {0}: send it again")]
    AttachmentMissing(ModuleDigest),
    /// The node's admission control handed the request back: evaluate it here.
    #[error("pushed back by the storage node: {}", .0.reason)]
    PushedBack(PushBack),
    /// The node could not serve even raw reads, and kept refusing for the whole
    /// retry budget.
    #[error("storage node overloaded (retry in {} ms): {message}", .retry_after.as_millis())]
    Busy {
        /// The node's message.
        message: String,
        /// Its last retry hint.
        retry_after: Duration,
    },
}

/// How long a client keeps retrying a request the node refuses with a retry hint.
pub const RETRY_BUDGET: Duration = Duration::from_secs(60);

/// Client result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<tonic::Status> for Error {
    fn from(s: tonic::Status) -> Self {
        match StatusDetail::of(&s) {
            Some(StatusDetail::PushedBack(p)) => Error::PushedBack(p),
            Some(StatusDetail::RetryAfter(retry_after)) => Error::Busy {
                message: s.message().to_string(),
                retry_after,
            },
            Some(StatusDetail::ModuleMissing(d)) => Error::ModuleMissing(d),
            Some(StatusDetail::AttachmentMissing(d)) => Error::AttachmentMissing(d),
            None => Error::Rpc {
                code: s.code(),
                message: s.message().to_string(),
            },
        }
    }
}

impl From<FlightError> for Error {
    fn from(e: FlightError) -> Self {
        match e {
            FlightError::Tonic(s) => (*s).into(),
            FlightError::Arrow(a) => Error::Arrow(a),
            FlightError::ExternalError(inner) => match inner.downcast::<Error>() {
                Ok(ours) => *ours,
                Err(other) => Error::Flight(FlightError::ExternalError(other)),
            },
            other => Error::Flight(other),
        }
    }
}

impl Error {
    /// Wraps a local I/O error with what we were doing.
    pub fn io(context: impl std::fmt::Display, source: std::io::Error) -> Self {
        Error::Io {
            context: context.to_string(),
            source,
        }
    }

    /// The gRPC code, if the node answered with one.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Error::Rpc { code, .. } => Some(*code),
            Error::ModuleMissing(_) | Error::AttachmentMissing(_) => Some(tonic::Code::NotFound),
            Error::PushedBack(_) => Some(tonic::Code::Unavailable),
            Error::Busy { .. } => Some(tonic::Code::ResourceExhausted),
            _ => None,
        }
    }

    /// Whether the node (or this copy of its data) is gone rather than refusing
    /// the request: it cannot be reached, its connection broke mid-answer, it is
    /// unavailable, or it lost the data. Another copy of the same data on another
    /// node can answer instead; a refusal (pushed back, busy, bad request) cannot
    /// be cured that way.
    pub fn node_lost(&self) -> bool {
        match self {
            Error::Connect { .. } | Error::Flight(_) => true,
            Error::Rpc { code, .. } => matches!(
                code,
                tonic::Code::Unavailable
                    | tonic::Code::Unknown
                    | tonic::Code::Cancelled
                    | tonic::Code::Aborted
                    | tonic::Code::DataLoss
            ),
            _ => false,
        }
    }

    /// What kind of failure this is.
    pub fn status_code(&self) -> StatusCode {
        match self {
            Error::Rpc { code, .. } => StatusCode::from_tonic(*code),
            Error::ModuleMissing(_) | Error::AttachmentMissing(_) => StatusCode::NotFound,
            Error::Connect { .. } | Error::PushedBack(_) => StatusCode::Unavailable,
            Error::InvalidInput(_) | Error::Arrow(_) => StatusCode::InvalidArgument,
            Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                StatusCode::NotFound
            }
            Error::Io { .. } => StatusCode::InvalidArgument,
            Error::Protocol(_) | Error::Flight(_) => StatusCode::Internal,
            Error::Runtime(e) => e.status_code(),
            Error::Busy { .. } => StatusCode::ResourceExhausted,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RETRY_AFTER_METADATA;

    #[test]
    fn a_busy_nodes_refusal_says_its_hint_once() {
        let node_side = crate::error::Error::Busy {
            reason: "no lease of 5 slots now: the node has 2 CPU workers".into(),
            retry_after: Duration::from_millis(500),
        };
        let status: tonic::Status = node_side.into();
        let e = Error::from(status).to_string();
        assert_eq!(
            e,
            "storage node overloaded (retry in 500 ms): no lease of 5 slots now: the node has 2 CPU workers"
        );
        // Another Flight server's message is kept whole.
        let mut other = tonic::Status::resource_exhausted("queue full");
        other
            .metadata_mut()
            .insert(RETRY_AFTER_METADATA, "20".parse().unwrap());
        assert_eq!(
            Error::from(other).to_string(),
            "storage node overloaded (retry in 20 ms): queue full"
        );
    }
}
