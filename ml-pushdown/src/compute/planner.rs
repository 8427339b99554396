//! The split planner: predicted epoch time of every split, and the least.
//!
//! For split `k` the node decodes and runs stages `[0, k)`, the link carries stage
//! `k - 1`'s output (or the encoded samples for `k = 0`), and the compute tier runs
//! `[k, n)` (plus decoding for `k = 0`). The three run as a pipeline (the node streams
//! while the compute tier trains), so the epoch takes as long as the slowest of them,
//! plus one batch through the other two to fill the pipe:
//!
//! `epoch(k) = max(node, link, compute) + (node + link + compute) / batches`
//!
//! Rates come from measurements: per-stage seconds per sample measured on the node (a
//! `Profile` request) and here, scaled by the node's free share of its CPUs (from its
//! admission figures), and the link's measured bandwidth. FLOPs and bytes per stage come
//! from the model definition and are shown in the `explain` table.

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use crate::model::StageInfo;
use crate::profile::Profile;

/// Everything the planner weighs.
#[derive(Debug, Clone)]
pub struct PlanInputs {
    /// Samples in the epoch.
    pub samples: u64,
    /// The model's stages.
    pub stages: Vec<StageInfo>,
    /// The node's profile (with all of its CPUs).
    pub node: Profile,
    /// Share of the node's CPUs free for this job (0 < share ≤ 1).
    pub(crate) node_share: f64,
    /// The compute tier's profile.
    pub compute: Profile,
    /// Link bandwidth, bytes per second.
    pub link_bps: f64,
    /// Bytes per feature element on the wire (4 for f32, 2 for f16).
    pub(crate) feature_bytes: u64,
    /// Samples per node batch (for the pipeline fill term).
    pub batch: u64,
}

/// One candidate split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// Stages `[0, split)` at the node.
    pub split: usize,
    /// The last stage at the node (`-` for none).
    pub at_node: String,
    /// FLOPs per sample at the node.
    pub node_flops: u64,
    /// FLOPs per sample here.
    pub compute_flops: u64,
    /// Bytes per sample over the link.
    pub bytes_per_sample: f64,
    /// Predicted seconds of node work.
    pub node_s: f64,
    /// Predicted seconds on the link.
    pub link_s: f64,
    /// Predicted seconds of work here.
    pub compute_s: f64,
    /// Predicted epoch seconds.
    pub epoch_s: f64,
}

/// All candidates and the chosen one: the fewest bytes among those predicted within
/// `NEAR` of the least epoch time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// One per split, `0..=n`.
    pub candidates: Vec<Candidate>,
    /// Index of the chosen candidate.
    pub best: usize,
}

/// Prices every split.
pub fn plan(i: &PlanInputs) -> Plan {
    let n = i.stages.len();
    let samples = i.samples as f64;
    let share = i.node_share.clamp(0.01, 1.0);
    let batches = (i.samples as f64 / i.batch.max(1) as f64).max(1.0);
    let mut candidates = Vec::with_capacity(n + 1);
    for k in 0..=n {
        let node_flops: u64 = i.stages[..k].iter().map(|s| s.flops).sum();
        let compute_flops: u64 = i.stages[k..].iter().map(|s| s.flops).sum();
        let (node_per, compute_per) = if k == 0 {
            (
                0.0,
                i.compute.decode_s + i.compute.stage_s.iter().sum::<f64>(),
            )
        } else {
            (
                (i.node.decode_s + i.node.stage_s[..k].iter().sum::<f64>()) / share,
                // (+ 0.0: an empty f64 sum is -0.0)
                i.compute.stage_s[k..].iter().sum::<f64>() + 0.0,
            )
        };
        let bytes_per_sample = if k == 0 {
            i.node.sample_bytes.max(i.compute.sample_bytes)
        } else {
            (i.stages[k - 1].out_elems() as u64 * i.feature_bytes) as f64
        };
        let node_s = node_per * samples;
        let link_s = bytes_per_sample * samples / i.link_bps.max(1.0);
        let compute_s = compute_per * samples;
        let epoch_s = node_s.max(link_s).max(compute_s) + (node_s + link_s + compute_s) / batches;
        candidates.push(Candidate {
            split: k,
            at_node: if k == 0 {
                "-".into()
            } else {
                i.stages[k - 1].name.clone()
            },
            node_flops,
            compute_flops,
            bytes_per_sample,
            node_s,
            link_s,
            compute_s,
            epoch_s,
        });
    }
    let least = candidates
        .iter()
        .map(|c| c.epoch_s)
        .fold(f64::INFINITY, f64::min);
    // Among the splits predicted within NEAR of the least, the fewest bytes (then the
    // least time): see [`NEAR`].
    let best = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.epoch_s <= least * (1.0 + NEAR))
        .min_by(|a, b| {
            a.1.bytes_per_sample
                .total_cmp(&b.1.bytes_per_sample)
                .then(a.1.epoch_s.total_cmp(&b.1.epoch_s))
        })
        .map(|(i, _)| i)
        .unwrap_or(0);
    Plan { candidates, best }
}

/// Splits predicted within this fraction of the least epoch time count as equal, and
/// the one that moves the fewest bytes wins. Moving bytes costs more than the link's
/// time: the sender's serialization and the receiver's decoding take CPU from the
/// same cores as the model, which the pipeline model (one resource per side) does not
/// charge, and a shared link carries other traffic too.
pub(crate) const NEAR: f64 = 0.03;

impl Plan {
    /// The chosen split.
    pub fn split(&self) -> usize {
        self.candidates[self.best].split
    }

    /// The candidate table, one line per split, the chosen one marked.
    pub fn explain(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:>5}  {:<8} {:>10} {:>10} {:>12} {:>9} {:>9} {:>9} {:>9}",
            "split",
            "at node",
            "node MFLOP",
            "here MFLOP",
            "bytes/sample",
            "node s",
            "link s",
            "here s",
            "epoch s"
        );
        for (i, c) in self.candidates.iter().enumerate() {
            let _ = writeln!(
                s,
                "{:>5}  {:<8} {:>10.1} {:>10.1} {:>12.0} {:>9.2} {:>9.2} {:>9.2} {:>9.2}{}",
                c.split,
                c.at_node,
                c.node_flops as f64 / 1e6,
                c.compute_flops as f64 / 1e6,
                c.bytes_per_sample,
                c.node_s,
                c.link_s,
                c.compute_s,
                c.epoch_s,
                if i == self.best { "  <- chosen" } else { "" }
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;

    fn inputs(link_mbit: f64, node_share: f64) -> PlanInputs {
        let stages = Arch::EfficientNetLite0.stages();
        let n = stages.len();
        // A node 2x slower than the compute tier, every stage costing its FLOPs.
        let per_flop = 1.0 / 10e9;
        let compute = Profile {
            samples: 8,
            sample_bytes: 110_000.0,
            decode_s: 0.004,
            stage_s: stages.iter().map(|s| s.flops as f64 * per_flop).collect(),
        };
        let node = Profile {
            decode_s: 0.008,
            stage_s: compute.stage_s.iter().map(|s| s * 2.0).collect(),
            ..compute.clone()
        };
        assert_eq!(node.stage_s.len(), n);
        PlanInputs {
            samples: 10_000,
            stages,
            node,
            node_share,
            compute,
            link_bps: link_mbit * 1e6 / 8.0,
            feature_bytes: 4,
            batch: 32,
        }
    }

    #[test]
    fn slow_links_push_everything_down_fast_links_keep_work_here() {
        let n = Arch::EfficientNetLite0.stages().len();
        // 50 Mbit/s with the compute tier the bottleneck: part of the network moves to
        // the idle node, but not all of it (the node is 2x slower, so past some stage it
        // becomes the bottleneck): a split strictly inside, beating both ends.
        let slow = plan(&inputs(50.0, 1.0));
        let c = &slow.candidates;
        assert!(slow.split() > 0 && slow.split() < n, "{}", slow.explain());
        assert!(
            c[slow.best].epoch_s < c[0].epoch_s.min(c[n].epoch_s),
            "{}",
            slow.explain()
        );
        // A node 10x faster than the compute tier behind a 5 Mbit/s link: everything at
        // the node, and only the pooled features (5 kB) cross.
        let mut fast_node = inputs(5.0, 1.0);
        fast_node.node.stage_s = fast_node.compute.stage_s.iter().map(|s| s / 10.0).collect();
        assert_eq!(
            plan(&fast_node).split(),
            n,
            "{}",
            plan(&fast_node).explain()
        );
        // A fat link and a busy node: ship the samples and compute here.
        assert_eq!(plan(&inputs(100_000.0, 0.05)).split(), 0);
        let p = plan(&inputs(200.0, 1.0));
        let best = p.candidates[p.best].epoch_s;
        assert!(
            p.candidates
                .iter()
                .all(|c| c.epoch_s * (1.0 + NEAR) >= best),
            "{}",
            p.explain()
        );
        let table = p.explain();
        assert_eq!(table.lines().count(), n + 2, "{table}");
        assert!(table.contains("<- chosen"));
    }

    #[test]
    fn near_ties_go_to_the_split_that_moves_fewer_bytes() {
        let p = plan(&inputs(200.0, 1.0));
        let c = &p.candidates;
        let least = c.iter().map(|c| c.epoch_s).fold(f64::INFINITY, f64::min);
        let chosen = &c[p.best];
        assert!(chosen.epoch_s <= least * (1.0 + NEAR), "{}", p.explain());
        for other in c.iter().filter(|o| o.epoch_s <= least * (1.0 + NEAR)) {
            assert!(
                chosen.bytes_per_sample <= other.bytes_per_sample,
                "{}",
                p.explain()
            );
        }
        // Two splits made equal in time: the one with fewer bytes wins either way round.
        let mut i = inputs(200.0, 1.0);
        let n = i.stages.len();
        i.compute.stage_s = vec![0.0; n];
        i.node.stage_s = vec![0.0; n];
        i.node.decode_s = 0.0;
        i.compute.decode_s = 0.0;
        i.link_bps = 1e15;
        let p = plan(&i);
        let fewest = p
            .candidates
            .iter()
            .map(|c| c.bytes_per_sample)
            .fold(f64::INFINITY, f64::min);
        assert_eq!(
            p.candidates[p.best].bytes_per_sample,
            fewest,
            "{}",
            p.explain()
        );
    }
}
