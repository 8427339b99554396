//! Throttled-link accuracy: achieved bandwidth vs setting from 100 Mbit/s to 10 Gbit/s,
//! and round-trip time vs configured latency, through `csd_testbed::link`.
//!
//! `cargo run --release -p csd-benches --bin link -- [--seconds 2]`

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use csd_benches::{default_json_path, write_json};
use csd_testbed::link::{LinkSpec, ThrottledLink};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser)]
struct Args {
    /// Seconds of traffic per bandwidth setting.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// JSON output path.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Serialize)]
struct Row {
    setting: String,
    configured: f64,
    measured: f64,
    ratio: f64,
}

/// Reads everything, then answers with the byte count; or echoes 1-byte pings.
async fn server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            s.set_nodelay(true).ok();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 20];
                let mut n = 0u64;
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(1) if buf[0] == b'?' => {
                            let _ = s.write_all(b"!").await;
                        }
                        Ok(k) => n += k as u64,
                    }
                }
                let _ = s.write_all(&n.to_le_bytes()).await;
            });
        }
    });
    addr
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let upstream = server().await;
    let mut rows = Vec::new();
    println!(
        "{:<22} {:>14} {:>14} {:>8}",
        "link", "configured", "measured", "ratio"
    );
    for mbit in [100.0, 250.0, 1000.0, 2500.0, 10000.0] {
        let link = ThrottledLink::start(LinkSpec::mbit(mbit, 0), upstream)
            .await
            .expect("link");
        let bytes = ((mbit * 1e6 / 8.0) * args.seconds) as usize;
        let chunk = vec![1u8; 1 << 20];
        let mut s = TcpStream::connect(link.addr()).await.expect("connect");
        let t0 = Instant::now();
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len());
            s.write_all(&chunk[..n]).await.expect("write");
            left -= n;
        }
        s.shutdown().await.expect("shutdown");
        let mut got = [0u8; 8];
        s.read_exact(&mut got).await.expect("count");
        let secs = t0.elapsed().as_secs_f64();
        assert_eq!(
            u64::from_le_bytes(got) as usize,
            bytes,
            "bytes lost in the link"
        );
        let measured = bytes as f64 * 8.0 / secs / 1e6;
        println!(
            "{:<22} {:>9.0} Mbit/s {:>9.0} Mbit/s {:>8.3}",
            format!("{mbit} Mbit/s, 0 latency"),
            mbit,
            measured,
            measured / mbit
        );
        rows.push(Row {
            setting: format!("{mbit} Mbit/s"),
            configured: mbit,
            measured,
            ratio: measured / mbit,
        });
        link.shutdown().await;
    }
    for lat_us in [0u64, 100, 1000, 10_000] {
        let link = ThrottledLink::start(LinkSpec::mbit(1000.0, lat_us), upstream)
            .await
            .expect("link");
        let mut s = TcpStream::connect(link.addr()).await.expect("connect");
        s.set_nodelay(true).ok();
        let n = 50;
        let mut b = [0u8; 1];
        let t0 = Instant::now();
        for _ in 0..n {
            s.write_all(b"?").await.expect("ping");
            s.read_exact(&mut b).await.expect("pong");
        }
        let rtt = t0.elapsed() / n;
        let want = Duration::from_micros(2 * lat_us);
        // With no latency configured the "ratio" is meaningless: report the proxy's own RTT.
        let ratio = if lat_us == 0 {
            f64::NAN
        } else {
            rtt.as_secs_f64() / want.as_secs_f64()
        };
        println!(
            "{:<22} {:>11.0} us {:>11.0} us {:>8.3}",
            format!("RTT, {lat_us} us one way"),
            want.as_micros(),
            rtt.as_micros(),
            ratio
        );
        rows.push(Row {
            setting: format!("rtt {lat_us}us"),
            configured: want.as_micros() as f64,
            measured: rtt.as_micros() as f64,
            ratio,
        });
        link.shutdown().await;
    }
    write_json(
        &args.json.unwrap_or_else(|| default_json_path("link")),
        &rows,
    )
    .expect("json");
}
