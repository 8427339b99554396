//! Statement handles: what a client holds between `CreatePreparedStatement`,
//! `DoPut` (bind), `GetFlightInfo` and `DoGet`. They are stateless — the SQL and its
//! bound values travel inside — so any gateway replica can answer any step, and
//! nothing is kept per client. A handle comes back from the client, so decoding
//! trusts nothing: sizes are capped, versions checked, and bound values are plain
//! scalars (no nested types, whose wire form carries Arrow IPC).

use bytes::Bytes;
use csd_protocol::Error;
use datafusion::common::ScalarValue;
use datafusion_proto::protobuf;
use prost::Message;

/// Longest handle accepted (SQL and bound values).
pub(crate) const MAX_HANDLE_BYTES: usize = 4 << 20;
/// Most values bound to one statement.
pub(crate) const MAX_PARAMS: usize = 1024;

const VERSION: u32 = 1;

/// A statement as the client holds it.
#[derive(Clone, PartialEq, prost::Message)]
struct HandleMsg {
    #[prost(uint32, tag = "1")]
    version: u32,
    #[prost(string, tag = "2")]
    sql: String,
    /// Bound values, in the statement's parameter order (`$1`, `$2`, …), as
    /// DataFusion's protobuf scalars.
    #[prost(message, repeated, tag = "3")]
    params: Vec<protobuf::ScalarValue>,
    /// Whether values were bound (a statement without parameters has none either way).
    #[prost(bool, tag = "4")]
    bound: bool,
}

/// A statement: its SQL and, once bound, its parameter values.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Statement {
    pub(crate) sql: String,
    pub(crate) params: Option<Vec<ScalarValue>>,
}

impl Statement {
    pub(crate) fn new(sql: impl Into<String>) -> Self {
        Statement {
            sql: sql.into(),
            params: None,
        }
    }

    /// The handle's bytes.
    pub(crate) fn encode(&self) -> Result<Bytes, Error> {
        let params = self
            .params
            .iter()
            .flatten()
            .map(|v| {
                protobuf::ScalarValue::try_from(v).map_err(|e| {
                    Error::InvalidArgument(format!("a bound value ({v:?}) cannot be kept: {e}"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let msg = HandleMsg {
            version: VERSION,
            sql: self.sql.clone(),
            params,
            bound: self.params.is_some(),
        };
        let bytes = msg.encode_to_vec();
        if bytes.len() > MAX_HANDLE_BYTES {
            return Err(Error::InvalidArgument(format!(
                "the statement and its values take {} bytes; at most {MAX_HANDLE_BYTES} are accepted",
                bytes.len()
            )));
        }
        Ok(bytes.into())
    }

    /// A handle a client sent back.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, Error> {
        let bad = |why: String| {
            Error::InvalidArgument(format!(
                "not a statement handle of this gateway ({why}): prepare the statement again"
            ))
        };
        if bytes.len() > MAX_HANDLE_BYTES {
            return Err(bad(format!(
                "{} bytes, at most {MAX_HANDLE_BYTES}",
                bytes.len()
            )));
        }
        let msg = HandleMsg::decode(bytes).map_err(|e| bad(e.to_string()))?;
        if msg.version != VERSION {
            return Err(bad(format!("version {}", msg.version)));
        }
        if msg.params.len() > MAX_PARAMS {
            return Err(bad(format!("{} values", msg.params.len())));
        }
        let params = msg
            .params
            .iter()
            .map(|p| scalar(p).ok_or_else(|| bad("a bound value of an unsupported kind".into())))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Statement {
            sql: msg.sql,
            params: msg.bound.then_some(params),
        })
    }
}

/// A bound value's scalar, if it is a plain one (nested kinds carry Arrow IPC inside
/// and are refused before anything decodes them).
fn scalar(p: &protobuf::ScalarValue) -> Option<ScalarValue> {
    use datafusion_proto_common::protobuf_common::scalar_value::Value as V;
    let plain = matches!(
        p.value.as_ref()?,
        V::BoolValue(_)
            | V::Utf8Value(_)
            | V::LargeUtf8Value(_)
            | V::Utf8ViewValue(_)
            | V::Int8Value(_)
            | V::Int16Value(_)
            | V::Int32Value(_)
            | V::Int64Value(_)
            | V::Uint8Value(_)
            | V::Uint16Value(_)
            | V::Uint32Value(_)
            | V::Uint64Value(_)
            | V::Float32Value(_)
            | V::Float64Value(_)
            | V::Date32Value(_)
            | V::Date64Value(_)
            | V::Decimal128Value(_)
            | V::TimestampValue(_)
            | V::BinaryValue(_)
            | V::LargeBinaryValue(_)
            | V::NullValue(_)
    );
    if !plain {
        return None;
    }
    let v = ScalarValue::try_from(p).ok()?;
    (!v.data_type().is_nested()).then_some(v)
}

/// Whether bound values of this type can travel in a handle.
pub(crate) fn bindable(v: &ScalarValue) -> bool {
    protobuf::ScalarValue::try_from(v)
        .ok()
        .and_then(|p| scalar(&p))
        .is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_garbage() {
        let s = Statement {
            sql: "SELECT * FROM t WHERE a = $1 AND b < $2".into(),
            params: Some(vec![
                ScalarValue::Int64(Some(42)),
                ScalarValue::Utf8(Some("x".into())),
            ]),
        };
        assert_eq!(Statement::decode(&s.encode().unwrap()).unwrap(), s);
        let unbound = Statement::new("SELECT 1");
        assert_eq!(
            Statement::decode(&unbound.encode().unwrap()).unwrap(),
            unbound
        );
        for junk in [&b"\xff\xff\xff"[..], b"SELECT 1", &[0x08, 0x07][..]] {
            let e = Statement::decode(junk).unwrap_err().to_string();
            assert!(e.contains("not a statement handle"), "{e}");
        }
        // A nested value (its wire form carries IPC) is refused before decoding.
        let nested = HandleMsg {
            version: VERSION,
            sql: "SELECT $1".into(),
            params: vec![protobuf::ScalarValue {
                value: Some(
                    datafusion_proto_common::protobuf_common::scalar_value::Value::ListValue(
                        datafusion_proto_common::protobuf_common::ScalarNestedValue {
                            ipc_message: vec![1, 2, 3],
                            arrow_data: vec![4, 5],
                            ..Default::default()
                        },
                    ),
                ),
            }],
            bound: true,
        };
        let e = Statement::decode(&nested.encode_to_vec())
            .unwrap_err()
            .to_string();
        assert!(e.contains("unsupported kind"), "{e}");
        assert!(bindable(&ScalarValue::Float64(Some(1.5))));
        assert!(!bindable(&ScalarValue::List(
            datafusion::common::utils::SingleRowListArrayBuilder::new(std::sync::Arc::new(
                arrow::array::Int32Array::from(vec![1])
            ))
            .build_list_array()
            .into()
        )));
    }
}
