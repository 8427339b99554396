//! Copies of one partition on several nodes (`csd put --replicas N`), merged into one
//! endpoint, and the nodes a table can do without.
//!
//! Every copy is a whole partition, computable in place (no striping): a fragment
//! runs at any one of them. Copies are replicas only when they agree object for
//! object — rows, length and the digest of the bytes each node reports — and a
//! partition whose copies disagree is not read at all (which one is right cannot be
//! told here). Each partition's fragments go to one copy, chosen by the partition's
//! name so that a table's partitions spread over the nodes holding them; the others
//! stand by for when that node is lost (see `scan/stream.rs` and the byte-range
//! store's failover in `range_read.rs`).

use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};

use csd_protocol::DeletedCopy;

use crate::compute::endpoints::Endpoint;

/// `copies` of one partition without those a node remembers deleting (a node that
/// was out of reach when the partition was deleted still lists its copy until
/// `csd repair` removes it).
pub(crate) fn without_deleted(copies: Vec<Endpoint>, deleted: &[DeletedCopy]) -> Vec<Endpoint> {
    copies
        .into_iter()
        .filter(|c| {
            let gone = deleted.iter().any(|d| d.matches(&c.partition, &c.objects));
            if gone {
                tracing::info!(partition = %c.partition, node = %c.client.url(), "a deleted copy, not read");
            }
            !gone
        })
        .collect()
}

/// Copies of a partition that are not the same data.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CopiesDiffer {
    table: String,
    partition: String,
    /// The nodes of the first copy and of the one that differs.
    nodes: (String, String),
    how: Box<Difference>,
}

impl fmt::Display for CopiesDiffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "partition {} of table {} is stored on {} and on {}, and the copies differ \
             ({}): they are not replicas of each other; delete the wrong one (`csd rm`) \
             or put the partition again",
            self.partition, self.table, self.nodes.0, self.nodes.1, self.how
        )
    }
}

/// How two copies differ: the first difference found, object by object.
#[derive(Debug, Clone, PartialEq)]
enum Difference {
    Rows(u64, u64),
    Objects(usize, usize),
    /// An object's name, rows and bytes in each.
    Object((String, u64, u64), (String, u64, u64)),
    /// An object's name and digest in each.
    Digest((String, u32), (String, u32)),
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Difference::Rows(a, b) => write!(f, "{a} rows against {b}"),
            Difference::Objects(a, b) => write!(f, "{a} objects against {b}"),
            Difference::Object((x, xr, xl), (y, yr, yl)) => write!(
                f,
                "{x} ({xr} rows, {xl} bytes) against {y} ({yr} rows, {yl} bytes)"
            ),
            Difference::Digest((x, dx), (y, dy)) => {
                write!(f, "{x} has digest {dx:08x}, {y} has {dy:08x}")
            }
        }
    }
}

/// One partition from its copies (in node order, at least one): the copy that
/// serves it, the others as its replicas; `Err` when the copies are not the same
/// data.
pub(crate) fn merge_copies(
    table: &str,
    mut copies: Vec<Endpoint>,
) -> std::result::Result<Option<Endpoint>, CopiesDiffer> {
    let Some(first) = copies.first() else {
        return Ok(None);
    };
    for other in &copies[1..] {
        if let Err(how) = same_data(first, other) {
            return Err(CopiesDiffer {
                table: table.to_string(),
                partition: first.partition.clone(),
                nodes: (
                    first.client.url().to_string(),
                    other.client.url().to_string(),
                ),
                how: Box::new(how),
            });
        }
    }
    let mut h = DefaultHasher::new();
    (table, &first.partition).hash(&mut h);
    let serving = (h.finish() % copies.len() as u64) as usize;
    let mut primary = copies.remove(serving);
    primary.replicas = copies;
    Ok(Some(primary))
}

/// How `a` and `b` differ, if they do: object by object, rows, length and digest
/// (a digest either node does not report is not compared).
fn same_data(a: &Endpoint, b: &Endpoint) -> std::result::Result<(), Difference> {
    if a.rows != b.rows {
        return Err(Difference::Rows(a.rows, b.rows));
    }
    if a.objects.len() != b.objects.len() {
        return Err(Difference::Objects(a.objects.len(), b.objects.len()));
    }
    for (x, y) in a.objects.iter().zip(&b.objects) {
        if x.rows != y.rows || x.len != y.len {
            return Err(Difference::Object(
                (x.name.clone(), x.rows, x.len),
                (y.name.clone(), y.rows, y.len),
            ));
        }
        if let (Some(dx), Some(dy)) = (x.digest, y.digest)
            && dx != dy
        {
            return Err(Difference::Digest(
                (x.name.clone(), dx),
                (y.name.clone(), dy),
            ));
        }
    }
    Ok(())
}

/// Why a table cannot be read with `out` of its nodes out of reach, if it cannot:
/// a partition kept in `copies` copies (the fewest of any partition the reachable
/// nodes list) may be on `copies` of the unreachable nodes only, and then nobody
/// here knows it exists — reading the rest would silently drop its rows.
pub(crate) fn unreachable_loses(
    table: &str,
    copies: u32,
    out: &[(String, String)],
) -> Option<String> {
    if out.is_empty() || (out.len() as u64) < u64::from(copies) {
        return None;
    }
    let nodes: Vec<String> = out.iter().map(|(u, why)| format!("{u} ({why})")).collect();
    Some(format!(
        "table {table} cannot be read whole: {} of its nodes cannot be reached ({}) and \
         its partitions are kept in {copies} {}, so some may be on those nodes only; \
         bring them back, or store the table with `csd put --replicas` above {}",
        out.len(),
        nodes.join(", "),
        if copies == 1 { "copy" } else { "copies" },
        out.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_survives_fewer_lost_nodes_than_copies() {
        let out = vec![("grpc://a".to_string(), "refused".to_string())];
        assert!(unreachable_loses("t", 2, &out).is_none());
        assert!(unreachable_loses("t", 1, &[]).is_none());
        let why = unreachable_loses("t", 1, &out).unwrap();
        assert!(
            why.contains("grpc://a (refused)") && why.contains("1 copy"),
            "{why}"
        );
        let two = vec![out[0].clone(), ("grpc://b".into(), "timed out".into())];
        assert!(unreachable_loses("t", 2, &two).is_some());
    }
}
