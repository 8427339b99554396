//! The pushed fragment on the wire, and the node's checks before it plans anything.
//!
//! The `args` of an `Operator { name: "sql" }` ticket are one protobuf message:
//!
//! ```text
//! message SqlFragment {
//!   string table = 1;               // the table the plan reads (its only NamedTable)
//!   optional string partition = 2;  // one partition of it; absent = all on this node
//!   bytes plan = 3;                 // a Substrait `Plan` (substrait 0.63 protobuf)
//!   Mode mode = 4;                  // COMPLETE = 0, PARTIAL_AGGREGATE = 1
//!   repeated KeyFilter key_filters = 5;  // join keys the output rows may have
//!   optional float direct_above = 6;     // hand back if the filters keep more
//!   repeated string objects = 7;         // run only on exactly these objects
//!   repeated WasmFunction functions = 8; // Wasm SQL functions the plan calls
//!   repeated string partitions = 9;      // several partitions read as one
//!   optional float shrink_above = 10;    // hand back an aggregate that does not shrink
//!   bytes output_schema = 11;            // the answer's schema as the asker planned it
//!   bool late_filters = 12;              // filter while decoding
//!   optional uint64 state_bytes = 13;    // state the asker expects the plan to hold
//! }
//! ```
//!
//! `functions` (see [`crate::wire::shipped::WasmFunctionMsg`]) declares the shipped
//! scalar functions the plan calls by name: each names its module by digest (the
//! bytes ride along when small; else a node that lacks the module answers
//! `NOT_FOUND` naming it and the compute tier sends it with `put_module`). A
//! fragment with functions needs the tenant's `code` permission.
//!
//! `COMPLETE` runs the plan and returns its rows. `PARTIAL_AGGREGATE` requires the
//! plan's root to be an aggregate (under renaming projections at most) and returns
//! DataFusion's partial-aggregation state instead of final values (`avg` → sum and
//! count, …), one row per group and input partition, for the caller to merge with a
//! final aggregate.
//!
//! `objects`, when given, names the partition's Parquet objects the compute tier
//! planned with; a node whose partition holds any other set refuses the fragment
//! with `FAILED_PRECONDITION` (the compute tier may have relied on those objects'
//! statistics, e.g. that partitions hold disjoint group keys).
//!
//! `key_filters` (see [`crate::wire::keyfilter`]) drop output rows whose key (some output
//! columns) is not in a bloom filter of a join's build-side keys; rows with a NULL
//! in their key are kept. With `direct_above` set, a node whose filters keep more
//! than that fraction of the fragment's first 8,192 rows hands it back (gRPC
//! `UNAVAILABLE` with `csd-pushback`, as admission does).
//!
//! `shrink_above`, on a `PARTIAL_AGGREGATE` the compute tier could not judge before
//! running (its objects carry no distinct-count sketches), asks the node to judge it
//! while running: when DataFusion's partial-aggregation probe finds more groups than
//! that fraction of a stream's first rows, the node hands the fragment back before
//! it has sent anything (`UNAVAILABLE` with `csd-pushback`, as the first message of
//! the answer).
//!
//! `output_schema` (an Arrow IPC schema message, as Flight sends schemas) is the
//! answer's schema as the compute tier planned it. With it, a node may read string
//! and binary columns as views (faster to group, compare and hash) and casts its
//! answer's columns back to the planned types: plain and view strings are the same
//! values. Without it, the node answers in the table's own types.
//!
//! ## Supported Substrait subset
//! * Relations: `ReadRel` on a `NamedTable` (with `filter`, `best_effort_filter`,
//!   `projection`), `FilterRel`, `ProjectRel`, `AggregateRel` (plain groupings),
//!   `SortRel`, `FetchRel`. Nothing else: no joins, no local files, no virtual tables,
//!   no extensions, no writes.
//! * Expressions: literals, field references, scalar functions, `IfThen`, `Switch`,
//!   `SingularOrList` (IN lists), `Cast`; the ranking window functions
//!   [`WINDOW_FUNCTIONS`] and the aggregates as window functions, as a `ProjectRel`'s
//!   own expressions (a per-group top-k, a window in a part a node runs whole). No
//!   subqueries, other window functions, lambdas or parameters.
//! * Functions: DataFusion's comparison, boolean, arithmetic, `like`/`ilike`,
//!   `is_null`-style builtins, every non-volatile scalar function the node's DataFusion
//!   registers (string, math, date/time, regex, …), and the aggregates of
//!   [`AGGREGATES`] (`sum`, `count`, `min`, `max`, `avg`, the variances and standard
//!   deviations, `bool_and`/`bool_or`, `approx_distinct`). Volatile functions
//!   (`random`, `uuid`, …) are refused.
//! * Limits: [`MAX_PLAN_BYTES`] bytes, [`MAX_EXPR_DEPTH`] nested expressions,
//!   [`MAX_REL_DEPTH`] nested relations, [`MAX_IN_LIST`] IN-list items,
//!   [`MAX_FUNCTIONS`] declared functions, [`MAX_FILTERS`] key filters of at most
//!   [`MAX_FILTER_BYTES`] bytes.
//!
//! Anything outside this gets `INVALID_ARGUMENT` with the reason. Protobuf decoding
//! itself stops at 100 levels of message nesting (about 30 levels of expressions:
//! each is three messages deep), so hostile nesting never reaches the (recursive)
//! checks below, which bound what decodes.

use std::collections::HashSet;

/// The node's error type (re-exported for the fuzz target).
pub use csd_protocol::Error as NodeError;
use csd_protocol::{Error, ModuleDigest};
use datafusion_substrait::substrait::proto::{
    self, Expression, FunctionArgument, Plan, Rel, expression::RexType,
    extensions::simple_extension_declaration::MappingType, function_argument::ArgType, plan_rel,
    read_rel, rel::RelType,
};
use prost::Message;

use crate::wire::keyfilter::{KeyFilterMsg, MAX_FILTER_BYTES};
use crate::wire::shipped::{MAX_INLINE_MODULE, WasmFunctionMsg, check_functions};

/// Name of the operator in tickets.
pub const OPERATOR_NAME: &str = "sql";
/// Largest Substrait plan accepted.
pub const MAX_PLAN_BYTES: usize = 1 << 20;
/// Deepest expression nesting accepted.
pub const MAX_EXPR_DEPTH: usize = 24;
/// Deepest relation nesting accepted.
pub const MAX_REL_DEPTH: usize = 16;
/// Longest IN list accepted.
pub const MAX_IN_LIST: usize = 10_000;
/// Most function declarations accepted.
pub const MAX_FUNCTIONS: usize = 512;
/// Most join-key filters on one fragment.
pub const MAX_FILTERS: usize = 4;

/// What the node returns for a fragment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum Mode {
    /// The plan's rows.
    Complete = 0,
    /// The partial-aggregation state of the root aggregate.
    PartialAggregate = 1,
}

/// The `args` of a `"sql"` operator ticket.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SqlFragment {
    /// The table the plan reads.
    #[prost(string, tag = "1")]
    pub table: String,
    /// One partition of it (absent: all of the node's).
    #[prost(string, optional, tag = "2")]
    pub partition: Option<String>,
    /// Substrait `Plan`, protobuf-encoded.
    #[prost(bytes = "vec", tag = "3")]
    pub plan: Vec<u8>,
    /// What to return.
    #[prost(enumeration = "Mode", tag = "4")]
    pub mode: i32,
    /// Join-key filters on the output (see [`crate::wire::keyfilter`]).
    #[prost(message, repeated, tag = "5")]
    pub key_filters: Vec<KeyFilterMsg>,
    /// Hand the fragment back when the key filters keep more than this fraction of
    /// its first rows (a scan the compute tier would otherwise read directly).
    #[prost(float, optional, tag = "6")]
    pub direct_above: Option<f32>,
    /// The partition's object names the compute tier planned with. When given, the
    /// node runs the fragment only if the partition holds exactly these objects
    /// (else `FAILED_PRECONDITION`): a whole aggregate per partition is right only
    /// while partitions hold disjoint group keys, which the compute tier proved from
    /// these objects' statistics.
    #[prost(string, repeated, tag = "7")]
    pub objects: Vec<String>,
    /// Wasm SQL functions the plan calls.
    #[prost(message, repeated, tag = "8")]
    pub functions: Vec<WasmFunctionMsg>,
    /// Several of the node's partitions, read as one (with `partition` absent): a
    /// partial aggregate then answers one merged state for all of them instead of
    /// one per partition.
    #[prost(string, repeated, tag = "9")]
    pub partitions: Vec<String>,
    /// A partial aggregate the compute tier could not judge: handed back when a
    /// stream's first rows hold more groups than this fraction of them.
    #[prost(float, optional, tag = "10")]
    pub shrink_above: Option<f32>,
    /// The answer's schema as planned (Arrow IPC schema message); empty: unknown.
    #[prost(bytes = "vec", tag = "11")]
    pub output_schema: Vec<u8>,
    /// Filter while decoding (Parquet late materialization): the filter's columns
    /// first, the others only for the rows it keeps. Set when the compute tier
    /// expects the filter to keep very few rows of a read much wider than the
    /// filter (see `CsdScanExec::late_filters`); else every column is decoded and
    /// then filtered, which is faster when the kept rows are spread over most pages.
    #[prost(bool, tag = "12")]
    pub late_filters: bool,
    /// Bytes of state the compute tier expects the plan to hold at the node (a part
    /// run whole: its hash tables and sorts), from its sketches. The node's admission
    /// reserves it beside the reads, so such parts wait for memory, or are handed
    /// back, rather than spill.
    #[prost(uint64, optional, tag = "13")]
    pub state_bytes: Option<u64>,
}

/// At most 300 characters of a decoder message (they list the whole field path).
fn short(s: &str) -> String {
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// Most partitions one fragment reads as one.
pub const MAX_PARTITIONS: usize = 4096;

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

impl SqlFragment {
    /// Encodes for a ticket.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.encode_to_vec()
    }

    /// `schema` as [`SqlFragment::output_schema`] carries it.
    pub fn encode_schema(schema: &arrow::datatypes::Schema) -> Vec<u8> {
        use arrow::ipc::writer::IpcWriteOptions;
        use arrow_flight::{IpcMessage, SchemaAsIpc};
        IpcMessage::try_from(SchemaAsIpc::new(schema, &IpcWriteOptions::default()))
            .map(|m| m.0.to_vec())
            .unwrap_or_default()
    }

    /// The planned answer schema, when the fragment carries one.
    pub fn planned_schema(&self) -> Result<Option<arrow::datatypes::SchemaRef>, Error> {
        if self.output_schema.is_empty() {
            return Ok(None);
        }
        arrow::ipc::convert::try_schema_from_ipc_buffer(&self.output_schema)
            .map(|s| Some(std::sync::Arc::new(s)))
            .map_err(|e| {
                invalid(format!(
                    "malformed output schema: {}",
                    short(&e.to_string())
                ))
            })
    }

    /// Decodes untrusted bytes and the plan inside (sizes checked first), once:
    /// what it carries, checked, for whoever runs it.
    pub fn decode_checked(bytes: &[u8]) -> Result<CheckedFragment, Error> {
        if bytes.len()
            > MAX_PLAN_BYTES + MAX_FILTERS * MAX_FILTER_BYTES + MAX_INLINE_MODULE + (64 << 10)
        {
            return Err(invalid(format!(
                "SQL fragment of {} bytes exceeds the {MAX_PLAN_BYTES}-byte plan, {MAX_FILTERS} x {MAX_FILTER_BYTES}-byte key filter and {MAX_INLINE_MODULE}-byte inline module limits",
                bytes.len()
            )));
        }
        let f = SqlFragment::decode(bytes)
            .map_err(|e| invalid(format!("malformed SQL fragment: {}", short(&e.to_string()))))?;
        if f.table.is_empty() {
            return Err(invalid("SQL fragment names no table"));
        }
        if f.plan.is_empty() {
            return Err(invalid("SQL fragment carries no Substrait plan"));
        }
        if f.key_filters.len() > MAX_FILTERS {
            return Err(invalid(format!(
                "SQL fragment carries {} key filters, at most {MAX_FILTERS} allowed",
                f.key_filters.len()
            )));
        }
        for k in &f.key_filters {
            k.attached()?;
        }
        for (name, fraction) in [
            ("direct_above", f.direct_above),
            ("shrink_above", f.shrink_above),
        ] {
            if let Some(d) = fraction
                && !(0.0..=1.0).contains(&d)
            {
                return Err(invalid(format!(
                    "{name} must be a fraction between 0 and 1, not {d}"
                )));
            }
        }
        if !f.partitions.is_empty() {
            if f.partition.is_some() {
                return Err(invalid(
                    "SQL fragment names a partition and a list of partitions: give one or the other",
                ));
            }
            if f.partitions.len() > MAX_PARTITIONS {
                return Err(invalid(format!(
                    "SQL fragment names {} partitions, at most {MAX_PARTITIONS} allowed",
                    f.partitions.len()
                )));
            }
            let distinct: std::collections::HashSet<&str> =
                f.partitions.iter().map(String::as_str).collect();
            if distinct.len() != f.partitions.len() {
                return Err(invalid("SQL fragment names a partition twice"));
            }
        }
        let digests = check_functions(&f.functions)?;
        let mode = Mode::try_from(f.mode)
            .map_err(|_| invalid(format!("unknown fragment mode {}", f.mode)))?;
        if f.plan.len() > MAX_PLAN_BYTES {
            return Err(invalid(format!(
                "Substrait plan of {} bytes exceeds the {MAX_PLAN_BYTES}-byte limit",
                f.plan.len()
            )));
        }
        let plan = Plan::decode(f.plan.as_slice()).map_err(|e| {
            let e = e.to_string();
            if e.contains("recursion limit") {
                invalid(
                    "malformed Substrait plan: it nests deeper than the protobuf decoder's recursion limit (100 messages)",
                )
            } else {
                invalid(format!("malformed Substrait plan: {}", short(&e)))
            }
        })?;
        Ok(CheckedFragment {
            frag: f,
            mode,
            plan,
            digests,
        })
    }
}

/// A fragment decoded and checked once ([`SqlFragment::decode_checked`]).
#[derive(Debug, Clone)]
pub struct CheckedFragment {
    /// The fragment.
    pub frag: SqlFragment,
    /// What it returns.
    pub mode: Mode,
    /// Its Substrait plan, decoded.
    pub plan: Plan,
    /// The digests of its Wasm SQL functions' modules, in `frag.functions`' order.
    pub digests: Vec<ModuleDigest>,
}

/// Checks `plan` against the supported subset. `functions_ok` says whether a scalar
/// function name (without its `:signature` suffix) may run here.
pub fn validate(
    plan: &Plan,
    table: &str,
    functions_ok: &dyn Fn(&str) -> bool,
) -> Result<(), Error> {
    if plan.extensions.len() > MAX_FUNCTIONS {
        return Err(invalid(format!(
            "plan declares {} functions, more than the {MAX_FUNCTIONS} allowed",
            plan.extensions.len()
        )));
    }
    let mut v = Validator {
        table,
        functions: Default::default(),
        aggregates: Default::default(),
        windows: Default::default(),
    };
    for ext in &plan.extensions {
        match &ext.mapping_type {
            Some(MappingType::ExtensionFunction(f)) => {
                let base = f
                    .name
                    .split(':')
                    .next()
                    .unwrap_or_default()
                    .to_ascii_lowercase();
                if AGGREGATES.contains(&base.as_str()) || WHOLE_AGGREGATES.contains(&base.as_str())
                {
                    v.aggregates.insert(f.function_anchor);
                } else if WINDOW_FUNCTIONS.contains(&base.as_str()) {
                    v.windows.insert(f.function_anchor);
                } else if functions_ok(&base) {
                    v.functions.insert(f.function_anchor);
                } else {
                    return Err(Error::Unimplemented(format!(
                        "function {:?} cannot run at this storage node (unknown here, volatile, or refused by its settings); the compute tier evaluates the fragment itself",
                        f.name
                    )));
                }
            }
            Some(_) => {
                return Err(invalid(
                    "plan declares extension types, which the storage node does not support",
                ));
            }
            None => return Err(invalid("plan has an empty extension declaration")),
        }
    }
    if plan.advanced_extensions.is_some() {
        return Err(invalid("plan-level advanced extensions are not supported"));
    }
    let [rel] = plan.relations.as_slice() else {
        return Err(invalid(format!(
            "plan must have exactly one relation tree, it has {}",
            plan.relations.len()
        )));
    };
    let root = match &rel.rel_type {
        Some(plan_rel::RelType::Root(r)) => r.input.as_ref(),
        Some(plan_rel::RelType::Rel(r)) => Some(r),
        None => None,
    }
    .ok_or_else(|| invalid("plan relation is empty"))?;
    v.rel(root, 0).map(|_| ())
}

/// Aggregates a fragment may use: those whose partial states merge into the exact
/// answer (the variances' count, mean and sum of squares included), and
/// `approx_distinct`, whose sketches merge into the sketch of all the rows.
pub(crate) const AGGREGATES: &[&str] = &[
    "sum",
    "count",
    "min",
    "max",
    "avg",
    "stddev",
    "stddev_pop",
    "var",
    "var_pop",
    "bool_and",
    "bool_or",
    "approx_distinct",
];

/// Aggregates a fragment may use only in a part the node runs whole (see
/// `compute/whole_at_node.rs`): their partial states are every value, which shrink
/// nothing. A node still answers them exactly in either mode.
pub(crate) const WHOLE_AGGREGATES: &[&str] = &["median"];

/// Window functions a fragment may use: the ranking ones, whose value among a
/// node's rows is at most their value among all (see `compute/window_down.rs`).
pub(crate) const WINDOW_FUNCTIONS: &[&str] = &["row_number", "rank", "dense_rank"];

struct Validator<'a> {
    table: &'a str,
    functions: HashSet<u32>,
    aggregates: HashSet<u32>,
    windows: HashSet<u32>,
}

impl Validator<'_> {
    /// Checks `rel` and returns how many columns it outputs (field references are
    /// checked against it: DataFusion's consumer trusts them).
    fn rel(&self, rel: &Rel, depth: usize) -> Result<usize, Error> {
        if depth > MAX_REL_DEPTH {
            return Err(invalid(format!(
                "relations nest deeper than {MAX_REL_DEPTH} levels"
            )));
        }
        let child = |r: &Option<Box<Rel>>| -> Result<usize, Error> {
            match r {
                Some(r) => self.rel(r, depth + 1),
                None => Err(invalid("relation has no input")),
            }
        };
        let (common, width) = match rel.rel_type.as_ref() {
            Some(RelType::Read(r)) => {
                match &r.read_type {
                    Some(read_rel::ReadType::NamedTable(t)) => {
                        if t.names.len() != 1 || t.names[0] != self.table {
                            return Err(invalid(format!(
                                "the plan reads {:?}; this fragment may read only table {:?}",
                                t.names, self.table
                            )));
                        }
                    }
                    _ => {
                        return Err(invalid(
                            "only named-table reads are allowed (no local files, virtual or extension tables)",
                        ));
                    }
                }
                if r.advanced_extension.is_some() {
                    return Err(invalid("read extensions are not supported"));
                }
                let base = r
                    .base_schema
                    .as_ref()
                    .and_then(|s| s.r#struct.as_ref())
                    .map(|s| s.types.len())
                    .ok_or_else(|| invalid("read without a base schema"))?;
                for e in [&r.filter, &r.best_effort_filter].into_iter().flatten() {
                    self.expr(e, 0, base)?;
                }
                let width = match r.projection.as_ref().and_then(|p| p.select.as_ref()) {
                    Some(sel) => {
                        for item in &sel.struct_items {
                            if item.child.is_some() {
                                return Err(invalid("nested projection masks are not supported"));
                            }
                            if item.field < 0 || item.field as usize >= base {
                                return Err(invalid(format!(
                                    "projection names column {} of a {base}-column table",
                                    item.field
                                )));
                            }
                        }
                        sel.struct_items.len()
                    }
                    None => base,
                };
                (&r.common, width)
            }
            Some(RelType::Filter(f)) => {
                let w = child(&f.input)?;
                let c = f
                    .condition
                    .as_ref()
                    .ok_or_else(|| invalid("filter without a condition"))?;
                self.expr(c, 0, w)?;
                (&f.common, w)
            }
            Some(RelType::Project(p)) => {
                let w = child(&p.input)?;
                for e in &p.expressions {
                    match e.rex_type.as_ref() {
                        Some(RexType::WindowFunction(f)) => self.window(f, w)?,
                        _ => self.expr(e, 0, w)?,
                    }
                }
                (&p.common, w + p.expressions.len())
            }
            Some(RelType::Fetch(f)) => {
                use proto::fetch_rel::{CountMode, OffsetMode};
                let w = child(&f.input)?;
                #[allow(deprecated)]
                let exprs = [
                    match &f.offset_mode {
                        Some(OffsetMode::OffsetExpr(e)) => Some(e),
                        _ => None,
                    },
                    match &f.count_mode {
                        Some(CountMode::CountExpr(e)) => Some(e),
                        _ => None,
                    },
                ];
                for e in exprs.into_iter().flatten() {
                    self.expr(e, 0, 0)?;
                }
                (&f.common, w)
            }
            Some(RelType::Sort(s)) => {
                let w = child(&s.input)?;
                for f in &s.sorts {
                    let e = f
                        .expr
                        .as_ref()
                        .ok_or_else(|| invalid("sort key without expression"))?;
                    self.expr(e, 0, w)?;
                }
                (&s.common, w)
            }
            Some(RelType::Aggregate(a)) => {
                let w = child(&a.input)?;
                if a.groupings.len() > 1 {
                    return Err(invalid("grouping sets are not supported"));
                }
                let mut keys = a.grouping_expressions.len();
                for e in &a.grouping_expressions {
                    self.expr(e, 0, w)?;
                }
                for g in &a.groupings {
                    for r in &g.expression_references {
                        if *r as usize >= a.grouping_expressions.len() {
                            return Err(invalid("grouping refers to a missing expression"));
                        }
                    }
                    #[allow(deprecated)]
                    for e in &g.grouping_expressions {
                        self.expr(e, 0, w)?;
                    }
                    #[allow(deprecated)]
                    if !g.grouping_expressions.is_empty() {
                        keys = g.grouping_expressions.len();
                    }
                }
                for m in &a.measures {
                    if m.filter.is_some() {
                        return Err(invalid("aggregate FILTER clauses are not supported"));
                    }
                    let f = m
                        .measure
                        .as_ref()
                        .ok_or_else(|| invalid("aggregate measure without a function"))?;
                    if !self.aggregates.contains(&f.function_reference) {
                        return Err(invalid(format!(
                            "aggregate function #{} is not one of {}, {}",
                            f.function_reference,
                            AGGREGATES.join(", "),
                            WHOLE_AGGREGATES.join(", ")
                        )));
                    }
                    if !f.sorts.is_empty() {
                        return Err(invalid("ordered aggregates are not supported"));
                    }
                    self.args(&f.arguments, 0, w)?;
                }
                (&a.common, keys + a.measures.len())
            }
            Some(other) => {
                return Err(invalid(format!(
                    "relation {} is not allowed in a pushed-down fragment",
                    rel_name(other)
                )));
            }
            None => return Err(invalid("empty relation")),
        };
        // An emit mapping reorders or drops output columns.
        use proto::rel_common::EmitKind;
        match common.as_ref().and_then(|c| c.emit_kind.as_ref()) {
            Some(EmitKind::Emit(e)) => {
                if let Some(bad) = e
                    .output_mapping
                    .iter()
                    .find(|i| **i < 0 || **i as usize >= width)
                {
                    return Err(invalid(format!(
                        "output mapping names column {bad} of {width}"
                    )));
                }
                Ok(e.output_mapping.len())
            }
            _ => Ok(width),
        }
    }

    /// Checks a window function standing as a project's expression: a ranking one,
    /// or an aggregate over a frame (in a part a node runs whole).
    fn window(&self, f: &proto::expression::WindowFunction, width: usize) -> Result<(), Error> {
        if !self.windows.contains(&f.function_reference)
            && !self.aggregates.contains(&f.function_reference)
        {
            return Err(invalid(format!(
                "window function #{} is not one of {}, {}",
                f.function_reference,
                WINDOW_FUNCTIONS.join(", "),
                AGGREGATES.join(", ")
            )));
        }
        self.args(&f.arguments, 0, width)?;
        #[allow(deprecated)]
        for e in f.partitions.iter().chain(&f.args) {
            self.expr(e, 1, width)?;
        }
        for s in &f.sorts {
            let e = s
                .expr
                .as_ref()
                .ok_or_else(|| invalid("window ordering without expression"))?;
            self.expr(e, 1, width)?;
        }
        Ok(())
    }

    fn args(&self, args: &[FunctionArgument], depth: usize, width: usize) -> Result<(), Error> {
        for a in args {
            match &a.arg_type {
                Some(ArgType::Value(e)) => self.expr(e, depth + 1, width)?,
                Some(ArgType::Enum(_)) | Some(ArgType::Type(_)) => {}
                None => return Err(invalid("function argument is empty")),
            }
        }
        Ok(())
    }

    /// Checks `e`, whose column references must be below `width`.
    fn expr(&self, e: &Expression, depth: usize, width: usize) -> Result<(), Error> {
        if depth > MAX_EXPR_DEPTH {
            return Err(invalid(format!(
                "expression nests deeper than {MAX_EXPR_DEPTH} levels"
            )));
        }
        let d = depth + 1;
        match e.rex_type.as_ref() {
            Some(RexType::Literal(_)) => Ok(()),
            Some(RexType::Selection(f)) => {
                use proto::expression::field_reference::{ReferenceType, RootType};
                use proto::expression::reference_segment::ReferenceType as Seg;
                let direct = match (&f.reference_type, &f.root_type) {
                    (
                        Some(ReferenceType::DirectReference(seg)),
                        Some(RootType::RootReference(_)),
                    )
                    | (Some(ReferenceType::DirectReference(seg)), None) => Some(seg),
                    _ => None,
                };
                match direct.and_then(|s| s.reference_type.as_ref()) {
                    Some(Seg::StructField(s)) if s.child.is_none() => {
                        if s.field < 0 || s.field as usize >= width {
                            Err(invalid(format!(
                                "column reference {} is out of range (the input has {width} columns)",
                                s.field
                            )))
                        } else {
                            Ok(())
                        }
                    }
                    _ => Err(invalid("only plain column references are supported")),
                }
            }
            Some(RexType::ScalarFunction(f)) => {
                if !self.functions.contains(&f.function_reference) {
                    return Err(invalid(format!(
                        "scalar function #{} is not declared or not allowed",
                        f.function_reference
                    )));
                }
                #[allow(deprecated)]
                for a in &f.args {
                    self.expr(a, d, width)?;
                }
                self.args(&f.arguments, depth, width)
            }
            Some(RexType::IfThen(i)) => {
                for c in &i.ifs {
                    for e in [&c.r#if, &c.then].into_iter().flatten() {
                        self.expr(e, d, width)?;
                    }
                }
                if let Some(e) = &i.r#else {
                    self.expr(e, d, width)?;
                }
                Ok(())
            }
            Some(RexType::SwitchExpression(s)) => {
                if let Some(m) = &s.r#match {
                    self.expr(m, d, width)?;
                }
                for c in &s.ifs {
                    if let Some(t) = &c.then {
                        self.expr(t, d, width)?;
                    }
                }
                if let Some(e) = &s.r#else {
                    self.expr(e, d, width)?;
                }
                Ok(())
            }
            Some(RexType::SingularOrList(l)) => {
                if l.options.len() > MAX_IN_LIST {
                    return Err(invalid(format!(
                        "IN list of {} items exceeds the {MAX_IN_LIST}-item limit",
                        l.options.len()
                    )));
                }
                if let Some(v) = &l.value {
                    self.expr(v, d, width)?;
                }
                for o in &l.options {
                    self.expr(o, d, width)?;
                }
                Ok(())
            }
            Some(RexType::Cast(c)) => match &c.input {
                Some(i) => self.expr(i, d, width),
                None => Err(invalid("cast without input")),
            },
            Some(_) => Err(invalid(
                "expression kind not allowed in a pushed-down fragment (subquery, window, lambda, parameter, …)",
            )),
            None => Err(invalid("empty expression")),
        }
    }
}

fn rel_name(r: &RelType) -> &'static str {
    match r {
        RelType::Join(_) | RelType::HashJoin(_) | RelType::MergeJoin(_) => "join",
        RelType::NestedLoopJoin(_) => "nested-loop join",
        RelType::Cross(_) => "cross join",
        RelType::Set(_) => "set operation",
        RelType::Write(_) | RelType::Ddl(_) | RelType::Update(_) => "write/DDL",
        RelType::Window(_) => "window",
        RelType::Exchange(_) => "exchange",
        RelType::Expand(_) => "expand",
        RelType::Reference(_) => "reference",
        _ => "extension",
    }
}
