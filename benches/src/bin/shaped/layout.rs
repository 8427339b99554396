//! How the bench lays TPC-H out, as users' tables come: each table in `files` Parquet
//! files (the parts the generator makes; nation and region stay one file), each file
//! its own partition, the partitions spread round-robin over `nodes` storage nodes.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

use csd_benches::csd_binary;
use csd_testbed::tpch;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::basic::Compression;
use datafusion::parquet::file::properties::WriterProperties;

use csd_benches::net::{Net, sh, start_nodes, stop_nodes};

/// Files per table and nodes: `FILESxNODES` on the command line (`4x2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) files: usize,
    pub(crate) nodes: usize,
}

impl FromStr for Layout {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!("layout {s:?}: expected FILESxNODES, e.g. 4x2 (4 files per table over 2 nodes)")
        };
        let (f, n) = s.trim().split_once('x').ok_or_else(bad)?;
        let files: usize = f.parse().map_err(|_| bad())?;
        let nodes: usize = n.parse().map_err(|_| bad())?;
        if !(1..=64).contains(&files) || !(1..=8).contains(&nodes) {
            return Err(format!(
                "layout {s:?}: files per table must be 1 to 64 and nodes 1 to 8"
            ));
        }
        Ok(Layout { files, nodes })
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.files, self.nodes)
    }
}

/// Tables the generator makes in one piece whatever the parts asked.
const ONE_FILE: [&str; 2] = ["nation", "region"];

/// Files of `table` in this layout: `TABLE.parquet`, or `TABLE-I.parquet` for each
/// part `I` (the names `benches/duckdb_query.py --files` reads).
pub(crate) fn files_of(table: &str, files: usize) -> Vec<String> {
    if files == 1 || ONE_FILE.contains(&table) {
        vec![format!("{table}.parquet")]
    } else {
        (0..files).map(|i| format!("{table}-{i}.parquet")).collect()
    }
}

/// The data directory of `files` files per table under `root` (nginx serves `root`).
pub(crate) fn data_dir(root: &Path, scale: f64, files: usize) -> PathBuf {
    root.join(format!("sf{scale}-{files}files"))
}

/// Writes each table as `files` Parquet files (Snappy, 122,880-row groups: what
/// DuckDB's own `COPY … (FORMAT parquet)` writes), unless they are there already.
pub(crate) fn write_tables(scale: f64, files: usize, dir: &Path) {
    std::fs::create_dir_all(dir).expect("data dir");
    for table in tpch::TABLES {
        let names = files_of(table, files);
        let parts = names.len();
        for (i, name) in names.iter().enumerate() {
            let path = dir.join(name);
            if path.exists() {
                continue;
            }
            let (schema, batches) =
                tpch::generate(table, scale, i as i32 + 1, parts as i32).expect("generate");
            let props = WriterProperties::builder()
                .set_compression(Compression::SNAPPY)
                .set_max_row_group_row_count(Some(122_880))
                .build();
            let tmp = path.with_extension("tmp");
            let mut w = ArrowWriter::try_new(
                std::fs::File::create(&tmp).expect("create"),
                schema,
                Some(props),
            )
            .expect("writer");
            for b in &batches {
                w.write(b).expect("write");
            }
            w.close().expect("close");
            std::fs::rename(&tmp, &path).expect("rename");
        }
    }
}

/// Formats one device per node of `layout` in `work` and stores the layout's files
/// with `csd put`, file `I` of a table as partition `pI` on node `I mod nodes`.
/// Returns the devices.
pub(crate) fn load(
    net: &mut Net,
    layout: Layout,
    data: &Path,
    work: &Path,
    serve_args: &str,
) -> Vec<PathBuf> {
    let devices: Vec<PathBuf> = (0..layout.nodes)
        .map(|j| work.join(format!("layout-{layout}-node{j}.img")))
        .collect();
    let nodes = start_nodes(net, &devices, true, "adaptive", serve_args);
    for table in tpch::TABLES {
        for (i, name) in files_of(table, layout.files).iter().enumerate() {
            sh(Command::new(csd_binary())
                .args(["put", "--node", &nodes[i % nodes.len()], "--table", table])
                .args(["--partition", &format!("p{i}")])
                .arg(data.join(name)));
        }
    }
    stop_nodes(net, nodes.len());
    devices
}
