//! Kill -9 a real child process mid-put, many times, and check the store after each.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use csd_runtime::device::uring::UringDevice;
use csd_runtime::store::{ObjectStore, StoreOptions};

const DEVICE_BYTES: u64 = 24 << 20;

fn size_of(i: u64) -> usize {
    (i as usize * 7919) % 900_000 + 1
}

/// Runs in the child: puts objects forever (deleting some), acknowledging each on stdout.
#[test]
#[ignore = "helper: run by crash::kill_9_mid_put in a child process"]
fn crash_child() {
    let Ok(path) = std::env::var("CSD_CRASH_DEVICE") else {
        return;
    };
    let start: u64 = std::env::var("CSD_CRASH_START").unwrap().parse().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let dev =
            std::sync::Arc::new(UringDevice::open(path.as_ref(), Some(DEVICE_BYTES), 32).unwrap());
        let store = ObjectStore::open(dev, StoreOptions::default())
            .await
            .unwrap();
        for i in start.. {
            // Keep the device from filling: drop the oldest objects first.
            while store.stats().await.free_blocks < 800 {
                let oldest = store.list("c/").into_iter().min_by_key(|o| o.id).unwrap();
                println!("BEGIN del {}", oldest.name);
                store.delete(&oldest.name).await.unwrap();
                println!("ACK del {}", oldest.name);
            }
            store
                .put(&format!("c/{i}"), &crate::contents(i, size_of(i)))
                .await
                .unwrap();
            println!("ACK put c/{i}");
            if i % 5 == 0 {
                println!("BEGIN del c/{}", i - 1);
                store.delete(&format!("c/{}", i - 1)).await.ok();
                println!("ACK del c/{}", i - 1);
            }
        }
    });
}

#[test]
fn kill_9_mid_put() {
    let runs: u64 = std::env::var("CSD_CRASH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(25);
    let dir = crate::scratch_dir();
    let path = dir.path().join("crash.img");
    let exe = std::env::current_exe().unwrap();
    let mut acked: BTreeSet<String> = BTreeSet::new();
    let mut next = 1u64;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut total_acks = 0;
    for run in 0..runs {
        let mut child = Command::new(&exe)
            .args([
                "crash::crash_child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("CSD_CRASH_DEVICE", &path)
            .env("CSD_CRASH_START", next.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
                .filter(|l| l.starts_with("ACK ") || l.starts_with("BEGIN "))
                .collect::<Vec<_>>()
        });
        // Kill at a varying instant: early runs hit start-up/format, later ones mid-put.
        std::thread::sleep(Duration::from_millis(30 + (run * 37) % 250));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let lines = reader.join().unwrap();
        total_acks += lines.len();
        // A delete that began but was not acknowledged may or may not have landed.
        let mut in_flight_delete: BTreeSet<String> = BTreeSet::new();
        for l in &lines {
            if let Some(n) = l.strip_prefix("ACK put ") {
                acked.insert(n.to_string());
            } else if let Some(n) = l.strip_prefix("BEGIN del ") {
                in_flight_delete.insert(n.to_string());
            } else if let Some(n) = l.strip_prefix("ACK del ") {
                in_flight_delete.remove(n);
                acked.remove(n);
            }
        }
        let found: BTreeMap<String, u64> = rt.block_on(async {
            let dev = std::sync::Arc::new(UringDevice::open(&path, None, 32).unwrap());
            let store = match ObjectStore::open(dev, StoreOptions::default()).await {
                Ok(s) => s,
                // Killed before the first format finished: the device must still be blank.
                Err(e) if acked.is_empty() => {
                    panic!("run {run}: reopen failed before any ack: {e}")
                }
                Err(e) => panic!("run {run}: reopen failed: {e}"),
            };
            let mut found = BTreeMap::new();
            for o in store.list("") {
                let i: u64 = o.name.trim_start_matches("c/").parse().unwrap();
                // Every present object is whole: right length and bytes, checksums pass.
                let got = store
                    .get_all(&o.name)
                    .await
                    .unwrap_or_else(|e| panic!("run {run}: {}: {e}", o.name));
                assert_eq!(
                    &got[..],
                    &crate::contents(i, size_of(i))[..],
                    "run {run}: {} torn",
                    o.name
                );
                found.insert(o.name.clone(), i);
            }
            crate::store::assert_consistent(&store).await;
            found
        });
        for name in acked.iter().filter(|n| !in_flight_delete.contains(*n)) {
            assert!(
                found.contains_key(name),
                "run {run}: acknowledged {name} was lost"
            );
        }
        // An unacknowledged put may have landed; adopt what is there.
        acked = found.keys().cloned().collect();
        next = found.values().max().copied().unwrap_or(next).max(next) + 1;
        next += 10;
    }
    assert!(
        total_acks > runs as usize,
        "the child made too little progress ({total_acks} acks) to test anything"
    );
}
