//! The node side of SQL pushdown: the `"sql"` operator (`operator.rs`: its settings,
//! state and the objects a fragment reads). It decodes and checks a
//! [`SqlFragment`](crate::wire::fragment::SqlFragment) once ([`sql::SqlRequest`]),
//! plans it ([`crate::eval`]) over the node's own Parquet objects (`table.rs`:
//! footers and page indexes from the node's in-memory catalog, reads straight to the
//! object store, counted), and streams the result on the node's CPU pool under its
//! memory pool (`memory.rs`). The `"wasm"` operator (`wasm.rs`) runs a shipped module
//! over such a scan's rows.

mod guard;
mod memory;
mod operator;
mod sql;
mod table;
mod wasm;
pub use operator::{SqlNodeOptions, SqlOperator};
pub use wasm::WasmOperator;

use std::sync::Arc;

use bytes::Bytes;
use csd_protocol::Result;
use csd_runtime::operator::{Operator, OperatorRequest};

use crate::wire::fragment::OPERATOR_NAME;

impl Operator for SqlOperator {
    fn name(&self) -> &'static str {
        OPERATOR_NAME
    }

    fn parse(self: Arc<Self>, args: Bytes) -> Result<Box<dyn OperatorRequest>> {
        Ok(Box::new(sql::SqlRequest::parse(self, &args)?))
    }

    fn memory_used(&self) -> u64 {
        self.memory_reserved()
    }
}
