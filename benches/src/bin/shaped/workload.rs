//! What the bench runs: TPC-H as its generator writes it (each table's files hold
//! ranges of its first key), TPC-H as a user's pipeline rewrites it (rows in random
//! order across the files, plain `Utf8` strings), or `groups`: a generated fact
//! table whose keys range from 10 to 10^7 distinct values (skewed, NULLs, integer
//! and string keys) and the queries whose work does not shrink at a node.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, UInt32Array};
use arrow::compute::{cast, concat_batches, take_record_batch};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use csd_testbed::tpch;
use datafusion::parquet::arrow::ArrowWriter;
use datafusion::parquet::basic::Compression;
use datafusion::parquet::file::properties::WriterProperties;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use crate::groups;

/// A workload: its tables, how they are written, and its queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Workload {
    /// TPC-H as generated: each file of a table a range of its first key.
    Tpch,
    /// TPC-H with every table's rows in random order before it is cut into files,
    /// strings as plain `Utf8` (what a pyarrow rewrite gives).
    TpchShuffled,
    /// The generated `facts` and `dims` tables (`groups.rs`).
    Groups,
}

impl FromStr for Workload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tpch" => Ok(Workload::Tpch),
            "tpch-shuffled" => Ok(Workload::TpchShuffled),
            "groups" => Ok(Workload::Groups),
            other => Err(format!(
                "workload {other:?} is not one of tpch, tpch-shuffled, groups"
            )),
        }
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Workload::Tpch => "tpch",
            Workload::TpchShuffled => "tpch-shuffled",
            Workload::Groups => "groups",
        })
    }
}

/// Tables the TPC-H generator makes in one piece whatever the parts asked.
const ONE_FILE: [&str; 2] = ["nation", "region"];

impl Workload {
    /// Its tables.
    pub(crate) fn tables(self) -> &'static [&'static str] {
        match self {
            Workload::Tpch | Workload::TpchShuffled => &tpch::TABLES,
            Workload::Groups => &groups::TABLES,
        }
    }

    /// The folder of its queries (`qN.sql`).
    pub(crate) fn queries_dir(self, root: &Path) -> PathBuf {
        match self {
            Workload::Tpch | Workload::TpchShuffled => root.join("testbed/queries/tpch"),
            Workload::Groups => root.join("benches/queries/groups"),
        }
    }

    /// Its query numbers.
    pub(crate) fn queries(self) -> Vec<u32> {
        match self {
            Workload::Tpch | Workload::TpchShuffled => (1..=22).collect(),
            Workload::Groups => (1..=groups::QUERIES).collect(),
        }
    }

    /// What `--scale` means for it, for the report.
    pub(crate) fn describe(self, scale: f64) -> String {
        match self {
            Workload::Tpch => format!("TPC-H SF {scale}"),
            Workload::TpchShuffled => format!("TPC-H SF {scale}, rows shuffled, Utf8 strings"),
            Workload::Groups => format!(
                "groups: facts of {:.0}M rows, keys of 10 to 10^7 values",
                groups::rows(scale) as f64 / 1e6
            ),
        }
    }

    /// Files of `table` in a layout of `files` files per table: `TABLE.parquet`, or
    /// `TABLE-I.parquet` for each part `I` (the names `benches/duckdb_query.py
    /// --files` reads). Small tables stay one file.
    pub(crate) fn files_of(self, table: &str, files: usize) -> Vec<String> {
        let one = match self {
            Workload::Tpch | Workload::TpchShuffled => ONE_FILE.contains(&table),
            Workload::Groups => groups::ONE_FILE.contains(&table),
        };
        if files == 1 || one {
            vec![format!("{table}.parquet")]
        } else {
            (0..files).map(|i| format!("{table}-{i}.parquet")).collect()
        }
    }

    /// The data directory of `files` files per table under `root` (nginx serves
    /// `root`).
    pub(crate) fn data_dir(self, root: &Path, scale: f64, files: usize) -> PathBuf {
        let name = match self {
            Workload::Tpch => format!("sf{scale}-{files}files"),
            Workload::TpchShuffled => format!("sf{scale}-shuffled-{files}files"),
            Workload::Groups => format!("groups{scale}-{files}files"),
        };
        root.join(name)
    }

    /// Writes each table as `files` Parquet files unless they are there already.
    pub(crate) fn write_tables(self, scale: f64, files: usize, dir: &Path) {
        std::fs::create_dir_all(dir).expect("data dir");
        for table in self.tables() {
            let names = self.files_of(table, files);
            if names.iter().all(|n| dir.join(n).exists()) {
                continue;
            }
            let parts: Vec<(SchemaRef, Vec<RecordBatch>)> = match self {
                Workload::Tpch => (0..names.len())
                    .map(|i| {
                        tpch::generate(table, scale, i as i32 + 1, names.len() as i32)
                            .expect("generate")
                    })
                    .collect(),
                Workload::TpchShuffled => {
                    let (schema, batches) = tpch::generate(table, scale, 1, 1).expect("generate");
                    shuffled_parts(schema, &batches, names.len(), table)
                }
                Workload::Groups => groups::generate(table, scale, names.len()),
            };
            for (name, (schema, batches)) in names.iter().zip(parts) {
                write_parquet(&dir.join(name), schema, &batches);
            }
        }
    }
}

/// Writes `batches` as one Parquet file the way DuckDB's own `COPY … (FORMAT
/// parquet)` does (Snappy, 122,880-row groups), through a temporary name.
pub(crate) fn write_parquet(path: &Path, schema: SchemaRef, batches: &[RecordBatch]) {
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
    for b in batches {
        w.write(b).expect("write");
    }
    w.close().expect("close");
    std::fs::rename(&tmp, path).expect("rename");
}

/// `batches` with their rows in a random order (seeded by the table's name), string
/// views as plain strings, cut into `parts` files of about equal rows.
fn shuffled_parts(
    schema: SchemaRef,
    batches: &[RecordBatch],
    parts: usize,
    table: &str,
) -> Vec<(SchemaRef, Vec<RecordBatch>)> {
    let plain = Arc::new(Schema::new(
        schema
            .fields()
            .iter()
            .map(|f| match f.data_type() {
                DataType::Utf8View => Field::new(f.name(), DataType::Utf8, f.is_nullable()),
                _ => f.as_ref().clone(),
            })
            .collect::<Vec<_>>(),
    ));
    let all = concat_batches(&schema, batches).expect("concat");
    let all = RecordBatch::try_new(
        plain.clone(),
        all.columns()
            .iter()
            .zip(plain.fields())
            .map(|(c, f)| cast(c, f.data_type()).expect("cast"))
            .collect::<Vec<ArrayRef>>(),
    )
    .expect("plain batch");
    let n = all.num_rows();
    let seed = table
        .bytes()
        .fold(7u64, |h, b| h.wrapping_mul(31) ^ u64::from(b));
    let mut order: Vec<u32> = (0..n as u32).collect();
    order.shuffle(&mut StdRng::seed_from_u64(seed));
    (0..parts)
        .map(|i| {
            let (from, to) = (i * n / parts, (i + 1) * n / parts);
            let batches = order[from..to]
                .chunks(65_536)
                .map(|idx| take_record_batch(&all, &UInt32Array::from(idx.to_vec())).expect("take"))
                .collect();
            (plain.clone(), batches)
        })
        .collect()
}
