//! The policies a scenario compares ([`PolicyName`]), by workload.

use serde::{Deserialize, Serialize};

use super::{Scenario, WorkloadSpec, bad};
use crate::Result;

/// A policy to compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicyName {
    /// SQL: read Parquet ranges, evaluate everything at the compute node.
    None,
    /// SQL: push down; nodes run everything (queueing, never pushing back).
    /// Features: every feature stage at the node.
    Full,
    /// SQL: push down; nodes admit what they have room for and push the rest back.
    Adaptive,
    /// Features: ship raw samples, run the whole model here.
    ComputeOnly,
    /// Features: the planner's split.
    Auto,
    /// Features: stages `[0, k)` at the node.
    Split(usize),
    /// Pipelines: each step's answer kept at the nodes, read there by the next.
    Kept,
    /// Pipelines: each step's answer brought back and sent to a node again.
    Shipped,
}

impl PolicyName {
    /// Whether it applies to SQL workloads (else to feature jobs). `full` is both.
    pub fn sql(self) -> bool {
        matches!(
            self,
            PolicyName::None | PolicyName::Full | PolicyName::Adaptive
        )
    }
    /// Whether it applies to pipelines.
    pub fn pipeline(self) -> bool {
        matches!(self, PolicyName::Kept | PolicyName::Shipped)
    }
    /// Whether it applies to feature jobs.
    pub fn features(self) -> bool {
        matches!(
            self,
            PolicyName::Full | PolicyName::ComputeOnly | PolicyName::Auto | PolicyName::Split(_)
        )
    }
}

impl std::fmt::Display for PolicyName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicyName::None => f.write_str("none"),
            PolicyName::Full => f.write_str("full"),
            PolicyName::Adaptive => f.write_str("adaptive"),
            PolicyName::ComputeOnly => f.write_str("compute-only"),
            PolicyName::Auto => f.write_str("auto"),
            PolicyName::Split(k) => write!(f, "split:{k}"),
            PolicyName::Kept => f.write_str("kept"),
            PolicyName::Shipped => f.write_str("shipped"),
        }
    }
}

impl std::str::FromStr for PolicyName {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Ok(match s {
            "none" => PolicyName::None,
            "full" => PolicyName::Full,
            "adaptive" => PolicyName::Adaptive,
            "compute-only" => PolicyName::ComputeOnly,
            "auto" => PolicyName::Auto,
            "kept" => PolicyName::Kept,
            "shipped" => PolicyName::Shipped,
            other => match other.strip_prefix("split:").map(str::parse) {
                Some(Ok(k)) => PolicyName::Split(k),
                _ => {
                    return Err(format!(
                        "unknown policy {other:?}: expected none, full, adaptive (SQL), compute-only, full, auto, split:N (features) or kept, shipped (pipelines)"
                    ));
                }
            },
        })
    }
}

impl Serialize for PolicyName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PolicyName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Scenario {
    /// The policies' part of [`Scenario::validate`].
    pub(super) fn validate_policies(&self) -> Result<()> {
        if self.policies.is_empty() {
            return Err(bad("policies", "expected at least one policy"));
        }
        let sql = matches!(self.workload, WorkloadSpec::Sql { .. });
        let pipeline = matches!(self.workload, WorkloadSpec::Pipeline { .. });
        for p in &self.policies {
            if pipeline {
                if !p.pipeline() {
                    return Err(bad(
                        "policies",
                        format!("{p} does not apply to pipelines; they take kept, shipped"),
                    ));
                }
                continue;
            }
            if p.pipeline() {
                return Err(bad(
                    "policies",
                    format!("{p} is a pipeline policy (workload.kind = \"pipeline\")"),
                ));
            }
            if sql && !p.sql() {
                return Err(bad(
                    "policies",
                    format!("{p} is a feature-job policy; SQL takes none, full, adaptive"),
                ));
            }
            if !sql && !p.features() {
                return Err(bad(
                    "policies",
                    format!(
                        "{p} is a SQL policy; feature jobs take compute-only, full, auto, split:N"
                    ),
                ));
            }
        }
        if let Some(b) = self.baseline
            && !self.policies.contains(&b)
        {
            return Err(bad("baseline", format!("{b} is not among the policies")));
        }
        Ok(())
    }
}
