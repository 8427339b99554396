//! `csd put --replicas N`: one file stored whole as the same partition on N nodes,
//! acknowledged once every copy is durable, nothing left behind when one fails.

use std::path::Path;

use csd_client::{Error, NodeClient, Result};

use super::ClientCreds;
use super::put_file::read_file;

/// Stores `file` as `table`/`partition` on the `copies` nodes of `nodes` that
/// [`csd_client::placement`] picks.
pub(crate) async fn run(
    creds: &ClientCreds,
    file: &Path,
    table: &str,
    partition: &str,
    nodes: &[String],
    copies: u32,
) -> Result<()> {
    let chosen = csd_client::placement::nodes_for(table, partition, nodes, copies as usize)
        .map_err(Error::InvalidInput)?;
    // Every node first: one out of reach stores nothing anywhere.
    let mut clients: Vec<NodeClient> = Vec::new();
    for url in &chosen {
        clients.push(creds.connect(url).await?);
    }
    for c in &clients {
        if let Ok(t) = c.table(table).await
            && t.description.partitions.iter().any(|p| p.name == partition)
        {
            return Err(Error::InvalidInput(format!(
                "partition {partition} of table {table} already exists on {}: copies are \
                 written whole, so give a new partition name or delete it first \
                 (`csd rm --table {table} --partition {partition}` on each node)",
                c.url()
            )));
        }
    }
    let mut stored = Vec::new();
    for c in &clients {
        let (schema, bar, rx) = read_file(file.to_path_buf())?;
        let put = c
            .put_copy(
                table,
                partition,
                copies,
                schema,
                tokio_stream::wrappers::ReceiverStream::new(rx),
            )
            .await;
        bar.finish_and_clear();
        match put {
            Ok(s) => stored.push((c, s)),
            Err(e) => {
                let undone = undo(&stored, table, partition).await;
                return Err(Error::NodeStep {
                    context: format!(
                        "storing copy {} of {copies} of {table}/{partition} on {} failed ({undone})",
                        stored.len() + 1,
                        c.url()
                    ),
                    source: e,
                });
            }
        }
    }
    for (c, s) in &stored {
        println!(
            "stored {} rows of {} into {}/{} on {} as {} ({} bytes, {} row groups)",
            s.rows,
            file.display(),
            s.table,
            s.partition,
            c.url(),
            s.object,
            s.bytes,
            s.row_groups
        );
    }
    println!("{copies} copies of {table}/{partition} are durable");
    Ok(())
}

/// Deletes the copies already stored; says what it did.
async fn undo(
    stored: &[(&NodeClient, csd_protocol::PutSummary)],
    table: &str,
    partition: &str,
) -> String {
    if stored.is_empty() {
        return "no copy was stored".into();
    }
    let mut said = Vec::new();
    for (c, _) in stored {
        match c.delete(table, Some(partition)).await {
            Ok(_) => said.push(format!("deleted the copy on {}", c.url())),
            Err(e) => said.push(format!(
                "the copy on {} could not be deleted ({e}): delete it with `csd rm`",
                c.url()
            )),
        }
    }
    said.join("; ")
}
