//! `csd repair`: every partition back to the copies it was put with.
//!
//! Lists every node's partitions, verifies each copy (the node scrubs the copy's
//! objects from its device; objects the node has lost count as damage), and where a
//! partition has fewer good copies than it was put with (`csd put --replicas`),
//! deletes the damaged copies and copies a good one, byte for byte, to the nodes
//! that should hold it (placement first, then any node without a copy). A copy
//! that a node remembers deleting (`csd rm` while its node was out of reach) is
//! deleted where it still is. Copies that are whole but differ from each other are
//! reported and left alone: which one is right cannot be told here. Safe to run at
//! any time and again: a second run finds nothing to do.

use std::collections::BTreeMap;

use csd_client::{Error, NodeClient, Result};
use csd_protocol::{DeletedCopy, PartitionDescription};

use super::ClientCreds;

#[derive(clap::Args)]
pub(crate) struct RepairArgs {
    /// Node URL (repeat: every node of the cluster, in any order).
    #[arg(long = "node", required = true)]
    nodes: Vec<String>,
    /// Only this table.
    #[arg(long)]
    table: Option<String>,
    #[command(flatten)]
    creds: ClientCreds,
}

/// One node's copy of a partition, and whether it verified.
struct Copy {
    node: usize,
    description: PartitionDescription,
    /// Why it is not a good copy, if it is not.
    damage: Option<String>,
}

#[derive(Default)]
struct Tally {
    partitions: u64,
    verified: u64,
    copied: u64,
    replaced: u64,
    /// Copies a node still held of a partition deleted while it was out of reach.
    deletes_applied: u64,
    short: Vec<String>,
}

pub(crate) async fn run(args: RepairArgs) -> Result<()> {
    let RepairArgs {
        nodes,
        table,
        creds,
    } = args;
    let mut clients: Vec<Option<NodeClient>> = Vec::new();
    for url in &nodes {
        match creds.connect(url).await {
            Ok(c) => clients.push(Some(c)),
            Err(e) => {
                println!("{url}: not reached ({e}); its copies are not counted");
                clients.push(None);
            }
        }
    }
    // Every listing first: a node may remember deleting a copy another holds.
    let mut listed: Vec<(usize, String, PartitionDescription)> = Vec::new();
    let mut deleted: BTreeMap<String, Vec<DeletedCopy>> = BTreeMap::new();
    for (i, c) in clients.iter().enumerate() {
        let Some(c) = c else { continue };
        for t in c.list_tables("").await? {
            if table.as_ref().is_some_and(|want| *want != t.name) {
                continue;
            }
            deleted
                .entry(t.name.clone())
                .or_default()
                .extend(t.description.deleted);
            listed.extend(
                t.description
                    .partitions
                    .into_iter()
                    .map(|p| (i, t.name.clone(), p)),
            );
        }
    }
    let mut tally = Tally::default();
    let mut partitions: BTreeMap<(String, String), Vec<Copy>> = BTreeMap::new();
    for (i, t, p) in listed {
        let Some(c) = &clients[i] else { continue };
        if deleted
            .get(&t)
            .is_some_and(|ds| ds.iter().any(|d| d.matches(&p.name, &p.objects)))
        {
            c.delete(&t, Some(&p.name)).await?;
            println!(
                "{t}/{} on {}: deleted (a delete made while it was out of reach)",
                p.name, nodes[i]
            );
            tally.deletes_applied += 1;
            continue;
        }
        let damage = verify(c, &t, &p).await?;
        partitions
            .entry((t.clone(), p.name.clone()))
            .or_default()
            .push(Copy {
                node: i,
                description: p,
                damage,
            });
    }
    for ((t, p), copies) in &partitions {
        tally.partitions += 1;
        repair(&clients, &nodes, t, p, copies, &mut tally).await?;
    }
    println!(
        "repair: {} partitions on {} of {} nodes; {} copies verified, {} copied, {} damaged \
         copies replaced, {} deleted copies removed",
        tally.partitions,
        clients.iter().filter(|c| c.is_some()).count(),
        nodes.len(),
        tally.verified,
        tally.copied,
        tally.replaced,
        tally.deletes_applied
    );
    if tally.short.is_empty() {
        return Ok(());
    }
    Err(Error::Runtime(csd_protocol::Error::Unavailable(format!(
        "{} partition(s) are still short of good copies: {}",
        tally.short.len(),
        tally.short.join("; ")
    ))))
}

/// Why `node`'s copy of `table`/`p` is damaged, if it is: objects it has lost, or
/// ranges its scrub found wrong.
async fn verify(
    node: &NodeClient,
    table: &str,
    p: &PartitionDescription,
) -> Result<Option<String>> {
    if let Some(lost) = p.lost.first() {
        return Ok(Some(format!("lost an object: {lost}")));
    }
    let report = node.scrub(&format!("{table}/{}/", p.name)).await?;
    Ok(report
        .damaged
        .first()
        .map(|d| format!("{} damaged range(s), the first {d}", report.damaged_count)))
}

/// How `a` and `b`, both whole, differ, if they do.
fn differ(a: &PartitionDescription, b: &PartitionDescription) -> Option<String> {
    if a.objects.len() != b.objects.len() {
        return Some(format!(
            "{} objects against {}",
            a.objects.len(),
            b.objects.len()
        ));
    }
    a.objects.iter().zip(&b.objects).find_map(|(x, y)| {
        (x.len != y.len || x.rows != y.rows || x.digest != y.digest).then(|| {
            format!(
                "{} ({} bytes, digest {:?}) against {} ({} bytes, digest {:?})",
                x.name, x.len, x.digest, y.name, y.len, y.digest
            )
        })
    })
}

async fn repair(
    clients: &[Option<NodeClient>],
    urls: &[String],
    table: &str,
    partition: &str,
    copies: &[Copy],
    tally: &mut Tally,
) -> Result<()> {
    let wanted = copies
        .iter()
        .map(|c| c.description.copies.max(1) as usize)
        .max()
        .unwrap_or(1);
    let good: Vec<&Copy> = copies.iter().filter(|c| c.damage.is_none()).collect();
    tally.verified += good.len() as u64;
    let Some(source) = good.first() else {
        for c in copies {
            println!(
                "{table}/{partition} on {}: damaged ({}); no good copy is left anywhere \
                 reached: put the partition again",
                urls[c.node],
                c.damage.as_deref().unwrap_or_default()
            );
        }
        tally
            .short
            .push(format!("{table}/{partition} (no good copy)"));
        return Ok(());
    };
    if let Some(other) = good[1..]
        .iter()
        .find_map(|c| differ(&source.description, &c.description).map(|d| (c.node, d)))
    {
        println!(
            "{table}/{partition}: the copies on {} and {} differ ({}); left alone: delete the \
             wrong one (`csd rm`) and run repair again",
            urls[source.node], urls[other.0], other.1
        );
        tally
            .short
            .push(format!("{table}/{partition} (copies differ)"));
        return Ok(());
    }
    if good.len() >= wanted && good.len() == copies.len() {
        return Ok(());
    }
    // Damaged copies go first: their nodes are where the partition was placed.
    let mut free: Vec<usize> = Vec::new();
    for c in copies.iter().filter(|c| c.damage.is_some()) {
        let Some(node) = &clients[c.node] else {
            continue;
        };
        node.delete(table, Some(partition)).await?;
        println!(
            "{table}/{partition} on {}: damaged copy deleted ({})",
            urls[c.node],
            c.damage.as_deref().unwrap_or_default()
        );
        free.push(c.node);
    }
    let holding: Vec<usize> = good.iter().map(|c| c.node).collect();
    // Then the nodes placement picks for the partition, then any other reached.
    let placed = csd_client::placement::nodes_for(table, partition, urls, urls.len())
        .unwrap_or_else(|_| urls.iter().collect());
    for url in placed {
        let Some(i) = urls.iter().position(|u| u == url) else {
            continue;
        };
        if !free.contains(&i) && !holding.contains(&i) {
            free.push(i);
        }
    }
    let mut have = good.len();
    for target in free {
        if have >= wanted {
            break;
        }
        let (Some(to), Some(from)) = (&clients[target], &clients[source.node]) else {
            continue;
        };
        match copy_partition(from, to, table, partition, &source.description).await {
            Ok(bytes) => {
                println!(
                    "{table}/{partition}: copied from {} to {} ({} objects, {bytes} bytes)",
                    urls[source.node],
                    urls[target],
                    source.description.objects.len()
                );
                have += 1;
                if copies.iter().any(|c| c.node == target) {
                    tally.replaced += 1;
                } else {
                    tally.copied += 1;
                }
            }
            Err(e) => println!(
                "{table}/{partition}: copying from {} to {} failed ({e}); nothing left there",
                urls[source.node], urls[target]
            ),
        }
    }
    if have < wanted {
        tally
            .short
            .push(format!("{table}/{partition} ({have} of {wanted} copies)"));
    }
    Ok(())
}

/// Copies every object of `p` from `from` to `to`, byte for byte; on a failure, what
/// was copied is deleted again.
async fn copy_partition(
    from: &NodeClient,
    to: &NodeClient,
    table: &str,
    partition: &str,
    p: &PartitionDescription,
) -> Result<u64> {
    let mut bytes = 0;
    for o in &p.objects {
        match to.copy_object_from(from, table, partition, o).await {
            Ok(s) => bytes += s.bytes,
            Err(e) => {
                if bytes > 0 {
                    let _ = to.delete(table, Some(partition)).await;
                }
                return Err(e.into());
            }
        }
    }
    Ok(bytes)
}
