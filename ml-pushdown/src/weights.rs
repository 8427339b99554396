//! Model weights stored at the node as a table, addressed by their content.
//!
//! A safetensors file (or an ONNX model) becomes the table `_w_{sha256}_{len}` of
//! `(seq UInt32, chunk Binary)` rows of at most 1 MiB, so weights travel and rest like
//! any data: checksummed by the object store, kept across restarts, listed by `csd
//! ls`, removed by `csd rm`. The client uploads a file once ([`ensure`]); the node
//! reads it back and checks the content against the name.

use std::sync::Arc;

use arrow::array::{BinaryArray, UInt32Array};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;
use csd_protocol::node_client::NodeClient;

use crate::{Error, Result};

const CHUNK: usize = 1 << 20;

/// The table name holding `bytes`.
pub fn table_name(bytes: &[u8]) -> String {
    format!(
        "_w_{}_{:x}",
        csd_protocol::ModuleDigest::of(bytes).hex(),
        bytes.len()
    )
}

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("seq", DataType::UInt32, false),
        Field::new("chunk", DataType::Binary, false),
    ]))
}

/// `bytes` as batches of the weights table.
pub(crate) fn to_batches(bytes: &[u8]) -> Result<Vec<RecordBatch>> {
    bytes
        .chunks(CHUNK)
        .enumerate()
        .collect::<Vec<_>>()
        .chunks(8)
        .map(|group| {
            let seq = UInt32Array::from_iter_values(group.iter().map(|(i, _)| *i as u32));
            let chunk = BinaryArray::from_iter_values(group.iter().map(|(_, c)| *c));
            Ok(RecordBatch::try_new(
                schema(),
                vec![Arc::new(seq), Arc::new(chunk)],
            )?)
        })
        .collect()
}

/// Reassembles weights from the table's batches and checks them against `table`.
#[cfg(feature = "node")]
pub(crate) fn from_batches(table: &str, batches: &[RecordBatch]) -> Result<Vec<u8>> {
    use arrow::array::{Array, AsArray};
    use arrow::datatypes::UInt32Type;
    let mut parts: Vec<(u32, &[u8])> = Vec::new();
    for b in batches {
        let seq = b
            .column_by_name("seq")
            .and_then(|c| c.as_primitive_opt::<UInt32Type>())
            .ok_or_else(|| Error::InvalidArgument(format!("{table} is not a weights table")))?;
        let chunk = b
            .column_by_name("chunk")
            .and_then(|c| c.as_binary_opt::<i32>())
            .ok_or_else(|| Error::InvalidArgument(format!("{table} is not a weights table")))?;
        if seq.null_count() + chunk.null_count() > 0 {
            return Err(Error::InvalidArgument(format!("{table} has null chunks")));
        }
        parts.extend(
            seq.values()
                .iter()
                .copied()
                .zip(chunk.iter().map(|c| c.unwrap_or_default())),
        );
    }
    parts.sort_by_key(|(s, _)| *s);
    let mut out = Vec::with_capacity(parts.iter().map(|(_, c)| c.len()).sum());
    for (i, (s, c)) in parts.iter().enumerate() {
        if *s as usize != i {
            return Err(Error::InvalidArgument(format!(
                "{table}: chunk {i} is missing or repeated"
            )));
        }
        out.extend_from_slice(c);
    }
    if table_name(&out) != table {
        return Err(Error::InvalidArgument(format!(
            "{table}: stored weights do not match their name (got {}); upload them again",
            table_name(&out)
        )));
    }
    Ok(out)
}

/// Uploads `bytes` to the node unless it holds them already; returns the table name.
pub async fn ensure(client: &NodeClient, bytes: &[u8]) -> Result<String> {
    let name = table_name(bytes);
    match client.table(&name).await {
        Ok(_) => return Ok(name),
        Err(e) if e.code() == Some(tonic::Code::NotFound) => {}
        Err(e) => return Err(e.into()),
    }
    let batches = to_batches(bytes)?;
    let stream = futures::stream::iter(batches.into_iter().map(Ok));
    client.put(&name, "0", schema(), stream).await?;
    Ok(name)
}

/// The safetensors metadata key that carries a text model's `tokenizer.json`.
pub(crate) const TOKENIZER_KEY: &str = "csd.tokenizer";

/// Splits a safetensors file into its header (JSON) and the tensor data after it.
fn header(bytes: &[u8]) -> Result<(serde_json::Map<String, serde_json::Value>, &[u8])> {
    let bad = |why: &str| Error::InvalidArgument(format!("weights are not safetensors: {why}"));
    let n = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
        .ok_or_else(|| bad("shorter than its 8-byte header length"))?;
    let end = usize::try_from(n)
        .ok()
        .and_then(|n| n.checked_add(8))
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| bad("the header is longer than the file"))?;
    let head: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..end]).map_err(|e| bad(&e.to_string()))?;
    Ok((head, &bytes[end..]))
}

/// The tokenizer (`tokenizer.json` text) a weights file carries, if any.
pub fn tokenizer(bytes: &[u8]) -> Result<Option<String>> {
    let (head, _) = header(bytes)?;
    Ok(head
        .get("__metadata__")
        .and_then(|m| m.get(TOKENIZER_KEY))
        .and_then(|t| t.as_str())
        .map(str::to_string))
}

/// `weights` (safetensors) with `tokenizer_json` put into its metadata, so the file
/// alone describes a text model; the tensors are untouched.
pub fn with_tokenizer(weights: &[u8], tokenizer_json: &[u8]) -> Result<Vec<u8>> {
    let json = std::str::from_utf8(tokenizer_json)
        .map_err(|e| Error::InvalidArgument(format!("tokenizer.json is not UTF-8: {e}")))?;
    tokenizers::Tokenizer::from_bytes(json)
        .map_err(|e| Error::InvalidArgument(format!("tokenizer.json is not a tokenizer: {e}")))?;
    let (mut head, data) = header(weights)?;
    let meta = head
        .entry("__metadata__")
        .or_insert_with(|| serde_json::Value::Object(Default::default()));
    let Some(meta) = meta.as_object_mut() else {
        return Err(Error::InvalidArgument(
            "weights are not safetensors: __metadata__ is not an object".into(),
        ));
    };
    meta.insert(TOKENIZER_KEY.into(), json.into());
    let mut h = serde_json::to_vec(&head)
        .map_err(|e| Error::InvalidArgument(format!("cannot write the header: {e}")))?;
    // Tensor data stays 8-byte aligned, as the format's writers keep it.
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + h.len() + data.len());
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    Ok(out)
}
