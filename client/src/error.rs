//! The `csd` command line's and client library's error: every crate's error kept as
//! the cause, so that `csd` prints the whole chain and exits with the kind it was.

use csd_protocol::StatusCode;

/// Errors of the client library and the `csd` command.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A storage node refused or failed a request, or could not be reached.
    #[error(transparent)]
    Node(#[from] csd_protocol::node_client::Error),
    /// An embedded node (`csd serve`, `csd demo`) failed.
    #[error(transparent)]
    Runtime(#[from] csd_protocol::Error),
    /// A SQL statement failed (planning or running it).
    #[error(transparent)]
    Query(#[from] datafusion::error::DataFusionError),
    /// A feature job failed.
    #[error(transparent)]
    Ml(#[from] csd_ml_pushdown::Error),
    /// A testbed scenario failed.
    #[error(transparent)]
    Testbed(#[from] csd_testbed::Error),
    /// Reading or writing a local file or stream.
    #[error("{context}: {source}")]
    Io {
        /// What was being read or written.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Arrow data that could not be read or written.
    #[error("{context}: {source}")]
    Arrow {
        /// What was being read or written.
        context: String,
        /// Arrow's error.
        #[source]
        source: arrow::error::ArrowError,
    },
    /// Parquet data that could not be read or written.
    #[error("{context}: {source}")]
    Parquet {
        /// What was being read or written.
        context: String,
        /// Parquet's error.
        #[source]
        source: parquet::errors::ParquetError,
    },
    /// A node's error, with what was being done and what was left behind.
    #[error("{context}: {source}")]
    NodeStep {
        /// What was being done, and what was undone.
        context: String,
        /// The node's error.
        #[source]
        source: csd_protocol::node_client::Error,
    },
    /// Bad input from the user (arguments, files).
    #[error("{0}")]
    InvalidInput(String),
}

impl From<arrow::error::ArrowError> for Error {
    fn from(source: arrow::error::ArrowError) -> Self {
        Error::arrow("arrow data", source)
    }
}

/// Result with the client's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl std::fmt::Display, source: std::io::Error) -> Self {
        Error::Io {
            context: context.to_string(),
            source,
        }
    }

    /// Wraps an Arrow error with what was being done.
    pub fn arrow(context: impl std::fmt::Display, source: arrow::error::ArrowError) -> Self {
        Error::Arrow {
            context: context.to_string(),
            source,
        }
    }

    /// Wraps a Parquet error with what was being done.
    pub fn parquet(context: impl std::fmt::Display, source: parquet::errors::ParquetError) -> Self {
        Error::Parquet {
            context: context.to_string(),
            source,
        }
    }

    /// What kind of failure this is.
    pub fn status_code(&self) -> StatusCode {
        match self {
            Error::Node(e) | Error::NodeStep { source: e, .. } => e.status_code(),
            Error::Runtime(e) => e.status_code(),
            Error::Query(e) => csd_query_pushdown::error::status_code(e),
            Error::Ml(e) => e.status_code(),
            Error::Testbed(e) => {
                csd_protocol::Error::code_in(e).unwrap_or(StatusCode::InvalidArgument)
            }
            Error::InvalidInput(_) => StatusCode::InvalidArgument,
            Error::Io { .. } | Error::Arrow { .. } | Error::Parquet { .. } => {
                StatusCode::InvalidArgument
            }
        }
    }

    /// The process exit code `csd` ends with for this error: 2 for bad input, 3
    /// when a node could not be reached or was unavailable, 4 for corrupt data, 5
    /// when the node refused who the caller is or what it asked, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self.status_code() {
            StatusCode::InvalidArgument | StatusCode::NotFound | StatusCode::AlreadyExists => 2,
            StatusCode::Unavailable | StatusCode::DeadlineExceeded => 3,
            StatusCode::DataLoss => 4,
            StatusCode::Unauthenticated | StatusCode::PermissionDenied => 5,
            _ => 1,
        }
    }
}
