//! `csd auth`: tokens and certificates for nodes with tenants (`csd serve --auth`,
//! TLS).

use std::path::PathBuf;

use clap::Subcommand;
use csd_client::{Error, Result};

#[derive(Subcommand)]
pub(crate) enum AuthCmd {
    /// Print the SHA-256 digest of a token, for `token_sha256` in a tenants file
    /// (reads the token from stdin when none is given, so it stays out of `ps`).
    Hash {
        /// The token.
        token: Option<String>,
    },
    /// Make a new random token; print it and its digest.
    Token,
    /// Make a private CA, a node certificate and a client certificate (PEM files
    /// ca.pem, node.pem, node.key, client.pem, client.key) in DIR.
    Ca {
        /// Folder to write them into (files there are not overwritten).
        dir: PathBuf,
        /// Names and IP addresses the node is reached by (repeat).
        #[arg(long = "host", default_values = ["localhost", "127.0.0.1"])]
        hosts: Vec<String>,
        /// The client certificate's subject common name (a tenant's `cert_subject`).
        #[arg(long, default_value = "client")]
        client: String,
    },
}

pub(crate) fn run(cmd: AuthCmd) -> Result<()> {
    use csd_runtime::auth::{new_token, token_digest};
    match cmd {
        AuthCmd::Hash { token } => {
            let token = match token {
                Some(t) => t,
                None => {
                    let mut line = String::new();
                    std::io::stdin()
                        .read_line(&mut line)
                        .map_err(|e| Error::io("reading the token from stdin", e))?;
                    line.trim().to_string()
                }
            };
            if token.is_empty() {
                return Err(Error::InvalidInput("the token is empty".into()));
            }
            println!("{}", token_digest(&token));
        }
        AuthCmd::Token => {
            let t = new_token();
            println!("token:        {t}");
            println!("token_sha256: {}", token_digest(&t));
        }
        AuthCmd::Ca { dir, hosts, client } => {
            let certs = csd_runtime::tls::make_certificates(&hosts, &client)?;
            for p in certs.write(&dir)? {
                println!("wrote {}", p.display());
            }
            println!(
                "node:   csd serve --tls-cert {0}/node.pem --tls-key {0}/node.key [--tls-client-ca {0}/ca.pem]",
                dir.display()
            );
            println!(
                "client: csd ls --node grpc+tls://{}:50051 --tls-ca {1}/ca.pem [--tls-cert {1}/client.pem --tls-key {1}/client.key]",
                hosts.first().map(String::as_str).unwrap_or("localhost"),
                dir.display()
            );
        }
    }
    Ok(())
}
