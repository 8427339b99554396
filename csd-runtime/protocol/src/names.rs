//! What a table or partition may be called: names travel in descriptors, tickets
//! and requests, and both sides check them alike.

use crate::error::{Error, Result, truncated};

/// Table names: SQL identifiers (`[A-Za-z_][A-Za-z0-9_]*`, at most 128 bytes).
pub fn validate_table_name(name: &str) -> Result<()> {
    let mut b = name.bytes();
    let ok = name.len() <= 128
        && b.next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "table name {:?} is not an identifier ([A-Za-z_][A-Za-z0-9_]*, at most 128 bytes)",
            truncated(name)
        )))
    }
}

/// Partition names: 1-128 bytes of `[A-Za-z0-9_=.-]`, not `.` or `..`.
pub fn validate_partition_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"_=.-".contains(&c));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "partition name {:?} is invalid (1-128 of A-Z a-z 0-9 _ = . -)",
            truncated(name)
        )))
    }
}
