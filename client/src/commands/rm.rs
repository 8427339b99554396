//! `csd rm`: delete a table or one partition (`table/partition`), on every node given.
//!
//! A partition kept in several copies (`csd put --replicas`) may be deleted while
//! fewer nodes are out of reach than it has copies, and while at least as many
//! nodes are reached as it has copies: every node reached first remembers the
//! deleted copies (by their objects' digests), then deletes its own. A node that
//! was out keeps its copy until `csd repair` removes it, and until then no reader
//! reads it: whichever nodes a query reaches (fewer out than copies), one of them
//! remembers the delete. Fewer nodes reached than copies, or a partition that may
//! live on the unreached nodes only, and nothing is deleted.

use std::collections::{BTreeMap, BTreeSet};

use csd_client::{Error, NodeClient, Result};
use csd_protocol::{DeletedCopy, StatusCode};

use super::ClientCreds;

#[derive(clap::Args)]
pub(crate) struct RmArgs {
    /// `table` or `table/partition`.
    target: String,
    /// Node URL (repeat for a partition kept on several nodes, giving every node of
    /// the cluster: the delete must reach every copy or be remembered by enough
    /// nodes that the copies out of reach stay deleted).
    #[arg(long = "node", default_value = "grpc://127.0.0.1:50051")]
    nodes: Vec<String>,
    #[command(flatten)]
    creds: ClientCreds,
}

/// What the nodes reached list of the partitions to delete.
#[derive(Default)]
struct Target {
    /// The fewest copies any of them was put with.
    fewest: Option<u32>,
    /// Their copies as deleted copies (copies that differ are each one).
    copies: Vec<DeletedCopy>,
    /// The partitions listed.
    seen: BTreeSet<String>,
}

pub(crate) async fn run(args: RmArgs) -> Result<()> {
    let RmArgs {
        target,
        nodes,
        creds,
    } = args;
    let (table, partition) = match target.split_once('/') {
        Some((t, p)) => (t, Some(p)),
        None => (target.as_str(), None),
    };
    if let [one] = nodes.as_slice() {
        let n = creds.connect(one).await?.delete(table, partition).await?;
        println!("deleted {target} ({n} objects)");
        return Ok(());
    }
    let mut reached: Vec<NodeClient> = Vec::new();
    let mut out: Vec<String> = Vec::new();
    let mut found = Target::default();
    for url in &nodes {
        let listed = match creds.connect(url).await {
            Ok(c) => c.list_tables(table).await.map(|l| (c, l)),
            Err(Error::Node(e)) => Err(e),
            Err(e) => return Err(e),
        };
        match listed {
            Ok((c, tables)) => {
                for t in tables.iter().filter(|t| t.name == table) {
                    let wanted = t.description.partitions.iter();
                    for p in wanted.filter(|p| partition.is_none_or(|want| p.name == want)) {
                        found.fewest = Some(found.fewest.unwrap_or(u32::MAX).min(p.copies.max(1)));
                        found.seen.insert(p.name.clone());
                        if let Some(d) = DeletedCopy::of(p).filter(|_| p.lost.is_empty())
                            && !found.copies.contains(&d)
                        {
                            found.copies.push(d);
                        }
                    }
                }
                reached.push(c);
            }
            Err(e) if e.node_lost() => out.push(format!("{url} ({e})")),
            Err(e) => return Err(e.into()),
        }
    }
    let Some(fewest) = found.fewest else {
        let none = format!("{target} on none of the {} nodes reached", reached.len());
        if out.is_empty() {
            return Err(Error::Runtime(csd_protocol::Error::NotFound(none)));
        }
        // It may be on the nodes not reached: that is no answer.
        return Err(Error::Runtime(csd_protocol::Error::Unavailable(format!(
            "{none}; not reached, and may hold it: {}; nothing was deleted",
            out.join(", ")
        ))));
    };
    if !out.is_empty()
        && (out.len() as u64 >= u64::from(fewest) || (reached.len() as u64) < u64::from(fewest))
    {
        return Err(Error::Runtime(csd_protocol::Error::Unavailable(format!(
            "not deleting {target}: {} of the nodes cannot be reached ({}), and its \
             partitions are kept in {fewest} {}: {}; nothing was deleted — bring the \
             nodes back and run the same command again",
            out.len(),
            out.join(", "),
            if fewest == 1 { "copy" } else { "copies" },
            if out.len() as u64 >= u64::from(fewest) {
                "a copy may be on those nodes only"
            } else {
                "too few nodes would remember the delete for every reader to see it"
            }
        ))));
    }
    // Partitions none of whose reached copies is whole (objects lost): which
    // digests to remember cannot be told.
    let untold: Vec<&str> = (found.seen.iter())
        .filter(|n| !found.copies.iter().any(|d| d.partition == **n))
        .map(String::as_str)
        .collect();
    if !out.is_empty() && fewest > 1 && !untold.is_empty() {
        return Err(Error::Runtime(csd_protocol::Error::Unavailable(format!(
            "not deleting {target}: {} cannot be reached, and no whole copy of {} was \
             reached to tell the copy there by; nothing was deleted — bring the nodes \
             back (or run `csd repair`) and run the same command again",
            out.join(", "),
            untold.join(", ")
        ))));
    }
    // Copies kept on several nodes are remembered everywhere reached, so that a
    // copy on a node out of reach (now, or cut off by this command stopping
    // half-way) stays deleted.
    let remember = if fewest > 1 { found.copies } else { vec![] };
    let mut deleted = 0;
    let mut per_node: BTreeMap<String, u64> = BTreeMap::new();
    for c in &reached {
        match c
            .delete_remembering(table, partition, remember.clone())
            .await
        {
            Ok(n) => {
                per_node.insert(c.url().to_string(), n);
                deleted += 1;
            }
            Err(e) if e.status_code() == StatusCode::NotFound => {}
            Err(e) => {
                return Err(Error::NodeStep {
                    context: format!(
                        "deleting {target} on {} failed after {deleted} of the nodes deleted \
                         it (run the same command again once it answers)",
                        c.url()
                    ),
                    source: e,
                });
            }
        }
    }
    for (url, n) in per_node.iter().filter(|(_, n)| **n > 0) {
        println!("deleted {target} on {url} ({n} objects)");
    }
    for url in &out {
        println!(
            "not reached: {url}; its copies stay deleted ({} nodes remember the delete), \
             and `csd repair` removes them once it is back",
            reached.len()
        );
    }
    Ok(())
}
