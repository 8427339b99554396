//! How the bench lays a workload's tables out, as users' tables come: each table in
//! `files` Parquet files (small tables stay one file), each file its own partition,
//! the partitions spread over the storage nodes round-robin, or unevenly by weight
//! (`8x3:1`: 8 files per table over two nodes, the first holding three times the
//! files of the second), or kept on several nodes at once (`8x3r2`: every file
//! stored with `csd put --replicas 2` over the three nodes).

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

use csd_benches::csd_binary;
use csd_benches::net::{Net, sh, start_nodes, stop_nodes};

use crate::workload::Workload;

/// Most nodes a layout spreads over.
const MAX_NODES: usize = 8;

/// Files per table and how they spread over nodes: `FILESxNODES` on the command
/// line (`4x2`: round-robin), `FILESxW1:W2:…` (`8x3:1`: node `j` holds files in
/// proportion to `Wj`), or `FILESxNODESrCOPIES` (`8x3r2`: each file on 2 of the 3
/// nodes, placed by `csd put --replicas`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) files: usize,
    pub(crate) nodes: usize,
    /// Per node, its weight; all 1 for round-robin.
    weights: [u8; MAX_NODES],
    /// Copies of each file (1: placed by weight; more: by `csd put --replicas`).
    copies: usize,
}

impl FromStr for Layout {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "layout {s:?}: expected FILESxNODES (4x2: 4 files per table over 2 nodes) \
                 or FILESxW1:W2… (8x3:1: 8 files over two nodes, 3 to 1) \
                 or FILESxNODESrCOPIES (8x3r2: each file on 2 of 3 nodes)"
            )
        };
        let (f, n) = s.trim().split_once('x').ok_or_else(bad)?;
        let (n, copies) = match n.split_once('r') {
            Some((n, c)) => (n, c.parse::<usize>().map_err(|_| bad())?),
            None => (n, 1),
        };
        let files: usize = f.parse().map_err(|_| bad())?;
        let mut weights = [1u8; MAX_NODES];
        let nodes = if n.contains(':') {
            let w: Vec<u8> = n
                .split(':')
                .map(|w| w.parse().ok().filter(|w| *w > 0))
                .collect::<Option<_>>()
                .ok_or_else(bad)?;
            if w.len() > MAX_NODES {
                return Err(bad());
            }
            weights[..w.len()].copy_from_slice(&w);
            w.len()
        } else {
            n.parse().map_err(|_| bad())?
        };
        if !(1..=64).contains(&files) || !(1..=MAX_NODES).contains(&nodes) {
            return Err(format!(
                "layout {s:?}: files per table must be 1 to 64 and nodes 1 to {MAX_NODES}"
            ));
        }
        if !(1..=nodes).contains(&copies) || (copies > 1 && weights.iter().any(|w| *w != 1)) {
            return Err(format!(
                "layout {s:?}: copies must be 1 to the number of nodes, on even nodes"
            ));
        }
        Ok(Layout {
            files,
            nodes,
            weights,
            copies,
        })
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = &self.weights[..self.nodes];
        if self.copies > 1 {
            write!(f, "{}x{}r{}", self.files, self.nodes, self.copies)
        } else if w.iter().all(|w| *w == 1) {
            write!(f, "{}x{}", self.files, self.nodes)
        } else {
            let w: Vec<String> = w.iter().map(u8::to_string).collect();
            write!(f, "{}x{}", self.files, w.join(":"))
        }
    }
}

impl Layout {
    /// The node holding file `i` of `n`: round-robin over a cycle in which node `j`
    /// appears `Wj` times.
    pub(crate) fn node_of(&self, i: usize) -> usize {
        let cycle: Vec<usize> = (0..self.nodes)
            .flat_map(|j| std::iter::repeat_n(j, usize::from(self.weights[j])))
            .collect();
        cycle[i % cycle.len()]
    }
}

/// Formats one device per node of `layout` in `work` and stores the workload's
/// files with `csd put`, file `I` of a table as partition `pI` on node
/// [`Layout::node_of`]`(I)`, or on as many nodes as the layout keeps copies
/// (`csd put --replicas` places them). Returns the devices.
pub(crate) fn load(
    net: &mut Net,
    workload: Workload,
    layout: Layout,
    data: &Path,
    work: &Path,
    serve_args: &str,
) -> Vec<PathBuf> {
    let devices: Vec<PathBuf> = (0..layout.nodes)
        .map(|j| work.join(format!("{workload}-{layout}-node{j}.img").replace(':', "_")))
        .collect();
    let nodes = start_nodes(net, &devices, true, "adaptive", serve_args);
    let started = std::time::Instant::now();
    for table in workload.tables() {
        for (i, name) in workload.files_of(table, layout.files).iter().enumerate() {
            let mut put = Command::new(csd_binary());
            put.args(["put", "--table", table]);
            if layout.copies > 1 {
                put.args(["--replicas", &layout.copies.to_string()]);
                for n in &nodes {
                    put.args(["--node", n]);
                }
            } else {
                put.args(["--node", &nodes[layout.node_of(i)]]);
            }
            sh(put
                .args(["--partition", &format!("p{i}")])
                .arg(data.join(name)));
        }
    }
    eprintln!(
        "  layout {layout}: loaded in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    stop_nodes(net, nodes.len());
    devices
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_layouts_spread_by_weight() {
        let l: Layout = "8x3:1".parse().unwrap();
        assert_eq!((l.files, l.nodes), (8, 2));
        let on: Vec<usize> = (0..8).map(|i| l.node_of(i)).collect();
        assert_eq!(on, [0, 0, 0, 1, 0, 0, 0, 1]);
        assert_eq!(l.to_string(), "8x3:1");
        let r: Layout = "4x2".parse().unwrap();
        assert_eq!(
            (0..4).map(|i| r.node_of(i)).collect::<Vec<_>>(),
            [0, 1, 0, 1]
        );
        assert_eq!(r.to_string(), "4x2");
        assert!("4x0".parse::<Layout>().is_err() && "4x1:0".parse::<Layout>().is_err());
        let c: Layout = "8x3r2".parse().unwrap();
        assert_eq!((c.files, c.nodes, c.copies), (8, 3, 2));
        assert_eq!(c.to_string(), "8x3r2");
        assert!("8x2r3".parse::<Layout>().is_err() && "8x3:1r2".parse::<Layout>().is_err());
    }
}
