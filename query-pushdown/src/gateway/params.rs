//! A statement's SQL made into a plan the gateway may run: `?` placeholders (ADBC's
//! and JDBC's style) numbered `$1…$n`, nothing but queries allowed, bound values
//! put in; and what a client binds (`DoPut`) made into values.

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Field, Schema};
use csd_protocol::Error;
use datafusion::common::{ParamValues, ScalarValue};
use datafusion::execution::context::SQLOptions;
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::SessionContext;
use datafusion::sql::sqlparser::dialect::GenericDialect;
use datafusion::sql::sqlparser::tokenizer::{Token, Tokenizer};

use super::handle::{MAX_PARAMS, Statement, bindable};
use crate::error::to_runtime;

/// `sql` with each `?` placeholder (outside strings, identifiers and comments)
/// replaced by `$1`, `$2`, … in the order they are written: DataFusion reads every
/// `?` as one parameter without a type.
pub(crate) fn number_placeholders(sql: &str) -> Result<String, Error> {
    let tokens = Tokenizer::new(&GenericDialect {}, sql)
        .tokenize_with_location()
        .map_err(|e| Error::InvalidArgument(format!("the SQL does not parse: {e}")))?;
    let marks: Vec<(u64, u64)> = tokens
        .iter()
        .filter(|t| matches!(&t.token, Token::Placeholder(p) if p == "?"))
        .map(|t| (t.span.start.line, t.span.start.column))
        .collect();
    if marks.is_empty() {
        return Ok(sql.to_string());
    }
    // Lines and columns (1-based, in characters) to byte offsets.
    let mut offsets = Vec::with_capacity(marks.len());
    let (mut line, mut column) = (1u64, 1u64);
    let mut next = marks.iter().peekable();
    for (at, ch) in sql.char_indices() {
        if next.peek() == Some(&&(line, column)) {
            offsets.push(at);
            next.next();
        }
        if ch == '\n' {
            line += 1;
            column = 1;
        } else {
            column += 1;
        }
    }
    if offsets.len() != marks.len() {
        return Err(Error::Internal(
            "numbering the SQL's ? placeholders lost track of one".into(),
        ));
    }
    let mut out = String::with_capacity(sql.len() + 2 * offsets.len());
    let mut from = 0;
    for (i, at) in offsets.into_iter().enumerate() {
        out.push_str(&sql[from..at]);
        out.push_str(&format!("${}", i + 1));
        from = at + 1;
    }
    out.push_str(&sql[from..]);
    Ok(out)
}

/// The plan of `statement` in `ctx`, its values bound when it has them. Only
/// queries: DDL (`CREATE EXTERNAL TABLE` would read the gateway host's files), DML
/// and statements such as `SET` are refused.
pub(crate) async fn plan(
    ctx: &SessionContext,
    statement: &Statement,
) -> Result<LogicalPlan, Error> {
    let sql = number_placeholders(&statement.sql)?;
    let state = ctx.state();
    let parsed = state
        .sql_to_statement(&sql, &state.config().options().sql_parser.dialect)
        .map_err(to_runtime)?;
    let plan = state.statement_to_plan(parsed).await.map_err(to_runtime)?;
    SQLOptions::new()
        .with_allow_ddl(false)
        .with_allow_dml(false)
        .with_allow_statements(false)
        .verify_plan(&plan)
        .map_err(|e| {
            Error::InvalidArgument(format!(
                "the gateway answers queries only (no DDL, DML or SET): {e}"
            ))
        })?;
    let wanted = parameter_count(&plan)?;
    match &statement.params {
        Some(values) => {
            if values.len() != wanted {
                return Err(Error::InvalidArgument(format!(
                    "the statement has {wanted} parameters and {} values are bound",
                    values.len()
                )));
            }
            if wanted == 0 {
                return Ok(plan);
            }
            plan.with_param_values(ParamValues::from(values.clone()))
                .map_err(to_runtime)
        }
        None => Ok(plan),
    }
}

fn parameter_count(plan: &LogicalPlan) -> Result<usize, Error> {
    Ok(plan.get_parameter_fields().map_err(to_runtime)?.len())
}

/// What a client binds to `plan`'s parameters: one field per parameter, `$1…$n` in
/// order, of the type DataFusion infers (`Null` where it infers none).
pub(crate) fn parameter_schema(plan: &LogicalPlan) -> Result<Schema, Error> {
    let mut fields: Vec<(String, Option<Arc<Field>>)> = plan
        .get_parameter_fields()
        .map_err(to_runtime)?
        .into_iter()
        .collect();
    // `$10` after `$9`: by number where the names are numbers.
    fields.sort_by_key(|(name, _)| {
        let n = name
            .trim_start_matches('$')
            .parse::<u64>()
            .unwrap_or(u64::MAX);
        (n, name.clone())
    });
    Ok(Schema::new(
        fields
            .into_iter()
            .map(|(name, f)| match f {
                Some(f) => Field::new(name, f.data_type().clone(), true),
                None => Field::new(name, DataType::Null, true),
            })
            .collect::<Vec<_>>(),
    ))
}

/// The values bound by one `DoPut`: one row, a column per parameter in order. No
/// rows (or no columns) unbinds.
pub(crate) fn values_of(batches: &[RecordBatch]) -> Result<Vec<ScalarValue>, Error> {
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    if rows == 0 {
        return Ok(Vec::new());
    }
    if rows > 1 {
        return Err(Error::InvalidArgument(format!(
            "{rows} rows of parameter values were bound; a statement takes one row (run it once per row)"
        )));
    }
    let Some(batch) = batches.iter().find(|b| b.num_rows() == 1) else {
        return Err(Error::Internal("a bound row went missing".into()));
    };
    if batch.num_columns() > MAX_PARAMS {
        return Err(Error::InvalidArgument(format!(
            "{} parameter values were bound; at most {MAX_PARAMS} are accepted",
            batch.num_columns()
        )));
    }
    batch
        .columns()
        .iter()
        .zip(batch.schema().fields())
        .map(|(column, field)| {
            let v = ScalarValue::try_from_array(column, 0).map_err(to_runtime)?;
            if !bindable(&v) {
                return Err(Error::InvalidArgument(format!(
                    "parameter {:?} is of type {}; bind plain values (numbers, strings, dates, timestamps, decimals, booleans, binary)",
                    field.name(),
                    field.data_type()
                )));
            }
            Ok(v)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_question_marks_in_order_and_leaves_the_rest() {
        assert_eq!(
            number_placeholders("SELECT a FROM t WHERE b = ? AND c IN (?, ?)").unwrap(),
            "SELECT a FROM t WHERE b = $1 AND c IN ($2, $3)"
        );
        // In strings, quoted names and comments a ? is text.
        let sql = "SELECT '?', \"a?\" -- why?\nFROM t /* ? */ WHERE x = ? AND y = 'é?'";
        assert_eq!(
            number_placeholders(sql).unwrap(),
            "SELECT '?', \"a?\" -- why?\nFROM t /* ? */ WHERE x = $1 AND y = 'é?'"
        );
        // Across lines, after multi-byte characters.
        assert_eq!(
            number_placeholders("SELECT 'ü'\n  , ?\n  , ?").unwrap(),
            "SELECT 'ü'\n  , $1\n  , $2"
        );
        assert_eq!(number_placeholders("SELECT $1").unwrap(), "SELECT $1");
        assert!(number_placeholders("SELECT 'open").is_err());
    }

    #[tokio::test]
    async fn binds_in_order_and_refuses_writes() {
        let ctx = SessionContext::new();
        ctx.sql("CREATE TABLE t AS VALUES (1, 'a'), (2, 'b'), (3, 'c')")
            .await
            .unwrap();
        let mut s = Statement::new("SELECT column2 FROM t WHERE column1 >= ? AND column1 < ?");
        let p = plan(&ctx, &s).await.unwrap();
        let schema = parameter_schema(&p).unwrap();
        let names: Vec<_> = schema.fields().iter().map(|f| f.name().clone()).collect();
        assert_eq!(names, ["$1", "$2"]);
        s.params = Some(vec![
            ScalarValue::Int64(Some(2)),
            ScalarValue::Int64(Some(3)),
        ]);
        let p = plan(&ctx, &s).await.unwrap();
        let out = ctx
            .execute_logical_plan(p)
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        let text = arrow::util::pretty::pretty_format_batches(&out)
            .unwrap()
            .to_string();
        assert!(text.contains("| b ") && !text.contains("| c "), "{text}");
        s.params = Some(vec![ScalarValue::Int64(Some(2))]);
        let e = plan(&ctx, &s).await.unwrap_err().to_string();
        assert!(e.contains("2 parameters and 1 values"), "{e}");
        for sql in [
            "CREATE EXTERNAL TABLE x STORED AS CSV LOCATION '/etc/passwd'",
            "INSERT INTO t VALUES (4, 'd')",
            "SET datafusion.execution.batch_size = 1",
            "COPY t TO '/tmp/x.csv'",
        ] {
            let e = plan(&ctx, &Statement::new(sql)).await.unwrap_err();
            assert_eq!(
                e.status_code(),
                csd_protocol::StatusCode::InvalidArgument,
                "{sql}: {e}"
            );
        }
        // Parameters numbered past 9 sort by number.
        let many = (1..=11)
            .map(|i| format!("${i}"))
            .collect::<Vec<_>>()
            .join(" + ");
        let p = plan(&ctx, &Statement::new(format!("SELECT {many} FROM t")))
            .await
            .unwrap();
        let names: Vec<_> = parameter_schema(&p)
            .unwrap()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        assert_eq!(names.last().map(String::as_str), Some("$11"));
        assert_eq!(names[1], "$2");
    }

    #[test]
    fn one_row_of_plain_values() {
        let b = RecordBatch::try_from_iter([
            ("0", Arc::new(arrow::array::Int64Array::from(vec![7])) as _),
            (
                "1",
                Arc::new(arrow::array::StringArray::from(vec!["x"])) as _,
            ),
        ])
        .unwrap();
        assert_eq!(
            values_of(std::slice::from_ref(&b)).unwrap(),
            [
                ScalarValue::Int64(Some(7)),
                ScalarValue::Utf8(Some("x".into()))
            ]
        );
        let two = arrow::compute::concat_batches(&b.schema(), [&b, &b]).unwrap();
        let e = values_of(&[two]).unwrap_err().to_string();
        assert!(e.contains("2 rows"), "{e}");
        assert!(values_of(&[]).unwrap().is_empty());
    }
}
