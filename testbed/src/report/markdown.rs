//! The report's Markdown: the set-up, a table per sweep point, what each policy
//! bought against the baseline, the plots.

use std::fmt::Write as _;

use super::plots::Figure;
use super::*;

impl Report {
    pub(super) fn markdown(&self, plots: &[Figure]) -> String {
        let s = &self.scenario;
        let mut m = String::new();
        let _ = writeln!(m, "# Testbed: {}\n", s.name);
        if !s.description.is_empty() {
            let _ = writeln!(m, "{}\n", s.description.trim());
        }
        if self.quick {
            let _ = writeln!(m, "*Quick run (`--quick`): smaller data, shorter runs.*\n");
        }
        let _ = writeln!(m, "## Headline\n");
        for h in &self.headline {
            let _ = writeln!(m, "- {h}");
        }
        let bad: usize = self.runs.iter().map(|r| r.mismatches.len()).sum();
        let _ = writeln!(
            m,
            "- Answers compared with the baseline ({}): {}",
            self.baseline,
            if bad == 0 {
                "all equal".to_string()
            } else {
                format!("**{bad} differ** (see below)")
            }
        );
        let _ = writeln!(m, "\n## Set-up\n");
        let d = &s.nodes.device;
        if s.nodes.system == crate::scenario::NodeSystem::Qemu {
            let q = &s.nodes.qemu;
            let boot = self
                .boot_s
                .iter()
                .map(|b| format!("{b:.1}"))
                .collect::<Vec<_>>()
                .join(", ");
            let _ = writeln!(
                m,
                "- {} storage node(s), each in a QEMU guest of its own (TCG, {}; {} vCPU, {} MiB; {}): the node ({} CPU worker(s), {} memory) stores on an emulated NVMe controller ({} MiB, {}-byte LBAs) through `{}`; QEMU start to a serving node: {} s",
                s.nodes.count,
                q.arch.name(),
                s.nodes.settings.cpus,
                q.memory_mib,
                crate::guest::Kit::find_for(q.arch)
                    .map_or_else(|_| "kernel unknown".into(), |k| k.kernel),
                s.nodes.settings.cpus,
                s.nodes.settings.memory,
                q.disk_mib,
                q.lba_bytes,
                q.device.spec(),
                if boot.is_empty() { "-".into() } else { boot }
            );
        } else {
            let _ = writeln!(
                m,
                "- {} storage node(s), {} CPU worker(s) and {} memory each; emulated NVMe: {} µs, {} MB/s read, queue depth {}, parallelism {}",
                s.nodes.count,
                s.nodes.settings.cpus,
                s.nodes.settings.memory,
                d.latency_us,
                d.read_mbps,
                d.queue_depth,
                d.parallelism
            );
        }
        let _ = writeln!(
            m,
            "- Link per node: {} Mbit/s, {} µs one way{}",
            s.link.bandwidth_mbit,
            s.link.latency_us,
            if s.links.is_empty() {
                ""
            } else {
                " (some nodes overridden)"
            }
        );
        let _ = writeln!(
            m,
            "- Data: `{}`",
            serde_json::to_string(&s.data).unwrap_or_default()
        );
        let _ = writeln!(
            m,
            "- Workload: `{}`",
            serde_json::to_string(&s.workload).unwrap_or_default()
        );
        if let Some(c) = self.capacity_qps {
            let _ = writeln!(m, "- Measured capacity: {c:.2} queries/s");
        }
        if s.nodes.pin {
            let _ = writeln!(
                m,
                "- Pinned (`nodes.pin`): each node's operator workers have cores of their own, \
                 and the compute tier's ML work the rest of this machine's {} cores; gRPC, \
                 links and the compute tier's SQL share all of them.",
                self.machine_cores
            );
        } else {
            let _ = writeln!(
                m,
                "- Everything shares this machine's {} cores (nodes, links, compute).",
                self.machine_cores
            );
        }
        let _ = writeln!(m, "\n## Results\n");
        let features = matches!(s.workload, WorkloadSpec::Features { .. });
        for pt in self.points() {
            if !pt.is_empty() {
                let _ = writeln!(m, "### {}\n", label(&pt));
            }
            let runs = self.at(&pt);
            let base = runs.iter().find(|r| r.policy == self.baseline).copied();
            let _ = writeln!(
                m,
                "| policy | wall s | ok / failed / cut | goodput /s | p50 ms | p99 ms | MB from nodes | bytes ÷ | time ÷ | pushed back | CPU busy |{}",
                if features { " split |" } else { "" }
            );
            let _ = writeln!(
                m,
                "|---|---|---|---|---|---|---|---|---|---|---|{}",
                if features { "---|" } else { "" }
            );
            for r in runs {
                let (bx, tx) = match base {
                    Some(b) => (
                        format!(
                            "{:.1}x",
                            b.bytes_from_nodes as f64 / (r.bytes_from_nodes as f64).max(1.0)
                        ),
                        format!("{:.2}x", b.wall_s / r.wall_s.max(1e-9)),
                    ),
                    None => ("-".into(), "-".into()),
                };
                let _ = writeln!(
                    m,
                    "| {} | {:.2} | {} / {} / {} | {:.2} | {:.1} | {:.1} | {:.3} | {} | {} | {}/{} | {} |{}",
                    r.policy,
                    r.wall_s,
                    r.completed,
                    r.failed,
                    r.cut,
                    r.goodput_qps,
                    r.p50_ms,
                    r.p99_ms,
                    r.bytes_from_nodes as f64 / 1e6,
                    bx,
                    tx,
                    r.pushed_back,
                    r.fragments,
                    r.cpu_mean()
                        .map_or("not sampled".to_string(), |c| format!("{:.0}%", c * 100.0)),
                    if features {
                        format!(
                            " {} |",
                            r.extra
                                .get("split")
                                .map(|k| k.to_string())
                                .unwrap_or("-".into())
                        )
                    } else {
                        String::new()
                    }
                );
            }
            let _ = writeln!(m);
            for r in self.at(&pt) {
                for e in &r.mismatches {
                    let _ = writeln!(m, "- **{}: {e}**", r.policy);
                }
                for e in &r.errors {
                    let _ = writeln!(m, "- {} error: {e}", r.policy);
                }
                if r.timed_out {
                    let _ = writeln!(m, "- {} hit the {} s timeout", r.policy, s.timeout_s);
                }
            }
        }
        let _ = writeln!(m, "\n## Plots\n");
        for f in plots {
            match &f.file {
                Some(file) => {
                    let _ = writeln!(m, "### {}\n\n![{}]({file})\n", f.title, f.title);
                }
                None => {
                    let _ = writeln!(m, "### {}\n\nNot drawn: {}\n", f.title, f.missing);
                }
            }
        }
        let _ = writeln!(
            m,
            "Storage CPU is the fraction of the nodes' CPU workers running pushed-down work, sampled every 100 ms (raw Parquet reads are not counted). Bytes are what crossed the throttled links from the nodes."
        );
        m
    }
}
