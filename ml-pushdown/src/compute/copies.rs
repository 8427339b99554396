//! A partition's feature stream from its copies (`csd put --replicas`), asked as
//! [`Copies`] decides for every kind of pushed work: of one node, and of the next
//! copy's when that node is lost or hands the partition back for its own load, with
//! the samples already passed on left out by id; run here over a copy's rows when
//! every copy's node was busy or one judged the prefix should run here.

use std::collections::HashSet;

use csd_protocol::node_client::{Copies, Declined, Next, NodeClient, Tried};
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;

use super::boundary::Boundary;
use crate::{Error, Result};

/// Rows of a partition at the split, as one stream.
pub(crate) type Rows = BoxStream<'static, Result<Boundary>>;

/// `partition`'s rows at the split from its copies on `nodes`: `ask` runs the
/// prefix at a copy's node, `here` runs it here over a copy's raw rows. A copy
/// lost mid-stream is replaced by the next, leaving out the samples already passed
/// on (by id), so that none is lost or doubled. Fails only when no copy is left,
/// naming the partition and every node tried.
pub(crate) fn from_copies<F, H>(partition: String, nodes: Vec<NodeClient>, ask: F, here: H) -> Rows
where
    F: Fn(NodeClient) -> BoxFuture<'static, Result<Rows>> + Send + 'static,
    H: Fn(NodeClient) -> BoxFuture<'static, Result<Rows>> + Send + 'static,
{
    /// The rows being passed on, from which copy, and whether they run here.
    struct Current {
        client: NodeClient,
        rows: Rows,
        here: bool,
    }
    struct State<F, H> {
        ask: F,
        here: H,
        partition: String,
        copies: Copies<NodeClient>,
        /// What to do once `current` is gone.
        next: Option<Next<NodeClient>>,
        current: Option<Current>,
        passed: HashSet<u64>,
    }
    let mut copies = Copies::new(nodes);
    let state = State {
        ask,
        here,
        partition,
        next: copies.first().map(Next::Ask),
        copies,
        current: None,
        passed: Default::default(),
    };
    futures::stream::try_unfold(state, |mut st| async move {
        loop {
            let (client, here, failed) = match st.current.as_mut() {
                Some(cur) => match cur.rows.next().await {
                    Some(Ok(b)) => match b.without(&mut st.passed)? {
                        Some(b) => return Ok(Some((b, st))),
                        None => continue,
                    },
                    Some(Err(e)) => {
                        let cur = st.current.take().expect("current");
                        (cur.client, cur.here, e)
                    }
                    None => return Ok(None),
                },
                None => {
                    let (client, here) = match st.next.take() {
                        Some(Next::Ask(client)) => (client, false),
                        Some(Next::Here(client)) => (client, true),
                        Some(Next::NoneLeft) => {
                            return Err(Error::Node(csd_protocol::Error::Unavailable(format!(
                                "no copy of partition {} could be read: tried {}",
                                st.partition,
                                Tried::list(st.copies.tried())
                            ))));
                        }
                        None => return Ok(None),
                    };
                    let opened = match here {
                        false => (st.ask)(client.clone()).await,
                        true => (st.here)(client.clone()).await,
                    };
                    match opened {
                        Ok(rows) => {
                            st.current = Some(Current { client, rows, here });
                            continue;
                        }
                        Err(e) => (client, here, e),
                    }
                }
            };
            // Running here, only a lost node is passed over: anything else it says
            // fails the rows wherever they run.
            let why = match declined(&failed) {
                Some(why) if !here || !why.handed_back_work() => why,
                _ => return Err(failed),
            };
            let at = format!("{}/{}", client.url(), st.partition);
            if let Declined::Lost(_) = why {
                tracing::warn!(partition = %st.partition, node = client.url(), passed = st.passed.len(), "node lost: asking the next copy ({why})");
            }
            st.next = Some(st.copies.declined(client, at, why));
        }
    })
    .boxed()
}

/// What `e` says about the copy's node (see [`Declined::of`]); `None`: the work or
/// the data is wrong, which no other copy cures.
fn declined(e: &Error) -> Option<Declined> {
    match e {
        Error::Client(c) => Declined::of(c),
        Error::Node(n) => matches!(
            n.status_code(),
            csd_protocol::StatusCode::Unavailable | csd_protocol::StatusCode::DataLoss
        )
        .then(|| Declined::Lost(n.to_string())),
        _ => None,
    }
}
