//! Why a hash join's build side gives the scans it filters no key filter: the scans
//! then run unfiltered and the join above stays exact, so a reason is only ever
//! shown (in `EXPLAIN ANALYZE` and the logs), never acted on. A collector finds one
//! of its own, or a key board on another worker finds one (see
//! `compute::distributed::keys`); reasons cross between workers as [`NoFilterMsg`].

use std::time::Duration;

/// Why there is no join-key filter.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum NoFilter {
    /// More distinct keys than a filter is built for.
    #[error("more than {max} distinct build keys")]
    TooManyKeys { max: u64 },
    /// The distinct keys, all seen, do not fit a filter.
    #[error("{keys} distinct build keys do not fit a filter")]
    TooBig { keys: u64 },
    /// The key expressions could not be evaluated or hashed over a batch.
    #[error("the build keys could not be hashed: {0}")]
    Unhashable(String),
    /// The build side failed (its error is the join's to report).
    #[error("build side failed: {0}")]
    BuildFailed(String),
    /// The build side's stream was dropped before its end.
    #[error("build side stopped before its end")]
    BuildStopped,
    /// The build side had not finished when the scan's wait was over.
    #[error("build side not finished after {0:?}")]
    BuildLate(Duration),
    /// A thread panicked while holding the collector.
    #[error("key collector poisoned")]
    Poisoned,
    /// One build task of another stage had no keys to give.
    #[error("build task {task} has no keys: {why}")]
    TaskGaveUp { task: u32, why: Box<NoFilter> },
    /// Build tasks named different task counts for one set.
    #[error("build tasks disagree on their number ({0} and {1})")]
    TasksDisagree(u32, u32),
    /// The board's worker holds as many keys as it will.
    #[error("the worker holds {held} join keys already, at most {max}")]
    BoardFull { held: u64, max: u64 },
    /// Not every build task had published within the scan's wait.
    #[error("{have} of {} build tasks had published after {wait:?}", of.map_or("?".to_string(), |t| t.to_string()))]
    TasksLate {
        have: u32,
        of: Option<u32>,
        wait: Duration,
    },
    /// The board forgot the set (it expired).
    #[error("the set was forgotten")]
    Forgotten,
    /// The board's worker could not be reached, or answered with an error.
    #[error("the key board at {}: {}", .0.home, .0.why)]
    Unreachable(AtWorker),
    /// The board's worker answered with something that does not decode.
    #[error("worker {}: a bad answer about join keys: {}", .0.home, .0.why)]
    BadAnswer(AtWorker),
    /// Another worker sent a reason this one cannot read (a newer worker's, or one
    /// damaged on the way).
    #[error("a reason this worker cannot read")]
    Unreadable,
}

/// A [`NoFilter`] on the wire between workers.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct NoFilterMsg {
    #[prost(
        oneof = "Reason",
        tags = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15"
    )]
    reason: Option<Reason>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Reason {
    #[prost(uint64, tag = "1")]
    TooManyKeys(u64),
    #[prost(uint64, tag = "2")]
    TooBig(u64),
    #[prost(string, tag = "3")]
    Unhashable(String),
    #[prost(string, tag = "4")]
    BuildFailed(String),
    #[prost(message, tag = "5")]
    BuildStopped(Nothing),
    #[prost(uint64, tag = "6")]
    BuildLateMs(u64),
    #[prost(message, tag = "7")]
    Poisoned(Nothing),
    #[prost(message, tag = "8")]
    TaskGaveUp(GaveUpMsg),
    #[prost(message, tag = "9")]
    TasksDisagree(PairMsg),
    #[prost(message, tag = "10")]
    BoardFull(PairMsg),
    #[prost(message, tag = "11")]
    TasksLate(LateMsg),
    #[prost(message, tag = "12")]
    Forgotten(Nothing),
    #[prost(message, tag = "13")]
    Unreachable(AtWorker),
    #[prost(message, tag = "14")]
    BadAnswer(AtWorker),
    #[prost(message, tag = "15")]
    Unreadable(Nothing),
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
struct Nothing {}

#[derive(Clone, PartialEq, prost::Message)]
struct GaveUpMsg {
    #[prost(uint32, tag = "1")]
    task: u32,
    #[prost(message, optional, boxed, tag = "2")]
    why: Option<Box<NoFilterMsg>>,
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
struct PairMsg {
    #[prost(uint64, tag = "1")]
    a: u64,
    #[prost(uint64, tag = "2")]
    b: u64,
}

#[derive(Clone, Copy, PartialEq, prost::Message)]
struct LateMsg {
    #[prost(uint32, tag = "1")]
    have: u32,
    #[prost(uint32, optional, tag = "2")]
    of: Option<u32>,
    #[prost(uint64, tag = "3")]
    wait_ms: u64,
}

/// What went wrong at (or on the way to) a key board's worker, and which worker.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub(crate) struct AtWorker {
    /// The worker (`http://host:port`).
    #[prost(string, tag = "1")]
    pub(crate) home: String,
    /// What went wrong there.
    #[prost(string, tag = "2")]
    pub(crate) why: String,
}

impl From<&NoFilter> for NoFilterMsg {
    fn from(n: &NoFilter) -> Self {
        let ms = |d: &Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let reason = match n {
            NoFilter::TooManyKeys { max } => Reason::TooManyKeys(*max),
            NoFilter::TooBig { keys } => Reason::TooBig(*keys),
            NoFilter::Unhashable(e) => Reason::Unhashable(e.clone()),
            NoFilter::BuildFailed(e) => Reason::BuildFailed(e.clone()),
            NoFilter::BuildStopped => Reason::BuildStopped(Nothing {}),
            NoFilter::BuildLate(d) => Reason::BuildLateMs(ms(d)),
            NoFilter::Poisoned => Reason::Poisoned(Nothing {}),
            NoFilter::TaskGaveUp { task, why } => Reason::TaskGaveUp(GaveUpMsg {
                task: *task,
                why: Some(Box::new(NoFilterMsg::from(&**why))),
            }),
            NoFilter::TasksDisagree(a, b) => Reason::TasksDisagree(PairMsg {
                a: u64::from(*a),
                b: u64::from(*b),
            }),
            NoFilter::BoardFull { held, max } => Reason::BoardFull(PairMsg { a: *held, b: *max }),
            NoFilter::TasksLate { have, of, wait } => Reason::TasksLate(LateMsg {
                have: *have,
                of: *of,
                wait_ms: ms(wait),
            }),
            NoFilter::Forgotten => Reason::Forgotten(Nothing {}),
            NoFilter::Unreachable(at) => Reason::Unreachable(at.clone()),
            NoFilter::BadAnswer(at) => Reason::BadAnswer(at.clone()),
            NoFilter::Unreadable => Reason::Unreadable(Nothing {}),
        };
        NoFilterMsg {
            reason: Some(reason),
        }
    }
}

impl From<NoFilterMsg> for NoFilter {
    /// The reason a message from another worker says; one that names none this
    /// worker knows is [`NoFilter::Unreadable`].
    fn from(m: NoFilterMsg) -> Self {
        let narrow = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
        let Some(r) = m.reason else {
            return NoFilter::Unreadable;
        };
        match r {
            Reason::TooManyKeys(max) => NoFilter::TooManyKeys { max },
            Reason::TooBig(keys) => NoFilter::TooBig { keys },
            Reason::Unhashable(e) => NoFilter::Unhashable(e),
            Reason::BuildFailed(e) => NoFilter::BuildFailed(e),
            Reason::BuildStopped(_) => NoFilter::BuildStopped,
            Reason::BuildLateMs(ms) => NoFilter::BuildLate(Duration::from_millis(ms)),
            Reason::Poisoned(_) => NoFilter::Poisoned,
            Reason::TaskGaveUp(g) => NoFilter::TaskGaveUp {
                task: g.task,
                why: Box::new(g.why.map_or(NoFilter::Unreadable, |w| NoFilter::from(*w))),
            },
            Reason::TasksDisagree(p) => NoFilter::TasksDisagree(narrow(p.a), narrow(p.b)),
            Reason::BoardFull(p) => NoFilter::BoardFull {
                held: p.a,
                max: p.b,
            },
            Reason::TasksLate(l) => NoFilter::TasksLate {
                have: l.have,
                of: l.of,
                wait: Duration::from_millis(l.wait_ms),
            },
            Reason::Forgotten(_) => NoFilter::Forgotten,
            Reason::Unreachable(at) => NoFilter::Unreachable(at),
            Reason::BadAnswer(at) => NoFilter::BadAnswer(at),
            Reason::Unreadable(_) => NoFilter::Unreadable,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use prost::Message;

    /// Every reason crosses the wire and comes back the same, nested ones too.
    #[test]
    fn every_reason_survives_the_wire() {
        let all = [
            NoFilter::TooManyKeys { max: 7 },
            NoFilter::TooBig { keys: 9 },
            NoFilter::Unhashable("bad cast".into()),
            NoFilter::BuildFailed("boom".into()),
            NoFilter::BuildStopped,
            NoFilter::BuildLate(Duration::from_millis(1500)),
            NoFilter::Poisoned,
            NoFilter::TaskGaveUp {
                task: 3,
                why: Box::new(NoFilter::BuildFailed("disk".into())),
            },
            NoFilter::TasksDisagree(2, 3),
            NoFilter::BoardFull { held: 10, max: 8 },
            NoFilter::TasksLate {
                have: 1,
                of: Some(2),
                wait: Duration::from_millis(50),
            },
            NoFilter::TasksLate {
                have: 0,
                of: None,
                wait: Duration::from_secs(1),
            },
            NoFilter::Forgotten,
            NoFilter::Unreachable(AtWorker {
                home: "http://w:1".into(),
                why: "refused".into(),
            }),
            NoFilter::BadAnswer(AtWorker {
                home: "http://w:1".into(),
                why: "garbage".into(),
            }),
            NoFilter::Unreadable,
        ];
        for n in all {
            let bytes = NoFilterMsg::from(&n).encode_to_vec();
            let back = NoFilter::from(NoFilterMsg::decode(bytes.as_slice()).unwrap());
            assert_eq!(back, n);
        }
    }

    #[test]
    fn a_reason_naming_none_it_knows_is_unreadable() {
        assert_eq!(NoFilter::from(NoFilterMsg::default()), NoFilter::Unreadable);
        assert_eq!(
            NoFilter::TasksLate {
                have: 1,
                of: None,
                wait: Duration::from_millis(5)
            }
            .to_string(),
            "1 of ? build tasks had published after 5ms"
        );
    }
}
