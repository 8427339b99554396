//! A table some of whose objects a node has lost: registered in place of the real
//! one so that every query reading it fails with DATA_LOSS naming what is gone,
//! never answers from the objects that are left. When nothing left tells the
//! table's schema (its only objects are the lost ones), even naming its columns
//! fails that way: [`UnknownSchemas`] answers the table's lookup with the error.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use csd_protocol::Error;
use datafusion::catalog::{SchemaProvider, Session};
use datafusion::common::{DataFusionError, Result};
use datafusion::datasource::{TableProvider, TableType};
use datafusion::logical_expr::Expr;
use datafusion::physical_plan::ExecutionPlan;

/// See the module docs.
#[derive(Debug)]
pub(crate) struct LostTable {
    name: String,
    schema: SchemaRef,
    lost: Vec<String>,
}

impl LostTable {
    /// Table `name` of `schema`, with `lost` saying what is gone.
    pub(crate) fn new(name: &str, schema: SchemaRef, lost: Vec<String>) -> Self {
        LostTable {
            name: name.to_string(),
            schema,
            lost,
        }
    }
}

#[async_trait]
impl TableProvider for LostTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        _projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        _limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Err(lost_error(&self.name, &self.lost))
    }
}

/// The DATA_LOSS error of table `name`, `lost` saying what is gone.
fn lost_error(name: &str, lost: &[String]) -> DataFusionError {
    let more = match lost.len() {
        1 => String::new(),
        n => format!(" (and {} more)", n - 1),
    };
    DataFusionError::External(Box::new(Error::Corrupt(format!(
        "table {name} cannot be read whole: {}{more}; put the partition again",
        lost.first().map_or("", String::as_str)
    ))))
}

/// A session's schema of tables around DataFusion's own, in which the tables whose
/// schema is unknown (see the module docs) fail their lookup with DATA_LOSS, so
/// that a query naming them fails as reading them would, not on a column the
/// planner cannot find.
#[derive(Debug)]
pub(crate) struct UnknownSchemas {
    inner: Arc<dyn SchemaProvider>,
    /// Table name, and what was lost of it.
    unknown: BTreeMap<String, Vec<String>>,
}

impl UnknownSchemas {
    pub(crate) fn new(
        inner: Arc<dyn SchemaProvider>,
        unknown: BTreeMap<String, Vec<String>>,
    ) -> Self {
        UnknownSchemas { inner, unknown }
    }
}

#[async_trait]
impl SchemaProvider for UnknownSchemas {
    fn table_names(&self) -> Vec<String> {
        let mut names = self.inner.table_names();
        names.extend(self.unknown.keys().cloned());
        names
    }

    async fn table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>> {
        match self.unknown.get(name) {
            Some(lost) => Err(lost_error(name, lost)),
            None => self.inner.table(name).await,
        }
    }

    fn register_table(
        &self,
        name: String,
        table: Arc<dyn TableProvider>,
    ) -> Result<Option<Arc<dyn TableProvider>>> {
        self.inner.register_table(name, table)
    }

    fn deregister_table(&self, name: &str) -> Result<Option<Arc<dyn TableProvider>>> {
        self.inner.deregister_table(name)
    }

    fn table_exist(&self, name: &str) -> bool {
        self.unknown.contains_key(name) || self.inner.table_exist(name)
    }
}
