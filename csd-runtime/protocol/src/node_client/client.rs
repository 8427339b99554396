//! [`NodeClient`]: a connection to one storage node and the calls every user of a
//! node makes (put, list, scan, read by range, operators, delete, figures); leases
//! and kept results add theirs in `leases.rs` and `refs.rs`.

use std::sync::Arc;
use std::time::Duration;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{
    Criteria, FlightClient, FlightData, FlightDescriptor, FlightInfo, Ticket as FlightTicket,
};
use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt, TryStreamExt};
use tonic::transport::{Channel, Endpoint};

use super::credentials::Credentials;
use super::error::{Error, RETRY_BUDGET, Result};
use super::reply::{OperatorReply, TableInfo, reply_of};
use crate::actions::{
    ActionRequest, DeleteRequest, ObjectsRequest, PUT_ATTACHMENT, PUT_MODULE,
    PutAttachmentResponse, PutModuleResponse, StatsRequest,
};
use crate::error::chain;
use crate::host::{self, HostCores};
use crate::messages::{ObjectDescription, ObjectEntry, PutSummary};
use crate::stats::NodeStats;
use crate::ticket::{AskerFigures, Compression, Ticket};

/// `Bearer <token>` as metadata (marked sensitive: never logged).
fn bearer(token: &str) -> Result<tonic::metadata::MetadataValue<tonic::metadata::Ascii>> {
    let mut v: tonic::metadata::MetadataValue<_> =
        format!("Bearer {token}").parse().map_err(|_| {
            Error::InvalidInput("the token must be printable ASCII without spaces".into())
        })?;
    v.set_sensitive(true);
    Ok(v)
}

/// Largest message the client accepts.
const MAX_MESSAGE_BYTES: usize = crate::MAX_MESSAGE_BYTES;

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
                Error::InvalidInput(format!("TLS settings for {url}: {}", chain(&e)))
            })?;
        }
        Ok(endpoint
            .connect_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .initial_stream_window_size(crate::STREAM_WINDOW)
            .initial_connection_window_size(crate::CONNECTION_WINDOW))
    }

    /// A client over `channel` to `url`, sending `credentials`' token and leases.
    fn over(url: &str, channel: Channel, credentials: &Credentials) -> Result<Self> {
        let authorization = credentials.token.as_deref().map(bearer).transpose()?;
        let raw = FlightServiceClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let lease = crate::LeaseIds::new(&credentials.leases)
            .map_err(|e| Error::InvalidInput(e.to_string()))?
            .map(|ids| {
                // Checked ids are hex digits and commas: a valid header value.
                ids.to_string().parse().map_err(|_| {
                    Error::InvalidInput(format!("lease ids {ids} are not printable ASCII"))
                })
            })
            .transpose()?;
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

    /// The same connection, sending `token` as its bearer token instead (`None`: no
    /// token): a front end that serves many users over one connection per node
    /// (`csd gateway`) asks as each user.
    pub fn with_token(mut self, token: Option<&str>) -> Result<Self> {
        self.authorization = token.map(bearer).transpose()?;
        Ok(self)
    }

    /// `DoGet` of `ticket`; a refusal with a retry hint (the node is saturated) is
    /// retried after the hint, for up to [`RETRY_BUDGET`].
    async fn do_get(&self, ticket: &Ticket) -> Result<tonic::Streaming<FlightData>> {
        self.do_get_bytes(ticket.encode()).await
    }

    /// [`Self::do_get`] of a ticket's bytes as they are (a sealed one, a reference's).
    pub(super) async fn do_get_bytes(
        &self,
        bytes: Vec<u8>,
    ) -> Result<tonic::Streaming<FlightData>> {
        let started = std::time::Instant::now();
        let mut attempt = 0u32;
        loop {
            let mut req = tonic::Request::new(FlightTicket::new(bytes.clone()));
            if let Some(t) = &self.tenant {
                req.metadata_mut().insert(crate::TENANT_METADATA, t.clone());
            }
            if let Some(a) = &self.authorization {
                req.metadata_mut().insert(crate::AUTHORIZATION, a.clone());
            }
            if let Some(l) = &self.lease {
                req.metadata_mut().insert(crate::LEASE_METADATA, l.clone());
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

    pub(super) fn flight(&self) -> FlightClient {
        let mut c = FlightClient::new_from_inner(self.raw.clone());
        for (k, v) in [
            (crate::TENANT_METADATA, &self.tenant),
            (crate::AUTHORIZATION, &self.authorization),
            (crate::LEASE_METADATA, &self.lease),
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
        self.put_copy(table, partition, 1, None, schema, batches)
            .await
    }

    /// [`put`](Self::put) of one of `copies` copies of the partition, each stored
    /// on its own node by the caller (the node keeps the number with the object),
    /// all of one put named `put` (the node keeps it too, so that every copy of
    /// this put has the same bytes and another put of the same rows other bytes).
    pub async fn put_copy<S>(
        &self,
        table: &str,
        partition: &str,
        copies: u32,
        put: Option<&str>,
        schema: SchemaRef,
        batches: S,
    ) -> Result<PutSummary>
    where
        S: Stream<Item = Result<RecordBatch>> + Send + 'static,
    {
        let mut path = vec![table.to_string(), partition.to_string()];
        if copies != 1 || put.is_some() {
            path.push(copies.to_string());
        }
        path.extend(put.map(str::to_string));
        // The upload is marked and closed with an end message: should this future be
        // dropped or `batches` fail, arrow-flight's client ends the stream cleanly,
        // and the missing end tells the node to store nothing.
        let data = FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .with_metadata(bytes::Bytes::from_static(crate::PUT_MARKED))
            .with_flight_descriptor(Some(FlightDescriptor::new_path(path)))
            .build(batches.map_err(|e| FlightError::ExternalError(Box::new(e))))
            .chain(futures::stream::once(async {
                Ok(FlightData::new().with_app_metadata(crate::PUT_END))
            }));
        self.put_stream(data).await
    }

    /// Stores `object` of `from` (a Parquet object of `table`/`partition` there) on
    /// this node byte for byte, read from `from` in 4 MiB pieces as it is sent: a
    /// new copy of the partition that stays a replica of the others (same length,
    /// same digest), added to the partition's objects here.
    pub async fn copy_object_from(
        &self,
        from: &NodeClient,
        table: &str,
        partition: &str,
        object: &ObjectDescription,
    ) -> Result<PutSummary> {
        const PIECE: u64 = 4 << 20;
        let descriptor = FlightDescriptor::new_path(vec![table.to_string(), partition.to_string()]);
        let (source, name, len) = (from.clone(), object.name.clone(), object.len);
        let pieces = futures::stream::iter((0..len).step_by(PIECE as usize))
            .then(move |at| {
                let (source, name) = (source.clone(), name.clone());
                async move {
                    let n = PIECE.min(len - at);
                    source.read_range(&name, at, n).await
                }
            })
            .map_ok(|bytes| FlightData::new().with_data_body(bytes));
        let first = FlightData::new()
            .with_descriptor(descriptor)
            .with_app_metadata(crate::PUT_OBJECT_COPY);
        // A failed read ends the upload before its end marker: nothing is stored,
        // and the read's error is the answer.
        let data = futures::stream::once(async { Ok(first) })
            .chain(pieces.map_err(|e| FlightError::ExternalError(Box::new(e))))
            .chain(futures::stream::once(async {
                Ok(FlightData::new().with_app_metadata(crate::PUT_END))
            }));
        self.put_stream(data).await
    }

    /// Sends a `DoPut` stream; the node's summary of what it stored.
    async fn put_stream(
        &self,
        data: impl Stream<Item = std::result::Result<FlightData, FlightError>> + Send + 'static,
    ) -> Result<PutSummary> {
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
        self.scan_rows(table, partition, columns, 0, limit).await
    }

    /// [`scan`](Self::scan) from row `skip` (in storage order), at most `limit` rows
    /// when given: the rest of a partition whose first rows were read before.
    pub async fn scan_rows(
        &self,
        table: &str,
        partition: Option<&str>,
        columns: &[&str],
        skip: u64,
        limit: Option<u64>,
    ) -> Result<FlightRecordBatchStream> {
        let ticket = Ticket::Scan {
            table: table.into(),
            partition: partition.map(Into::into),
            columns: columns.iter().map(|c| c.to_string()).collect(),
            skip,
            limit,
        };
        let inner = self.do_get(&ticket).await?;
        Ok(FlightRecordBatchStream::new_from_flight_data(
            inner.map_err(|s| FlightError::Tonic(Box::new(s))),
        ))
    }

    /// Reads `len` raw bytes at `offset` of a stored object.
    pub async fn read_range(&self, object: &str, offset: u64, len: u64) -> Result<Bytes> {
        self.read_range_with(object, offset, len, Compression::None)
            .await
            .map(|(b, _)| b)
    }

    /// [`read_range`](Self::read_range), the pieces that shrink sent with
    /// `compression` (see [`crate::bodies`]); also the bytes that crossed the wire.
    pub async fn read_range_with(
        &self,
        object: &str,
        offset: u64,
        len: u64,
        compression: Compression,
    ) -> Result<(Bytes, u64)> {
        let ticket = Ticket::Range {
            object: object.into(),
            offset,
            length: len,
            compression,
        };
        let transfer = self.link.transfer();
        let mut stream = self.do_get(&ticket).await?;
        let mut out = BytesMut::with_capacity(len as usize);
        let mut wire = 0u64;
        while let Some(d) = stream.message().await? {
            transfer.add(d.data_body.len() as u64);
            wire += d.data_body.len() as u64;
            let due = len.saturating_sub(out.len() as u64);
            let piece = crate::bodies::decompress(&d.app_metadata, d.data_body, due)
                .map_err(|e| Error::Protocol(format!("reading {object}: {e}")))?;
            out.extend_from_slice(&piece);
        }
        drop(transfer);
        if out.len() as u64 != len {
            return Err(Error::Protocol(format!(
                "asked for {len} bytes of {object}, got {}",
                out.len()
            )));
        }
        Ok((out.freeze(), wire))
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
    /// cores are saturated). `load` is the fraction of this tier's cores busy (its
    /// host's busy fraction is sent if higher); it travels with the link throughput
    /// this client has measured, if any, and this process's host and CPUs.
    pub async fn operator_with(
        &self,
        name: &str,
        args: Vec<u8>,
        compression: Compression,
        patient: bool,
        load: f64,
    ) -> Result<OperatorReply> {
        static THIS_HOST: std::sync::OnceLock<HostCores> = std::sync::OnceLock::new();
        let this_host = THIS_HOST.get_or_init(HostCores::this);
        let ticket = Ticket::Operator {
            name: name.into(),
            args,
            compression,
            patient,
            asker: Some(AskerFigures {
                link_bytes_per_s: self.link.bytes_per_sec().unwrap_or(0.0),
                // Its own queue of handed-back work, or its host's cores if busier.
                load: if load.is_finite() {
                    load.clamp(0.0, 1.0).max(host::busy_fraction())
                } else {
                    host::busy_fraction()
                },
                host: this_host.host.clone(),
                cpus: this_host.cpus.clone(),
            }),
            keep_ms: None,
            keep_group: None,
        };
        let inner = self.do_get(&ticket).await?;
        Ok(reply_of(inner))
    }

    /// Runs the typed action `request` (see [`crate::actions`]).
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
        self.delete_remembering(table, partition, vec![]).await
    }

    /// [`delete`](Self::delete), remembering `copies` first: deleted copies of the
    /// table's partitions that a node out of reach may hold, to stay deleted when it
    /// comes back. Nothing to delete here is then no error (0 objects).
    pub async fn delete_remembering(
        &self,
        table: &str,
        partition: Option<&str>,
        copies: Vec<crate::messages::DeletedCopy>,
    ) -> Result<u64> {
        let r = DeleteRequest {
            table: table.into(),
            partition: partition.map(Into::into),
            remember: copies,
        };
        Ok(self.action(&r).await?.deleted_objects)
    }

    /// Sends a WebAssembly module's bytes (the `put_module` action): the node checks
    /// and compiles it once and keeps it for requests that name its digest.
    pub async fn put_module(&self, bytes: &[u8]) -> Result<PutModuleResponse> {
        self.put_bytes(PUT_MODULE, bytes).await
    }

    /// Sends bytes several requests share (the `put_attachment` action): the node
    /// keeps them for requests that name their digest.
    pub async fn put_attachment(&self, bytes: &[u8]) -> Result<PutAttachmentResponse> {
        self.put_bytes(PUT_ATTACHMENT, bytes).await
    }

    /// An action whose body is raw bytes and whose answer is JSON.
    async fn put_bytes<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
        bytes: &[u8],
    ) -> Result<T> {
        let action = arrow_flight::Action::new(name, Bytes::copy_from_slice(bytes));
        let mut results = self.flight().do_action(action).await?;
        let r = results
            .try_next()
            .await?
            .ok_or_else(|| Error::Protocol(format!("{name} returned nothing")))?;
        serde_json::from_slice(&r)
            .map_err(|e| Error::Protocol(format!("the answer to {name}: {e}")))
    }

    /// Node, device, store, admission and request figures.
    pub async fn stats(&self) -> Result<NodeStats> {
        self.action(&StatsRequest {}).await
    }

    /// Reads every stored object whose name starts with `prefix` (all when empty)
    /// from the device and checks it; what was damaged.
    pub async fn scrub(&self, prefix: &str) -> Result<crate::stats::ScrubReport> {
        self.action(&crate::actions::ScrubRequest {
            prefix: prefix.into(),
        })
        .await
    }

    /// Stored objects whose names start with `prefix`.
    pub async fn objects(&self, prefix: &str) -> Result<Vec<ObjectEntry>> {
        self.action(&ObjectsRequest {
            prefix: prefix.into(),
        })
        .await
    }
}
