//! Scalar SQL functions shipped as one module (`csd sql --wasm-fn
//! discounted=functions.wasm:discounted …`):
//!
//! - `discounted(price, discount)`: `price * (1 - discount)`, what the SQL expression
//!   `CAST(price AS DOUBLE) * (1 - CAST(discount AS DOUBLE))` gives;
//! - `word_count(text)`: the number of whitespace-separated words;
//! - `strict_sqrt(x)`: the square root, and a failure naming the value for a
//!   negative one (what a function that refuses its input looks like to SQL).

use std::sync::Arc;

use csd_guest::ArrayRef;
use csd_guest::arrow_array::{Array, Float64Array, Int64Array, StringArray};

fn floats(args: &[ArrayRef], i: usize) -> Result<&Float64Array, String> {
    args.get(i)
        .and_then(|a| a.as_any().downcast_ref::<Float64Array>())
        .ok_or_else(|| format!("argument {} is not Float64", i + 1))
}

fn discounted(args: &[ArrayRef]) -> Result<ArrayRef, String> {
    let (price, discount) = (floats(args, 0)?, floats(args, 1)?);
    let out: Float64Array = price
        .iter()
        .zip(discount.iter())
        .map(|(p, d)| Some(p? * (1.0 - d?)))
        .collect();
    Ok(Arc::new(out))
}

fn word_count(args: &[ArrayRef]) -> Result<ArrayRef, String> {
    let text = args
        .first()
        .and_then(|a| a.as_any().downcast_ref::<StringArray>())
        .ok_or("argument 1 is not Utf8")?;
    let out: Int64Array = text
        .iter()
        .map(|t| t.map(|t| t.split_whitespace().count() as i64))
        .collect();
    Ok(Arc::new(out))
}

fn strict_sqrt(args: &[ArrayRef]) -> Result<ArrayRef, String> {
    let x = floats(args, 0)?;
    let mut out = Vec::with_capacity(x.len());
    for v in x.iter() {
        match v {
            Some(v) if v < 0.0 => return Err(format!("strict_sqrt of a negative number: {v}")),
            v => out.push(v.map(f64::sqrt)),
        }
    }
    Ok(Arc::new(Float64Array::from(out)))
}

csd_guest::export_functions! {
    discounted: "Float64, Float64 -> Float64" => discounted,
    word_count: "Utf8 -> Int64" => word_count,
    strict_sqrt: "Float64 -> Float64" => strict_sqrt,
}
