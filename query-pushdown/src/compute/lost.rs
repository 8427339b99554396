//! A table some of whose objects a node has lost: registered in place of the real
//! one so that every query reading it fails with DATA_LOSS naming what is gone,
//! never answers from the objects that are left.

use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use csd_protocol::Error;
use datafusion::catalog::Session;
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
        let more = match self.lost.len() {
            1 => String::new(),
            n => format!(" (and {} more)", n - 1),
        };
        Err(DataFusionError::External(Box::new(Error::Corrupt(
            format!(
                "table {} cannot be read whole: {}{more}; put the partition again",
                self.name,
                self.lost.first().map_or("", String::as_str)
            ),
        ))))
    }
}
