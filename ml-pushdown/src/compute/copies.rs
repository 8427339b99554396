//! A partition's feature stream from its copies (`csd put --replicas`): asked of one
//! node, and of the next copy's when that node is lost or hands the partition back
//! for its own load, with the samples already passed on left out by id; run here
//! only when every copy's node was busy.

use std::collections::{HashSet, VecDeque};

use csd_protocol::node_client::NodeClient;
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;

use super::boundary::Boundary;
use crate::{Error, Result};

/// Rows of a partition at the split, as one stream.
pub(crate) type Rows = BoxStream<'static, Result<Boundary>>;

/// What asking one copy's node gave.
pub(crate) enum Asked {
    /// Its rows at the split (run there, or here when the node judged they should
    /// be).
    Rows(Rows),
    /// The node handed the partition back for its own load (its admission: why),
    /// which another copy's node may not share.
    Busy(String),
}

/// `partition`'s rows at the split from its copies on `nodes`: asked of the first,
/// and should that node be lost (out of reach, killed mid-stream, DATA_LOSS: see
/// `node_lost`) or busy, of the next, leaving out the samples already passed on (by
/// id), so that none is lost or doubled; when every copy left was busy, `here` runs
/// the partition here over a busy copy's rows. Fails only when no copy is left,
/// naming the partition and every node tried.
pub(crate) fn from_copies<F, H>(
    partition: String,
    nodes: VecDeque<NodeClient>,
    ask: F,
    here: H,
) -> Rows
where
    F: Fn(NodeClient) -> BoxFuture<'static, Result<Asked>> + Send + 'static,
    H: Fn(NodeClient) -> BoxFuture<'static, Result<Rows>> + Send + 'static,
{
    struct Copies<F, H> {
        ask: F,
        here: H,
        partition: String,
        next: VecDeque<NodeClient>,
        /// Copies whose nodes handed the partition back, in the order asked.
        busy: VecDeque<NodeClient>,
        current: Option<(String, Rows)>,
        passed: HashSet<u64>,
        tried: Vec<String>,
    }
    let state = Copies {
        ask,
        here,
        partition,
        next: nodes,
        busy: VecDeque::new(),
        current: None,
        passed: Default::default(),
        tried: Vec::new(),
    };
    futures::stream::try_unfold(state, |mut st| async move {
        loop {
            let failed = match st.current.as_mut() {
                Some((_, s)) => match s.next().await {
                    Some(Ok(b)) => match b.without(&mut st.passed)? {
                        Some(b) => return Ok(Some((b, st))),
                        None => continue,
                    },
                    Some(Err(e)) => e,
                    None => return Ok(None),
                },
                None => {
                    let url;
                    let asked = match st.next.pop_front() {
                        Some(client) => {
                            url = client.url().to_string();
                            (st.ask)(client.clone())
                                .await
                                .map(|a| (a, Some(client)))
                        }
                        None => {
                            let Some(client) = st.busy.pop_front() else {
                                return Ok(None);
                            };
                            url = client.url().to_string();
                            (st.here)(client).await.map(|r| (Asked::Rows(r), None))
                        }
                    };
                    match asked {
                        Ok((Asked::Rows(s), _)) => {
                            st.current = Some((url, s));
                            continue;
                        }
                        Ok((Asked::Busy(why), client)) => {
                            tracing::info!(partition = %st.partition, node = %url, "handed back ({why}): asking the next copy");
                            st.busy.extend(client);
                            continue;
                        }
                        Err(e) => {
                            st.current = Some((url, futures::stream::empty().boxed()));
                            e
                        }
                    }
                }
            };
            let url = st.current.take().map(|(u, _)| u).unwrap_or_default();
            if !node_lost(&failed) {
                return Err(failed);
            }
            st.tried.push(format!("{url} ({failed})"));
            if st.next.is_empty() && st.busy.is_empty() {
                return Err(Error::Node(csd_protocol::Error::Unavailable(format!(
                    "no copy of partition {} could be read: tried {}",
                    st.partition,
                    st.tried.join(", ")
                ))));
            }
            tracing::warn!(
                partition = %st.partition,
                node = %url,
                passed = st.passed.len(),
                "node lost: asking the next copy ({failed})"
            );
        }
    })
    .boxed()
}

/// Whether `e` says the node is lost (another copy can answer), not that the work
/// or the data is wrong.
fn node_lost(e: &Error) -> bool {
    match e {
        Error::Client(c) => c.node_lost(),
        Error::Node(n) => matches!(
            n.status_code(),
            csd_protocol::StatusCode::Unavailable | csd_protocol::StatusCode::DataLoss
        ),
        _ => false,
    }
}
