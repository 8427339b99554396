//! The split planner: predicted epoch time of every split and share, and the least.
//!
//! For split `k` the node decodes and runs stages `[0, k)`, the link carries stage
//! `k - 1`'s output (or the encoded samples for `k = 0`), and the compute tier runs
//! `[k, n)` (plus decoding for `k = 0`) on each training batch. The three run as a
//! pipeline (the node streams while the compute tier trains), so the epoch ends when
//! the last of them is done:
//!
//! - the busiest node, after its work, sends its last batch, and this side runs the
//!   layers after the split on the last training batch;
//! - this side, after its work and after waiting for its first input (a node's first
//!   batch, or, with partitions of its own, their first raw rows);
//! - the link, after its bytes, and the last training batch here.
//!
//! `epoch(k) = max(node + last batch over the link + last training batch here,
//!                 here + first input, link + last training batch here)`
//!
//! Besides where the layers split, the planner weighs how the *partitions* split: a
//! share of them read raw and run whole at the compute tier while the nodes run their
//! other partitions to stage `k`. With two one-core sides and a model whose every
//! layer split moves more bytes than the images (ResNet-50), dividing the samples
//! between the sides beats any layer split. Each node's work is its own partitions'
//! samples (nodes run in parallel); the link and the compute tier carry everyone's.
//!
//! Rates come from measurements: per-stage seconds per sample measured on the node (a
//! `Profile` request) and here, scaled by the node's free share of its CPUs (from its
//! admission figures), and the link's measured bandwidth. FLOPs and bytes per stage come
//! from the model definition and are shown in the `explain` table.

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use crate::model::StageInfo;
use crate::profile::Profile;

/// One partition of the dataset: which node holds it and its samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// Index of its node (partitions on the same node share its CPUs).
    pub node: usize,
    /// Samples in it.
    pub rows: u64,
}

/// Everything the planner weighs.
#[derive(Debug, Clone)]
pub struct PlanInputs {
    /// The dataset's partitions, in the order the stream opens them (empty: one
    /// partition of `samples` on one node).
    pub parts: Vec<Part>,
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
    /// Samples per node batch (the pipeline's first and last pieces).
    pub batch: u64,
    /// Samples per training batch: this side runs the layers after the split on that
    /// many at once.
    pub train_batch: u64,
}

/// One candidate: a split and the partitions read raw and run whole here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// Stages `[0, split)` at the node.
    pub split: usize,
    /// The last stage at the node (`-` for none).
    pub at_node: String,
    /// Partitions (indices into [`PlanInputs::parts`]) read raw and run whole at the
    /// compute tier; the nodes run the others to `split`.
    #[serde(default)]
    pub here: Vec<usize>,
    /// Samples in those partitions.
    #[serde(default)]
    pub here_samples: u64,
    /// FLOPs per sample at the node.
    pub node_flops: u64,
    /// FLOPs per sample here.
    pub compute_flops: u64,
    /// Bytes per sample over the link (averaged over the epoch's samples).
    pub bytes_per_sample: f64,
    /// Predicted seconds of node work (the busiest node's).
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
    /// Per split `0..=n`, every share of the partitions: none here first, then one,
    /// two, … partitions here (those [`here_set`] picks).
    pub candidates: Vec<Candidate>,
    /// Index of the chosen candidate.
    pub best: usize,
}

/// The `m` partitions to run whole here: one at a time, the largest partition of
/// the node left with the most samples (ties: the lower index), so the nodes' shares
/// stay even.
pub fn here_set(parts: &[Part], m: usize) -> Vec<usize> {
    let mut left: Vec<bool> = vec![true; parts.len()];
    let mut out = Vec::with_capacity(m);
    for _ in 0..m.min(parts.len()) {
        let mut load: std::collections::BTreeMap<usize, u64> = Default::default();
        for (i, p) in parts.iter().enumerate() {
            if left[i] {
                *load.entry(p.node).or_default() += p.rows;
            }
        }
        let busiest = load
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(n, _)| *n);
        let pick = parts
            .iter()
            .enumerate()
            .filter(|(i, p)| left[*i] && Some(p.node) == busiest)
            .max_by(|a, b| a.1.rows.cmp(&b.1.rows).then(b.0.cmp(&a.0)))
            .map(|(i, _)| i);
        let Some(i) = pick else { break };
        left[i] = false;
        out.push(i);
    }
    out.sort_unstable();
    out
}

/// Prices every split and share.
pub fn plan(i: &PlanInputs) -> Plan {
    let n = i.stages.len();
    let parts: Vec<Part> = if i.parts.is_empty() {
        vec![Part {
            node: 0,
            rows: i.samples,
        }]
    } else {
        i.parts.clone()
    };
    let samples = parts.iter().map(|p| p.rows).sum::<u64>().max(1) as f64;
    let share = i.node_share.clamp(0.01, 1.0);
    let raw_bytes = i.node.sample_bytes.max(i.compute.sample_bytes);
    // Seconds per sample of the whole model here (decoding included).
    let whole_here = i.compute.decode_s + i.compute.stage_s.iter().sum::<f64>();
    let mut candidates = Vec::new();
    for k in 0..=n {
        let node_flops: u64 = i.stages[..k].iter().map(|s| s.flops).sum();
        let compute_flops: u64 = i.stages[k..].iter().map(|s| s.flops).sum();
        let node_per = if k == 0 {
            0.0
        } else {
            (i.node.decode_s + i.node.stage_s[..k].iter().sum::<f64>()) / share
        };
        // (+ 0.0: an empty f64 sum is -0.0)
        let tail_per = if k == 0 {
            whole_here
        } else {
            i.compute.stage_s[k..].iter().sum::<f64>() + 0.0
        };
        let sent_per = if k == 0 {
            raw_bytes
        } else {
            (i.stages[k - 1].out_elems() as u64 * i.feature_bytes) as f64
        };
        // Split 0 reads every partition raw already: no share to weigh.
        let shares = if k == 0 { 1 } else { parts.len() };
        for m in 0..shares {
            let here = here_set(&parts, m);
            let here_rows: u64 = here.iter().map(|&j| parts[j].rows).sum();
            let mut per_node: std::collections::BTreeMap<usize, u64> = Default::default();
            for (j, p) in parts.iter().enumerate() {
                if !here.contains(&j) {
                    *per_node.entry(p.node).or_default() += p.rows;
                }
            }
            let busiest = per_node.values().copied().max().unwrap_or(0) as f64;
            let (here_rows, node_rows) = (here_rows as f64, samples - here_rows as f64);
            let node_s = node_per * busiest;
            let sent = sent_per * node_rows + raw_bytes * here_rows;
            let link_s = sent / i.link_bps.max(1.0);
            let compute_s = tail_per * node_rows + whole_here * here_rows;
            // The pipeline's ends (see the module's doc). This side's own partitions
            // wait for nothing but their first raw rows; the node's rows reach it a
            // node batch at a time, and the layers after the split run on them a
            // training batch at a time.
            let batch = i.batch.max(1) as f64;
            let last_here = if node_rows > 0.0 {
                tail_per * (i.train_batch.max(1) as f64).min(node_rows)
            } else {
                whole_here * batch.min(here_rows)
            };
            let node_done = if node_rows > 0.0 {
                node_s + sent_per * batch / i.link_bps.max(1.0) + last_here
            } else {
                0.0
            };
            let first_input = if here_rows > 0.0 {
                raw_bytes * batch / i.link_bps.max(1.0)
            } else {
                (node_per + sent_per / i.link_bps.max(1.0)) * batch
            };
            let epoch_s = node_done
                .max(compute_s + first_input)
                .max(link_s + last_here);
            candidates.push(Candidate {
                split: k,
                at_node: if k == 0 {
                    "-".into()
                } else {
                    i.stages[k - 1].name.clone()
                },
                here_samples: here_rows as u64,
                here,
                node_flops,
                compute_flops,
                bytes_per_sample: sent / samples,
                node_s,
                link_s,
                compute_s,
                epoch_s,
            });
        }
    }
    let least = candidates
        .iter()
        .map(|c| c.epoch_s)
        .fold(f64::INFINITY, f64::min);
    // Among the candidates predicted within NEAR of the least, the fewest bytes, then
    // the least time (see [`NEAR`]), then the later split: a stage that takes no time
    // (a reshape after the pool) still costs this side a session to build and run
    // per batch.
    let best = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.epoch_s <= least * (1.0 + NEAR))
        .min_by(|a, b| {
            a.1.bytes_per_sample
                .total_cmp(&b.1.bytes_per_sample)
                .then(a.1.epoch_s.total_cmp(&b.1.epoch_s))
                .then(b.1.split.cmp(&a.1.split))
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

    /// The partitions (indices into [`PlanInputs::parts`]) the chosen candidate runs
    /// whole here.
    pub fn here(&self) -> &[usize] {
        &self.candidates[self.best].here
    }

    /// The candidate table, one line per split (its fastest share of the partitions,
    /// or the chosen one), the chosen one marked.
    pub fn explain(&self) -> String {
        let parts = self
            .candidates
            .iter()
            .filter(|c| c.split > 0)
            .map(|c| c.here.len() + 1)
            .max()
            .unwrap_or(1);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:>5}  {:<8} {:>10} {:>10} {:>10} {:>12} {:>9} {:>9} {:>9} {:>9}",
            "split",
            "at node",
            "node MFLOP",
            "here MFLOP",
            "parts here",
            "bytes/sample",
            "node s",
            "link s",
            "here s",
            "epoch s"
        );
        let mut i = 0;
        while i < self.candidates.len() {
            let k = self.candidates[i].split;
            let end = (i..self.candidates.len())
                .find(|&j| self.candidates[j].split != k)
                .unwrap_or(self.candidates.len());
            let shown = if (i..end).contains(&self.best) {
                self.best
            } else {
                (i..end)
                    .min_by(|a, b| {
                        self.candidates[*a]
                            .epoch_s
                            .total_cmp(&self.candidates[*b].epoch_s)
                    })
                    .unwrap_or(i)
            };
            let c = &self.candidates[shown];
            let here = if k == 0 {
                "all".to_string()
            } else {
                format!("{}/{parts}", c.here.len())
            };
            let _ = writeln!(
                s,
                "{:>5}  {:<8} {:>10.1} {:>10.1} {:>10} {:>12.0} {:>9.2} {:>9.2} {:>9.2} {:>9.2}{}",
                c.split,
                c.at_node,
                c.node_flops as f64 / 1e6,
                c.compute_flops as f64 / 1e6,
                here,
                c.bytes_per_sample,
                c.node_s,
                c.link_s,
                c.compute_s,
                c.epoch_s,
                if shown == self.best {
                    "  <- chosen"
                } else {
                    ""
                }
            );
            i = end;
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
            parts: vec![],
            samples: 10_000,
            stages,
            node,
            node_share,
            compute,
            link_bps: link_mbit * 1e6 / 8.0,
            feature_bytes: 4,
            batch: 32,
            train_batch: 64,
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
        let fewest_bytes = |p: &Plan| {
            p.candidates
                .iter()
                .map(|c| c.bytes_per_sample)
                .fold(f64::INFINITY, f64::min)
        };
        let p = plan(&i);
        let fewest = fewest_bytes(&p);
        assert_eq!(
            p.candidates[p.best].bytes_per_sample,
            fewest,
            "{}",
            p.explain()
        );
        // Equal in time and bytes too (features that cost nothing to send): the
        // latest of them (fewest stages here).
        i.feature_bytes = 0;
        let p = plan(&i);
        let fewest = fewest_bytes(&p);
        let latest = p
            .candidates
            .iter()
            .filter(|c| c.bytes_per_sample == fewest)
            .map(|c| c.split)
            .max();
        assert_eq!(Some(p.split()), latest, "{}", p.explain());
        assert!(
            p.candidates
                .iter()
                .filter(|c| c.bytes_per_sample == fewest)
                .count()
                > 1,
            "the case needs a tie: {}",
            p.explain()
        );
    }

    #[test]
    fn here_set_takes_from_the_busiest_node_first() {
        let p = |node, rows| Part { node, rows };
        let parts = [p(0, 100), p(1, 100), p(0, 50), p(1, 60)];
        assert_eq!(here_set(&parts, 0), Vec::<usize>::new());
        // Node 1 holds 160 samples, node 0 150: node 1's largest partition.
        assert_eq!(here_set(&parts, 1), vec![1]);
        // Then node 0 (150 against 60).
        assert_eq!(here_set(&parts, 2), vec![0, 1]);
        assert_eq!(here_set(&parts, 9).len(), 4);
    }

    #[test]
    fn equal_sides_share_the_partitions_when_no_layer_split_balances_them() {
        // Equal sides, and one stage holding all of the model's time: every layer
        // split leaves that stage to one side while the other idles; half the
        // partitions here, the other half whole at the node, halves the epoch.
        let mut i = inputs(1000.0, 1.0);
        let n = i.stages.len();
        i.compute.decode_s = 0.0;
        i.compute.stage_s = vec![0.0; n];
        i.compute.stage_s[n / 2] = 0.08;
        i.node = i.compute.clone();
        i.link_bps = 1e12;
        i.parts = vec![
            Part {
                node: 0,
                rows: 5_000,
            },
            Part {
                node: 0,
                rows: 5_000,
            },
        ];
        let n = i.stages.len();
        let p = plan(&i);
        let chosen = &p.candidates[p.best];
        assert_eq!(chosen.here.len(), 1, "{}", p.explain());
        assert_eq!(chosen.here_samples, 5_000);
        let unshared = p
            .candidates
            .iter()
            .filter(|c| c.here.is_empty())
            .map(|c| c.epoch_s)
            .fold(f64::INFINITY, f64::min);
        assert!(chosen.epoch_s < 0.6 * unshared, "{}", p.explain());
        // Every split's line is in the table once, with its share.
        let table = p.explain();
        assert_eq!(table.lines().count(), n + 2, "{table}");
        assert!(table.contains("1/2"), "{table}");
        assert_eq!(p.here(), chosen.here.as_slice());
    }

    #[test]
    fn this_sides_own_partitions_do_not_wait_for_the_node() {
        // As measured for EfficientNet-Lite0 on two one-core sides (ms per image): the
        // node runs the first half in 4.9 and the whole in 8.85 (decoding included),
        // this side the second half in 4.6 and the whole in 10.5; 216 images in two
        // partitions. Run whole, one partition each: this side's own partition needs
        // nothing from the node and is done at 108 x 10.5 ms; the split in the
        // middle waits for the node, whose last batch then takes a training batch
        // here (measured: the share 1.43-1.53 s a process, the middle split 1.62-1.67 s).
        let mut i = inputs(1e6, 1.0);
        let n = i.stages.len();
        let mid = n / 2;
        i.node.decode_s = 0.00095;
        i.node.stage_s = vec![0.0; n];
        i.node.stage_s[mid - 1] = 0.00395;
        i.node.stage_s[n - 1] = 0.0039;
        i.compute.decode_s = 0.001;
        i.compute.stage_s = vec![0.0; n];
        i.compute.stage_s[mid - 1] = 0.0049;
        i.compute.stage_s[n - 1] = 0.0046;
        i.samples = 216;
        i.parts = vec![Part { node: 0, rows: 108 }, Part { node: 0, rows: 108 }];
        let p = plan(&i);
        let chosen = &p.candidates[p.best];
        assert_eq!((chosen.split, chosen.here.len()), (n, 1), "{}", p.explain());
        assert!(
            (chosen.epoch_s - 108.0 * 0.0105).abs() < 0.01,
            "{}",
            p.explain()
        );
        let middle = p
            .candidates
            .iter()
            .find(|c| c.split == mid && c.here.is_empty())
            .unwrap();
        // The node's 216 x 4.9 ms, then a training batch of 64 x 4.6 ms here.
        assert!(
            (middle.epoch_s - (216.0 * 0.0049 + 64.0 * 0.0046)).abs() < 0.01,
            "{}",
            p.explain()
        );
    }

    #[test]
    fn nodes_work_in_parallel() {
        // The same samples over two nodes instead of one: the node side of a split
        // that runs everything at the nodes takes half as long.
        let mut one = inputs(1000.0, 1.0);
        let part = |node| Part { node, rows: 5_000 };
        one.parts = vec![part(0), part(0)];
        let mut two = one.clone();
        two.parts = vec![part(0), part(1)];
        let n = one.stages.len();
        let full = |p: &Plan| {
            p.candidates
                .iter()
                .find(|c| c.split == n && c.here.is_empty())
                .map(|c| c.node_s)
                .unwrap_or_default()
        };
        let (a, b) = (full(&plan(&one)), full(&plan(&two)));
        assert!(a > 0.0 && (b - a / 2.0).abs() < 1e-9 * a, "{a} {b}");
    }
}
