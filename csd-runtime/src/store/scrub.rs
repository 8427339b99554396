//! Scrubbing: every chunk of every object read from the device (never from the
//! read cache) and checked against its checksum, one piece at a time, so that
//! damage is found before a query needs the bytes. A [`Pace`] spaces the pieces: a
//! scrub asked for runs them back to back, the node's background scrub at its rate
//! and in turn with the node's other reads.

use std::future::Future;
use std::time::Instant;

use super::{ObjectStore, ScrubReport, lock};
use crate::error::{Error, Result};

/// Bytes read per command while scrubbing (one command in flight: a scrub never
/// holds more of the device than one reader would).
const PIECE: u64 = 1 << 20;
/// Damaged ranges a report names (it counts them all).
const NAMED: usize = 64;

/// How a scrub spaces its reads.
pub trait Pace: Send {
    /// Held while one piece is read.
    type Turn: Send;
    /// Waits until a piece of `bytes` may be read; the turn is held while it is.
    fn turn(&mut self, bytes: u64) -> impl Future<Output = Turn<Self::Turn>> + Send;
}

/// A [`Pace`]'s answer: read now, or stop the scrub here.
pub enum Turn<T> {
    /// Read the piece, holding this.
    Go(T),
    /// Stop: what was checked so far is the report.
    Stop,
}

/// Pieces back to back.
pub struct Unpaced;

impl Pace for Unpaced {
    type Turn = ();
    async fn turn(&mut self, _bytes: u64) -> Turn<()> {
        Turn::Go(())
    }
}

impl ObjectStore {
    /// Reads and checks every object whose name starts with `prefix`; what was
    /// damaged. A read the device refuses or whose checksum does not match is a
    /// damaged range (counted, named, and the scrub goes on with the next piece);
    /// only a device that stops answering (lost power, a bad command) ends it.
    pub async fn scrub(&self, prefix: &str) -> Result<ScrubReport> {
        self.scrub_paced(prefix, &mut Unpaced).await
    }

    /// [`Self::scrub`], each piece read when `pace` gives it a turn.
    pub async fn scrub_paced(&self, prefix: &str, pace: &mut impl Pace) -> Result<ScrubReport> {
        let started = Instant::now();
        let mut report = ScrubReport {
            runs: 1,
            ..ScrubReport::default()
        };
        let damaged = |report: &mut ScrubReport, why: String| {
            tracing::error!("scrub: {why}");
            report.damaged_count += 1;
            if report.damaged.len() < NAMED {
                report.damaged.push(why);
            }
        };
        'objects: for info in self.list(prefix) {
            report.objects += 1;
            let table = match self.crc_table_from_device(&info).await {
                Ok(t) => t,
                Err(Error::Corrupt(why)) => {
                    damaged(&mut report, why);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let chunk = u64::from(self.inner.sb.chunk_size);
            // Whole chunks per piece, so each is checked on its own.
            let piece = PIECE.div_ceil(chunk).max(1) * chunk;
            let mut at = 0;
            while at < info.len {
                let end = (at + piece).min(info.len);
                let Turn::Go(turn) = pace.turn(end - at).await else {
                    break 'objects;
                };
                let read = self.read_logical(&info, at, end).await;
                drop(turn);
                match read {
                    // Each chunk on its own: every damaged one is named.
                    Ok(bytes) => {
                        for (i, c) in bytes.chunks(chunk as usize).enumerate() {
                            let from = at + i as u64 * chunk;
                            match self.verify_chunks(&info, &table, from, c) {
                                Ok(()) => report.bytes += c.len() as u64,
                                Err(Error::Corrupt(why)) => damaged(&mut report, why),
                                Err(e) => return Err(e),
                            }
                        }
                    }
                    Err(Error::Corrupt(why)) => damaged(&mut report, why),
                    Err(e) => return Err(e),
                }
                at = end;
                tokio::task::yield_now().await;
            }
        }
        report.seconds = started.elapsed().as_secs_f64();
        {
            let mut all = lock(&self.inner.scrubs);
            all.runs += 1;
            all.objects += report.objects;
            all.bytes += report.bytes;
            all.damaged_count += report.damaged_count;
            all.seconds += report.seconds;
            for d in &report.damaged {
                if all.damaged.len() < NAMED {
                    all.damaged.push(d.clone());
                }
            }
        }
        Ok(report)
    }
}
