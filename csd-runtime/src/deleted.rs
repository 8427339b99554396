//! Deletes a node remembers: copies of partitions deleted while a node holding one
//! may have been out of reach (`csd rm` of a partition kept in several copies), so
//! that such a copy stays deleted when its node comes back.
//!
//! Each is a small object `{table}/{partition}/{seq:08}.deleted` holding the deleted
//! copy ([`DeletedCopy`]: its objects' digests) as JSON, beside the partition's
//! Parquet objects (deleting a partition deletes only those). A node lists them
//! with the table (`TableDescription::deleted`); readers and `csd repair` treat a
//! copy whose digests match one as deleted. At start-up the node applies its own:
//! a delete cut short after it was remembered finishes then.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::protocol::DeletedCopy;
use crate::store::ObjectStore;

/// The suffix of a remembered delete's object name.
pub(crate) const SUFFIX: &str = ".deleted";

/// The deletes a node remembers, by table.
#[derive(Debug, Default)]
pub(crate) struct Remembered {
    by_table: BTreeMap<String, Vec<DeletedCopy>>,
}

/// The remembered delete stored as `name` (of `partition`).
pub(crate) async fn load(store: &ObjectStore, name: &str, partition: &str) -> Result<DeletedCopy> {
    let bytes = store.get_all(name).await?;
    let d: DeletedCopy = serde_json::from_slice(&bytes)
        .map_err(|e| Error::Corrupt(format!("remembered delete {name} does not read: {e}")))?;
    if d.partition != partition {
        return Err(Error::Corrupt(format!(
            "remembered delete {name} names partition {:?}",
            d.partition
        )));
    }
    Ok(d)
}

/// Stores `d` as `name`.
pub(crate) async fn store(store: &ObjectStore, name: &str, d: &DeletedCopy) -> Result<()> {
    let json = serde_json::to_vec(d)
        .map_err(|e| Error::external(crate::StatusCode::Internal, "a remembered delete", e))?;
    store.put(name, &json).await?;
    Ok(())
}

impl Remembered {
    /// Remembers `d`, a deleted copy of a partition of `table`.
    pub(crate) fn insert(&mut self, table: &str, d: DeletedCopy) {
        let of = self.by_table.entry(table.to_string()).or_default();
        if !of.contains(&d) {
            of.push(d);
        }
    }

    /// Whether `d` of `table` is remembered.
    pub(crate) fn contains(&self, table: &str, d: &DeletedCopy) -> bool {
        self.by_table.get(table).is_some_and(|of| of.contains(d))
    }

    /// The deletes remembered of `table`.
    pub(crate) fn of(&self, table: &str) -> Vec<DeletedCopy> {
        self.by_table.get(table).cloned().unwrap_or_default()
    }

    /// Every table with a remembered delete.
    pub(crate) fn tables(&self) -> impl Iterator<Item = &String> {
        self.by_table.keys()
    }
}
