//! A node's settings checked once, into types: [`NodeConfig::settings`] reads what
//! [`NodeConfig`] holds as the flags, variables and file gave it (strings, numbers of
//! seconds and milliseconds) and returns [`NodeSettings`], from which start-up and the
//! node's state are built, with no defaults of their own. Whatever is wrong with the
//! settings is an error here, naming the flag, before the device is opened.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use crate::admission::AdmissionConfig;
use crate::config::NodeConfig;
use crate::device::DeviceSpec;
use crate::error::{Error, Result};
use crate::sandbox::SandboxLimits;
use crate::store::FormatMode;
use crate::table::ParquetOptions;

/// A node's settings, checked (see the module docs).
#[derive(Debug, Clone)]
pub struct NodeSettings {
    /// The device, parsed.
    pub device: DeviceSpec,
    /// Capacity of a new device file or emulated device, in bytes.
    pub capacity: u64,
    /// Whether to format it at start.
    pub format: FormatMode,
    /// Where the Flight service listens.
    pub listen: SocketAddr,
    /// The URL advertised to clients, when not the bound address's.
    pub advertise: Option<String>,
    /// CPU workers for operator work.
    pub cpus: usize,
    /// The cores of `--cpu-set`, if given.
    pub cores: Option<Vec<usize>>,
    /// The node's memory budget, in bytes.
    pub memory: u64,
    /// Bytes of the read cache.
    pub read_cache: u64,
    /// How tables are written.
    pub parquet: ParquetOptions,
    /// Admission control: slots, policy, queueing target, link prior, tenants' shares.
    pub admission: AdmissionConfig,
    /// Where Prometheus metrics are served, if anywhere.
    pub metrics_listen: Option<SocketAddr>,
    /// The tenants file.
    pub auth: Option<PathBuf>,
    /// The Flight port's TLS files.
    pub tls: Option<TlsFiles>,
    /// The file of the key that seals tickets (`None`: kept on the device).
    pub ticket_key: Option<PathBuf>,
    /// How long handed-out tickets stay valid.
    pub ticket_ttl: Duration,
    /// Longest a kept result may live.
    pub ref_max_ttl: Duration,
    /// Longest lease of CPU slots.
    pub lease_max: Duration,
    /// The limits shipped code runs under.
    pub sandbox: SandboxLimits,
    /// Bytes of an object a raw range stream sends per message.
    pub range_chunk: u64,
    /// Size an operator answer's batches are cut to.
    pub wire_piece: u64,
    /// The background scrub's bytes a second (`None`: off).
    pub scrub_rate: Option<u64>,
}

/// The Flight port's TLS: its certificate chain and key, and the CA its clients'
/// certificates must be signed by (mutual TLS).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Certificate chain (PEM).
    pub cert: PathBuf,
    /// Private key (PEM).
    pub key: PathBuf,
    /// Clients' CA (PEM), for mutual TLS.
    pub client_ca: Option<PathBuf>,
}

impl NodeConfig {
    /// These settings checked, typed (see the module docs).
    pub fn settings(&self) -> Result<NodeSettings> {
        if self.cpus == 0 {
            return Err(Error::InvalidArgument("--cpus must be at least 1".into()));
        }
        let cores = self
            .cpu_set
            .as_deref()
            .map(crate::pool::parse_core_list)
            .transpose()?;
        let listen = socket_addr("--listen", &self.listen)?;
        let metrics_listen = self
            .metrics_listen
            .as_deref()
            .map(|m| socket_addr("--metrics-listen", m))
            .transpose()?;
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
            }),
            (None, None) if self.tls_client_ca.is_some() => {
                return Err(Error::InvalidArgument(
                    "--tls-client-ca needs --tls-cert and --tls-key".into(),
                ));
            }
            (None, None) => None,
            _ => {
                return Err(Error::InvalidArgument(
                    "--tls-cert and --tls-key go together".into(),
                ));
            }
        };
        if let Some(m) = metrics_listen
            && (tls.is_some() || self.auth.is_some())
            && !m.ip().is_loopback()
            && !self.metrics_public
        {
            return Err(Error::InvalidArgument(format!(
                "metrics would be served in clear to anyone on {m} while the Flight port is protected: bind them to 127.0.0.1, or pass --metrics-public"
            )));
        }
        Ok(NodeSettings {
            device: self.device.parse()?,
            capacity: self.capacity.bytes(),
            format: if self.format {
                FormatMode::Force
            } else {
                FormatMode::IfBlank
            },
            listen,
            advertise: self.advertise.clone(),
            cpus: self.cpus,
            cores,
            memory: self.memory.bytes(),
            read_cache: self.read_cache_bytes(),
            parquet: self.parquet.clone(),
            admission: self.admission()?,
            metrics_listen,
            auth: self.auth.clone(),
            tls,
            ticket_key: self.ticket_key.clone(),
            ticket_ttl: Duration::from_secs(self.ticket_ttl_s.max(1)),
            ref_max_ttl: Duration::from_secs(self.ref_max_ttl_s.max(1)),
            lease_max: Duration::from_secs(self.lease_max_s.max(1)),
            sandbox: self.sandbox_limits(),
            range_chunk: self.range_chunk.bytes().max(4096),
            wire_piece: self.wire_piece.bytes().max(64 << 10),
            scrub_rate: self.scrub_rate.map(|r| r.bytes()).filter(|&r| r > 0),
        })
    }
}

/// `text` (`HOST:PORT`, the host a name or an address) as the address it names.
fn socket_addr(flag: &str, text: &str) -> Result<SocketAddr> {
    text.to_socket_addrs()
        .map_err(|e| Error::InvalidArgument(format!("{flag} {text:?}: {e} (expected HOST:PORT)")))?
        .next()
        .ok_or_else(|| Error::InvalidArgument(format!("{flag} {text:?}: names no address")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ByteSize;

    #[test]
    fn settings_are_checked_into_types_once() {
        let s = NodeConfig::default().settings().unwrap();
        assert_eq!(s.listen, "127.0.0.1:50051".parse().unwrap());
        assert_eq!(s.memory, 2 << 30);
        assert_eq!(s.read_cache, 512 << 20);
        assert_eq!(s.ticket_ttl, Duration::from_secs(3600));
        assert_eq!(s.range_chunk, 1 << 20);
        assert!(s.tls.is_none() && s.metrics_listen.is_none() && s.scrub_rate.is_none());

        let c = NodeConfig {
            listen: "localhost:0".into(),
            cpu_set: Some("0-1".into()),
            scrub_rate: Some(ByteSize(0)),
            ..NodeConfig::default()
        };
        let s = c.settings().unwrap();
        assert!(s.listen.ip().is_loopback());
        assert_eq!(s.cores, Some(vec![0, 1]));
        assert_eq!(s.scrub_rate, None, "a rate of 0 is off");

        for (bad, says) in [
            (
                NodeConfig {
                    listen: "nowhere".into(),
                    ..NodeConfig::default()
                },
                "--listen",
            ),
            (
                NodeConfig {
                    cpus: 0,
                    ..NodeConfig::default()
                },
                "--cpus",
            ),
            (
                NodeConfig {
                    cpu_set: Some("3-1".into()),
                    ..NodeConfig::default()
                },
                "cpu set",
            ),
            (
                NodeConfig {
                    tls_key: Some("k.pem".into()),
                    ..NodeConfig::default()
                },
                "--tls-cert and --tls-key",
            ),
            (
                NodeConfig {
                    auth: Some("tenants.toml".into()),
                    metrics_listen: Some("0.0.0.0:9100".into()),
                    ..NodeConfig::default()
                },
                "--metrics-public",
            ),
            (
                NodeConfig {
                    device: "emulated:bogus".into(),
                    ..NodeConfig::default()
                },
                "bogus",
            ),
            (
                NodeConfig {
                    tenants: vec!["a=x".into()],
                    ..NodeConfig::default()
                },
                "tenant a: weight",
            ),
        ] {
            let e = bad.settings().unwrap_err();
            assert!(e.to_string().contains(says), "{says}: {e}");
        }
    }
}
