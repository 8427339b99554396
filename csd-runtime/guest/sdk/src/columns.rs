//! Reading values of the column types a node may hand a guest, whatever their
//! layout (strings as Utf8, LargeUtf8 or Utf8View; decimals scaled to doubles).

use crate::DataType;
use arrow_array::Array;
use arrow_array::cast::AsArray;
use arrow_array::types::{Decimal128Type, Float64Type, Int32Type, Int64Type};

/// Row `i` of a string column (any string layout).
pub fn str_at(a: &dyn Array, i: usize) -> Result<&str, String> {
    Ok(match a.data_type() {
        DataType::Utf8 => a.as_string::<i32>().value(i),
        DataType::LargeUtf8 => a.as_string::<i64>().value(i),
        DataType::Utf8View => a.as_string_view().value(i),
        t => return Err(format!("expected a string column, got {t}")),
    })
}

/// Row `i` of a numeric column as a double (decimals scaled).
pub fn float_at(a: &dyn Array, i: usize) -> Result<Option<f64>, String> {
    if a.is_null(i) {
        return Ok(None);
    }
    Ok(Some(match a.data_type() {
        DataType::Float64 => a.as_primitive::<Float64Type>().value(i),
        DataType::Int64 => a.as_primitive::<Int64Type>().value(i) as f64,
        DataType::Int32 => a.as_primitive::<Int32Type>().value(i) as f64,
        DataType::Decimal128(_, s) => {
            a.as_primitive::<Decimal128Type>().value(i) as f64 / 10f64.powi(i32::from(*s))
        }
        t => return Err(format!("expected a numeric column, got {t}")),
    }))
}

/// Row `i` of an integer column.
pub fn int_at(a: &dyn Array, i: usize) -> Result<Option<i64>, String> {
    if a.is_null(i) {
        return Ok(None);
    }
    Ok(Some(match a.data_type() {
        DataType::Int64 => a.as_primitive::<Int64Type>().value(i),
        DataType::Int32 => i64::from(a.as_primitive::<Int32Type>().value(i)),
        t => return Err(format!("expected an integer column, got {t}")),
    }))
}
