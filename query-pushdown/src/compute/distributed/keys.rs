//! Join-key filters across stages: a hash join's build side and the probe-side scan
//! its keys filter can land in different stages, on different workers (a
//! partitioned join: both sides behind shuffles). Each task of the build side's
//! stage then *publishes* the keys it saw to a [`KeyBoard`] on one worker (the
//! collector's home, chosen when the plan is cut into stages, see `lift`); the scan's
//! tasks *fetch* the union from it once every build task has published, as a bloom
//! filter built there once. The board answers a fetch when the set is complete, when
//! a build task gave up (too many keys, an error, a stream dropped early), or when the
//! scan's wait (`csd.key_wait_secs`) is over; the last two mean no filter, so the
//! scan runs unfiltered and the join above stays exact.
//!
//! The board is reached through the worker's own Flight service (actions
//! `csd.keys.publish` and `csd.keys.fetch`, see `service.rs`), by
//! [`FlightKeyBoard`], the collectors' way to their set. It holds a
//! bounded number of sets and of hashes, and forgets a set some time after its last
//! use.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use csd_protocol::Error;
use prost::Message;
use tokio::sync::watch;

use super::actions::{FETCH, PUBLISH, call};
use crate::compute::key_collector::{KeyMeeting, RemoteKeys};
use crate::compute::no_filter::{AtWorker, NoFilter, NoFilterMsg};
use crate::wire::keyfilter::{Bloom, MAX_FILTER_BYTES};

/// Most sets a board holds at once.
const MAX_SETS: usize = 4096;
/// Most hashes a board holds at once, over all its sets (8 bytes each).
const MAX_HELD_HASHES: usize = 32 << 20;
/// How long a set outlives its last publish or fetch beyond the waits named.
const KEEP: Duration = Duration::from_secs(60);
/// One build task's keys.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct PublishMsg {
    #[prost(string, tag = "1")]
    pub(crate) key: String,
    /// This task's index in its stage.
    #[prost(uint32, tag = "2")]
    pub(crate) task: u32,
    /// Tasks in the stage: the set is complete when each has published.
    #[prost(uint32, tag = "3")]
    pub(crate) tasks: u32,
    /// Filter bits per key.
    #[prost(uint32, tag = "4")]
    pub(crate) bits_per_key: u32,
    /// Row hashes, little-endian u64s.
    #[prost(bytes = "vec", tag = "5")]
    pub(crate) hashes: Vec<u8>,
    /// Set instead of hashes when the task has no keys to give: why.
    #[prost(message, optional, tag = "6")]
    pub(crate) abandoned: Option<NoFilterMsg>,
    /// How long scans wait for the set, in milliseconds (how long it is kept).
    #[prost(uint64, tag = "7")]
    pub(crate) wait_ms: u64,
}

/// A scan task's request for the filter.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct FetchMsg {
    #[prost(string, tag = "1")]
    pub(crate) key: String,
    /// How long the board may hold the request for the set to complete.
    #[prost(uint64, tag = "2")]
    pub(crate) wait_ms: u64,
}

/// The board's answer to a fetch: a filter, or why there is none.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct KeysMsg {
    /// The bloom filter's blocks (as in a fragment's key filter).
    #[prost(bytes = "vec", tag = "1")]
    pub(crate) blocks: Vec<u8>,
    /// Distinct keys in it.
    #[prost(uint64, tag = "2")]
    pub(crate) keys: u64,
    /// Set when there is no filter: why.
    #[prost(message, optional, tag = "3")]
    pub(crate) none: Option<NoFilterMsg>,
}

/// A complete set's outcome: the filter's blocks and its key count, or why not.
type Outcome = Result<Arc<(Vec<u8>, usize)>, NoFilter>;

struct Set {
    tasks: Option<u32>,
    seen: HashSet<u32>,
    hashes: Vec<u64>,
    outcome: Option<Outcome>,
    done: watch::Sender<bool>,
    expires: Instant,
}

impl Set {
    fn new(now: Instant) -> Self {
        Set {
            tasks: None,
            seen: HashSet::new(),
            hashes: Vec::new(),
            outcome: None,
            done: watch::channel(false).0,
            expires: now + KEEP,
        }
    }

    fn keep_until(&mut self, t: Instant) {
        self.expires = self.expires.max(t);
    }

    fn end(&mut self, outcome: Outcome) {
        if self.outcome.is_none() {
            if let Err(why) = &outcome {
                tracing::debug!("cross-stage join-key filter abandoned: {why}");
            }
            self.outcome = Some(outcome);
            self.hashes = Vec::new();
            self.done.send_replace(true);
        }
    }
}

/// Keys published by build tasks, merged into filters for the scans that fetch
/// them (see the module docs).
#[derive(Default)]
pub(crate) struct KeyBoard {
    sets: Mutex<HashMap<String, Set>>,
}

impl std::fmt::Debug for KeyBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyBoard")
            .field("sets", &self.lock().len())
            .finish()
    }
}

impl KeyBoard {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Set>> {
        self.sets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The set `key`, made if new (after forgetting expired sets).
    fn set<'a>(
        sets: &'a mut HashMap<String, Set>,
        key: &str,
        now: Instant,
    ) -> Result<&'a mut Set, Error> {
        if !sets.contains_key(key) {
            sets.retain(|_, s| s.expires > now);
            if sets.len() >= MAX_SETS {
                return Err(Error::ResourcesExhausted(format!(
                    "this worker holds {MAX_SETS} join-key sets already; the scans waiting \
                     on a new one run unfiltered"
                )));
            }
            sets.insert(key.to_string(), Set::new(now));
        }
        sets.get_mut(key)
            .ok_or_else(|| Error::Internal("a join-key set vanished as it was made".into()))
    }

    /// Adds one build task's keys (or its reason for having none).
    pub(crate) fn publish(&self, m: PublishMsg) -> Result<(), Error> {
        if m.key.is_empty() || m.tasks == 0 || m.task >= m.tasks {
            return Err(Error::InvalidArgument(format!(
                "join keys published by task {} of {} under {:?}: a task index below a \
                 non-zero task count and a set name are needed",
                m.task, m.tasks, m.key
            )));
        }
        if !(1..=64).contains(&m.bits_per_key) || !m.hashes.len().is_multiple_of(8) {
            return Err(Error::InvalidArgument(format!(
                "join keys with {} bits per key and {} bytes of hashes: 1 to 64 bits and \
                 whole 8-byte hashes are needed",
                m.bits_per_key,
                m.hashes.len()
            )));
        }
        let now = Instant::now();
        let mut sets = self.lock();
        let held: usize = sets.values().map(|s| s.hashes.len()).sum();
        let set = Self::set(&mut sets, &m.key, now)?;
        set.keep_until(now + 2 * Duration::from_millis(m.wait_ms) + KEEP);
        if set.outcome.is_some() {
            return Ok(());
        }
        if let Some(why) = m.abandoned {
            set.end(Err(NoFilter::TaskGaveUp {
                task: m.task,
                why: Box::new(why.into()),
            }));
            return Ok(());
        }
        match set.tasks {
            Some(t) if t != m.tasks => {
                set.end(Err(NoFilter::TasksDisagree(t, m.tasks)));
                return Ok(());
            }
            _ => set.tasks = Some(m.tasks),
        }
        let n = m.hashes.len() / 8;
        if held + n > MAX_HELD_HASHES {
            set.end(Err(NoFilter::BoardFull {
                held: held as u64,
                max: MAX_HELD_HASHES as u64,
            }));
            return Ok(());
        }
        set.hashes.extend(
            m.hashes
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])),
        );
        let max_keys = MAX_FILTER_BYTES * 8 / m.bits_per_key as usize;
        if set.hashes.len() > 2 * max_keys {
            set.hashes.sort_unstable();
            set.hashes.dedup();
            if set.hashes.len() > max_keys {
                set.end(Err(NoFilter::TooManyKeys {
                    max: max_keys as u64,
                }));
                return Ok(());
            }
        }
        set.seen.insert(m.task);
        if set.seen.len() == m.tasks as usize {
            let mut h = std::mem::take(&mut set.hashes);
            h.sort_unstable();
            h.dedup();
            let outcome = Bloom::with_bits_per_key(&h, m.bits_per_key as usize)
                .map(|b| Arc::new((b.to_msg(&[]).blocks, h.len())))
                .ok_or(NoFilter::TooBig {
                    keys: h.len() as u64,
                });
            set.end(outcome);
        }
        Ok(())
    }

    /// The filter of set `key`, once complete, or why there is none (also when it is
    /// not complete within `wait`).
    pub(crate) async fn fetch(&self, key: &str, wait: Duration) -> Result<KeysMsg, Error> {
        let mut rx = {
            let now = Instant::now();
            let mut sets = self.lock();
            let set = Self::set(&mut sets, key, now)?;
            set.keep_until(now + wait + KEEP);
            set.done.subscribe()
        };
        let finished = tokio::time::timeout(wait, rx.wait_for(|d| *d))
            .await
            .is_ok();
        let sets = self.lock();
        let outcome = sets.get(key).and_then(|s| s.outcome.clone());
        Ok(match outcome {
            Some(Ok(f)) => KeysMsg {
                blocks: f.0.clone(),
                keys: f.1 as u64,
                none: None,
            },
            Some(Err(why)) => KeysMsg {
                none: Some(NoFilterMsg::from(&why)),
                ..Default::default()
            },
            None => KeysMsg {
                none: Some(NoFilterMsg::from(&if finished {
                    NoFilter::Forgotten
                } else {
                    let set = sets.get(key);
                    NoFilter::TasksLate {
                        have: set.map_or(0, |s| s.seen.len() as u32),
                        of: set.and_then(|s| s.tasks),
                        wait,
                    }
                })),
                ..Default::default()
            },
        })
    }

    /// Sets held now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// The key board on a worker, reached through its Flight service: how the
/// collectors of a distributed plan meet.
#[derive(Debug)]
pub(crate) struct FlightKeyBoard;

#[async_trait]
impl KeyMeeting for FlightKeyBoard {
    async fn publish(
        &self,
        at: &RemoteKeys,
        (task, tasks): (usize, usize),
        bits_per_key: usize,
        keys: Result<Vec<u64>, NoFilter>,
    ) -> Result<(), NoFilter> {
        let (hashes, abandoned) = match keys {
            Ok(h) => (h.iter().flat_map(|h| h.to_le_bytes()).collect(), None),
            Err(why) => (Vec::new(), Some(NoFilterMsg::from(&why))),
        };
        let m = PublishMsg {
            key: at.key.clone(),
            task: task as u32,
            tasks: tasks as u32,
            bits_per_key: bits_per_key as u32,
            hashes,
            abandoned,
            wait_ms: at.wait_ms,
        };
        // Why the keys did not get there is all a build task can say of it (the
        // scans waiting on them run unfiltered).
        call(&at.home, PUBLISH, m.encode_to_vec(), at.wait())
            .await
            .map(drop)
            .map_err(|e| unreachable_at(at, &e))
    }

    async fn fetch(&self, at: &RemoteKeys, wait: Duration) -> Result<(Bloom, usize), NoFilter> {
        let m = FetchMsg {
            key: at.key.clone(),
            wait_ms: wait.as_millis() as u64,
        };
        let body = call(&at.home, FETCH, m.encode_to_vec(), wait)
            .await
            .map_err(|e| unreachable_at(at, &e))?;
        let bad = |why: String| {
            NoFilter::BadAnswer(AtWorker {
                home: at.home.clone(),
                why,
            })
        };
        let k = KeysMsg::decode(body.as_slice())
            .map_err(|e| bad(format!("the answer to {FETCH} does not decode: {e}")))?;
        if let Some(why) = k.none {
            return Err(why.into());
        }
        let bloom = Bloom::from_blocks(&k.blocks).map_err(|e| bad(e.to_string()))?;
        Ok((bloom, k.keys as usize))
    }
}

/// A call to the board at `at` that failed: the worker, and its chain of causes
/// (all a build task or scan can say of it; the scans run unfiltered).
fn unreachable_at(at: &RemoteKeys, e: &Error) -> NoFilter {
    NoFilter::Unreachable(AtWorker {
        home: at.home.clone(),
        why: csd_protocol::error::chain(e),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    pub(crate) fn msg(key: &str, task: u32, tasks: u32, hashes: &[u64]) -> PublishMsg {
        PublishMsg {
            key: key.into(),
            task,
            tasks,
            bits_per_key: 12,
            hashes: hashes.iter().flat_map(|h| h.to_le_bytes()).collect(),
            abandoned: None,
            wait_ms: 1000,
        }
    }

    pub(crate) fn hashes(range: std::ops::Range<u64>) -> Vec<u64> {
        range
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect()
    }

    #[tokio::test]
    async fn a_fetch_waits_for_every_task_and_gets_all_their_keys() {
        let board = Arc::new(KeyBoard::default());
        let b = board.clone();
        let waiting =
            tokio::spawn(async move { b.fetch("q/1", Duration::from_secs(10)).await.unwrap() });
        tokio::time::sleep(Duration::from_millis(20)).await;
        board.publish(msg("q/1", 0, 3, &hashes(0..100))).unwrap();
        board.publish(msg("q/1", 2, 3, &hashes(50..300))).unwrap();
        assert!(!waiting.is_finished(), "answered before task 1 published");
        // A task publishing twice (a retry) still counts once.
        board.publish(msg("q/1", 2, 3, &hashes(50..300))).unwrap();
        board
            .publish(msg("q/1", 1, 3, &hashes(1000..1010)))
            .unwrap();
        let k = waiting.await.unwrap();
        assert_eq!(k.none, None);
        assert_eq!(k.keys, 310);
        let bloom = Bloom::from_blocks(&k.blocks).unwrap();
        for h in hashes(0..300).into_iter().chain(hashes(1000..1010)) {
            assert!(bloom.contains(h));
        }
        let misses = hashes(5000..15000)
            .into_iter()
            .filter(|&h| bloom.contains(h))
            .count();
        assert!(misses < 500, "{misses} of 10000 absent keys pass");
        // A later fetch gets the same filter at once.
        let again = board.fetch("q/1", Duration::ZERO).await.unwrap();
        assert_eq!(again, k);
    }

    #[tokio::test]
    async fn no_filter_when_a_task_gives_up_disagrees_or_is_late() {
        let board = KeyBoard::default();
        board.publish(msg("a", 0, 2, &hashes(0..10))).unwrap();
        let mut gave_up = msg("a", 1, 2, &[]);
        gave_up.abandoned = Some(NoFilterMsg::from(&NoFilter::BuildFailed("boom".into())));
        board.publish(gave_up).unwrap();
        let k = board.fetch("a", Duration::from_secs(1)).await.unwrap();
        assert_eq!(
            NoFilter::from(k.none.unwrap()),
            NoFilter::TaskGaveUp {
                task: 1,
                why: Box::new(NoFilter::BuildFailed("boom".into()))
            }
        );

        board.publish(msg("b", 0, 2, &hashes(0..10))).unwrap();
        board.publish(msg("b", 1, 3, &hashes(0..10))).unwrap();
        let k = board.fetch("b", Duration::from_secs(1)).await.unwrap();
        assert_eq!(
            NoFilter::from(k.none.unwrap()),
            NoFilter::TasksDisagree(2, 3)
        );

        board.publish(msg("c", 0, 2, &hashes(0..10))).unwrap();
        let started = Instant::now();
        let k = board.fetch("c", Duration::from_millis(50)).await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert_eq!(
            NoFilter::from(k.none.unwrap()),
            NoFilter::TasksLate {
                have: 1,
                of: Some(2),
                wait: Duration::from_millis(50)
            }
        );

        // Too many distinct keys for a filter.
        let max = MAX_FILTER_BYTES * 8 / 12;
        board
            .publish(msg("d", 0, 2, &hashes(0..max as u64)))
            .unwrap();
        board
            .publish(msg("d", 1, 2, &hashes(max as u64..2 * max as u64 + 2)))
            .unwrap();
        let k = board.fetch("d", Duration::from_secs(1)).await.unwrap();
        assert_eq!(
            NoFilter::from(k.none.unwrap()),
            NoFilter::TooManyKeys { max: max as u64 }
        );
        assert_eq!(board.len(), 4);
    }

    #[test]
    fn bad_publishes_are_refused_with_a_reason() {
        let board = KeyBoard::default();
        let e = board.publish(msg("x", 2, 2, &[1])).unwrap_err();
        assert_eq!(e.status_code(), csd_protocol::StatusCode::InvalidArgument);
        assert!(e.to_string().contains("task index"), "{e}");
        let mut m = msg("x", 0, 1, &[1]);
        m.hashes.pop();
        let e = board.publish(m).unwrap_err();
        assert!(e.to_string().contains("8-byte"), "{e}");
        let mut m = msg("x", 0, 1, &[1]);
        m.bits_per_key = 0;
        assert!(board.publish(m).is_err());
    }
}
