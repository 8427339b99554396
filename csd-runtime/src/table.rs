//! Tables and partitions, held as Parquet objects the node writes itself.
//!
//! A table is a schema plus named partitions; a partition is a list of Parquet
//! objects named `{table}/{partition}/{seq:08}.parquet`. Each append (`DoPut`) adds
//! one object, written with row-group statistics and a page index so later scans
//! prune by range. The registry is rebuilt at start-up from the objects' footers,
//! read by range through [`ObjectReader`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use bytes::Bytes;
use futures::{Stream, StreamExt};
use parquet::arrow::arrow_reader::ArrowReaderMetadata;
use parquet::arrow::async_writer::AsyncArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use serde::{Deserialize, Serialize};

use crate::deleted::{self, Remembered};
use crate::error::{Error, Result, truncated};
use crate::protocol::{DeletedCopy, PutSummary};
use crate::sketch::ColumnSketches;
use crate::store::{ObjectInfo, ObjectStore};

mod io;
pub use csd_protocol::names::{validate_partition_name, validate_table_name};
pub use io::ObjectReader;

/// How the node writes Parquet (`[parquet]` in a node's settings file).
#[derive(Debug, Clone, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct ParquetOptions {
    /// Rows per row group: the unit of statistics pruning.
    #[arg(long, env = "CSD_ROW_GROUP_ROWS", default_value_t = 128 * 1024)]
    pub row_group_rows: usize,
    /// Rows per data page: the unit of page-index pruning.
    #[arg(long, env = "CSD_PAGE_ROWS", default_value_t = 16 * 1024)]
    pub page_rows: usize,
    /// Compression of stored column chunks: `none`, `lz4`, `zstd` or `snappy`.
    /// None by default: scans are the node's work and its cores the scarce part,
    /// and decompressing costs a weak core more than reading the extra bytes costs
    /// the device (`benches/RESULTS.md` has the measurement; `zstd` stores about half).
    #[arg(
        long = "parquet-compression",
        env = "CSD_PARQUET_COMPRESSION",
        default_value = "none"
    )]
    pub compression: String,
    /// Write a distinct-count sketch of every column into each object's footer
    /// (`csd.distinct`), from which the compute tier judges whether an aggregate
    /// shrinks at the node before asking it to run one.
    #[arg(
        long = "parquet-distinct-sketches",
        env = "CSD_PARQUET_DISTINCT_SKETCHES",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub distinct_sketches: bool,
}

impl Default for ParquetOptions {
    /// The flags' defaults.
    fn default() -> Self {
        crate::flags::clap_defaults()
    }
}

impl ParquetOptions {
    fn writer_properties(&self) -> Result<WriterProperties> {
        let compression = match self.compression.as_str() {
            "zstd" => Compression::ZSTD(ZstdLevel::default()),
            "lz4" => Compression::LZ4_RAW,
            "snappy" => Compression::SNAPPY,
            "none" => Compression::UNCOMPRESSED,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "parquet compression {other:?} is not one of zstd, lz4, snappy, none"
                )));
            }
        };
        if self.row_group_rows == 0 || self.page_rows == 0 {
            return Err(Error::InvalidArgument(
                "row_group_rows and page_rows must be positive".into(),
            ));
        }
        Ok(WriterProperties::builder()
            .set_max_row_group_row_count(Some(self.row_group_rows))
            .set_data_page_row_count_limit(self.page_rows)
            .set_write_batch_size(self.page_rows.min(8192))
            .set_statistics_enabled(EnabledStatistics::Page)
            .set_compression(compression)
            .set_created_by(format!("csd-runtime {}", env!("CARGO_PKG_VERSION")))
            .build())
    }
}

/// The footer key saying how many copies of the object's partition its writer
/// asked for (see `PartitionDescription::copies`).
pub const COPIES_KEY: &str = "csd.copies";

/// The footer key naming the put an object's copies are of (`csd put --replicas`):
/// the same on every copy, different for every put, so that a deleted copy is
/// known by its digests (see `DeletedCopy`).
pub const PUT_KEY: &str = "csd.put";

/// The copies of a partition a put stores, one per node, and the put's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copies {
    /// Copies in all (see [`COPIES_KEY`]).
    pub copies: u32,
    /// The put's name (see [`PUT_KEY`]).
    pub put: Option<String>,
}

impl Copies {
    /// One copy, no name.
    pub const ONE: Copies = Copies {
        copies: 1,
        put: None,
    };
}

/// How an append writes its object.
struct Writing {
    props: WriterProperties,
    /// The memory it stays within (see [`TableStore::append_within`]).
    within: Option<u64>,
    /// The copies of the partition being stored.
    copies: Copies,
}

/// One Parquet object of a partition, with its footer cached.
#[derive(Debug, Clone)]
pub struct ParquetObject {
    /// The object.
    pub object: Arc<ObjectInfo>,
    /// Footer, page index and Arrow schema.
    pub metadata: ArrowReaderMetadata,
    /// Its columns' distinct-count sketches, from the footer (`None`: an object
    /// written without them).
    pub sketches: Option<Arc<ColumnSketches>>,
}

impl ParquetObject {
    /// `object` with its footer `metadata`, its sketches read from the footer.
    pub fn new(object: Arc<ObjectInfo>, metadata: ArrowReaderMetadata) -> Self {
        let columns = metadata.schema().fields().len();
        let sketches = ColumnSketches::from_footer(metadata.metadata(), columns).map(Arc::new);
        ParquetObject {
            object,
            metadata,
            sketches,
        }
    }

    /// The copies of its partition its writer asked for (footer key
    /// [`COPIES_KEY`]; 1 when absent or unreadable).
    pub fn copies(&self) -> u32 {
        self.metadata
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .and_then(|kv| kv.iter().find(|e| e.key == COPIES_KEY))
            .and_then(|e| e.value.as_deref()?.parse().ok())
            .filter(|n| *n >= 1)
            .unwrap_or(1)
    }

    /// Rows in the object.
    pub fn rows(&self) -> u64 {
        self.metadata.metadata().file_metadata().num_rows().max(0) as u64
    }

    /// For each top-level column, `[min, max]` when it is a signed integer or date
    /// column whose every row group has exact statistics and no NULLs (the footer
    /// says so); `None` otherwise. Lets the compute tier prove that partitions hold
    /// disjoint key ranges. Empty when the Parquet schema is not flat.
    pub fn int_ranges(&self) -> Vec<Option<[i64; 2]>> {
        use arrow::datatypes::DataType;
        use parquet::file::statistics::Statistics;
        let meta = self.metadata.metadata();
        let fields = self.metadata.schema().fields();
        let leaves = meta.file_metadata().schema_descr();
        if leaves.num_columns() != fields.len()
            || fields
                .iter()
                .enumerate()
                .any(|(i, f)| leaves.column(i).path().parts() != [f.name().clone()])
        {
            return vec![];
        }
        fields
            .iter()
            .enumerate()
            .map(|(i, f)| {
                if !matches!(
                    f.data_type(),
                    DataType::Int8
                        | DataType::Int16
                        | DataType::Int32
                        | DataType::Int64
                        | DataType::Date32
                ) {
                    return None;
                }
                let mut range: Option<[i64; 2]> = None;
                for rg in meta.row_groups() {
                    let stats = rg.column(i).statistics()?;
                    if stats.null_count_opt() != Some(0)
                        || !stats.min_is_exact()
                        || !stats.max_is_exact()
                    {
                        return None;
                    }
                    let (lo, hi) = match stats {
                        Statistics::Int32(v) => {
                            (i64::from(*v.min_opt()?), i64::from(*v.max_opt()?))
                        }
                        Statistics::Int64(v) => (*v.min_opt()?, *v.max_opt()?),
                        _ => return None,
                    };
                    range = Some(match range {
                        None => [lo, hi],
                        Some([a, b]) => [a.min(lo), b.max(hi)],
                    });
                }
                range
            })
            .collect()
    }
}

/// A table: schema and partitions.
#[derive(Debug, Clone)]
pub struct Table {
    /// Name.
    pub name: String,
    /// Arrow schema shared by every object.
    pub schema: SchemaRef,
    /// Partition name → objects in append order.
    pub partitions: BTreeMap<String, Vec<ParquetObject>>,
    /// Partition name → why its objects that could not be read when the node
    /// started are lost (each names its object): the partition then reads as
    /// `DATA_LOSS` rather than without them.
    pub damaged: BTreeMap<String, Vec<String>>,
}

impl Table {
    /// Estimated distinct non-NULL values per column over `objects` (the union of
    /// their sketches): `None` for a column unless every object has its sketch.
    pub fn distinct<'a>(
        &self,
        objects: impl Iterator<Item = &'a ParquetObject>,
    ) -> Vec<Option<u64>> {
        let union = ColumnSketches::union(objects.map(|o| o.sketches.as_deref()));
        match union {
            Some(u) => u.estimates(),
            None => vec![None; self.schema.fields().len()],
        }
    }

    /// The objects of `partitions` (of every partition when none is named):
    /// `NOT_FOUND` for a partition the table does not have, `DATA_LOSS` naming the
    /// object for one holding an object that could not be read when the node started
    /// (its other partitions read as before).
    pub fn objects_of(&self, partitions: &[&str]) -> Result<Vec<ParquetObject>> {
        let named: Vec<&str> = match partitions.is_empty() {
            true => self.partitions.keys().map(String::as_str).collect(),
            false => partitions.to_vec(),
        };
        let mut objects = Vec::new();
        for p in named {
            let of = self.partitions.get(p).ok_or_else(|| {
                Error::NotFound(format!(
                    "partition {} of table {}",
                    truncated(p),
                    truncated(&self.name)
                ))
            })?;
            if let Some(why) = self.damaged.get(p).and_then(|d| d.first()) {
                return Err(Error::Corrupt(format!(
                    "partition {} of table {} has lost an object: {why}; put the partition \
                     again (or read it from another copy)",
                    truncated(p),
                    truncated(&self.name)
                )));
            }
            objects.extend(of.iter().cloned());
        }
        Ok(objects)
    }

    /// Total rows.
    pub fn rows(&self) -> u64 {
        self.partitions.values().flatten().map(|o| o.rows()).sum()
    }
    /// Total stored bytes.
    pub fn bytes(&self) -> u64 {
        self.partitions
            .values()
            .flatten()
            .map(|o| o.object.len)
            .sum()
    }
}

/// The node's tables.
pub struct TableStore {
    store: ObjectStore,
    tables: RwLock<BTreeMap<String, Table>>,
    props: WriterProperties,
    /// Whether objects get distinct-count sketches.
    sketches: bool,
    next_seq: Mutex<u64>,
    /// Deletes of copies kept on other nodes too (see [`crate::deleted`]).
    deleted: RwLock<Remembered>,
}

fn check_same_schema(table: &str, want: &SchemaRef, got: &SchemaRef) -> Result<()> {
    let describe = |s: &SchemaRef| {
        s.fields()
            .iter()
            .map(|f| {
                format!(
                    "{}: {}{}",
                    f.name(),
                    f.data_type(),
                    if f.is_nullable() { "" } else { " not null" }
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let same = want.fields().len() == got.fields().len()
        && want.fields().iter().zip(got.fields()).all(|(a, b)| {
            a.name() == b.name()
                && a.data_type() == b.data_type()
                && a.is_nullable() == b.is_nullable()
        });
    if same {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "schema of the appended data does not match table {table}: expected ({}), got ({})",
            describe(want),
            describe(got)
        )))
    }
}

/// Types Parquet cannot hold are the caller's problem (INVALID_ARGUMENT), not the node's.
/// The schema an object was put with: the reader's carries the footer's key-value
/// pairs, the node's own among them (sketches, copies), which are not the table's.
fn as_put(metadata: &ArrowReaderMetadata) -> SchemaRef {
    let mut schema = metadata.schema().as_ref().clone();
    schema.metadata.retain(|k, _| !k.starts_with("csd."));
    Arc::new(schema)
}

fn unstorable(e: parquet::errors::ParquetError) -> Error {
    match e {
        parquet::errors::ParquetError::NYI(m) => {
            Error::InvalidArgument(format!("cannot store this data as Parquet: {m}"))
        }
        other => other.into(),
    }
}

pub(crate) fn parse_object_name(name: &str) -> Option<(&str, &str, u64)> {
    split_object_name(name, ".parquet")
}

/// `{table}/{partition}/{seq:08}{suffix}` → table, partition, seq.
fn split_object_name<'a>(name: &'a str, suffix: &str) -> Option<(&'a str, &'a str, u64)> {
    let mut parts = name.split('/');
    let (t, p, f) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let seq = f.strip_suffix(suffix)?.parse().ok()?;
    Some((t, p, seq))
}

/// Records that an object of `partition` of `table` is lost (`why` names it).
fn damage(tables: &mut BTreeMap<String, Table>, table: &str, partition: &str, why: String) {
    tracing::error!(table, partition, "a stored object is lost: {why}");
    // A table none of whose objects could be read has no schema left.
    let t = tables.entry(table.to_string()).or_insert_with(|| Table {
        name: table.to_string(),
        schema: Arc::new(arrow::datatypes::Schema::empty()),
        partitions: BTreeMap::new(),
        damaged: BTreeMap::new(),
    });
    t.partitions.entry(partition.to_string()).or_default();
    t.damaged
        .entry(partition.to_string())
        .or_default()
        .push(why);
}

impl TableStore {
    /// Loads the registry from the Parquet objects in `store`.
    pub async fn open(store: ObjectStore, options: &ParquetOptions) -> Result<Self> {
        let mut tables: BTreeMap<String, Table> = BTreeMap::new();
        let mut max_seq = 0;
        // Objects whose footer cannot be read: one lost object, not a node that
        // will not start.
        let mut damaged: Vec<(String, String, String)> = Vec::new();
        let mut remembered = Remembered::default();
        for object in store.list("") {
            if let Some((t, p, seq)) = split_object_name(&object.name, deleted::SUFFIX) {
                max_seq = max_seq.max(seq);
                match deleted::load(&store, &object.name, p).await {
                    Ok(d) => remembered.insert(t, d),
                    // What it would have kept deleted may come back: say so loudly.
                    Err(Error::Corrupt(why)) => {
                        tracing::error!(
                            table = t,
                            partition = p,
                            "a remembered delete is lost: {why}"
                        );
                    }
                    Err(e) => return Err(e),
                }
                continue;
            }
            let Some((t, p, seq)) = parse_object_name(&object.name) else {
                continue;
            };
            max_seq = max_seq.max(seq);
            let metadata = match ObjectReader::new(store.clone(), object.clone())
                .load_metadata()
                .await
            {
                Ok(m) => m,
                Err(Error::Corrupt(why)) => {
                    damaged.push((t.to_string(), p.to_string(), why));
                    continue;
                }
                Err(e) => return Err(e),
            };
            let schema = as_put(&metadata);
            let table = tables.entry(t.to_string()).or_insert_with(|| Table {
                name: t.to_string(),
                schema: schema.clone(),
                partitions: BTreeMap::new(),
                damaged: BTreeMap::new(),
            });
            if let Err(e) = check_same_schema(t, &table.schema, &schema) {
                tracing::warn!(object = %object.name, "skipping object: {e}");
                continue;
            }
            table
                .partitions
                .entry(p.to_string())
                .or_default()
                .push(ParquetObject::new(object, metadata));
        }
        for (t, p, why) in damaged {
            damage(&mut tables, &t, &p, why);
        }
        let store = TableStore {
            store,
            tables: RwLock::new(tables),
            props: options.writer_properties()?,
            sketches: options.distinct_sketches,
            next_seq: Mutex::new(max_seq + 1),
            deleted: RwLock::new(remembered),
        };
        store.finish_remembered_deletes().await?;
        Ok(store)
    }

    /// Deletes the copies here that a remembered delete names (one cut short
    /// between remembering it and deleting the copy).
    async fn finish_remembered_deletes(&self) -> Result<()> {
        let mut doomed = Vec::new();
        for t in self.tables() {
            let remembered = self.deleted_of(&t.name);
            for (p, objects) in &t.partitions {
                let copy = DeletedCopy {
                    partition: p.clone(),
                    digests: objects.iter().map(|o| o.object.digest()).collect(),
                };
                if remembered.contains(&copy) {
                    doomed.push((t.name.clone(), p.clone()));
                }
            }
        }
        for (t, p) in doomed {
            tracing::info!(table = %t, partition = %p, "finishing a delete cut short");
            self.delete(&t, Some(&p), &[]).await?;
        }
        Ok(())
    }

    /// The deletes of copies of `table`'s partitions this node remembers.
    pub fn deleted_of(&self, table: &str) -> Vec<DeletedCopy> {
        self.deleted
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .of(table)
    }

    /// The tables of which this node remembers deletes but holds no partition.
    pub fn deleted_tables(&self) -> Vec<String> {
        let tables = self.tables.read().unwrap_or_else(|p| p.into_inner());
        self.deleted
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .tables()
            .filter(|t| !tables.contains_key(*t))
            .cloned()
            .collect()
    }

    /// Remembers `copies`, deleted copies of partitions of `table` (before they are
    /// deleted here or anywhere, so a delete cut short is finished, never undone).
    async fn remember(&self, table: &str, copies: &[DeletedCopy]) -> Result<()> {
        for d in copies {
            validate_partition_name(&d.partition)?;
            let known = self
                .deleted
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .contains(table, d);
            if known {
                continue;
            }
            let name = self.new_name(table, &d.partition, deleted::SUFFIX);
            deleted::store(&self.store, &name, d).await?;
            self.deleted
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .insert(table, d.clone());
        }
        Ok(())
    }

    fn mark_damaged(&self, table: &str, partition: &str, why: &str) {
        let mut tables = self.tables.write().unwrap_or_else(|p| p.into_inner());
        damage(&mut tables, table, partition, why.to_string());
    }

    /// The object store underneath.
    pub fn object_store(&self) -> &ObjectStore {
        &self.store
    }

    /// All tables.
    pub fn tables(&self) -> Vec<Table> {
        self.tables
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// One table.
    pub fn table(&self, name: &str) -> Result<Table> {
        self.tables
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("table {}", truncated(name))))
    }

    /// Appends `batches` (all of `schema`) to a partition as one new Parquet object.
    /// The table is created by its first append; later appends must match its schema.
    pub async fn append<S>(
        &self,
        table: &str,
        partition: &str,
        schema: SchemaRef,
        batches: S,
    ) -> Result<PutSummary>
    where
        S: Stream<Item = Result<RecordBatch>> + Unpin + Send,
    {
        let how = Writing {
            props: self.props.clone(),
            within: None,
            copies: Copies::ONE,
        };
        self.append_with(table, partition, schema, batches, how)
            .await
    }

    /// Like [`Self::append`], within `memory` bytes: a row group ends early once its
    /// encoded pages reach a third of it (the writer copies a finished row group once
    /// more while it flushes, and decoded batches wait beside it). `copies`: the
    /// copies of the partition the writer is storing on as many nodes (kept in the
    /// footer, see [`COPIES_KEY`]).
    pub async fn append_within<S>(
        &self,
        table: &str,
        partition: &str,
        schema: SchemaRef,
        batches: S,
        memory: u64,
        copies: Copies,
    ) -> Result<PutSummary>
    where
        S: Stream<Item = Result<RecordBatch>> + Unpin + Send,
    {
        let how = Writing {
            props: self.props.clone(),
            within: Some(memory),
            copies,
        };
        self.append_with(table, partition, schema, batches, how)
            .await
    }

    /// Like [`Self::append`], encoded for the CPU rather than for space (LZ4_RAW
    /// pages): for short-lived data written and read soon, such as kept results;
    /// within `memory` bytes as [`Self::append_within`].
    pub async fn append_transient<S>(
        &self,
        table: &str,
        partition: &str,
        schema: SchemaRef,
        batches: S,
        memory: u64,
    ) -> Result<PutSummary>
    where
        S: Stream<Item = Result<RecordBatch>> + Unpin + Send,
    {
        let props = self
            .props
            .clone()
            .into_builder()
            .set_compression(Compression::LZ4_RAW)
            .build();
        let how = Writing {
            props,
            within: Some(memory),
            copies: Copies::ONE,
        };
        self.append_with(table, partition, schema, batches, how)
            .await
    }

    async fn append_with<S>(
        &self,
        table: &str,
        partition: &str,
        schema: SchemaRef,
        mut batches: S,
        how: Writing,
    ) -> Result<PutSummary>
    where
        S: Stream<Item = Result<RecordBatch>> + Unpin + Send,
    {
        // Within a memory bound, a row group ends once its pages reach a third of it.
        let Writing {
            props,
            within,
            copies,
        } = how;
        let flush_at = within.map(|m| (m / 3).max(1 << 20) as usize);
        validate_table_name(table)?;
        validate_partition_name(partition)?;
        if let Ok(t) = self.table(table) {
            check_same_schema(table, &t.schema, &schema)?;
        }
        let name = self.new_object_name(table, partition);
        let writer = self.store.create(&name)?;
        let mut pw =
            AsyncArrowWriter::try_new(writer, schema.clone(), Some(props)).map_err(unstorable)?;
        let mut sketches = self.sketches.then(|| ColumnSketches::for_schema(&schema));
        while let Some(batch) = batches.next().await {
            let batch = batch?;
            if batch.schema().fields() != schema.fields() {
                check_same_schema(table, &schema, &batch.schema())?;
            }
            if let Some(s) = sketches.as_mut() {
                s.update(&batch);
            }
            pw.write(&batch).await.map_err(unstorable)?;
            if flush_at.is_some_and(|f| pw.in_progress_size() >= f) {
                pw.flush().await.map_err(unstorable)?;
            }
        }
        if let Some(s) = sketches {
            pw.append_key_value_metadata(s.to_key_value());
        }
        if copies.copies > 1 {
            let n = copies.copies.to_string();
            pw.append_key_value_metadata(KeyValue::new(COPIES_KEY.into(), n));
        }
        if let Some(put) = copies.put {
            pw.append_key_value_metadata(KeyValue::new(PUT_KEY.into(), put));
        }
        pw.finish().await.map_err(unstorable)?;
        let object = pw.into_inner().finish().await?;
        // Committed: a footer that cannot be read back is an object lost at once,
        // and its partition must read as lost, not as the partition without it.
        let metadata = match ObjectReader::new(self.store.clone(), object.clone())
            .load_metadata()
            .await
        {
            Ok(m) => m,
            Err(Error::Corrupt(why)) => {
                self.mark_damaged(table, partition, &why);
                return Err(Error::Corrupt(why));
            }
            Err(e) => return Err(e),
        };
        self.register(table, partition, &schema, name, object, metadata)
            .await
    }

    /// The name of a new Parquet object of `table`/`partition`.
    fn new_object_name(&self, table: &str, partition: &str) -> String {
        self.new_name(table, partition, ".parquet")
    }

    /// The name of a new object of `table`/`partition` ending in `suffix`.
    fn new_name(&self, table: &str, partition: &str, suffix: &str) -> String {
        let seq = {
            let mut n = self.next_seq.lock().unwrap_or_else(|p| p.into_inner());
            *n += 1;
            *n - 1
        };
        format!("{table}/{partition}/{seq:08}{suffix}")
    }

    /// Stores `pieces`, the bytes of another node's Parquet object of
    /// `table`/`partition`, byte for byte as a new object of that partition (so the
    /// copies stay replicas: same length, same digest; `csd repair`). The bytes must
    /// read as Parquet of the table's schema, else nothing is kept.
    pub async fn adopt<S>(&self, table: &str, partition: &str, mut pieces: S) -> Result<PutSummary>
    where
        S: Stream<Item = Result<Bytes>> + Unpin + Send,
    {
        validate_table_name(table)?;
        validate_partition_name(partition)?;
        let name = self.new_object_name(table, partition);
        let mut writer = self.store.create(&name)?;
        while let Some(piece) = pieces.next().await {
            writer.write(&piece?).await?;
        }
        let object = writer.finish().await?;
        let metadata = match ObjectReader::new(self.store.clone(), object.clone())
            .load_metadata()
            .await
        {
            Ok(m) => m,
            Err(e) => {
                self.store.delete(&name).await?;
                return Err(Error::InvalidArgument(format!(
                    "the copy of {table}/{partition} sent here does not read as Parquet \
                     ({e}); nothing was stored"
                )));
            }
        };
        let schema = as_put(&metadata);
        self.register(table, partition, &schema, name, object, metadata)
            .await
    }

    /// Makes `object` (just committed as `name`, of `schema`) one of the objects of
    /// `table`/`partition`; deletes it again when the table's schema differs.
    async fn register(
        &self,
        table: &str,
        partition: &str,
        schema: &SchemaRef,
        name: String,
        object: Arc<ObjectInfo>,
        metadata: ArrowReaderMetadata,
    ) -> Result<PutSummary> {
        let summary = PutSummary {
            table: table.into(),
            partition: partition.into(),
            object: name,
            rows: metadata.metadata().file_metadata().num_rows().max(0) as u64,
            bytes: object.len,
            row_groups: metadata.metadata().num_row_groups(),
        };
        let conflict = {
            let mut tables = self.tables.write().unwrap_or_else(|p| p.into_inner());
            let entry = tables.entry(table.to_string()).or_insert_with(|| Table {
                name: table.to_string(),
                schema: schema.clone(),
                partitions: BTreeMap::new(),
                damaged: BTreeMap::new(),
            });
            // Only lost objects left: the table takes the schema of what comes now.
            if entry.schema.fields().is_empty() && entry.partitions.values().all(Vec::is_empty) {
                entry.schema = schema.clone();
            }
            // A concurrent first append may have created the table with another schema.
            match check_same_schema(table, &entry.schema, schema) {
                Ok(()) => {
                    entry
                        .partitions
                        .entry(partition.to_string())
                        .or_default()
                        .push(ParquetObject::new(object, metadata));
                    None
                }
                Err(e) => Some(e),
            }
        };
        if let Some(e) = conflict {
            self.store.delete(&summary.object).await?;
            return Err(e);
        }
        Ok(summary)
    }

    /// Deletes a table, or one partition of it, atomically. Returns objects deleted.
    /// `remember`: deleted copies to remember first (see [`crate::deleted`]); with
    /// them, nothing here to delete is not an error.
    pub async fn delete(
        &self,
        table: &str,
        partition: Option<&str>,
        remember: &[DeletedCopy],
    ) -> Result<usize> {
        validate_table_name(table)?;
        self.remember(table, remember).await?;
        let t = match self.table(table) {
            Ok(t) => t,
            Err(Error::NotFound(_)) if !remember.is_empty() => return Ok(0),
            Err(e) => return Err(e),
        };
        let prefix = match partition {
            Some(p) if !remember.is_empty() && !t.partitions.contains_key(p) => return Ok(0),
            Some(p) if !t.partitions.contains_key(p) => {
                return Err(Error::NotFound(format!(
                    "partition {} of table {}",
                    truncated(p),
                    truncated(table)
                )));
            }
            Some(p) => format!("{table}/{p}/"),
            None => format!("{table}/"),
        };
        // The partition's Parquet objects; its remembered deletes stay.
        let gone = self
            .store
            .delete_where(&prefix, |name| !name.ends_with(deleted::SUFFIX))
            .await?
            .len();
        {
            let mut tables = self.tables.write().unwrap_or_else(|p| p.into_inner());
            match partition {
                Some(p) => {
                    if let Some(t) = tables.get_mut(table) {
                        t.partitions.remove(p);
                        t.damaged.remove(p);
                        if t.partitions.is_empty() {
                            tables.remove(table);
                        }
                    }
                }
                None => {
                    tables.remove(table);
                }
            }
        }
        // The catalog no longer holds the objects: unless a reader still does, the
        // device hears now that their blocks are free.
        drop(t);
        self.store.deallocate_released().await;
        Ok(gone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembered_deletes_are_named_apart_from_parquet_objects() {
        let deletes = |name| split_object_name(name, deleted::SUFFIX);
        assert_eq!(deletes("t/p/00000012.deleted"), Some(("t", "p", 12)));
        assert_eq!(deletes("t/p/00000012.parquet"), None);
        assert_eq!(deletes("t/p/x/00000012.deleted"), None);
        assert_eq!(deletes("t/p/twelve.deleted"), None);
        assert_eq!(parse_object_name("t/p/00000012.deleted"), None);
    }
}
