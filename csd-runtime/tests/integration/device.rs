use std::sync::Arc;

use csd_runtime::Error;
use csd_runtime::device::emulated::{EmulatedDevice, TimingModel};
use csd_runtime::device::uring::UringDevice;
use csd_runtime::device::{BlockDevice, DmaBuf};

fn backends(dir: &std::path::Path) -> Vec<Arc<dyn BlockDevice>> {
    vec![
        Arc::new(UringDevice::open(&dir.join("uring.img"), Some(8 << 20), 32).unwrap()),
        Arc::new(EmulatedDevice::open(None, 8 << 20, 4096, TimingModel::untimed()).unwrap()),
        Arc::new(
            EmulatedDevice::open(
                Some(&dir.join("emu.img")),
                8 << 20,
                4096,
                TimingModel::untimed(),
            )
            .unwrap(),
        ),
        Arc::new(
            EmulatedDevice::open(
                None,
                8 << 20,
                4096,
                TimingModel {
                    latency_us: 50.0,
                    read_mbps: 500.0,
                    write_mbps: 400.0,
                    queue_depth: 8,
                    parallelism: 4,
                },
            )
            .unwrap(),
        ),
    ]
}

#[tokio::test]
async fn enforces_alignment_and_range() {
    let dir = crate::scratch_dir();
    for dev in backends(dir.path()) {
        let geo = dev.geometry().clone();
        assert_eq!(geo.capacity(), 8 << 20, "{}", geo.name);
        let e = dev.read(0, DmaBuf::zeroed(1000)).await.unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("multiple"),
            "{}: {e}",
            geo.name
        );
        assert!(matches!(
            dev.write(0, DmaBuf::zeroed(0)).await,
            Err(Error::InvalidArgument(_))
        ));
        let last = geo.num_blocks - 1;
        assert!(
            dev.read(last, DmaBuf::zeroed(4096)).await.is_ok(),
            "{}",
            geo.name
        );
        let e = dev.read(last, DmaBuf::zeroed(8192)).await.unwrap_err();
        assert!(
            e.to_string().contains("beyond the last block"),
            "{}: {e}",
            geo.name
        );
        assert!(matches!(
            dev.write(u64::MAX, DmaBuf::zeroed(4096)).await,
            Err(Error::InvalidArgument(_))
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_io_at_queue_depth() {
    let dir = crate::scratch_dir();
    for dev in backends(dir.path()) {
        let name = dev.geometry().name.clone();
        // 64 concurrent 16 KiB writes (more than any queue depth here), then reads.
        let writes = (0..64u64).map(|i| {
            let dev = dev.clone();
            tokio::spawn(async move {
                let mut b = DmaBuf::zeroed(16384);
                b.copy_from_slice(&crate::contents(i, 16384));
                dev.write(i * 4, b).await.map(|_| ())
            })
        });
        for r in futures::future::join_all(writes).await {
            r.unwrap().unwrap();
        }
        dev.flush().await.unwrap();
        let reads = (0..64u64).map(|i| {
            let dev = dev.clone();
            tokio::spawn(async move { (i, dev.read(i * 4, DmaBuf::zeroed(16384)).await) })
        });
        for r in futures::future::join_all(reads).await {
            let (i, b) = r.unwrap();
            assert_eq!(
                &b.unwrap()[..],
                &crate::contents(i, 16384)[..],
                "{name}: block run {i}"
            );
        }
        let s = dev.stats();
        assert_eq!(
            (s.writes, s.reads, s.bytes_written),
            (64, 64, 64 * 16384),
            "{name}"
        );
    }
}

#[tokio::test]
async fn uring_file_persists_across_reopen() {
    let dir = crate::scratch_dir();
    let path = dir.path().join("p.img");
    {
        let dev = UringDevice::open(&path, Some(1 << 20), 8).unwrap();
        let mut b = DmaBuf::zeroed(4096);
        b.fill(0xAB);
        dev.write(7, b).await.unwrap();
        dev.flush().await.unwrap();
    }
    let dev = UringDevice::open(&path, None, 8).unwrap();
    assert_eq!(dev.geometry().num_blocks, 256);
    assert!(
        dev.read(7, DmaBuf::zeroed(4096))
            .await
            .unwrap()
            .iter()
            .all(|&x| x == 0xAB)
    );
    let e = UringDevice::open(&dir.path().join("empty.img"), None, 8)
        .err()
        .expect("no capacity");
    assert!(e.to_string().contains("--capacity"), "{e}");
}
