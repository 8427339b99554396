//! How a call proves who it is: a bearer token and TLS files, as `csd --token`,
//! `--tls-ca`, `--tls-cert` and `--tls-key` take them (`auth={"token": …}` in
//! Python).

use std::collections::HashMap;
use std::path::Path;

use csd_protocol::node_client::Credentials;
use pyo3::prelude::*;

use crate::error;

/// The keys `auth` takes.
const KEYS: [&str; 4] = ["token", "tls_ca", "tls_cert", "tls_key"];

/// `auth` (`None`: no token, the system's TLS roots) as the client's credentials;
/// an unknown key or an unreadable file is refused by name.
pub(crate) fn credentials(auth: Option<HashMap<String, String>>) -> PyResult<Credentials> {
    let auth = auth.unwrap_or_default();
    if let Some(k) = auth.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(error::invalid(format!(
            "auth key {k:?}: csd takes {}",
            KEYS.join(", ")
        )));
    }
    let path = |k: &str| auth.get(k).map(Path::new);
    Credentials::from_files(
        auth.get("token").cloned(),
        path("tls_ca"),
        path("tls_cert"),
        path("tls_key"),
    )
    .map_err(|e| error::client(e.into()))
}
