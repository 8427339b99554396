//! How samples live at a node: a table of `id: UInt64, label: Int64, data: Binary`
//! (an encoded JPEG/PNG per row), partitioned like any table. `csd put --images DIR`
//! builds it from a folder.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, BinaryBuilder, Int64Array, UInt64Array};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::record_batch::RecordBatch;

use crate::{Error, Result};

/// Column names of an image dataset.
pub(crate) const ID: &str = "id";
/// Label column.
pub(crate) const LABEL: &str = "label";
/// Encoded sample column.
pub(crate) const DATA: &str = "data";

/// The schema `csd put --images` writes.
pub fn image_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new(ID, DataType::UInt64, false),
        Field::new(LABEL, DataType::Int64, false),
        Field::new(DATA, DataType::Binary, false),
    ]))
}

/// Checks a stored table can be read as an image dataset.
pub(crate) fn check_schema(table: &str, schema: &Schema) -> Result<()> {
    let want = [
        (ID, &[DataType::UInt64][..]),
        (LABEL, &[DataType::Int64][..]),
        (
            DATA,
            &[
                DataType::Binary,
                DataType::LargeBinary,
                DataType::BinaryView,
            ][..],
        ),
    ];
    for (name, types) in want {
        match schema.field_with_name(name) {
            Ok(f) if types.contains(f.data_type()) => {}
            Ok(f) => {
                return Err(Error::InvalidArgument(format!(
                    "table {table}: column {name} is {}, expected {types:?} (datasets are `id UInt64, label Int64, data Binary`)",
                    f.data_type()
                )));
            }
            Err(_) => {
                return Err(Error::InvalidArgument(format!(
                    "table {table} is not a dataset: no column {name} (datasets are `id UInt64, label Int64, data Binary`)"
                )));
            }
        }
    }
    Ok(())
}

/// One batch of a dataset, split into its columns.
pub struct Samples {
    /// Sample ids.
    pub ids: Vec<u64>,
    /// Labels.
    pub labels: Vec<i64>,
    /// Encoded samples.
    pub data: ArrayRef,
}

impl Samples {
    /// Takes a batch of a dataset table apart.
    pub fn from_batch(b: &RecordBatch) -> Result<Self> {
        let (ids, labels) = ids_labels(b)?;
        let data = b
            .column_by_name(DATA)
            .cloned()
            .ok_or_else(|| Error::InvalidArgument(format!("dataset batch lacks column {DATA}")))?;
        if data.null_count() > 0 {
            return Err(Error::InvalidArgument("dataset has null samples".into()));
        }
        Ok(Samples { ids, labels, data })
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The samples whose `keep` is true.
    pub fn retain(self, keep: &[bool]) -> Result<Samples> {
        let mask = arrow::array::BooleanArray::from(keep.to_vec());
        let data = arrow::compute::filter(&self.data, &mask)?;
        fn pick<T>(v: Vec<T>, keep: &[bool]) -> Vec<T> {
            v.into_iter()
                .zip(keep)
                .filter(|(_, k)| **k)
                .map(|(x, _)| x)
                .collect()
        }
        Ok(Samples {
            ids: pick(self.ids, keep),
            labels: pick(self.labels, keep),
            data,
        })
    }

    /// The encoded samples as byte slices.
    pub fn bytes(&self) -> Result<Vec<&[u8]>> {
        let d = &self.data;
        Ok(match d.data_type() {
            DataType::Binary => d
                .as_binary::<i32>()
                .iter()
                .map(|v| v.unwrap_or_default())
                .collect(),
            DataType::LargeBinary => d
                .as_binary::<i64>()
                .iter()
                .map(|v| v.unwrap_or_default())
                .collect(),
            DataType::BinaryView => d
                .as_binary_view()
                .iter()
                .map(|v| v.unwrap_or_default())
                .collect(),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "data column is {other}, not binary"
                )));
            }
        })
    }
}

/// The `id` (UInt64) and `label` (Int64) columns of a dataset or features batch.
pub(crate) fn ids_labels(b: &RecordBatch) -> Result<(Vec<u64>, Vec<i64>)> {
    let ids = b
        .column_by_name(ID)
        .and_then(|c| c.as_primitive_opt::<arrow::datatypes::UInt64Type>());
    let labels = b
        .column_by_name(LABEL)
        .and_then(|c| c.as_primitive_opt::<arrow::datatypes::Int64Type>());
    match (ids, labels) {
        (Some(i), Some(l)) if i.null_count() + l.null_count() == 0 => {
            Ok((i.values().to_vec(), l.values().to_vec()))
        }
        (Some(_), Some(_)) => Err(Error::InvalidArgument("null ids or labels".into())),
        _ => Err(Error::InvalidArgument(format!(
            "batch lacks a UInt64 {ID} or an Int64 {LABEL} column"
        ))),
    }
}

/// A folder of images with labels.
#[derive(Debug, Clone)]
pub struct ImageFolder {
    /// (file, label index) in a stable order.
    pub samples: Vec<(PathBuf, i64)>,
    /// Class names; label `i` is `classes[i]`.
    pub classes: Vec<String>,
}

fn is_image(p: &Path) -> bool {
    matches!(
        p.extension()
            .and_then(|e| e.to_str())
            .map(|e| e.to_ascii_lowercase())
            .as_deref(),
        Some("jpg" | "jpeg" | "png")
    )
}

/// Reads a folder of images. With `labels`, a CSV of `file,class[,...]` lines (paths
/// relative to `dir`; a header line starting `file,` is skipped; extra fields ignored); without, each subfolder of `dir` is
/// a class (the ImageFolder layout). Class names are numbered in sorted order.
pub fn image_folder(dir: &Path, labels: Option<&Path>) -> Result<ImageFolder> {
    let io = |what: &Path, e: std::io::Error| {
        Error::Node(csd_protocol::Error::io(
            format!("reading {}", what.display()),
            e,
        ))
    };
    let mut pairs: Vec<(PathBuf, String)> = Vec::new();
    match labels {
        Some(file) => {
            let text = std::fs::read_to_string(file).map_err(|e| io(file, e))?;
            for (n, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || (n == 0 && line.to_ascii_lowercase().starts_with("file,")) {
                    continue;
                }
                let mut fields = line.split(',');
                let (f, c) = match (fields.next(), fields.next()) {
                    (Some(f), Some(c)) if !f.trim().is_empty() && !c.trim().is_empty() => (f, c),
                    _ => {
                        return Err(Error::InvalidArgument(format!(
                            "{}:{}: expected `file,class[,...]`, got {line:?}",
                            file.display(),
                            n + 1
                        )));
                    }
                };
                let path = dir.join(f.trim());
                if !path.is_file() {
                    return Err(Error::InvalidArgument(format!(
                        "{}:{}: {} does not exist",
                        file.display(),
                        n + 1,
                        path.display()
                    )));
                }
                pairs.push((path, c.trim().to_string()));
            }
        }
        None => {
            let mut classes: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| io(dir, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_dir())
                .collect();
            classes.sort();
            for c in classes {
                let name = c
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let mut files: Vec<PathBuf> = std::fs::read_dir(&c)
                    .map_err(|e| io(&c, e))?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.is_file() && is_image(p))
                    .collect();
                files.sort();
                pairs.extend(files.into_iter().map(|f| (f, name.clone())));
            }
        }
    }
    if pairs.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "{}: no images found (expected class subfolders of .jpg/.png files, or a labels file)",
            dir.display()
        )));
    }
    let mut classes: Vec<String> = pairs.iter().map(|(_, c)| c.clone()).collect();
    classes.sort();
    classes.dedup();
    let samples = pairs
        .into_iter()
        .map(|(p, c)| {
            let i = classes.binary_search(&c).unwrap_or_default() as i64;
            (p, i)
        })
        .collect();
    Ok(ImageFolder { samples, classes })
}

/// Builds dataset batches of at most `rows` samples from `(id, label, bytes)` triples.
pub fn batch(ids: &[u64], labels: &[i64], data: &[&[u8]]) -> Result<RecordBatch> {
    let mut b = BinaryBuilder::with_capacity(data.len(), data.iter().map(|d| d.len()).sum());
    for d in data {
        b.append_value(d);
    }
    Ok(RecordBatch::try_new(
        image_schema(),
        vec![
            Arc::new(UInt64Array::from(ids.to_vec())),
            Arc::new(Int64Array::from(labels.to_vec())),
            Arc::new(b.finish()),
        ],
    )?)
}

/// Labelled text read from a file.
#[derive(Debug, Clone)]
pub struct TextFile {
    /// The samples, in file order.
    pub texts: Vec<String>,
    /// Their labels.
    pub labels: Vec<i64>,
    /// Class names when the labels were names (label `i` is `classes[i]`); empty when
    /// the file's labels were integers, kept as they are.
    pub classes: Vec<String>,
}

/// Reads labelled text from a Parquet or CSV file (with a header): the string column
/// `text_col` and the column `label_col`. Integer labels are kept; any other labels are
/// class names, numbered in sorted order. Null texts or labels are refused.
pub fn text_file(path: &Path, text_col: &str, label_col: &str) -> Result<TextFile> {
    use arrow::compute::cast;
    let err = |m: String| Error::InvalidArgument(format!("{}: {m}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    let parquet = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"));
    let batches: Vec<RecordBatch> = if parquet {
        parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)?
            .build()?
            .collect::<std::result::Result<_, _>>()?
    } else {
        let format = arrow::csv::reader::Format::default().with_header(true);
        let (schema, _) = format
            .infer_schema(std::io::BufReader::new(&file), Some(1000))
            .map_err(|e| err(format!("not a CSV with a header: {e}")))?;
        std::io::Seek::rewind(&mut &file).map_err(|e| err(e.to_string()))?;
        arrow::csv::ReaderBuilder::new(Arc::new(schema))
            .with_format(format)
            .build(file)?
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| err(e.to_string()))?
    };
    let (mut texts, mut raw_labels, mut int_labels) = (Vec::new(), Vec::new(), true);
    for b in &batches {
        let column = |name: &str| {
            b.column_by_name(name).cloned().ok_or_else(|| {
                let have: Vec<&str> = b
                    .schema_ref()
                    .fields()
                    .iter()
                    .map(|f| f.name().as_str())
                    .collect();
                err(format!("no column {name:?} (columns: {})", have.join(", ")))
            })
        };
        let t = cast(&column(text_col)?, &DataType::Utf8)?;
        let l = column(label_col)?;
        int_labels &= l.data_type().is_integer();
        let l = cast(&l, &DataType::Utf8)?;
        if t.null_count() + l.null_count() > 0 {
            return Err(err(format!("null values in {text_col:?} or {label_col:?}")));
        }
        texts.extend(
            t.as_string::<i32>()
                .iter()
                .map(|v| v.unwrap_or_default().to_string()),
        );
        raw_labels.extend(
            l.as_string::<i32>()
                .iter()
                .map(|v| v.unwrap_or_default().to_string()),
        );
    }
    if texts.is_empty() {
        return Err(err("no rows".into()));
    }
    let (labels, classes) = if int_labels {
        let labels = raw_labels
            .iter()
            .map(|l| {
                l.parse::<i64>()
                    .map_err(|e| err(format!("label {l:?}: {e}")))
            })
            .collect::<Result<_>>()?;
        (labels, Vec::new())
    } else {
        let mut classes = raw_labels.clone();
        classes.sort();
        classes.dedup();
        let labels = raw_labels
            .iter()
            .map(|l| classes.binary_search(l).unwrap_or_default() as i64)
            .collect();
        (labels, classes)
    };
    Ok(TextFile {
        texts,
        labels,
        classes,
    })
}
