//! `csd put --replicas N`: one file stored whole as the same partition on N nodes,
//! read once and written to all of them at the same time, acknowledged once every
//! copy is durable, nothing left behind when one fails.

use std::path::Path;

use arrow::array::RecordBatch;
use csd_client::{Error, NodeClient, Result};
use csd_protocol::node_client::{Error as NodeError, Result as NodeResult};
use tokio::sync::mpsc;

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
                 (`csd rm {table}/{partition}` with every node; a copy left by a delete \
                 made while that node was out of reach is removed by `csd repair`)",
                c.url()
            )));
        }
    }
    // Every copy carries this put's name: a copy deleted later is known by its
    // digests, which no other put of the partition (even of the same rows) shares.
    let put = format!("{:016x}", rand::random::<u64>());
    // The file is read once; every copy is written at the same time from it.
    let (schema, bar, rx) = read_file(file.to_path_buf())?;
    let (feeds, inputs): (Vec<_>, Vec<_>) = clients.iter().map(|_| mpsc::channel(4)).unzip();
    let tee = tokio::spawn(tee(rx, feeds));
    let puts = futures::future::join_all(clients.iter().zip(inputs).map(|(c, input)| {
        c.put_copy(
            table,
            partition,
            copies,
            Some(&put),
            schema.clone(),
            tokio_stream::wrappers::ReceiverStream::new(input),
        )
    }))
    .await;
    bar.finish_and_clear();
    let read = tee
        .await
        .map_err(|e| Error::InvalidInput(format!("reading {}: {e}", file.display())))?;
    let mut stored = Vec::new();
    let mut failed = None;
    for (c, put) in clients.iter().zip(puts) {
        match put {
            Ok(s) => stored.push((c, s)),
            Err(e) => failed = failed.or(Some((c, e))),
        }
    }
    let failure = match (read, failed) {
        (Err(e), _) => Some((
            format!("reading {} for {table}/{partition} failed", file.display()),
            e,
        )),
        (Ok(()), Some((c, e))) => Some((
            format!(
                "storing a copy of {table}/{partition} on {} failed",
                c.url()
            ),
            e,
        )),
        (Ok(()), None) => None,
    };
    if let Some((what, source)) = failure {
        let undone = undo(&stored, table, partition).await;
        return Err(Error::NodeStep {
            context: format!("{what} ({undone})"),
            source,
        });
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

/// Feeds every copy's upload each batch read (a copy whose upload failed has gone:
/// the others go on). A read error stops every upload and is returned.
async fn tee(
    mut read: mpsc::Receiver<NodeResult<RecordBatch>>,
    feeds: Vec<mpsc::Sender<NodeResult<RecordBatch>>>,
) -> NodeResult<()> {
    while let Some(item) = read.recv().await {
        match item {
            Ok(batch) => {
                for feed in &feeds {
                    let _ = feed.send(Ok(batch.clone())).await;
                }
            }
            Err(e) => {
                for feed in &feeds {
                    let _ = feed
                        .send(Err(NodeError::InvalidInput(
                            "the input file could not be read".into(),
                        )))
                        .await;
                }
                return Err(e);
            }
        }
    }
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
