//! Flight tickets: a version byte (`1`) followed by a protobuf message, so any
//! Flight client can build them:
//!
//! ```text
//! message Ticket   { oneof kind { Scan scan = 1; Range range = 2; Operator operator = 3; Ref ref = 4; } }
//! message Scan     { string table = 1; optional string partition = 2; repeated string columns = 3; }
//! message Range    { string object = 1; uint64 offset = 2; uint64 length = 3; Compression compression = 4; }
//! message Operator { string name = 1; bytes args = 2; Compression compression = 3; bool patient = 4;
//!                    optional Asker asker = 5; optional uint64 keep_ms = 6; optional string keep_group = 7; }
//! message Ref      { string id = 1; }
//! message Asker    { double link_bytes_per_s = 1; reserved 2; double load = 3;
//!                    string host = 4; repeated uint32 cpus = 5; }
//! enum Compression { NONE = 0; LZ4_FRAME = 1; ZSTD = 2; AUTO = 3; }
//! ```
//!
//! A `Scan` answers Arrow IPC batches (columns in table order; empty `columns` = all);
//! a `Range` answers `FlightData` messages whose `data_body` holds the raw bytes, in
//! order (asked with a `compression`, a piece that shrinks comes compressed, its
//! `app_metadata` naming the codec: see [`crate::bodies`]); an
//! `Operator` runs pushed-down work (see `csd_runtime::operator`; `args` is the operator's
//! own format, e.g. a Substrait plan for `"sql"`) and answers Arrow IPC batches,
//! compressed as asked, followed by one `FlightData` with only `app_metadata` (JSON
//! [`OperatorReport`](crate::OperatorReport)). A `patient` operator request
//! asks an adaptive node to queue it rather than push it back for queueing delay:
//! the compute tier sends it when its own cores are saturated (memory and a full
//! queue still push it back). `asker` carries what handing the request back would
//! cost the asker: its measured link throughput from this node, its cost per raw
//! byte of evaluating a fragment, the fraction of its host's cores busy (0 = unknown
//! for the first two), and its host's boot id and the CPUs it may use (empty =
//! unknown; see [`crate::host`]); an adaptive node prices handing back with them (see
//! `csd_runtime::admission`).
//!
//! An `Operator` with `keep_ms` is not a `DoGet` ticket: sent as the `cmd` of a
//! `GetFlightInfo` descriptor, it asks the node to keep the answer for `keep_ms`
//! milliseconds and answer a `FlightInfo` whose endpoint holds a `Ref` ticket (see
//! [`crate::refs`]); `DoGet` with a `Ref` streams the kept answer. `keep_group` (32
//! hex digits) puts it in the same table as the other parts of one kept query.
//!
//! A node with tenants hands out *sealed* tickets in its `FlightInfo` endpoints: a
//! version byte `2` followed by
//!
//! ```text
//! message Sealed { bytes ticket = 1; string tenant = 2; uint64 expires_unix_ms = 3; bytes mac = 4; }
//! ```
//!
//! where `ticket` is a version-1 ticket and `mac` an HMAC-SHA256 by the node's key over
//! the other three (see `csd_runtime::auth::TicketKey`). Clients pass them back as they are.
//!
//! Tickets come from the network, so decoding checks size first and never panics:
//! anything malformed is an [`Error::InvalidArgument`] saying what is wrong.

use prost::Message;

use crate::error::{Error, Result};

/// Current ticket version byte.
pub(crate) const TICKET_VERSION: u8 = 1;
/// The version byte of a sealed ticket.
pub(crate) const SEALED_VERSION: u8 = 2;
/// Largest ticket accepted (pushed-down plans travel in tickets later).
pub(crate) const MAX_TICKET_BYTES: usize = 4 << 20;

/// A decoded ticket.
#[derive(Debug, Clone, PartialEq)]
pub enum Ticket {
    /// Stream a table (or one partition) as Arrow batches.
    Scan {
        /// Table.
        table: String,
        /// Partition; `None` for all.
        partition: Option<String>,
        /// Columns to return (in table order, whatever order is asked); empty for all.
        columns: Vec<String>,
        /// Rows skipped first (in storage order); 0 for none.
        skip: u64,
        /// Only the first rows (in storage order) after those skipped; `None` for all.
        limit: Option<u64>,
    },
    /// Stream raw bytes `[offset, offset+length)` of one object.
    Range {
        /// Object name.
        object: String,
        /// First byte.
        offset: u64,
        /// Byte count.
        length: u64,
        /// Compression of the pieces that shrink by it (see [`crate::bodies`]).
        compression: Compression,
    },
    /// Run a pushed-down operator.
    Operator {
        /// Operator name (`"sql"`, …).
        name: String,
        /// The operator's arguments.
        args: Vec<u8>,
        /// Compression of the answer's Arrow IPC bodies.
        compression: Compression,
        /// Queue rather than push back for queueing delay (the asker is saturated).
        patient: bool,
        /// What handing it back would cost the asker.
        asker: Option<AskerFigures>,
        /// Keep the answer at the node this long (ms) instead of streaming it
        /// (`GetFlightInfo` only).
        keep_ms: Option<u64>,
        /// The kept query's group (its table `csd_ref_GROUP`); `None`: a new one.
        keep_group: Option<String>,
    },
    /// Stream a kept result (see [`crate::refs`]).
    Ref {
        /// The reference's id.
        id: String,
    },
}

/// The asker's side of an operator request (see the module docs); zero is unknown.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AskerFigures {
    /// Measured throughput of the asker's link from this node, bytes per second.
    #[prost(double, tag = "1")]
    pub link_bytes_per_s: f64,
    /// Fraction of the asker's cores busy, 0 to 1.
    #[prost(double, tag = "3")]
    pub load: f64,
    /// The asker's host: its kernel's boot id (see [`crate::host::HostCores`]).
    #[prost(string, tag = "4")]
    pub host: String,
    /// The CPUs the asker may run on.
    #[prost(uint32, repeated, tag = "5")]
    pub cpus: Vec<u32>,
}

/// Arrow IPC body compression of an operator's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum Compression {
    /// Uncompressed (fastest on loopback).
    None = 0,
    /// LZ4 frame: cheap, about 2x on typical columns.
    Lz4Frame = 1,
    /// ZSTD: more CPU, smallest; pays on slow links.
    Zstd = 2,
    /// Each piece of an operator's answer chosen as it is sent: LZ4 while the answer
    /// leaves as fast as the node makes it, ZSTD (level 1) while earlier pieces still
    /// wait to be sent (the link or the asker holds the answer back, so the extra
    /// CPU costs it no time). A `Range` asked so chooses each piece's codec the same
    /// way, by whether the network finds the next piece already made.
    Auto = 3,
}

impl std::str::FromStr for Compression {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "none" => Ok(Compression::None),
            "lz4" | "lz4_frame" => Ok(Compression::Lz4Frame),
            "zstd" => Ok(Compression::Zstd),
            "auto" => Ok(Compression::Auto),
            _ => Err(Error::InvalidArgument(format!(
                "compression {s:?} is not one of auto, none, lz4, zstd"
            ))),
        }
    }
}

/// A ticket bound to a tenant until an expiry, with the node's MAC over both.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Seal {
    /// The version-1 ticket.
    #[prost(bytes = "vec", tag = "1")]
    pub ticket: Vec<u8>,
    /// The tenant it was issued to.
    #[prost(string, tag = "2")]
    pub tenant: String,
    /// When it stops being valid, milliseconds since the Unix epoch.
    #[prost(uint64, tag = "3")]
    pub expires_unix_ms: u64,
    /// HMAC-SHA256 of the node's key over the fields above.
    #[prost(bytes = "vec", tag = "4")]
    pub mac: Vec<u8>,
}

impl Seal {
    /// Encodes with its version byte.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![SEALED_VERSION];
        Message::encode(self, &mut out).unwrap_or_else(|_| unreachable!("Vec grows as needed"));
        out
    }

    /// Decodes a sealed ticket's untrusted bytes (version byte included).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        check_size(bytes)?;
        match bytes.split_first() {
            Some((&SEALED_VERSION, body)) => <Seal as Message>::decode(body)
                .map_err(|e| Error::InvalidArgument(format!("malformed sealed ticket: {e}"))),
            _ => Err(Error::InvalidArgument("not a sealed ticket".into())),
        }
    }
}

fn check_size(bytes: &[u8]) -> Result<()> {
    if bytes.len() > MAX_TICKET_BYTES {
        return Err(Error::InvalidArgument(format!(
            "ticket of {} bytes exceeds the {MAX_TICKET_BYTES}-byte limit",
            bytes.len()
        )));
    }
    Ok(())
}

#[derive(Clone, PartialEq, prost::Message)]
struct TicketProto {
    #[prost(oneof = "Kind", tags = "1, 2, 3, 4")]
    kind: Option<Kind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Kind {
    #[prost(message, tag = "1")]
    Scan(ScanProto),
    #[prost(message, tag = "2")]
    Range(RangeProto),
    #[prost(message, tag = "3")]
    Operator(OperatorProto),
    #[prost(message, tag = "4")]
    Ref(RefProto),
}

#[derive(Clone, PartialEq, prost::Message)]
struct RefProto {
    #[prost(string, tag = "1")]
    id: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct OperatorProto {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(bytes = "vec", tag = "2")]
    args: Vec<u8>,
    #[prost(enumeration = "Compression", tag = "3")]
    compression: i32,
    #[prost(bool, tag = "4")]
    patient: bool,
    #[prost(message, optional, tag = "5")]
    asker: Option<AskerFigures>,
    #[prost(uint64, optional, tag = "6")]
    keep_ms: Option<u64>,
    #[prost(string, optional, tag = "7")]
    keep_group: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ScanProto {
    #[prost(string, tag = "1")]
    table: String,
    #[prost(string, optional, tag = "2")]
    partition: Option<String>,
    #[prost(string, repeated, tag = "3")]
    columns: Vec<String>,
    #[prost(uint64, optional, tag = "4")]
    limit: Option<u64>,
    #[prost(uint64, tag = "5")]
    skip: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RangeProto {
    #[prost(string, tag = "1")]
    object: String,
    #[prost(uint64, tag = "2")]
    offset: u64,
    #[prost(uint64, tag = "3")]
    length: u64,
    #[prost(enumeration = "Compression", tag = "4")]
    compression: i32,
}

impl Ticket {
    /// Encodes for a Flight `Ticket`.
    pub fn encode(&self) -> Vec<u8> {
        let kind = match self.clone() {
            Ticket::Scan {
                table,
                partition,
                columns,
                skip,
                limit,
            } => Kind::Scan(ScanProto {
                table,
                partition,
                columns,
                limit,
                skip,
            }),
            Ticket::Range {
                object,
                offset,
                length,
                compression,
            } => Kind::Range(RangeProto {
                object,
                offset,
                length,
                compression: compression as i32,
            }),
            Ticket::Operator {
                name,
                args,
                compression,
                patient,
                asker,
                keep_ms,
                keep_group,
            } => Kind::Operator(OperatorProto {
                name,
                args,
                compression: compression as i32,
                patient,
                asker,
                keep_ms,
                keep_group,
            }),
            Ticket::Ref { id } => Kind::Ref(RefProto { id }),
        };
        let mut out = vec![TICKET_VERSION];
        TicketProto { kind: Some(kind) }
            .encode(&mut out)
            .unwrap_or_else(|_| unreachable!("Vec grows as needed"));
        out
    }

    /// Decodes untrusted bytes: a ticket, sealed or not, and its seal if it has one
    /// (which the caller must verify).
    pub fn decode_sealed(bytes: &[u8]) -> Result<(Self, Option<Seal>)> {
        if bytes.first() == Some(&SEALED_VERSION) {
            let seal = Seal::decode(bytes)?;
            let t = Ticket::decode(&seal.ticket)?;
            Ok((t, Some(seal)))
        } else {
            Ok((Ticket::decode(bytes)?, None))
        }
    }

    /// Decodes untrusted bytes of an unsealed ticket.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        check_size(bytes)?;
        let (&version, body) = bytes
            .split_first()
            .ok_or_else(|| Error::InvalidArgument("empty ticket".into()))?;
        if version != TICKET_VERSION {
            return Err(Error::InvalidArgument(format!(
                "ticket version {version} is not supported (this node speaks versions {TICKET_VERSION} and {SEALED_VERSION}, sealed)"
            )));
        }
        let proto = TicketProto::decode(body)
            .map_err(|e| Error::InvalidArgument(format!("malformed ticket: {e}")))?;
        match proto.kind {
            Some(Kind::Scan(s)) => Ok(Ticket::Scan {
                table: s.table,
                partition: s.partition,
                columns: s.columns,
                skip: s.skip,
                limit: s.limit,
            }),
            Some(Kind::Range(r)) => Ok(Ticket::Range {
                compression: Compression::try_from(r.compression).map_err(|_| {
                    Error::InvalidArgument(format!(
                        "ticket asks for unknown compression {}",
                        r.compression
                    ))
                })?,
                object: r.object,
                offset: r.offset,
                length: r.length,
            }),
            Some(Kind::Operator(o)) => Ok(Ticket::Operator {
                asker: match o.asker {
                    Some(a)
                        if a.link_bytes_per_s.is_finite()
                            && a.link_bytes_per_s >= 0.0
                            && (0.0..=1.0).contains(&a.load)
                            && a.host.len() <= 64
                            && a.cpus.len() <= 65_536 =>
                    {
                        Some(a)
                    }
                    Some(a) => {
                        return Err(Error::InvalidArgument(format!(
                            "ticket's asker figures are out of range (link {} bytes/s must be finite and not negative, load {} within 0 to 1, host id at most 64 bytes ({}), at most 65,536 CPUs ({}))",
                            a.link_bytes_per_s,
                            a.load,
                            a.host.len(),
                            a.cpus.len()
                        )));
                    }
                    None => None,
                },
                compression: Compression::try_from(o.compression).map_err(|_| {
                    Error::InvalidArgument(format!(
                        "ticket asks for unknown compression {}",
                        o.compression
                    ))
                })?,
                name: o.name,
                args: o.args,
                patient: o.patient,
                keep_ms: o.keep_ms,
                keep_group: o.keep_group,
            }),
            Some(Kind::Ref(r)) => Ok(Ticket::Ref { id: r.id }),
            None => Err(Error::InvalidArgument("ticket names no operation".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let t = Ticket::Scan {
            table: "t".into(),
            partition: Some("p".into()),
            columns: vec!["a".into()],
            skip: 0,
            limit: None,
        };
        assert_eq!(Ticket::decode(&t.encode()).unwrap(), t);
        let t = Ticket::Scan {
            table: "t".into(),
            partition: None,
            columns: vec![],
            skip: 3,
            limit: Some(8),
        };
        assert_eq!(Ticket::decode(&t.encode()).unwrap(), t);
        let r = Ticket::Range {
            object: "t/p/1.parquet".into(),
            offset: 5,
            length: 9,
            compression: Compression::None,
        };
        assert_eq!(Ticket::decode(&r.encode()).unwrap(), r);
        let r = Ticket::Range {
            object: "t/p/1.parquet".into(),
            offset: 5,
            length: 9,
            compression: Compression::Zstd,
        };
        assert_eq!(Ticket::decode(&r.encode()).unwrap(), r);
        let k = Ticket::Ref { id: "00ff".into() };
        assert_eq!(Ticket::decode(&k.encode()).unwrap(), k);
        let o = Ticket::Operator {
            name: "sql".into(),
            args: vec![1, 2, 3],
            compression: Compression::Zstd,
            patient: false,
            asker: None,
            keep_ms: None,
            keep_group: None,
        };
        assert_eq!(Ticket::decode(&o.encode()).unwrap(), o);
        let o = Ticket::Operator {
            name: "ml".into(),
            args: vec![],
            compression: Compression::None,
            patient: true,
            asker: Some(AskerFigures {
                link_bytes_per_s: 125e6,
                load: 0.25,
                host: "8a1f5e2c-0d44-4c39-9a57-1b2c3d4e5f60".into(),
                cpus: vec![0, 1, 4],
            }),
            keep_ms: Some(60_000),
            keep_group: Some("0123456789abcdef0123456789abcdef".into()),
        };
        assert_eq!(Ticket::decode(&o.encode()).unwrap(), o);
        let bad = Ticket::Operator {
            name: "sql".into(),
            args: vec![],
            compression: Compression::None,
            patient: false,
            asker: Some(AskerFigures {
                link_bytes_per_s: f64::NAN,
                load: 2.0,
                ..AskerFigures::default()
            }),
            keep_ms: None,
            keep_group: None,
        };
        let e = Ticket::decode(&bad.encode()).unwrap_err().to_string();
        assert!(e.contains("out of range"), "{e}");
    }

    #[test]
    fn fuzz_seeds_are_valid_tickets() {
        for seed in [
            &include_bytes!("../../fuzz/seeds/ticket_decode/scan")[..],
            include_bytes!("../../fuzz/seeds/ticket_decode/scan_all"),
            include_bytes!("../../fuzz/seeds/ticket_decode/range"),
        ] {
            let t = Ticket::decode(seed).unwrap();
            assert_eq!(Ticket::decode(&t.encode()).unwrap(), t);
        }
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        for bad in [
            &b""[..],
            b"\x02abc",
            b"\x01\xff\xff\xff",
            b"\x01",
            b"\x01\x0a\x05\x0a\x10",
        ] {
            assert!(
                matches!(Ticket::decode(bad), Err(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
        let mut x = 0x1234_5678u32;
        for len in 0..2000 {
            let b: Vec<u8> = (0..len % 64)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    x as u8
                })
                .collect();
            let _ = Ticket::decode(&b);
        }
        let huge = vec![1u8; MAX_TICKET_BYTES + 1];
        assert!(matches!(
            Ticket::decode(&huge),
            Err(Error::InvalidArgument(_))
        ));
    }
}
