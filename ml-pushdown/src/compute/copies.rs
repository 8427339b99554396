//! A partition's feature stream from its copies (`csd put --replicas`): asked of one
//! node, and of the next copy's when that node is lost, with the samples already
//! passed on left out by id.

use std::collections::{HashSet, VecDeque};

use csd_protocol::node_client::NodeClient;
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;

use super::boundary::Boundary;
use crate::{Error, Result};

/// `partition`'s rows at the split from its copies on `nodes`: asked of the first,
/// and should that node be lost (out of reach, killed mid-stream, DATA_LOSS: see
/// `node_lost`), of the next, leaving out the samples already passed on (by id), so
/// that none is lost or doubled. Fails only when no copy is left, naming the
/// partition and every node tried.
pub(crate) fn from_copies<F>(
    partition: String,
    nodes: VecDeque<NodeClient>,
    ask: F,
) -> BoxStream<'static, Result<Boundary>>
where
    F: Fn(NodeClient) -> BoxFuture<'static, Result<BoxStream<'static, Result<Boundary>>>>
        + Send
        + 'static,
{
    struct Copies<F> {
        ask: F,
        partition: String,
        next: VecDeque<NodeClient>,
        current: Option<(String, BoxStream<'static, Result<Boundary>>)>,
        passed: HashSet<u64>,
        tried: Vec<String>,
    }
    let state = Copies {
        ask,
        partition,
        next: nodes,
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
                    let Some(client) = st.next.pop_front() else {
                        return Ok(None);
                    };
                    let url = client.url().to_string();
                    match (st.ask)(client).await {
                        Ok(s) => {
                            st.current = Some((url, s));
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
            if st.next.is_empty() {
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
