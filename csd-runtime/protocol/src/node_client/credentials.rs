//! How a client proves who it is and checks the node it talks to.

use super::error::{Error, Result};

/// How a client proves who it is and checks the node it talks to: a bearer token
/// for nodes with tenants, and TLS settings for `grpc+tls://` nodes.
#[derive(Clone, Default)]
pub struct Credentials {
    /// Bearer token sent with every call (`authorization: Bearer …`).
    pub token: Option<String>,
    /// CA certificate (PEM) a `grpc+tls://` node's certificate must chain to
    /// (default: the system's roots).
    pub tls_ca: Option<Vec<u8>>,
    /// Client certificate and key (PEM), for nodes that require mutual TLS.
    pub tls_identity: Option<(Vec<u8>, Vec<u8>)>,
    /// Leases (ids, of any nodes) operator requests run on where a node holds one
    /// (the `csd-lease` header): they skip its queue.
    pub leases: Vec<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("token", &self.token.as_ref().map(|_| "…"))
            .field("tls_ca", &self.tls_ca.is_some())
            .field("tls_identity", &self.tls_identity.is_some())
            .field("leases", &self.leases)
            .finish()
    }
}

impl Credentials {
    /// A bearer token only.
    pub fn token(token: impl Into<String>) -> Self {
        Credentials {
            token: Some(token.into()),
            ..Default::default()
        }
    }

    /// Credentials from a token and PEM files (what `csd`'s `--token`, `--tls-ca`,
    /// `--tls-cert` and `--tls-key` name).
    pub fn from_files(
        token: Option<String>,
        ca: Option<&std::path::Path>,
        cert: Option<&std::path::Path>,
        key: Option<&std::path::Path>,
    ) -> Result<Self> {
        let read = |p: &std::path::Path, what: &str| {
            std::fs::read(p)
                .map_err(|e| Error::io(format!("reading the {what} {}", p.display()), e))
        };
        let tls_identity = match (cert, key) {
            (Some(c), Some(k)) => Some((read(c, "client certificate")?, read(k, "client key")?)),
            (None, None) => None,
            _ => {
                return Err(Error::InvalidInput(
                    "--tls-cert and --tls-key go together".into(),
                ));
            }
        };
        Ok(Credentials {
            token: token.filter(|t| !t.is_empty()),
            tls_ca: ca.map(|p| read(p, "CA certificate")).transpose()?,
            tls_identity,
            leases: Vec::new(),
        })
    }
}
