//! Protobuf's wire format, read and written field by field.
//!
//! Graph surgery reads only the few fields it must understand (names, node inputs
//! and outputs, shapes) and copies every other field byte for byte, so a model keeps
//! whatever its exporter wrote — fields of newer ONNX versions included — where a
//! generated message type would drop the fields it does not know.

use prost::bytes::Buf;
use prost::encoding::{decode_varint, encode_varint};

use crate::{Error, Result};

/// How deep messages may nest (subgraphs in subgraphs) before a model is refused:
/// a crafted file must not overflow the stack.
pub(crate) const MAX_DEPTH: usize = 64;

/// One field's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Value<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Fixed32(u32),
}

/// One field as it lies in its message.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Field<'a> {
    pub number: u32,
    pub value: Value<'a>,
    /// The whole field: key and value, ready to copy.
    pub raw: &'a [u8],
}

impl<'a> Field<'a> {
    /// The payload of a length-delimited field.
    pub(crate) fn bytes(&self, what: &str) -> Result<&'a [u8]> {
        match self.value {
            Value::Bytes(b) => Ok(b),
            _ => Err(malformed(format!("{what} is not length-delimited"))),
        }
    }

    /// A string field.
    pub(crate) fn string(&self, what: &str) -> Result<String> {
        let b = self.bytes(what)?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| malformed(format!("{what} is not UTF-8")))
    }

    /// A varint field as a signed 64-bit integer (ONNX's int64/int32 fields).
    pub(crate) fn int(&self, what: &str) -> Result<i64> {
        match self.value {
            Value::Varint(v) => Ok(v as i64),
            _ => Err(malformed(format!("{what} is not a varint"))),
        }
    }
}

pub(crate) fn malformed(why: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("the ONNX model is malformed: {why}"))
}

/// The fields of one message, in order.
pub(crate) fn fields(mut buf: &[u8]) -> impl Iterator<Item = Result<Field<'_>>> {
    let mut failed = false;
    std::iter::from_fn(move || {
        if buf.is_empty() || failed {
            return None;
        }
        let start = buf;
        let r = next(&mut buf).map(|(number, value)| Field {
            number,
            value,
            raw: &start[..start.len() - buf.len()],
        });
        failed = r.is_err();
        Some(r)
    })
}

fn next<'a>(buf: &mut &'a [u8]) -> Result<(u32, Value<'a>)> {
    let truncated = || malformed("a message is truncated");
    let key = decode_varint(buf).map_err(|_| truncated())?;
    let number = u32::try_from(key >> 3)
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| malformed(format!("field number {} is out of range", key >> 3)))?;
    let value = match key & 7 {
        0 => Value::Varint(decode_varint(buf).map_err(|_| truncated())?),
        1 => {
            if buf.remaining() < 8 {
                return Err(truncated());
            }
            Value::Fixed64(buf.get_u64_le())
        }
        2 => {
            let len = decode_varint(buf).map_err(|_| truncated())?;
            let len = usize::try_from(len)
                .ok()
                .filter(|l| *l <= buf.len())
                .ok_or_else(truncated)?;
            let (b, rest) = buf.split_at(len);
            *buf = rest;
            Value::Bytes(b)
        }
        5 => {
            if buf.remaining() < 4 {
                return Err(truncated());
            }
            Value::Fixed32(buf.get_u32_le())
        }
        w => {
            return Err(malformed(format!(
                "wire type {w} (groups) is not used by ONNX"
            )));
        }
    };
    Ok((number, value))
}

/// Appends a length-delimited field.
pub(crate) fn put_bytes(out: &mut Vec<u8>, number: u32, payload: &[u8]) {
    encode_varint(u64::from(number) << 3 | 2, out);
    encode_varint(payload.len() as u64, out);
    out.extend_from_slice(payload);
}

/// Appends a varint field.
pub(crate) fn put_varint(out: &mut Vec<u8>, number: u32, v: u64) {
    encode_varint(u64::from(number) << 3, out);
    encode_varint(v, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_it_writes_and_refuses_truncation() {
        let mut m = Vec::new();
        put_varint(&mut m, 1, 300);
        put_bytes(&mut m, 7, b"graph");
        put_varint(&mut m, 2, u64::MAX);
        let f: Vec<Field> = fields(&m).collect::<Result<_>>().expect("valid");
        assert_eq!(f.len(), 3);
        assert_eq!((f[0].number, f[0].value), (1, Value::Varint(300)));
        assert_eq!(f[1].string("name").expect("string"), "graph");
        assert_eq!(f[2].int("n").expect("int"), -1);
        let again: Vec<u8> = f.iter().flat_map(|f| f.raw.iter().copied()).collect();
        assert_eq!(again, m);
        for cut in 1..m.len() {
            let bad: Result<Vec<Field>> = fields(&m[..cut]).collect();
            if cut != 3 && cut != 10 {
                assert!(bad.is_err(), "a message cut at {cut} was read");
            }
        }
        let e = fields(&[0x0b])
            .next()
            .expect("one")
            .unwrap_err()
            .to_string();
        assert!(e.contains("groups"), "{e}");
    }
}
