//! [`NodeClient`] talks Arrow Flight to one storage node: store tables
//! ([`NodeClient::put`]), list them, scan them back, read object bytes by range, run
//! pushed-down operators ([`NodeClient::operator`]), delete, and read node figures.
//! It lives here, beside the ticket format and the service, because this crate owns
//! the wire protocol; the operator crates and `csd-client` use it.

use std::time::Duration;

use crate::protocol::{
    ActionRequest, DeleteRequest, NodeStats, ObjectsRequest, PutSummary, StatsRequest,
    TableDescription, Ticket,
};
use crate::store::ObjectInfo;
use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use arrow_flight::decode::{DecodedPayload, FlightDataDecoder, FlightRecordBatchStream};
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{
    Criteria, FlightClient, FlightData, FlightDescriptor, FlightInfo, Ticket as FlightTicket,
};
use bytes::{Bytes, BytesMut};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt, TryStreamExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::StatusCode;
use crate::admission::PushBack;
use crate::protocol::Compression;
use crate::protocol::OperatorReport;
use crate::protocol::{PUSHBACK_METADATA, RETRY_AFTER_METADATA};
use tonic::transport::{Channel, Endpoint};

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
    #[error("cannot reach {url}: {}", crate::error::chain(.source))]
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
pub(crate) const RETRY_BUDGET: Duration = Duration::from_secs(60);

/// Client result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<tonic::Status> for Error {
    fn from(s: tonic::Status) -> Self {
        let meta = |k: &str| s.metadata().get(k).and_then(|v| v.to_str().ok());
        if s.code() == tonic::Code::Unavailable
            && let Some(p) = meta(PUSHBACK_METADATA).and_then(|j| serde_json::from_str(j).ok())
        {
            return Error::PushedBack(p);
        }
        if s.code() == tonic::Code::ResourceExhausted
            && let Some(ms) = meta(RETRY_AFTER_METADATA).and_then(|v| v.parse::<u64>().ok())
        {
            // A csd node's message repeats the hint this error prints: keep its reason.
            let m = s.message();
            let reason = m
                .strip_prefix("node overloaded, retry in ")
                .and_then(|r| r.split_once(" ms: "))
                .map_or(m, |(_, reason)| reason);
            return Error::Busy {
                message: reason.to_string(),
                retry_after: Duration::from_millis(ms),
            };
        }
        Error::Rpc {
            code: s.code(),
            message: s.message().to_string(),
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
    /// The gRPC code, if the node answered with one.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Error::Rpc { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// What kind of failure this is.
    pub fn status_code(&self) -> StatusCode {
        match self {
            Error::Rpc { code, .. } => StatusCode::from_tonic(*code),
            Error::Connect { .. } | Error::PushedBack(_) => StatusCode::Unavailable,
            Error::InvalidInput(_) | Error::Arrow(_) => StatusCode::InvalidArgument,
            Error::Protocol(_) | Error::Flight(_) => StatusCode::Internal,
            Error::Runtime(e) => e.status_code(),
            Error::Busy { .. } => StatusCode::ResourceExhausted,
        }
    }
}

/// Largest message the client accepts.
const MAX_MESSAGE_BYTES: usize = crate::protocol::MAX_MESSAGE_BYTES;

/// A table as a node describes it.
#[derive(Debug, Clone)]
pub struct TableInfo {
    /// Name.
    pub name: String,
    /// Arrow schema.
    pub schema: SchemaRef,
    /// Rows.
    pub rows: u64,
    /// Stored bytes.
    pub bytes: u64,
    /// Partitions and their objects.
    pub description: TableDescription,
}

impl TryFrom<FlightInfo> for TableInfo {
    type Error = Error;
    fn try_from(info: FlightInfo) -> Result<Self> {
        let schema = std::sync::Arc::new(info.clone().try_decode_schema()?);
        let description: TableDescription = serde_json::from_slice(&info.app_metadata)
            .map_err(|e| Error::Protocol(format!("table description: {e}")))?;
        Ok(TableInfo {
            name: description.table.clone(),
            schema,
            rows: info.total_records.max(0) as u64,
            bytes: info.total_bytes.max(0) as u64,
            description,
        })
    }
}

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
            std::fs::read(p).map_err(|e| {
                Error::InvalidInput(format!("reading the {what} {}: {e}", p.display()))
            })
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

/// A connection to one storage node.
#[derive(Clone)]
pub struct NodeClient {
    url: String,
    raw: FlightServiceClient<Channel>,
    tenant: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    /// `Bearer <token>`, sent with every call.
    authorization: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    /// Leases operator requests may run on (`csd-lease`).
    lease: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    /// This client's link from the node, learned from its range reads (shared by
    /// clones); sent with operator requests so the node can price handing back.
    link: Arc<crate::link::LinkMeter>,
}

impl NodeClient {
    /// Connects to `url` (`grpc://host:port`, `http://host:port` or `host:port`;
    /// `grpc+tls://`, `grpcs://` or `https://` for TLS with the system's roots).
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, &Credentials::default()).await
    }

    /// [`connect`](Self::connect) with a token and TLS settings.
    pub async fn connect_with(url: &str, credentials: &Credentials) -> Result<Self> {
        let endpoint = Self::endpoint(url, credentials)?;
        let channel = endpoint.connect().await.map_err(|source| Error::Connect {
            url: url.to_string(),
            source,
        })?;
        Self::over(url, channel, credentials)
    }

    /// [`connect_with`](Self::connect_with), connecting on the first call instead of
    /// now (for code that cannot wait here, such as a plan being decoded; a node that
    /// cannot be reached fails that call). Needs a Tokio runtime.
    pub fn connect_lazy_with(url: &str, credentials: &Credentials) -> Result<Self> {
        let channel = Self::endpoint(url, credentials)?.connect_lazy();
        Self::over(url, channel, credentials)
    }

    /// The transport endpoint of `url` with `credentials`' TLS settings.
    fn endpoint(url: &str, credentials: &Credentials) -> Result<Endpoint> {
        let (tls, http) = match url.split_once("://") {
            Some(("grpc" | "http", rest)) => (false, format!("http://{rest}")),
            Some(("grpc+tls" | "grpcs" | "https", rest)) => (true, format!("https://{rest}")),
            Some((scheme, _)) => {
                return Err(Error::InvalidInput(format!(
                    "node URL {url:?}: scheme {scheme} is not grpc, grpc+tls, grpcs, http or https"
                )));
            }
            None => (false, format!("http://{url}")),
        };
        let tls_asked = credentials.tls_ca.is_some() || credentials.tls_identity.is_some();
        if tls_asked && !tls {
            return Err(Error::InvalidInput(format!(
                "node URL {url:?} is plain TCP but TLS settings were given: use grpc+tls://"
            )));
        }
        let mut endpoint = Endpoint::from_shared(http)
            .map_err(|e| Error::InvalidInput(format!("node URL {url:?}: {e}")))?;
        if tls {
            use tonic::transport::{Certificate, ClientTlsConfig, Identity};
            let mut cfg = ClientTlsConfig::new();
            cfg = match &credentials.tls_ca {
                Some(ca) => cfg.ca_certificate(Certificate::from_pem(ca)),
                None => cfg.with_native_roots(),
            };
            if let Some((cert, key)) = &credentials.tls_identity {
                cfg = cfg.identity(Identity::from_pem(cert, key));
            }
            endpoint = endpoint.tls_config(cfg).map_err(|e| {
                Error::InvalidInput(format!(
                    "TLS settings for {url}: {}",
                    crate::error::chain(&e)
                ))
            })?;
        }
        Ok(endpoint
            .connect_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .initial_stream_window_size(crate::protocol::STREAM_WINDOW)
            .initial_connection_window_size(crate::protocol::CONNECTION_WINDOW))
    }

    /// A client over `channel` to `url`, sending `credentials`' token and leases.
    fn over(url: &str, channel: Channel, credentials: &Credentials) -> Result<Self> {
        let authorization = match &credentials.token {
            Some(t) => {
                let mut v: tonic::metadata::MetadataValue<_> =
                    format!("Bearer {t}").parse().map_err(|_| {
                        Error::InvalidInput(
                            "the token must be printable ASCII without spaces".into(),
                        )
                    })?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        let raw = FlightServiceClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let lease = match credentials.leases.join(",") {
            l if l.is_empty() => None,
            l => Some(l.parse().map_err(|_| {
                Error::InvalidInput(format!("lease ids {l:?} are not printable ASCII"))
            })?),
        };
        Ok(NodeClient {
            url: url.to_string(),
            raw,
            tenant: None,
            authorization,
            lease,
            link: crate::link::LinkMeter::new(),
        })
    }

    /// The same connection, sending `tenant` with every request (admission control
    /// shares the node's CPU between tenants by their weights).
    pub fn with_tenant(mut self, tenant: &str) -> Result<Self> {
        let v = tenant
            .parse()
            .map_err(|_| Error::InvalidInput(format!("tenant {tenant:?} is not ASCII")))?;
        self.tenant = Some(v);
        Ok(self)
    }

    /// `DoGet` of `ticket`; a refusal with a retry hint (the node is saturated) is
    /// retried after the hint, for up to [`RETRY_BUDGET`].
    async fn do_get(&self, ticket: &Ticket) -> Result<tonic::Streaming<FlightData>> {
        self.do_get_bytes(ticket.encode()).await
    }

    /// [`Self::do_get`] of a ticket's bytes as they are (a sealed one, a reference's).
    async fn do_get_bytes(&self, bytes: Vec<u8>) -> Result<tonic::Streaming<FlightData>> {
        let started = std::time::Instant::now();
        let mut attempt = 0u32;
        loop {
            let mut req = tonic::Request::new(FlightTicket::new(bytes.clone()));
            if let Some(t) = &self.tenant {
                req.metadata_mut()
                    .insert(crate::protocol::TENANT_METADATA, t.clone());
            }
            if let Some(a) = &self.authorization {
                req.metadata_mut()
                    .insert(crate::auth::AUTHORIZATION, a.clone());
            }
            if let Some(l) = &self.lease {
                req.metadata_mut()
                    .insert(crate::protocol::LEASE_METADATA, l.clone());
            }
            match self.raw.clone().do_get(req).await {
                Ok(r) => return Ok(r.into_inner()),
                Err(status) => match Error::from(status) {
                    Error::Busy {
                        message,
                        retry_after,
                    } if started.elapsed() + retry_after < RETRY_BUDGET => {
                        attempt += 1;
                        // The hint, stretched a little per attempt and spread so
                        // that refused clients do not all come back at once.
                        let spread = 1.0
                            + 0.25 * f64::from(attempt.min(8))
                            + (started.elapsed().subsec_nanos() % 97) as f64 / 400.0;
                        tracing::debug!(%message, ?retry_after, attempt, "node busy, retrying");
                        tokio::time::sleep(retry_after.mul_f64(spread)).await;
                    }
                    e => return Err(e),
                },
            }
        }
    }

    /// The node's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn flight(&self) -> FlightClient {
        let mut c = FlightClient::new_from_inner(self.raw.clone());
        for (k, v) in [
            (crate::protocol::TENANT_METADATA, &self.tenant),
            (crate::auth::AUTHORIZATION, &self.authorization),
            (crate::protocol::LEASE_METADATA, &self.lease),
        ] {
            if let Some(v) = v {
                c.metadata_mut().insert(k, v.clone());
            }
        }
        c
    }

    /// Stores `batches` as one new object of `table`/`partition`.
    pub async fn put<S>(
        &self,
        table: &str,
        partition: &str,
        schema: SchemaRef,
        batches: S,
    ) -> Result<PutSummary>
    where
        S: Stream<Item = Result<RecordBatch>> + Send + 'static,
    {
        // The upload is marked and closed with an end message: should this future be
        // dropped or `batches` fail, arrow-flight's client ends the stream cleanly,
        // and the missing end tells the node to store nothing.
        let data = FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .with_metadata(bytes::Bytes::from_static(crate::protocol::PUT_MARKED))
            .with_flight_descriptor(Some(FlightDescriptor::new_path(vec![
                table.into(),
                partition.into(),
            ])))
            .build(batches.map_err(|e| FlightError::ExternalError(Box::new(e))))
            .chain(futures::stream::once(async {
                Ok(FlightData::new().with_app_metadata(crate::protocol::PUT_END))
            }));
        let mut results = self.flight().do_put(data).await?;
        let first = results
            .try_next()
            .await?
            .ok_or_else(|| Error::Protocol("DoPut returned no result".into()))?;
        serde_json::from_slice(&first.app_metadata)
            .map_err(|e| Error::Protocol(format!("put summary: {e}")))
    }

    /// All tables (optionally those whose names start with `prefix`).
    pub async fn list_tables(&self, prefix: &str) -> Result<Vec<TableInfo>> {
        let infos: Vec<FlightInfo> = self
            .flight()
            .list_flights(
                Criteria {
                    expression: prefix.to_string().into(),
                }
                .expression,
            )
            .await?
            .try_collect()
            .await?;
        infos.into_iter().map(TableInfo::try_from).collect()
    }

    /// One table.
    pub async fn table(&self, name: &str) -> Result<TableInfo> {
        self.flight()
            .get_flight_info(FlightDescriptor::new_path(vec![name.into()]))
            .await?
            .try_into()
    }

    /// Streams a table (or one partition), optionally only some columns.
    pub async fn scan(
        &self,
        table: &str,
        partition: Option<&str>,
        columns: &[&str],
    ) -> Result<FlightRecordBatchStream> {
        self.scan_limit(table, partition, columns, None).await
    }

    /// [`scan`](Self::scan), only the first `limit` rows (in storage order) when given.
    pub async fn scan_limit(
        &self,
        table: &str,
        partition: Option<&str>,
        columns: &[&str],
        limit: Option<u64>,
    ) -> Result<FlightRecordBatchStream> {
        let ticket = Ticket::Scan {
            table: table.into(),
            partition: partition.map(Into::into),
            columns: columns.iter().map(|c| c.to_string()).collect(),
            limit,
        };
        let inner = self.do_get(&ticket).await?;
        Ok(FlightRecordBatchStream::new_from_flight_data(
            inner.map_err(|s| FlightError::Tonic(Box::new(s))),
        ))
    }

    /// Reads `len` raw bytes at `offset` of a stored object.
    pub async fn read_range(&self, object: &str, offset: u64, len: u64) -> Result<Bytes> {
        let ticket = Ticket::Range {
            object: object.into(),
            offset,
            length: len,
        };
        let transfer = self.link.transfer();
        let mut stream = self.do_get(&ticket).await?;
        let mut out = BytesMut::with_capacity(len as usize);
        while let Some(d) = stream.message().await? {
            transfer.add(d.data_body.len() as u64);
            out.extend_from_slice(&d.data_body);
        }
        drop(transfer);
        if out.len() as u64 != len {
            return Err(Error::Protocol(format!(
                "asked for {len} bytes of {object}, got {}",
                out.len()
            )));
        }
        Ok(out.freeze())
    }

    /// Runs the pushed-down operator `name` with `args`; the answer's IPC bodies are
    /// compressed with `compression`. Fails at once if the node refuses the request;
    /// [`Error::PushedBack`] means the caller should evaluate it itself.
    pub async fn operator(
        &self,
        name: &str,
        args: Vec<u8>,
        compression: Compression,
    ) -> Result<OperatorReply> {
        self.operator_with(name, args, compression, false, 0.0)
            .await
    }

    /// [`operator`](Self::operator); a `patient` request asks the node to queue it
    /// rather than push it back for queueing delay (send it when this tier's own
    /// cores are saturated). `load` is the fraction of this tier's cores busy; it
    /// travels with the link throughput this client has measured, if any.
    pub async fn operator_with(
        &self,
        name: &str,
        args: Vec<u8>,
        compression: Compression,
        patient: bool,
        load: f64,
    ) -> Result<OperatorReply> {
        let ticket = Ticket::Operator {
            name: name.into(),
            args,
            compression,
            patient,
            asker: Some(crate::protocol::AskerFigures {
                link_bytes_per_s: self.link.bytes_per_sec().unwrap_or(0.0),
                ns_per_byte: 0.0,
                load: if load.is_finite() {
                    load.clamp(0.0, 1.0)
                } else {
                    0.0
                },
            }),
            keep_ms: None,
            keep_group: None,
        };
        let inner = self.do_get(&ticket).await?;
        Ok(reply_of(inner))
    }

    /// Runs the typed action `request` (see [`crate::protocol::actions`]).
    pub async fn action<A: ActionRequest>(&self, request: &A) -> Result<A::Response> {
        let mut results = self.flight().do_action(request.to_action()?).await?;
        let r = results
            .try_next()
            .await?
            .ok_or_else(|| Error::Protocol(format!("action {} returned nothing", A::TYPE)))?;
        serde_json::from_slice(&r)
            .map_err(|e| Error::Protocol(format!("the answer to action {}: {e}", A::TYPE)))
    }

    /// Deletes `table`, or one partition of it; returns objects deleted.
    pub async fn delete(&self, table: &str, partition: Option<&str>) -> Result<u64> {
        let r = DeleteRequest {
            table: table.into(),
            partition: partition.map(Into::into),
        };
        Ok(self.action(&r).await?.deleted_objects)
    }

    /// Sends a WebAssembly module's bytes (the `put_module` action): the node checks
    /// and compiles it once and keeps it for requests that name its digest.
    pub async fn put_module(&self, bytes: &[u8]) -> Result<crate::protocol::PutModuleResponse> {
        let action =
            arrow_flight::Action::new(crate::protocol::PUT_MODULE, Bytes::copy_from_slice(bytes));
        let mut results = self.flight().do_action(action).await?;
        let r = results
            .try_next()
            .await?
            .ok_or_else(|| Error::Protocol("put_module returned nothing".into()))?;
        serde_json::from_slice(&r)
            .map_err(|e| Error::Protocol(format!("the answer to put_module: {e}")))
    }

    /// Runs operator `name` at the node and keeps its answer there for `ttl` instead
    /// of streaming it (see [`crate::refs`]): a reference any Flight client can
    /// resolve, renew or release. The node queues the request rather than hand it
    /// back for queueing delay (a kept result cannot be finished here). `group`
    /// (see [`crate::refs::new_group`]) keeps it in the same table as the other
    /// parts of one query; `None`: a table of its own.
    pub async fn keep(
        &self,
        name: &str,
        args: Vec<u8>,
        compression: Compression,
        ttl: Duration,
        group: Option<&str>,
    ) -> Result<Kept> {
        let ticket = Ticket::Operator {
            name: name.into(),
            args,
            compression,
            patient: true,
            asker: None,
            keep_ms: Some(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)),
            keep_group: group.map(String::from),
        };
        let info = self
            .flight()
            .get_flight_info(arrow_flight::FlightDescriptor::new_cmd(ticket.encode()))
            .await?;
        let endpoint = info
            .endpoint
            .first()
            .ok_or_else(|| Error::Protocol("a kept result came back without an endpoint".into()))?;
        Ok(Kept {
            reference: crate::refs::Reference::of_endpoint(endpoint, &self.url)
                .map_err(|e| Error::Protocol(e.to_string()))?,
            rows: u64::try_from(info.total_records).unwrap_or(0),
            bytes: u64::try_from(info.total_bytes).unwrap_or(0),
            report: serde_json::from_slice(&info.app_metadata).ok(),
        })
    }

    /// Streams a kept result held by this node (`DoGet` of its ticket).
    pub async fn resolve(
        &self,
        reference: &crate::refs::Reference,
    ) -> Result<BoxStream<'static, Result<RecordBatch>>> {
        let ticket = reference
            .ticket_bytes()
            .map_err(|e| Error::InvalidInput(e.to_string()))?;
        let inner = self.do_get_bytes(ticket).await?;
        let stream = FlightRecordBatchStream::new_from_flight_data(
            inner.map_err(|s| FlightError::Tonic(Box::new(s))),
        );
        Ok(stream.map_err(Error::from).boxed())
    }

    /// Like [`Self::resolve`], with the bytes received counted (as an operator's
    /// answer is).
    pub async fn resolve_counted(
        &self,
        reference: &crate::refs::Reference,
    ) -> Result<OperatorReply> {
        let ticket = reference
            .ticket_bytes()
            .map_err(|e| Error::InvalidInput(e.to_string()))?;
        Ok(reply_of(self.do_get_bytes(ticket).await?))
    }

    /// Extends a kept result to `ttl` from now (Flight's `RenewFlightEndpoint`).
    pub async fn renew(
        &self,
        reference: &crate::refs::Reference,
        ttl: Duration,
    ) -> Result<crate::refs::Reference> {
        let mut endpoint = reference
            .endpoint()
            .map_err(|e| Error::InvalidInput(e.to_string()))?;
        let until = crate::refs::now_unix_ms().saturating_add(ttl.as_millis() as u64);
        endpoint.expiration_time = Some(crate::refs::timestamp(until));
        let renewed = self
            .flight()
            .renew_flight_endpoint(arrow_flight::RenewFlightEndpointRequest {
                endpoint: Some(endpoint),
            })
            .await?;
        crate::refs::Reference::of_endpoint(&renewed, &self.url)
            .map_err(|e| Error::Protocol(e.to_string()))
    }

    /// Frees a kept result now.
    pub async fn release(
        &self,
        reference: &crate::refs::Reference,
    ) -> Result<crate::refs::RefInfo> {
        self.action(&crate::protocol::ReleaseRequest {
            ticket: reference.ticket.clone(),
        })
        .await
    }

    /// Lets tenant `to` read the kept query `reference` belongs to (at this node), or
    /// with `revoke`, no longer; returns the reference as `to` resolves it (its
    /// ticket sealed for `to`).
    pub async fn grant(
        &self,
        reference: &crate::refs::Reference,
        to: &str,
        revoke: bool,
    ) -> Result<crate::refs::Reference> {
        let d = self
            .action(&crate::protocol::actions::GrantRequest {
                ticket: reference.ticket.clone(),
                tenant: to.to_string(),
                revoke,
            })
            .await?;
        Ok(crate::refs::Reference::of_description(&d))
    }

    /// This tenant's kept results at the node (all of them, for an admin).
    pub async fn refs(&self) -> Result<Vec<crate::protocol::RefDescription>> {
        self.action(&crate::protocol::RefsRequest {}).await
    }

    /// Leases `slots` of the node's CPU slots for `ttl` (see [`crate::lease`]); a
    /// node that cannot spare them refuses with [`Error::Busy`] and when to retry.
    pub async fn lease(&self, slots: usize, ttl: Duration) -> Result<crate::lease::LeaseInfo> {
        self.lease_with(&crate::protocol::LeaseRequest {
            slots,
            seconds: ttl.as_secs_f64(),
            idle_seconds: None,
            memory: None,
        })
        .await
    }

    /// A lease as `request` asks (memory, an idle limit).
    pub async fn lease_with(
        &self,
        request: &crate::protocol::LeaseRequest,
    ) -> Result<crate::lease::LeaseInfo> {
        self.action(request).await
    }

    /// Like [`Self::lease`], held by this process: the node ends the lease once it
    /// has heard nothing from its holder for `idle`, and the returned [`HeldLease`]
    /// keeps telling it (`touch_lease`) until dropped. A holder that crashes or
    /// drops it gives the slots back within `idle`.
    pub async fn hold_lease(
        &self,
        slots: usize,
        ttl: Duration,
        idle: Duration,
    ) -> Result<HeldLease> {
        self.hold_lease_with(&crate::protocol::LeaseRequest {
            slots,
            seconds: ttl.as_secs_f64(),
            idle_seconds: Some(idle.as_secs_f64()),
            memory: None,
        })
        .await
    }

    /// [`Self::hold_lease`] as `request` asks; its idle limit defaults to 10 s.
    pub async fn hold_lease_with(
        &self,
        request: &crate::protocol::LeaseRequest,
    ) -> Result<HeldLease> {
        let mut request = request.clone();
        let idle = Duration::from_secs_f64(
            request
                .idle_seconds
                .filter(|i| i.is_finite() && *i > 0.0)
                .unwrap_or(10.0)
                .min(1e9),
        );
        request.idle_seconds = Some(idle.as_secs_f64());
        let info: crate::lease::LeaseInfo = self.action(&request).await?;
        let (client, id) = (self.clone(), info.id.clone());
        let every = (idle / 3).max(Duration::from_millis(10));
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                let touch = crate::protocol::TouchLeaseRequest { lease: id.clone() };
                if let Err(e) = client.action(&touch).await {
                    tracing::debug!("lease {id} no longer held: {e}");
                    if e.code() == Some(tonic::Code::NotFound) {
                        return;
                    }
                }
            }
        });
        Ok(HeldLease { info, task })
    }

    /// Ends a lease now.
    pub async fn release_lease(&self, lease: &str) -> Result<crate::lease::LeaseInfo> {
        self.action(&crate::protocol::ReleaseLeaseRequest {
            lease: lease.into(),
        })
        .await
    }

    /// Calls `export` of `module` (named by `digest`, its SHA-256) on `args`, on a
    /// lease's slot: hot on the instance the lease keeps, warm on a new one, cold
    /// when the node lacks the module (sent here once, then called).
    pub async fn invoke(
        &self,
        lease: &str,
        digest: &crate::sandbox::ModuleDigest,
        module: &[u8],
        export: &str,
        args: &RecordBatch,
    ) -> Result<Invoked> {
        let mut body = serde_json::to_vec(&crate::protocol::InvokeRequest {
            lease: lease.into(),
            module: digest.to_string(),
            export: export.into(),
        })
        .map_err(|e| Error::Protocol(e.to_string()))?;
        body.push(b'\n');
        let mut w = arrow::ipc::writer::StreamWriter::try_new(body, &args.schema())
            .map_err(|e| Error::InvalidInput(e.to_string()))?;
        w.write(args)
            .map_err(|e| Error::InvalidInput(e.to_string()))?;
        w.finish().map_err(|e| Error::InvalidInput(e.to_string()))?;
        let body = Bytes::from(
            w.into_inner()
                .map_err(|e| Error::InvalidInput(e.to_string()))?,
        );
        let mut cold = false;
        let reply = loop {
            let action = arrow_flight::Action::new(crate::protocol::INVOKE, body.clone());
            let r = async {
                self.flight()
                    .do_action(action)
                    .await?
                    .try_next()
                    .await?
                    .ok_or_else(|| Error::Protocol("invoke returned nothing".into()))
            }
            .await;
            match r {
                Err(e)
                    if !cold
                        && e.code() == Some(tonic::Code::NotFound)
                        && crate::sandbox::missing_module(&e.to_string()) == Some(*digest) =>
                {
                    self.put_module(module).await?;
                    cold = true;
                }
                r => break r?,
            }
        };
        let split = reply
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| Error::Protocol("an invoke answer without its head".into()))?;
        let head: serde_json::Value = serde_json::from_slice(&reply[..split])
            .map_err(|e| Error::Protocol(format!("invoke answer: {e}")))?;
        let batch = arrow::ipc::reader::StreamReader::try_new(
            std::io::Cursor::new(reply.slice(split + 1..)),
            None,
        )
        .map_err(|e| Error::Protocol(format!("invoke answer: {e}")))?
        .next()
        .ok_or_else(|| Error::Protocol("invoke answer without a batch".into()))?
        .map_err(|e| Error::Protocol(format!("invoke answer: {e}")))?;
        let start = if cold {
            "cold".to_string()
        } else {
            head["start"].as_str().unwrap_or("warm").to_string()
        };
        Ok(Invoked {
            out: batch.column(0).clone(),
            start,
        })
    }

    /// Node, device, store, admission and request figures.
    pub async fn stats(&self) -> Result<NodeStats> {
        self.action(&StatsRequest {}).await
    }

    /// Stored objects whose names start with `prefix`.
    pub async fn objects(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.action(&ObjectsRequest {
            prefix: prefix.into(),
        })
        .await
    }
}

/// An operator's (or a kept result's) answer: its batches, and its bytes and
/// trailing report counted as they arrive.
fn reply_of(inner: tonic::Streaming<FlightData>) -> OperatorReply {
    let stats = Arc::new(ReplyStats::default());
    // The trailing report has no IPC header (arrow-flight's decoder would refuse
    // it): take it out here.
    let counted = inner.filter_map({
        let stats = stats.clone();
        move |d| {
            let out = match d {
                Ok(d) => {
                    stats.bytes_received.fetch_add(
                        (d.data_header.len() + d.data_body.len()) as u64,
                        Ordering::Relaxed,
                    );
                    if d.data_header.is_empty() && !d.app_metadata.is_empty() {
                        match serde_json::from_slice(&d.app_metadata) {
                            Ok(r) => {
                                if let Ok(mut g) = stats.report.lock() {
                                    *g = Some(r);
                                }
                                None
                            }
                            Err(e) => Some(Err(FlightError::ProtocolError(format!(
                                "request report: {e}"
                            )))),
                        }
                    } else {
                        Some(Ok(d))
                    }
                }
                Err(s) => Some(Err(FlightError::Tonic(Box::new(s)))),
            };
            futures::future::ready(out)
        }
    });
    let batches = FlightDataDecoder::new(counted)
        .filter_map(|d| {
            futures::future::ready(match d {
                Err(e) => Some(Err(Error::from(e))),
                Ok(d) => match d.payload {
                    DecodedPayload::RecordBatch(b) => Some(Ok(b)),
                    DecodedPayload::Schema(_) | DecodedPayload::None => None,
                },
            })
        })
        .boxed();
    OperatorReply { batches, stats }
}

/// A lease this process holds (see [`NodeClient::hold_lease`]); dropping it stops
/// telling the node, which then ends the lease within its idle limit.
#[derive(Debug)]
pub struct HeldLease {
    /// The lease.
    pub info: crate::lease::LeaseInfo,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What [`NodeClient::invoke`] answers.
#[derive(Debug, Clone)]
pub struct Invoked {
    /// The function's result.
    pub out: arrow::array::ArrayRef,
    /// `hot`, `warm` or `cold` (see [`NodeClient::invoke`]).
    pub start: String,
}

/// What [`NodeClient::keep`] answers.
#[derive(Debug, Clone)]
pub struct Kept {
    /// The reference (print it as JSON; resolve it from anywhere).
    pub reference: crate::refs::Reference,
    /// Rows kept.
    pub rows: u64,
    /// Bytes it takes at the node.
    pub bytes: u64,
    /// The operator's report of the run.
    pub report: Option<OperatorReport>,
}

/// The answer of [`NodeClient::operator`]: a stream of batches and, once it has
/// ended, the node's [`OperatorReport`].
pub struct OperatorReply {
    /// The batches.
    pub batches: BoxStream<'static, Result<RecordBatch>>,
    /// Bytes received and the node's report (filled as the stream is read).
    pub stats: Arc<ReplyStats>,
}

/// What a client learns about one operator request.
#[derive(Debug, Default)]
pub struct ReplyStats {
    /// Bytes of `FlightData` headers and bodies received.
    pub bytes_received: AtomicU64,
    /// The node's report, once the stream has ended.
    pub report: Mutex<Option<OperatorReport>>,
}

impl ReplyStats {
    /// The node's report, if it has arrived.
    pub fn report(&self) -> Option<OperatorReport> {
        self.report.lock().ok().and_then(|g| g.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
