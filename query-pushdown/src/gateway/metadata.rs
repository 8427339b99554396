//! What database tools ask before they query: the server's facts (`GetSqlInfo`),
//! its types (`GetXdbcTypeInfo`), and the catalog tree (`GetCatalogs`,
//! `GetDbSchemas`, `GetTables`, `GetTableTypes`), read from the caller's session,
//! so a caller sees the tables the nodes show its tenant. arrow-flight's builders
//! apply the commands' filters (catalog, LIKE patterns, table types), so everything
//! is appended; a command without a catalog (ADBC's `get_objects` sends none)
//! matches every catalog. DataFusion's `information_schema` answers SQL but is not
//! listed (its catalog does not name it).

use std::sync::LazyLock;

use arrow::record_batch::RecordBatch;
use arrow_flight::sql::metadata::{
    SqlInfoData, SqlInfoDataBuilder, XdbcTypeInfo, XdbcTypeInfoData, XdbcTypeInfoDataBuilder,
};
use arrow_flight::sql::{
    CommandGetCatalogs, CommandGetDbSchemas, CommandGetTableTypes, CommandGetTables, Nullable,
    Searchable, SqlInfo, SqlSupportedTransaction, XdbcDataType,
};
use csd_protocol::{Error, StatusCode};
use datafusion::prelude::SessionContext;

/// Table type of the cluster's tables.
pub(crate) const TABLE: &str = "TABLE";
/// Table type of views (DataFusion's own; a gateway creates none).
pub(crate) const VIEW: &str = "VIEW";

fn arrow_error<E: std::error::Error + Send + Sync + 'static>(
    what: &str,
) -> impl Fn(E) -> Error + '_ {
    move |e| Error::external(StatusCode::Internal, what, e)
}

/// The server's facts (`GetSqlInfo`).
pub(crate) fn sql_info() -> Result<&'static SqlInfoData, Error> {
    static DATA: LazyLock<Result<SqlInfoData, String>> = LazyLock::new(|| {
        let mut b = SqlInfoDataBuilder::new();
        b.append(SqlInfo::FlightSqlServerName, "csd");
        b.append(SqlInfo::FlightSqlServerVersion, env!("CARGO_PKG_VERSION"));
        b.append(SqlInfo::FlightSqlServerArrowVersion, arrow::ARROW_VERSION);
        b.append(SqlInfo::FlightSqlServerReadOnly, true);
        b.append(SqlInfo::FlightSqlServerSql, true);
        b.append(SqlInfo::FlightSqlServerSubstrait, false);
        b.append(
            SqlInfo::FlightSqlServerTransaction,
            SqlSupportedTransaction::None as i32,
        );
        b.append(SqlInfo::FlightSqlServerCancel, true);
        b.append(SqlInfo::FlightSqlServerStatementTimeout, 0i32);
        b.append(SqlInfo::FlightSqlServerTransactionTimeout, 0i32);
        b.append(SqlInfo::SqlDdlCatalog, false);
        b.append(SqlInfo::SqlDdlSchema, false);
        b.append(SqlInfo::SqlDdlTable, false);
        b.append(SqlInfo::SqlIdentifierQuoteChar, "\"");
        b.build().map_err(|e| e.to_string())
    });
    built(&DATA, "SqlInfo")
}

/// The SQL types a client may use in statements (`GetXdbcTypeInfo`).
pub(crate) fn xdbc_info() -> Result<&'static XdbcTypeInfoData, Error> {
    static DATA: LazyLock<Result<XdbcTypeInfoData, String>> = LazyLock::new(|| {
        let mut b = XdbcTypeInfoDataBuilder::new();
        let types: [(&str, XdbcDataType, Option<i32>, bool); 10] = [
            ("BOOLEAN", XdbcDataType::XdbcBit, Some(1), false),
            ("SMALLINT", XdbcDataType::XdbcSmallint, Some(16), true),
            ("INTEGER", XdbcDataType::XdbcInteger, Some(32), true),
            ("BIGINT", XdbcDataType::XdbcBigint, Some(64), true),
            ("REAL", XdbcDataType::XdbcFloat, Some(24), true),
            ("DOUBLE", XdbcDataType::XdbcDouble, Some(53), true),
            ("DECIMAL", XdbcDataType::XdbcDecimal, Some(38), true),
            ("VARCHAR", XdbcDataType::XdbcVarchar, None, false),
            ("DATE", XdbcDataType::XdbcDate, None, false),
            ("TIMESTAMP", XdbcDataType::XdbcTimestamp, None, false),
        ];
        for (name, t, size, numeric) in types {
            let quoted = matches!(name, "VARCHAR" | "DATE" | "TIMESTAMP");
            b.append(XdbcTypeInfo {
                type_name: name.into(),
                data_type: t,
                column_size: size,
                literal_prefix: quoted.then(|| "'".into()),
                literal_suffix: quoted.then(|| "'".into()),
                create_params: (name == "DECIMAL")
                    .then(|| vec!["precision".into(), "scale".into()]),
                nullable: Nullable::NullabilityNullable,
                case_sensitive: name == "VARCHAR",
                searchable: Searchable::Full,
                unsigned_attribute: numeric.then_some(false),
                fixed_prec_scale: false,
                auto_increment: numeric.then_some(false),
                local_type_name: Some(name.into()),
                minimum_scale: None,
                maximum_scale: (name == "DECIMAL").then_some(38),
                sql_data_type: t,
                datetime_subcode: None,
                num_prec_radix: numeric.then_some(if name == "DECIMAL" { 10 } else { 2 }),
                interval_precision: None,
            });
        }
        b.build().map_err(|e| e.to_string())
    });
    built(&DATA, "XdbcTypeInfo")
}

/// A table built once from constants (a failure is a bug the tests catch).
fn built<T>(data: &'static Result<T, String>, what: &str) -> Result<&'static T, Error> {
    data.as_ref()
        .map_err(|e| Error::Internal(format!("the gateway's {what} does not build: {e}")))
}

/// Every (catalog, schema) of `ctx`.
fn schemas_of(ctx: &SessionContext) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for c in ctx.catalog_names() {
        if let Some(catalog) = ctx.catalog(&c) {
            let mut names = catalog.schema_names();
            names.sort();
            for s in names {
                out.push((c.clone(), s));
            }
        }
    }
    out
}

pub(crate) fn catalogs(
    ctx: &SessionContext,
    cmd: CommandGetCatalogs,
) -> Result<RecordBatch, Error> {
    let mut b = cmd.into_builder();
    let mut names = ctx.catalog_names();
    names.sort();
    for c in names {
        b.append(c);
    }
    b.build().map_err(arrow_error("listing catalogs"))
}

pub(crate) fn db_schemas(
    ctx: &SessionContext,
    cmd: CommandGetDbSchemas,
) -> Result<RecordBatch, Error> {
    let mut b = cmd.into_builder();
    for (c, s) in schemas_of(ctx) {
        b.append(c, s);
    }
    b.build().map_err(arrow_error("listing schemas"))
}

pub(crate) async fn tables(
    ctx: &SessionContext,
    cmd: CommandGetTables,
) -> Result<RecordBatch, Error> {
    let mut b = cmd.into_builder();
    for (c, s) in schemas_of(ctx) {
        let Some(schema) = ctx.catalog(&c).and_then(|cat| cat.schema(&s)) else {
            continue;
        };
        for t in schema.table_names() {
            let Some(provider) = schema
                .table(&t)
                .await
                .map_err(|e| Error::external(StatusCode::Internal, "listing tables", e))?
            else {
                continue;
            };
            b.append(&c, &s, &t, TABLE, provider.schema().as_ref())
                .map_err(arrow_error("listing tables"))?;
        }
    }
    b.build().map_err(arrow_error("listing tables"))
}

pub(crate) fn table_types(cmd: CommandGetTableTypes) -> Result<RecordBatch, Error> {
    let mut b = cmd.into_builder();
    b.append(TABLE);
    b.append(VIEW);
    b.build().map_err(arrow_error("listing table types"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_flight::sql::CommandGetSqlInfo;

    #[tokio::test]
    async fn tree_without_a_catalog_filter_and_facts() {
        let ctx = SessionContext::new_with_config(
            datafusion::prelude::SessionConfig::new().with_information_schema(true),
        );
        ctx.sql("CREATE TABLE lineitem AS VALUES (1)")
            .await
            .unwrap();
        let b = tables(
            &ctx,
            CommandGetTables {
                catalog: None,
                db_schema_filter_pattern: None,
                table_name_filter_pattern: Some("line%".into()),
                table_types: vec![],
                include_schema: true,
            },
        )
        .await
        .unwrap();
        assert_eq!(b.num_rows(), 1);
        assert_eq!(b.num_columns(), 5);
        let b = db_schemas(
            &ctx,
            CommandGetDbSchemas {
                catalog: None,
                db_schema_filter_pattern: None,
            },
        )
        .unwrap();
        assert_eq!(b.num_rows(), 1, "public");
        let none = tables(
            &ctx,
            CommandGetTables {
                catalog: Some("datafusion".into()),
                db_schema_filter_pattern: None,
                table_name_filter_pattern: None,
                table_types: vec![VIEW.into()],
                include_schema: false,
            },
        )
        .await
        .unwrap();
        assert_eq!(none.num_rows(), 0, "no views");
        assert_eq!(catalogs(&ctx, CommandGetCatalogs {}).unwrap().num_rows(), 1);
        assert_eq!(table_types(CommandGetTableTypes {}).unwrap().num_rows(), 2);
        let info = CommandGetSqlInfo { info: vec![] }
            .into_builder(sql_info().unwrap())
            .build()
            .unwrap();
        assert_eq!(info.num_rows(), 14);
        assert!(xdbc_info().unwrap().record_batch(None).unwrap().num_rows() >= 10);
    }
}
