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

/// A whole numeric column as doubles (decimals scaled): one type dispatch per
/// batch, then a tight loop (what a per-row [`float_at`] repeats for every value).
pub fn floats(a: &dyn Array) -> Result<Vec<Option<f64>>, String> {
    fn collect<T: arrow_array::ArrowPrimitiveType>(
        a: &dyn Array,
        f: impl Fn(T::Native) -> f64,
    ) -> Vec<Option<f64>> {
        let p = a.as_primitive::<T>();
        if p.null_count() == 0 {
            p.values().iter().map(|v| Some(f(*v))).collect()
        } else {
            p.iter().map(|v| v.map(&f)).collect()
        }
    }
    Ok(match a.data_type() {
        DataType::Float64 => collect::<Float64Type>(a, |v| v),
        DataType::Int64 => collect::<Int64Type>(a, |v| v as f64),
        DataType::Int32 => collect::<Int32Type>(a, f64::from),
        DataType::Decimal128(_, s) => {
            let scale = 10f64.powi(i32::from(*s));
            collect::<Decimal128Type>(a, |v| v as f64 / scale)
        }
        t => return Err(format!("expected a numeric column, got {t}")),
    })
}

/// A whole integer column (see [`floats`]).
pub fn ints(a: &dyn Array) -> Result<Vec<Option<i64>>, String> {
    Ok(match a.data_type() {
        DataType::Int64 => a.as_primitive::<Int64Type>().iter().collect(),
        DataType::Int32 => a
            .as_primitive::<Int32Type>()
            .iter()
            .map(|v| v.map(i64::from))
            .collect(),
        t => return Err(format!("expected an integer column, got {t}")),
    })
}

/// The rows `rows` of a numeric column as doubles (decimals scaled): what
/// [`floats`] returns, gathered, for a guest that selects rows before it converts.
pub fn floats_at(a: &dyn Array, rows: &[usize]) -> Result<Vec<Option<f64>>, String> {
    fn gather<T: arrow_array::ArrowPrimitiveType>(
        a: &dyn Array,
        rows: &[usize],
        f: impl Fn(T::Native) -> f64,
    ) -> Vec<Option<f64>> {
        let p = a.as_primitive::<T>();
        let values = p.values();
        if p.null_count() == 0 {
            rows.iter().map(|&i| Some(f(values[i]))).collect()
        } else {
            rows.iter()
                .map(|&i| p.is_valid(i).then(|| f(values[i])))
                .collect()
        }
    }
    Ok(match a.data_type() {
        DataType::Float64 => gather::<Float64Type>(a, rows, |v| v),
        DataType::Int64 => gather::<Int64Type>(a, rows, |v| v as f64),
        DataType::Int32 => gather::<Int32Type>(a, rows, f64::from),
        DataType::Decimal128(_, s) => {
            let scale = 10f64.powi(i32::from(*s));
            gather::<Decimal128Type>(a, rows, |v| v as f64 / scale)
        }
        t => return Err(format!("expected a numeric column, got {t}")),
    })
}

/// The rows `rows` of an integer column (see [`floats_at`]).
pub fn ints_at(a: &dyn Array, rows: &[usize]) -> Result<Vec<Option<i64>>, String> {
    fn gather<T: arrow_array::ArrowPrimitiveType>(
        a: &dyn Array,
        rows: &[usize],
        f: impl Fn(T::Native) -> i64,
    ) -> Vec<Option<i64>> {
        let p = a.as_primitive::<T>();
        let values = p.values();
        rows.iter()
            .map(|&i| p.is_valid(i).then(|| f(values[i])))
            .collect()
    }
    Ok(match a.data_type() {
        DataType::Int64 => gather::<Int64Type>(a, rows, |v| v),
        DataType::Int32 => gather::<Int32Type>(a, rows, i64::from),
        t => return Err(format!("expected an integer column, got {t}")),
    })
}

/// A string column of any layout, its type dispatched once per batch.
pub enum Strings<'a> {
    /// Utf8.
    Utf8(&'a arrow_array::StringArray),
    /// LargeUtf8.
    Large(&'a arrow_array::LargeStringArray),
    /// Utf8View.
    View(&'a arrow_array::StringViewArray),
}

impl<'a> Strings<'a> {
    /// `a` as strings.
    pub fn of(a: &'a dyn Array) -> Result<Self, String> {
        Ok(match a.data_type() {
            DataType::Utf8 => Strings::Utf8(a.as_string::<i32>()),
            DataType::LargeUtf8 => Strings::Large(a.as_string::<i64>()),
            DataType::Utf8View => Strings::View(a.as_string_view()),
            t => return Err(format!("expected a string column, got {t}")),
        })
    }

    /// Row `i`, `None` when null.
    pub fn get(&self, i: usize) -> Option<&'a str> {
        match self {
            Strings::Utf8(s) => s.is_valid(i).then(|| s.value(i)),
            Strings::Large(s) => s.is_valid(i).then(|| s.value(i)),
            Strings::View(s) => s.is_valid(i).then(|| s.value(i)),
        }
    }
}
