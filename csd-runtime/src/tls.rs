//! Certificates for a deployment without a PKI of its own: `csd auth ca` makes a
//! private CA, a server certificate for the node's names and a client certificate
//! (for mutual TLS), all as PEM files. The TLS tests use the same.

use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

use crate::error::{Error, Result};

/// A private CA and certificates it signed, as PEM.
#[derive(Clone)]
pub struct Certificates {
    /// The CA's certificate (clients trust it: `--tls-ca`; nodes check client
    /// certificates against it: `--tls-client-ca`).
    pub ca_pem: String,
    /// The node's certificate (`--tls-cert`).
    pub server_cert_pem: String,
    /// The node's private key (`--tls-key`).
    pub server_key_pem: String,
    /// A client certificate (mutual TLS), its subject common name the client's name.
    pub client_cert_pem: String,
    /// Its private key.
    pub client_key_pem: String,
}

fn failed(what: &str) -> impl Fn(rcgen::Error) -> Error + '_ {
    move |e| Error::external(crate::StatusCode::Internal, format!("making {what}"), e)
}

/// A new CA, a server certificate valid for `hosts` (names or IP addresses), and a
/// client certificate whose subject common name is `client`.
pub fn make_certificates(hosts: &[String], client: &str) -> Result<Certificates> {
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(failed("the CA"))?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "csd private CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().map_err(failed("the CA key"))?;
    let ca = CertifiedIssuer::self_signed(ca, ca_key).map_err(failed("the CA"))?;

    let mut server = CertificateParams::new(hosts.to_vec())
        .map_err(|e| Error::InvalidArgument(format!("server names {hosts:?}: {e}")))?;
    server.distinguished_name.push(
        DnType::CommonName,
        hosts.first().map(String::as_str).unwrap_or("csd node"),
    );
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server_key = KeyPair::generate().map_err(failed("the server key"))?;
    let server_cert = server
        .signed_by(&server_key, &ca)
        .map_err(failed("the server certificate"))?;

    let mut cl = CertificateParams::new(Vec::<String>::new()).map_err(failed("the client"))?;
    cl.distinguished_name.push(DnType::CommonName, client);
    cl.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client_key = KeyPair::generate().map_err(failed("the client key"))?;
    let client_cert = cl
        .signed_by(&client_key, &ca)
        .map_err(failed("the client certificate"))?;
    Ok(Certificates {
        ca_pem: ca.pem(),
        server_cert_pem: server_cert.pem(),
        server_key_pem: server_key.serialize_pem(),
        client_cert_pem: client_cert.pem(),
        client_key_pem: client_key.serialize_pem(),
    })
}

impl Certificates {
    /// Writes `ca.pem`, `node.pem`, `node.key`, `client.pem`, `client.key` into `dir`
    /// (keys mode 0600); refuses to overwrite.
    pub fn write(&self, dir: &Path) -> Result<Vec<std::path::PathBuf>> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let mut written = Vec::new();
        for (name, text, mode) in [
            ("ca.pem", &self.ca_pem, 0o644),
            ("node.pem", &self.server_cert_pem, 0o644),
            ("node.key", &self.server_key_pem, 0o600),
            ("client.pem", &self.client_cert_pem, 0o644),
            ("client.key", &self.client_key_pem, 0o600),
        ] {
            let path = dir.join(name);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&path)
                .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
            f.write_all(text.as_bytes())
                .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
            written.push(path);
        }
        Ok(written)
    }
}
