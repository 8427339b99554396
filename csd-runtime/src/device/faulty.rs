//! A device that misbehaves on purpose: every fault a real drive commits, each at its
//! own rate, deterministic for a seed (`faulty:SEED[,RATE=…]:INNER`).
//!
//! Writes land in a volatile cache (the drive's write-back cache) and reach the
//! backing device only at a flush, so a power loss has something to lose: at
//! [`FaultyDisk::restart`] each cached block is written, dropped, or torn (at 512-byte
//! sectors, or the whole 4 KiB block, garbage in the torn part), as FoundationDB's
//! `AsyncFileNonDurable` does to unsynced writes at a kill. The faults (TigerBeetle's
//! simulated storage injects the same): read bit-rot that persists (a bit flipped at
//! a position drawn from the block's own bytes, read wrong until rewritten); write
//! corruption (a byte changed on the way in); misdirected writes (the whole write
//! lands a few blocks away; its target keeps its old bytes); latent sector errors
//! (reads of a cluster of blocks fail with EIO until rewritten); write EIO (garbage
//! at the target); ENOSPC; flush failure (the cached writes are each written, dropped
//! or torn there and then, and the flush fails: a later flush succeeds without them,
//! as Linux's did in PostgreSQL's "fsyncgate"); and latency spikes. Blocks below
//! `safe_below` (the store's superblock and catalog slots, which the store's own
//! tests damage one at a time) get no silent faults unless it is set to 0.
//!
//! A [`FaultyDisk`] outlives the [`FaultyDevice`] handles opened over it: after a
//! power loss (`power_fail_after`) every handle answers `UNAVAILABLE`, and `restart`
//! settles the cache and hands out a new one over the same backing.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use super::block::{BlockDevice, DmaBuf, check_command};
use crate::error::{Error, Result};
use csd_protocol::stats::{DeviceStats, Geometry};

/// How often each fault happens: probabilities per command (per block read for
/// `rot`), 0 for never.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FaultRates {
    /// A block read turns to bit-rot (persisting until the block is rewritten).
    pub rot: f64,
    /// A write's data is changed on the way in.
    pub corrupt: f64,
    /// A write lands a few blocks away from its target.
    pub misdirect: f64,
    /// A read finds a cluster of latent sector errors.
    pub lse: f64,
    /// A write fails with EIO (leaving garbage at its target).
    pub write_eio: f64,
    /// A write fails with ENOSPC.
    pub enospc: f64,
    /// A flush fails (and what it should have made durable is settled as at a crash).
    pub flush_fail: f64,
    /// A command waits `spike_ms` first.
    pub spike: f64,
    /// Milliseconds of a latency spike.
    pub spike_ms: u64,
}

impl FaultRates {
    /// The option names, for messages.
    pub const KEYS: &'static str =
        "rot, corrupt, misdirect, lse, write_eio, enospc, flush_fail, spike, spike_ms";

    /// Sets the rate `key`; false when there is no such key.
    pub fn set(&mut self, key: &str, value: f64) -> bool {
        let slot = match key {
            "rot" => &mut self.rot,
            "corrupt" => &mut self.corrupt,
            "misdirect" => &mut self.misdirect,
            "lse" => &mut self.lse,
            "write_eio" => &mut self.write_eio,
            "enospc" => &mut self.enospc,
            "flush_fail" => &mut self.flush_fail,
            "spike" => &mut self.spike,
            "spike_ms" => {
                self.spike_ms = value as u64;
                return true;
            }
            _ => return false,
        };
        *slot = value;
        true
    }

    /// Every rate a probability.
    pub fn validate(&self) -> Result<()> {
        let rates = [
            self.rot,
            self.corrupt,
            self.misdirect,
            self.lse,
            self.write_eio,
            self.enospc,
            self.flush_fail,
            self.spike,
        ];
        if rates.iter().all(|r| (0.0..=1.0).contains(r)) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(
                "fault rates are probabilities between 0 and 1".into(),
            ))
        }
    }

    fn options(&self) -> [(&'static str, f64); 9] {
        [
            ("rot", self.rot),
            ("corrupt", self.corrupt),
            ("misdirect", self.misdirect),
            ("lse", self.lse),
            ("write_eio", self.write_eio),
            ("enospc", self.enospc),
            ("flush_fail", self.flush_fail),
            ("spike", self.spike),
            ("spike_ms", self.spike_ms as f64),
        ]
    }
}

impl fmt::Display for FaultRates {
    /// The options that are not 0, as `,key=value`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (k, v) in self.options() {
            if v != 0.0 {
                write!(f, ",{k}={v}")?;
            }
        }
        Ok(())
    }
}

/// What a [`FaultyDisk`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    /// A block turned to bit-rot.
    Rot,
    /// A write's data was changed.
    Corrupt,
    /// A write landed elsewhere.
    Misdirect,
    /// A cluster of blocks became unreadable.
    LatentSectorError,
    /// A write failed with EIO.
    WriteEio,
    /// A write failed with ENOSPC.
    Enospc,
    /// A flush failed.
    FlushFail,
    /// A command waited.
    Spike,
    /// The power failed.
    PowerLoss,
    /// A cached block was written at a power loss or failed flush.
    CachedWritten,
    /// A cached block was dropped.
    CachedDropped,
    /// A cached block was torn.
    CachedTorn,
}

impl Fault {
    /// Whether the fault can damage bytes a flush made durable (what a store can
    /// only detect, never prevent): the cache's losses at a power failure are not.
    pub fn damages_durable_data(self) -> bool {
        matches!(
            self,
            Fault::Rot
                | Fault::Corrupt
                | Fault::Misdirect
                | Fault::LatentSectorError
                | Fault::WriteEio
        )
    }
}

/// The backing, the cache and the faults of a faulty device; it outlives the device
/// handles opened over it.
pub struct FaultyDisk {
    inner: Arc<dyn BlockDevice>,
    geo: Geometry,
    rates: FaultRates,
    seed: u64,
    state: Mutex<State>,
    /// Reads and writes hold it shared, a flush or restart exclusively: the cache
    /// moves to the backing with nobody looking.
    barrier: tokio::sync::RwLock<()>,
}

struct State {
    rng: u64,
    epoch: u64,
    /// Commands left before the power fails (`None`: it does not).
    power_left: Option<u64>,
    dead: bool,
    /// The write-back cache: each block's latest content not yet flushed.
    cache: BTreeMap<u64, Vec<u8>>,
    /// Blocks that fail reads until rewritten.
    unreadable: HashSet<u64>,
    /// Blocks read with a bit flipped (byte, mask) until rewritten.
    rotten: HashMap<u64, (usize, u8)>,
    /// Blocks below this get no silent faults.
    safe_below: u64,
    injected: BTreeMap<Fault, u64>,
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl State {
    fn next(&mut self) -> u64 {
        splitmix(&mut self.rng)
    }
    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    fn count(&mut self, f: Fault) {
        *self.injected.entry(f).or_default() += 1;
    }
    /// Counts a command against the power; an error once it has failed.
    fn command(&mut self, epoch: u64, name: &str) -> Result<()> {
        if self.dead || epoch != self.epoch {
            return Err(Error::Unavailable(format!(
                "device {name} lost power; it answers again after a restart"
            )));
        }
        if let Some(left) = self.power_left.as_mut() {
            if *left == 0 {
                self.dead = true;
                self.power_left = None;
                self.count(Fault::PowerLoss);
                return Err(Error::Unavailable(format!("device {name} lost power")));
            }
            *left -= 1;
        }
        Ok(())
    }
    /// What a cached block becomes when the cache is lost: written, dropped, or torn
    /// (`None`: dropped).
    fn settle(&mut self, old: &[u8], new: Vec<u8>) -> Option<Vec<u8>> {
        match self.below(4) {
            0 | 1 => {
                self.count(Fault::CachedWritten);
                Some(new)
            }
            2 => {
                self.count(Fault::CachedDropped);
                None
            }
            _ => {
                self.count(Fault::CachedTorn);
                let mut torn = new;
                if self.chance(0.5) {
                    // The whole 4 KiB block: garbage.
                    torn.iter_mut().for_each(|b| *b = self.next() as u8);
                } else {
                    // Each 512-byte sector new, old or garbage.
                    for (i, sector) in torn.chunks_mut(512).enumerate() {
                        match self.below(3) {
                            0 => {}
                            1 => sector.copy_from_slice(&old[i * 512..i * 512 + sector.len()]),
                            _ => sector.iter_mut().for_each(|b| *b = self.next() as u8),
                        }
                    }
                }
                Some(torn)
            }
        }
    }
}

impl FaultyDisk {
    /// A faulty disk over `inner`, with `rates`, deterministic for `seed`.
    pub fn new(inner: Arc<dyn BlockDevice>, seed: u64, rates: FaultRates) -> Result<Arc<Self>> {
        rates.validate()?;
        let mut geo = inner.geometry().clone();
        geo.name = format!("faulty:{seed}:{}", geo.name);
        Ok(Arc::new(FaultyDisk {
            inner,
            geo,
            rates,
            seed,
            state: Mutex::new(State {
                rng: seed,
                epoch: 0,
                power_left: None,
                dead: false,
                cache: BTreeMap::new(),
                unreadable: HashSet::new(),
                rotten: HashMap::new(),
                safe_below: 0,
                injected: BTreeMap::new(),
            }),
            barrier: tokio::sync::RwLock::new(()),
        }))
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// A device handle over this disk (valid until the power fails).
    pub fn device(self: &Arc<Self>) -> Arc<dyn BlockDevice> {
        let epoch = self.lock().epoch;
        Arc::new(FaultyDevice {
            disk: self.clone(),
            epoch,
        })
    }

    /// No silent faults on blocks below `lba`.
    pub fn set_safe_below(&self, lba: u64) {
        self.lock().safe_below = lba;
    }

    /// The power fails after `commands` more commands (reads, writes, flushes).
    pub fn power_fail_after(&self, commands: u64) {
        self.lock().power_left = Some(commands);
    }

    /// Whether the power has failed.
    pub fn is_dead(&self) -> bool {
        self.lock().dead
    }

    /// Faults injected so far, by kind.
    pub fn injected(&self) -> BTreeMap<Fault, u64> {
        self.lock().injected.clone()
    }

    /// A new handle, every earlier one dead, the cache kept: what a node process
    /// restarted on a drive that kept its power sees (no stray command from the old
    /// process reaches the drive after the new one opened it).
    pub fn reattach(self: &Arc<Self>) -> Arc<dyn BlockDevice> {
        self.lock().epoch += 1;
        self.device()
    }

    /// Power back on: the cache is settled (each block written, dropped or torn) and
    /// a new handle is returned; every earlier handle stays dead.
    pub async fn restart(self: &Arc<Self>) -> Result<Arc<dyn BlockDevice>> {
        let _all = self.barrier.write().await;
        let cache = {
            let mut s = self.lock();
            if !s.dead {
                s.count(Fault::PowerLoss);
            }
            s.dead = true;
            s.power_left = None;
            std::mem::take(&mut s.cache)
        };
        self.settle(cache).await?;
        let mut s = self.lock();
        s.epoch += 1;
        s.dead = false;
        drop(s);
        Ok(self.device())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes what is left of `cache` after a loss to the backing.
    async fn settle(&self, cache: BTreeMap<u64, Vec<u8>>) -> Result<()> {
        let bs = self.geo.block_size;
        for (lba, new) in cache {
            let old = self.inner.read(lba, DmaBuf::zeroed(bs)).await?;
            let kept = self.lock().settle(&old, new);
            if let Some(b) = kept {
                self.inner.write(lba, DmaBuf::from_slice(&b)).await?;
            }
        }
        self.inner.flush().await
    }

    async fn spike(&self) {
        let wait = {
            let mut s = self.lock();
            let hit = s.chance(self.rates.spike);
            if hit {
                s.count(Fault::Spike);
            }
            hit
        };
        if wait {
            tokio::time::sleep(Duration::from_millis(self.rates.spike_ms)).await;
        }
    }
}

fn eio(what: String) -> Error {
    Error::io(what, std::io::Error::from_raw_os_error(EIO))
}

/// Linux's errno values.
const EIO: i32 = 5;
const ENOSPC: i32 = 28;

/// One handle over a [`FaultyDisk`].
pub struct FaultyDevice {
    disk: Arc<FaultyDisk>,
    epoch: u64,
}

#[async_trait]
impl BlockDevice for FaultyDevice {
    fn geometry(&self) -> &Geometry {
        &self.disk.geo
    }

    async fn read(&self, lba: u64, buf: DmaBuf) -> Result<DmaBuf> {
        let d = &self.disk;
        let blocks = check_command(&d.geo, "read", lba, &buf)?;
        d.spike().await;
        let _shared = d.barrier.read().await;
        d.lock().command(self.epoch, &d.geo.name)?;
        let mut buf = d.inner.read(lba, buf).await?;
        let bs = d.geo.block_size;
        let mut s = d.lock();
        s.command(self.epoch, &d.geo.name)?;
        // A new cluster of latent sector errors, somewhere in what is read.
        if lba + blocks > s.safe_below && s.chance(d.rates.lse) {
            let from = (lba + s.below(blocks)).max(s.safe_below);
            let n = 1 + s.below(8);
            (from..(from + n).min(d.geo.num_blocks)).for_each(|b| {
                s.unreadable.insert(b);
            });
            s.count(Fault::LatentSectorError);
        }
        if let Some(bad) = (lba..lba + blocks).find(|b| s.unreadable.contains(b)) {
            return Err(eio(format!("{}: reading block {bad}", d.geo.name)));
        }
        for b in lba..lba + blocks {
            let block = &mut buf[((b - lba) as usize) * bs..((b - lba) as usize + 1) * bs];
            if let Some(cached) = s.cache.get(&b) {
                block.copy_from_slice(cached);
            }
            if b >= s.safe_below && !s.rotten.contains_key(&b) && s.chance(d.rates.rot) {
                // A bit the block's own bytes pick: the same one every read.
                let h = block
                    .iter()
                    .fold(d.seed ^ b, |h, x| h.rotate_left(5) ^ u64::from(*x));
                let bit = h % (bs as u64 * 8);
                s.rotten.insert(b, ((bit / 8) as usize, 1 << (bit % 8)));
                s.count(Fault::Rot);
            }
            if let Some((byte, mask)) = s.rotten.get(&b) {
                block[*byte] ^= mask;
            }
        }
        Ok(buf)
    }

    async fn write(&self, lba: u64, buf: DmaBuf) -> Result<DmaBuf> {
        let d = &self.disk;
        let blocks = check_command(&d.geo, "write", lba, &buf)?;
        d.spike().await;
        let _shared = d.barrier.read().await;
        let bs = d.geo.block_size;
        let mut s = d.lock();
        s.command(self.epoch, &d.geo.name)?;
        if s.chance(d.rates.enospc) {
            s.count(Fault::Enospc);
            return Err(Error::io(
                format!("{}: writing blocks [{lba}, +{blocks})", d.geo.name),
                std::io::Error::from_raw_os_error(ENOSPC),
            ));
        }
        let silent = lba >= s.safe_below;
        let mut data = buf.to_vec();
        let failed = silent && s.chance(d.rates.write_eio);
        if failed {
            s.count(Fault::WriteEio);
            data.iter_mut().for_each(|b| *b = s.next() as u8);
        } else if silent && s.chance(d.rates.corrupt) {
            s.count(Fault::Corrupt);
            let at = s.below(data.len() as u64) as usize;
            data[at] ^= 1 + (s.next() % 255) as u8;
        }
        let mut to = lba;
        if !failed && silent && s.chance(d.rates.misdirect) {
            // A few blocks away, never into the safe region or off the end.
            let shift = 1 + s.below(8);
            let down = lba.checked_sub(shift).filter(|t| *t >= s.safe_below);
            let up = Some(lba + shift).filter(|t| t + blocks <= d.geo.num_blocks);
            if let Some(t) = if s.chance(0.5) {
                down.or(up)
            } else {
                up.or(down)
            } {
                to = t;
                s.count(Fault::Misdirect);
            }
        }
        for (i, block) in data.chunks(bs).enumerate() {
            let b = to + i as u64;
            s.cache.insert(b, block.to_vec());
            s.unreadable.remove(&b);
            s.rotten.remove(&b);
        }
        if failed {
            return Err(eio(format!(
                "{}: writing blocks [{lba}, +{blocks})",
                d.geo.name
            )));
        }
        Ok(buf)
    }

    async fn flush(&self) -> Result<()> {
        let d = &self.disk;
        d.spike().await;
        let _all = d.barrier.write().await;
        let (cache, fail) = {
            let mut s = d.lock();
            s.command(self.epoch, &d.geo.name)?;
            let fail = s.chance(d.rates.flush_fail);
            if fail {
                s.count(Fault::FlushFail);
            }
            (std::mem::take(&mut s.cache), fail)
        };
        if fail {
            // The cache is lost as at a crash, and the flush says so, once.
            d.settle(cache).await?;
            return Err(eio(format!("{}: flush", d.geo.name)));
        }
        for (lba, b) in cache {
            d.inner.write(lba, DmaBuf::from_slice(&b)).await?;
        }
        d.inner.flush().await
    }

    fn stats(&self) -> DeviceStats {
        self.disk.inner.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::emulated::{EmulatedDevice, TimingModel};

    fn mem(blocks: u64) -> Arc<dyn BlockDevice> {
        Arc::new(EmulatedDevice::open(None, blocks * 4096, 4096, TimingModel::untimed()).unwrap())
    }

    async fn read(dev: &Arc<dyn BlockDevice>, lba: u64) -> Result<Vec<u8>> {
        dev.read(lba, DmaBuf::zeroed(4096))
            .await
            .map(|b| b.to_vec())
    }

    #[tokio::test]
    async fn unflushed_writes_are_settled_at_a_power_loss_flushed_ones_stay() {
        let disk = FaultyDisk::new(mem(64), 7, FaultRates::default()).unwrap();
        let dev = disk.device();
        dev.write(1, DmaBuf::from_slice(&[1; 4096])).await.unwrap();
        dev.flush().await.unwrap();
        for b in 2..34 {
            dev.write(b, DmaBuf::from_slice(&[2; 4096])).await.unwrap();
        }
        // Reads see the cache before the flush.
        assert_eq!(read(&dev, 2).await.unwrap(), vec![2; 4096]);
        disk.power_fail_after(0);
        let e = read(&dev, 1).await.unwrap_err();
        assert!(matches!(e, Error::Unavailable(_)), "{e}");
        let again = disk.restart().await.unwrap();
        // The old handle stays dead; the flushed block is there.
        assert!(read(&dev, 1).await.is_err());
        assert_eq!(read(&again, 1).await.unwrap(), vec![1; 4096]);
        let n = disk.injected();
        let settled = [
            Fault::CachedWritten,
            Fault::CachedDropped,
            Fault::CachedTorn,
        ]
        .iter()
        .map(|f| n.get(f).copied().unwrap_or(0))
        .sum::<u64>();
        assert_eq!(settled, 32, "{n:?}");
        assert!(n.contains_key(&Fault::CachedTorn), "{n:?}");
        let mut seen = HashSet::new();
        for b in 2..34 {
            let got = read(&again, b).await.unwrap();
            seen.insert(if got == vec![2; 4096] {
                "new"
            } else if got == vec![0; 4096] {
                "old"
            } else {
                "torn"
            });
        }
        assert_eq!(seen.len(), 3, "{seen:?}");
    }

    #[tokio::test]
    async fn rot_persists_and_latent_errors_last_until_rewritten() {
        let rates = FaultRates {
            rot: 1.0,
            ..FaultRates::default()
        };
        let disk = FaultyDisk::new(mem(64), 9, rates).unwrap();
        disk.set_safe_below(4);
        let dev = disk.device();
        dev.write(3, DmaBuf::from_slice(&[3; 4096])).await.unwrap();
        dev.write(5, DmaBuf::from_slice(&[5; 4096])).await.unwrap();
        dev.flush().await.unwrap();
        // Below safe_below: never rots.
        assert_eq!(read(&dev, 3).await.unwrap(), vec![3; 4096]);
        let first = read(&dev, 5).await.unwrap();
        assert_ne!(first, vec![5; 4096]);
        assert_eq!(first.iter().filter(|b| **b != 5).count(), 1);
        assert_eq!(read(&dev, 5).await.unwrap(), first, "rot persists");

        let rates = FaultRates {
            lse: 1.0,
            ..FaultRates::default()
        };
        let disk = FaultyDisk::new(mem(64), 9, rates).unwrap();
        let dev = disk.device();
        let e = read(&dev, 10).await.unwrap_err();
        assert!(e.to_string().contains("block 10"), "{e}");
        assert!(read(&dev, 10).await.is_err(), "still unreadable");
        dev.write(10, DmaBuf::from_slice(&[1; 4096])).await.unwrap();
        assert!(!disk.lock().unreadable.contains(&10));
    }

    #[tokio::test]
    async fn a_failed_flush_loses_the_cache_and_the_next_flush_succeeds_without_it() {
        let rates = FaultRates {
            flush_fail: 1.0,
            ..FaultRates::default()
        };
        let disk = FaultyDisk::new(mem(64), 3, rates).unwrap();
        let dev = disk.device();
        for b in 0..16 {
            dev.write(b, DmaBuf::from_slice(&[9; 4096])).await.unwrap();
        }
        assert!(dev.flush().await.is_err());
        assert!(disk.lock().cache.is_empty());
        let n = disk.injected();
        assert_eq!(n.get(&Fault::FlushFail), Some(&1));
    }

    #[tokio::test]
    async fn the_same_seed_does_the_same() {
        async fn run(seed: u64) -> (BTreeMap<Fault, u64>, Vec<Vec<u8>>) {
            let rates = FaultRates {
                corrupt: 0.3,
                misdirect: 0.3,
                write_eio: 0.1,
                ..FaultRates::default()
            };
            let disk = FaultyDisk::new(mem(64), seed, rates).unwrap();
            let dev = disk.device();
            for b in 8..40 {
                let _ = dev.write(b, DmaBuf::from_slice(&[b as u8; 4096])).await;
            }
            let _ = dev.flush().await;
            let mut out = vec![];
            for b in 0..64 {
                out.push(read(&dev, b).await.unwrap());
            }
            (disk.injected(), out)
        }
        assert_eq!(run(11).await, run(11).await);
        assert_ne!(run(11).await, run(12).await);
    }
}
