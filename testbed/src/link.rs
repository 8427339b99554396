//! Throttled links: a TCP proxy on 127.0.0.1 that paces each direction through a token
//! bucket (bandwidth) and a delay line (one-way latency).
//!
//! Every connection through one [`ThrottledLink`] shares its two buckets, as flows on
//! one network link share its capacity; the two directions are independent
//! (full duplex). Pacing uses a virtual clock: each chunk is scheduled at
//! `max(next_free, now - burst) + bytes / rate`, so an oversleep by the timer is made
//! up later (within `burst`) instead of lowering the rate. Waits use
//! [`csd_runtime::timer`], since tokio's millisecond timer would swamp sub-millisecond
//! latencies.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use csd_runtime::timer;

/// Bandwidth and latency of a link, each direction.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkSpec {
    /// Bits per second; 0 = unlimited.
    pub bandwidth_bps: f64,
    /// One-way latency.
    #[serde(with = "micros")]
    pub latency: Duration,
}

mod micros {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_micros() as u64)
    }
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_micros(u64::deserialize(d)?))
    }
}

impl LinkSpec {
    /// `mbit` megabits per second, `latency_us` one way.
    pub fn mbit(mbit: f64, latency_us: u64) -> Self {
        LinkSpec {
            bandwidth_bps: mbit * 1e6,
            latency: Duration::from_micros(latency_us),
        }
    }

    /// No throttling at all (the proxy still sits in the path).
    pub fn unlimited() -> Self {
        LinkSpec {
            bandwidth_bps: 0.0,
            latency: Duration::ZERO,
        }
    }
}

/// Bytes carried by a link.
#[derive(Debug, Default)]
pub struct LinkCounters {
    /// Client → upstream.
    pub(crate) up_bytes: AtomicU64,
    /// Upstream → client.
    pub(crate) down_bytes: AtomicU64,
}

impl LinkCounters {
    /// Bytes carried client → upstream so far.
    pub fn up(&self) -> u64 {
        self.up_bytes.load(Ordering::Relaxed)
    }

    /// Bytes carried upstream → client so far.
    pub fn down(&self) -> u64 {
        self.down_bytes.load(Ordering::Relaxed)
    }
}

/// Token bucket on a virtual clock.
struct Pacer {
    rate: f64,
    burst: Duration,
    next_free: std::sync::Mutex<Instant>,
}

impl Pacer {
    fn new(bandwidth_bps: f64) -> Self {
        Pacer {
            rate: bandwidth_bps / 8.0,
            burst: Duration::from_millis(2),
            next_free: std::sync::Mutex::new(Instant::now()),
        }
    }

    /// Waits until `bytes` may leave.
    async fn take(&self, bytes: usize) {
        if self.rate <= 0.0 {
            return;
        }
        let due = {
            let mut next = self.next_free.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            let start = (*next).max(now.checked_sub(self.burst).unwrap_or(now));
            *next = start + Duration::from_secs_f64(bytes as f64 / self.rate);
            *next
        };
        timer::sleep_until(due).await;
    }
}

/// A running throttled link. Dropping it (or [`ThrottledLink::shutdown`]) closes the
/// listener and every connection through it.
pub struct ThrottledLink {
    addr: SocketAddr,
    spec: LinkSpec,
    counters: Arc<LinkCounters>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// Largest chunk moved at once (keeps pacing fine-grained).
const CHUNK: usize = 256 * 1024;

impl ThrottledLink {
    /// Listens on 127.0.0.1:0 and forwards each connection to `upstream` through the link.
    pub async fn start(spec: LinkSpec, upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let counters = Arc::new(LinkCounters::default());
        let up = Arc::new(Pacer::new(spec.bandwidth_bps));
        let down = Arc::new(Pacer::new(spec.bandwidth_bps));
        let (stop, mut stopped) = oneshot::channel();
        let c = counters.clone();
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    accepted = listener.accept() => {
                        let Ok((client, _)) = accepted else { continue };
                        let (up, down, c) = (up.clone(), down.clone(), c.clone());
                        conns.spawn(async move {
                            if let Err(e) = carry(client, upstream, spec, up, down, c).await {
                                tracing::debug!("link connection ended: {e}");
                            }
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
            // Closed to new connections before the open ones are cut: a client that
            // sees its connection cut and dials again must find the link gone.
            drop(listener);
            conns.shutdown().await;
        });
        Ok(ThrottledLink {
            addr,
            spec,
            counters,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `grpc://` URL of the link's entry.
    pub fn url(&self) -> String {
        format!("grpc://{}", self.addr)
    }

    /// The link's settings.
    pub fn spec(&self) -> LinkSpec {
        self.spec
    }

    /// Bytes carried so far.
    pub fn counters(&self) -> &LinkCounters {
        &self.counters
    }

    /// Closes the link and waits for its connections to end.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for ThrottledLink {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

async fn carry(
    client: TcpStream,
    upstream: SocketAddr,
    spec: LinkSpec,
    up: Arc<Pacer>,
    down: Arc<Pacer>,
    counters: Arc<LinkCounters>,
) -> std::io::Result<()> {
    client.set_nodelay(true)?;
    let server = TcpStream::connect(upstream).await?;
    server.set_nodelay(true)?;
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let c2 = counters.clone();
    let a = pump(cr, sw, spec.latency, up, move |n| {
        c2.up_bytes.fetch_add(n, Ordering::Relaxed);
    });
    let b = pump(sr, cw, spec.latency, down, move |n| {
        counters.down_bytes.fetch_add(n, Ordering::Relaxed);
    });
    let (ra, rb) = tokio::join!(a, b);
    ra.and(rb)
}

/// Moves bytes one way: read, pace, then deliver after the latency (delay line).
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    latency: Duration,
    pacer: Arc<Pacer>,
    count: impl Fn(u64),
) -> std::io::Result<()> {
    if latency.is_zero() {
        // No delay line needed: pace and forward in place.
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = from.read(&mut buf).await?;
            if n == 0 {
                return to.shutdown().await;
            }
            pacer.take(n).await;
            to.write_all(&buf[..n]).await?;
            count(n as u64);
        }
    }
    // Enough slots for a bandwidth-delay product of 256 MiB.
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(1024);
    let reader = async move {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = from.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(());
            }
            pacer.take(n).await;
            if tx
                .send((Instant::now() + latency, buf[..n].to_vec()))
                .await
                .is_err()
            {
                return Ok(());
            }
        }
    };
    let writer = async move {
        while let Some((due, data)) = rx.recv().await {
            if !latency.is_zero() {
                timer::sleep_until(due).await;
            }
            to.write_all(&data).await?;
            count(data.len() as u64);
        }
        to.shutdown().await
    };
    let (r, w) = tokio::join!(reader, writer);
    r.and(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Starts a sink that reads everything and answers with the byte count.
    async fn sink() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 65536];
                    let mut n = 0u64;
                    loop {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => n += k as u64,
                        }
                    }
                    let _ = s.write_all(&n.to_le_bytes()).await;
                });
            }
        });
        addr
    }

    /// Sends `data` through the link and returns the byte count the sink reports.
    async fn send_through(link: &ThrottledLink, data: &[u8]) -> u64 {
        let mut s = TcpStream::connect(link.addr()).await.unwrap();
        s.write_all(data).await.unwrap();
        s.shutdown().await.unwrap();
        let mut got = [0u8; 8];
        s.read_exact(&mut got).await.unwrap();
        u64::from_le_bytes(got)
    }

    #[tokio::test]
    async fn carries_every_byte_and_adds_latency() {
        let link = ThrottledLink::start(LinkSpec::mbit(0.0, 20_000), sink().await)
            .await
            .unwrap();
        let t0 = Instant::now();
        let data: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        assert_eq!(send_through(&link, &data).await, data.len() as u64);
        // Data there and the answer back: at least two one-way latencies.
        assert!(
            t0.elapsed() >= Duration::from_millis(40),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!(
            link.counters().up_bytes.load(Ordering::Relaxed),
            data.len() as u64
        );
        assert_eq!(link.counters().down_bytes.load(Ordering::Relaxed), 8);
        link.shutdown().await;
    }

    #[tokio::test]
    async fn paces_to_the_bandwidth() {
        // 8 Mbit/s = 1 MB/s: 400 KB cannot pass in much under 0.4 s.
        let link = ThrottledLink::start(LinkSpec::mbit(8.0, 0), sink().await)
            .await
            .unwrap();
        let t0 = Instant::now();
        assert_eq!(send_through(&link, &vec![7u8; 400_000]).await, 400_000);
        let secs = t0.elapsed().as_secs_f64();
        // Lower bound only (timing upper bounds belong in benchmarks); burst is 2 ms.
        assert!(
            secs >= 0.39,
            "400 KB crossed an 8 Mbit/s link in {secs:.3} s"
        );
    }
}
