//! The `ml` operator's request (JSON in the operator ticket's `args`), with limits.

use serde::{Deserialize, Serialize};

use crate::model::{Arch, PixelNorm};
use crate::profile::Profile;
use crate::{Error, Result};

/// Name of the operator in tickets.
pub const OPERATOR_NAME: &str = "ml";
/// Samples a profile request times.
pub const PROFILE_SAMPLES: usize = 4;
/// Samples per batch the whole model is timed at in a profile (the profile's
/// samples repeated; at most the node's batch): epochs run batches of tens, and a
/// small batch costs more per sample (the weights are read once per batch), which
/// made a node look slower than it runs.
pub const PROFILE_BATCH: usize = 16;
/// Node batch when the request sets no cap.
pub const DEFAULT_NODE_BATCH: usize = 32;

/// What the `ml` operator reports of a request (the typed details of its
/// [`OperatorReport`](csd_protocol::OperatorReport)). Fields come as the request
/// runs: each is absent until known.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MlDetails {
    /// Samples per node batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_batch: Option<usize>,
    /// Memory reserved with admission control, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_reserved: Option<u64>,
    /// The split it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<usize>,
    /// A profile request: whether its profile came from the node's cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile_cached: Option<bool>,
    /// A profile request: the profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<Profile>,
    /// Samples left out because they did not decode (`skip_bad_samples`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_samples: Option<u64>,
}

/// Largest request accepted.
pub(crate) const MAX_REQUEST_BYTES: usize = 16 << 10;
/// Most samples per node batch a request may ask for.
pub(crate) const MAX_NODE_BATCH: usize = 256;

/// Element type of the features sent back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FeatureType {
    /// 32-bit floats.
    #[default]
    F32,
    /// 16-bit floats (half the bytes; ~1e-3 relative rounding).
    F16,
}

impl FeatureType {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            FeatureType::F32 => 4,
            FeatureType::F16 => 2,
        }
    }
}

/// What the node should do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Run stages `[0, split)` over the partition and stream the features.
    #[default]
    Features,
    /// Time decoding and every stage on the first samples of the partition; answer no
    /// rows, the per-stage times in the report (`details.profile`, a [`Profile`]).
    ///
    /// [`Profile`]: crate::planner::Profile
    Profile,
}

/// One request: a dataset partition through a model prefix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeatureRequest {
    /// Dataset table (`id, label, data`).
    pub dataset: String,
    /// Partition of it.
    pub partition: String,
    /// Model architecture.
    pub model: Arch,
    /// The weights table ([`weights::table_name`](crate::weights::table_name)).
    pub weights: String,
    /// Stages `[0, split)` run at the node; `1 ≤ split ≤ stages`.
    pub split: usize,
    /// Feature element type.
    #[serde(default)]
    pub dtype: FeatureType,
    /// Cap on the node's batch size (the node may pick fewer to fit its memory).
    #[serde(default)]
    pub max_batch: Option<usize>,
    /// Only the first `limit` samples.
    #[serde(default)]
    pub limit: Option<u64>,
    /// Features (default) or a profile.
    #[serde(default)]
    pub mode: Mode,
    /// Leave out samples that cannot be decoded (counted in the report as
    /// `skipped_samples`) instead of failing the request.
    #[serde(default)]
    pub skip_bad_samples: bool,
    /// An ONNX model's pixel normalisation (default: none, mean 0 and std 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pixels: Option<PixelNorm>,
}

impl FeatureRequest {
    /// Encodes for the ticket.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes and validates a ticket's arguments.
    pub fn decode(args: &[u8]) -> Result<Self> {
        if args.len() > MAX_REQUEST_BYTES {
            return Err(Error::InvalidArgument(format!(
                "ml request is {} bytes; the limit is {MAX_REQUEST_BYTES}",
                args.len()
            )));
        }
        let r: FeatureRequest = serde_json::from_slice(args)
            .map_err(|e| Error::InvalidArgument(format!("ml request is not valid: {e}")))?;
        // An ONNX model's stages are known once its file is read (the node checks then).
        let n = match r.model {
            Arch::Onnx => usize::MAX,
            a => a.stages().len(),
        };
        if r.mode == Mode::Features && !(1..=n).contains(&r.split) {
            return Err(Error::InvalidArgument(format!(
                "split {} is out of range for {}: the node runs stages [0, split) with 1 ≤ split ≤ {n} \
                 (split 0 means no pushdown: read the dataset instead)",
                r.split, r.model
            )));
        }
        if let Some(b) = r.max_batch
            && !(1..=MAX_NODE_BATCH).contains(&b)
        {
            return Err(Error::InvalidArgument(format!(
                "max_batch {b} is out of range 1..={MAX_NODE_BATCH}"
            )));
        }
        csd_protocol::names::validate_table_name(&r.dataset)?;
        csd_protocol::names::validate_table_name(&r.weights)?;
        csd_protocol::names::validate_partition_name(&r.partition)?;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> FeatureRequest {
        FeatureRequest {
            dataset: "images".into(),
            partition: "0".into(),
            model: Arch::EfficientNetLite0,
            weights: "_w_0_0".into(),
            split: 3,
            dtype: FeatureType::F16,
            max_batch: None,
            limit: None,
            mode: Mode::Features,
            skip_bad_samples: false,
            pixels: None,
        }
    }

    #[test]
    fn round_trips_and_refuses_bad_requests() {
        let r = req();
        assert_eq!(FeatureRequest::decode(&r.encode()).expect("valid"), r);
        let bad = |f: &dyn Fn(&mut FeatureRequest), what: &str| {
            let mut r = req();
            f(&mut r);
            let e = FeatureRequest::decode(&r.encode()).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        };
        bad(&|r| r.split = 0, "split 0");
        bad(&|r| r.split = 99, "out of range");
        bad(&|r| r.max_batch = Some(0), "max_batch");
        bad(&|r| r.dataset = "no such; table".into(), "table name");
        let e = FeatureRequest::decode(br#"{"dataset":"x","model":"vgg"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not valid"), "{e}");
        let e = FeatureRequest::decode(&vec![b' '; MAX_REQUEST_BYTES + 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("limit"), "{e}");
    }
}
