//! The one offload path for work on a partition kept on several nodes (`csd put
//! --replicas`): ask a copy's node, then another's, then run the work here. SQL
//! fragments, ML feature streams and Wasm runs each keep a [`Copies`] per
//! partition and ask it, after every copy that did not run (or finish) the work,
//! what to do next; they differ only in what "ask" and "here" do.
//!
//! The rules ([`Copies::declined`]):
//! - a node that hands the work back for its own state (its queue, memory budget
//!   or policy: [`PushBackCause::Admission`], or out of memory before its first
//!   batch) is **busy**: the next copy is asked, and when none is left the work
//!   runs here;
//! - a node that judges the work not worth running at the data (it would not
//!   shrink: [`PushBackCause::Judgement`]) or cannot run it at all decides for
//!   every copy: the work runs here at once;
//! - a node that is **lost** (out of reach, killed mid-answer, DATA_LOSS) is
//!   passed over for the next copy; when none is left the work runs here if a copy
//!   that declined can still serve its data, and otherwise no copy is left (SQL
//!   then reads the objects' copies by byte range; the others fail, naming the
//!   copies tried).

use std::collections::VecDeque;
use std::fmt;

use super::error::Error;
use crate::messages::{PushBack, PushBackCause};

/// Why a copy's node did not run (or finish) the work it was asked to.
#[derive(Debug, Clone, PartialEq)]
pub enum Declined {
    /// Handed back for the node's own state (see the module docs): another copy's
    /// node may have room.
    Busy(String),
    /// Handed back because the work would not shrink there: every copy would say
    /// the same.
    Judged(String),
    /// The node cannot run it (a function or operator it lacks, an older node).
    Unable(String),
    /// The node was lost (see [`Error::node_lost`]).
    Lost(String),
}

impl Declined {
    /// A node's push-back, by whose decision it was.
    pub fn handed_back(p: &PushBack) -> Self {
        match p.cause {
            PushBackCause::Admission => Declined::Busy(p.reason.clone()),
            PushBackCause::Judgement => Declined::Judged(p.reason.clone()),
        }
    }

    /// What a node client's failure says about the node, when it is one of the
    /// ways a copy declines (pushed back, unable, lost, out of memory before any
    /// answer); `None` for a failure of the work itself, which fails it wherever
    /// it runs.
    pub fn of(e: &Error) -> Option<Self> {
        match e {
            Error::PushedBack(p) => Some(Declined::handed_back(p)),
            e if e.node_lost() => Some(Declined::Lost(e.to_string())),
            e => match e.code() {
                Some(tonic::Code::Unimplemented) => Some(Declined::Unable(e.to_string())),
                Some(tonic::Code::ResourceExhausted) => Some(Declined::Busy(e.to_string())),
                _ => None,
            },
        }
    }

    /// The node's own words (or the failure's), without saying which kind.
    pub fn reason(&self) -> &str {
        match self {
            Declined::Busy(why)
            | Declined::Judged(why)
            | Declined::Unable(why)
            | Declined::Lost(why) => why,
        }
    }

    /// Whether the node handed the work back (rather than being lost): the work it
    /// was asked for is then done here.
    pub fn handed_back_work(&self) -> bool {
        !matches!(self, Declined::Lost(_))
    }
}

impl fmt::Display for Declined {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Declined::Busy(why) | Declined::Judged(why) => write!(f, "handed back ({why})"),
            Declined::Unable(why) => write!(f, "the node cannot run it ({why})"),
            Declined::Lost(why) => write!(f, "node lost ({why})"),
        }
    }
}

/// A copy asked, and why it did not run the work.
#[derive(Debug, Clone, PartialEq)]
pub struct Tried {
    /// The copy, as `node-url/partition`.
    pub at: String,
    /// Why it did not.
    pub why: Declined,
}

impl Tried {
    /// Copies tried, as one line (`a: why; b: why`).
    pub fn list(tried: &[Tried]) -> String {
        let each: Vec<String> = tried.iter().map(ToString::to_string).collect();
        each.join("; ")
    }
}

impl fmt::Display for Tried {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.at, self.why)
    }
}

/// What to do after a copy declined (see [`Copies::declined`]).
#[derive(Debug, PartialEq)]
pub enum Next<C> {
    /// Ask this copy.
    Ask(C),
    /// Run the work here. The copy is one whose node declined the work but can
    /// still serve its data (the first such, in the order asked), for work that
    /// reads its rows from a node.
    Here(C),
    /// No copy is left to ask and none can serve the data.
    NoneLeft,
}

/// A partition's copies, in the order to ask them, and what came of asking.
#[derive(Debug)]
pub struct Copies<C> {
    next: VecDeque<C>,
    /// Copies whose nodes declined but were not lost, in the order asked.
    readers: VecDeque<C>,
    tried: Vec<Tried>,
}

impl<C> Copies<C> {
    /// The copies, the one to ask first first.
    pub fn new(copies: impl IntoIterator<Item = C>) -> Self {
        Copies {
            next: copies.into_iter().collect(),
            readers: VecDeque::new(),
            tried: Vec::new(),
        }
    }

    /// The copy to ask first (`None`: there is none).
    pub fn first(&mut self) -> Option<C> {
        self.next.pop_front()
    }

    /// `copy` (named `at`) did not run or finish the work, for `why`: what to do
    /// next (see the module docs).
    pub fn declined(&mut self, copy: C, at: String, why: Declined) -> Next<C> {
        let stop = matches!(why, Declined::Judged(_) | Declined::Unable(_));
        let lost = matches!(why, Declined::Lost(_));
        self.tried.push(Tried { at, why });
        if !lost {
            self.readers.push_back(copy);
        }
        let next = match (!stop).then(|| self.next.pop_front()).flatten() {
            Some(next) => Next::Ask(next),
            // A node that declined without being lost is among the readers, so
            // only a lost one with no copy left to ask ends here empty-handed.
            None => match self.readers.pop_front() {
                Some(reader) => Next::Here(reader),
                None => Next::NoneLeft,
            },
        };
        if let Some(t) = self.tried.last() {
            let then = match &next {
                Next::Ask(_) => "asking the next copy",
                Next::Here(_) => "running it here",
                Next::NoneLeft => "no copy left",
            };
            tracing::info!(copies_left = self.next.len(), "{t}: {then}");
        }
        next
    }

    /// For work that ended here: the copies to report as tried, and why the last
    /// did not run it (`None`: none was asked). A partition's one copy that
    /// handed the work back is not listed: the work's own hand-back says so.
    pub fn ended_here(&self) -> (Vec<Tried>, Option<Declined>) {
        let last = self.tried.last().map(|t| t.why.clone());
        match &self.tried[..] {
            [one] if one.why.handed_back_work() => (Vec::new(), last),
            all => (all.to_vec(), last),
        }
    }

    /// The copies asked so far that did not run the work, in order.
    pub fn tried(&self) -> &[Tried] {
        &self.tried
    }

    /// Copies not asked yet.
    pub fn left(&self) -> usize {
        self.next.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn busy() -> Declined {
        Declined::Busy("queue full".into())
    }

    fn lost() -> Declined {
        Declined::Lost("connection refused".into())
    }

    #[test]
    fn a_busy_copy_passes_the_work_on_and_it_runs_here_when_all_are_busy() {
        let mut c = Copies::new(["a", "b", "c"]);
        assert_eq!(c.first(), Some("a"));
        assert_eq!(c.declined("a", "a/p".into(), busy()), Next::Ask("b"));
        assert_eq!(c.declined("b", "b/p".into(), busy()), Next::Ask("c"));
        assert_eq!(c.declined("c", "c/p".into(), busy()), Next::Here("a"));
        let tried: Vec<String> = c.tried().iter().map(ToString::to_string).collect();
        assert_eq!(
            tried,
            [
                "a/p: handed back (queue full)",
                "b/p: handed back (queue full)",
                "c/p: handed back (queue full)"
            ]
        );
        let (listed, last) = c.ended_here();
        assert_eq!((listed.len(), last), (3, Some(busy())));
        let mut one = Copies::new(["a"]);
        one.first();
        assert_eq!(one.declined("a", "a".into(), busy()), Next::Here("a"));
        assert_eq!(one.ended_here(), (vec![], Some(busy())));
        let mut one = Copies::new(["a"]);
        one.first();
        assert_eq!(one.declined("a", "a".into(), lost()), Next::NoneLeft);
        assert_eq!(one.ended_here().0.len(), 1);
    }

    #[test]
    fn a_judgement_or_a_node_unable_stops_the_asking() {
        let mut c = Copies::new(["a", "b", "c"]);
        c.first();
        assert_eq!(c.declined("a", "a".into(), busy()), Next::Ask("b"));
        let judged = Declined::Judged("groups do not shrink".into());
        assert_eq!(c.declined("b", "b".into(), judged), Next::Here("a"));
        assert_eq!(c.left(), 1);
        let mut c = Copies::new(["a", "b"]);
        c.first();
        assert_eq!(
            c.declined("a", "a".into(), Declined::Unable("no such function".into())),
            Next::Here("a")
        );
    }

    #[test]
    fn a_lost_copy_passes_on_and_with_none_left_the_work_fails_or_runs_over_a_reader() {
        let mut c = Copies::new(["a", "b"]);
        c.first();
        assert_eq!(c.declined("a", "a".into(), lost()), Next::Ask("b"));
        assert_eq!(c.declined("b", "b".into(), lost()), Next::NoneLeft);
        // A busy copy asked earlier still serves the data when the one that took
        // the work over is lost.
        let mut c = Copies::new(["a", "b"]);
        c.first();
        assert_eq!(c.declined("a", "a".into(), busy()), Next::Ask("b"));
        assert_eq!(c.declined("b", "b".into(), lost()), Next::Here("a"));
        // The reader itself lost while the work runs over it: nothing is left.
        assert_eq!(c.declined("a", "a".into(), lost()), Next::NoneLeft);
        assert_eq!(c.tried().len(), 3);
    }

    #[test]
    fn node_failures_are_read_as_declines_and_the_rest_are_not() {
        let p = |cause| PushBack {
            reason: "r".into(),
            predicted_delay_ms: 0.0,
            estimate_ms: 0.0,
            bytes: 0,
            cause,
        };
        let of = |e: Error| Declined::of(&e);
        assert_eq!(
            of(Error::PushedBack(p(PushBackCause::Admission))),
            Some(Declined::Busy("r".into()))
        );
        assert_eq!(
            of(Error::PushedBack(p(PushBackCause::Judgement))),
            Some(Declined::Judged("r".into()))
        );
        let rpc = |code| Error::Rpc {
            code,
            message: "m".into(),
        };
        assert!(matches!(
            of(rpc(tonic::Code::Unavailable)),
            Some(Declined::Lost(_))
        ));
        assert!(matches!(
            of(rpc(tonic::Code::DataLoss)),
            Some(Declined::Lost(_))
        ));
        assert!(matches!(
            of(rpc(tonic::Code::Unimplemented)),
            Some(Declined::Unable(_))
        ));
        assert!(matches!(
            of(rpc(tonic::Code::ResourceExhausted)),
            Some(Declined::Busy(_))
        ));
        assert_eq!(of(rpc(tonic::Code::InvalidArgument)), None);
        assert_eq!(of(Error::InvalidInput("bad".into())), None);
    }
}
