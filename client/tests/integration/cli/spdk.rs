//! `csd serve --device spdk:tcp=…` (feature `spdk`): the node stores on a namespace
//! of SPDK's own NVMe-oF/TCP target (`nvmf_tgt` over a malloc bdev, on loopback),
//! sending real NVMe commands with SPDK's initiator; killed with SIGKILL and started
//! again on the same namespace, it has every table. Needs `SPDK_DIR` (a build of
//! `scripts/build-spdk.sh`).

use super::processes::spawn_listening_with;
use arrow::array::Int64Array;
use csd_runtime::node_client::NodeClient;
use futures::TryStreamExt;

const NQN: &str = "nqn.2016-06.io.spdk:csd-test";

/// SPDK's NVMe-oF target serving a 256 MiB malloc namespace on 127.0.0.1:`port`.
struct Target {
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spdk_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(
        std::env::var_os("SPDK_DIR").expect("SPDK_DIR: the SPDK build the `spdk` feature links"),
    )
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_target(port: u16) -> Target {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tgt.json");
    std::fs::write(
        &config,
        format!(
            r#"{{"subsystems":[
 {{"subsystem":"bdev","config":[{{"method":"bdev_malloc_create","params":{{"name":"Malloc0","num_blocks":524288,"block_size":512}}}}]}},
 {{"subsystem":"nvmf","config":[
  {{"method":"nvmf_create_transport","params":{{"trtype":"TCP"}}}},
  {{"method":"nvmf_create_subsystem","params":{{"nqn":"{NQN}","allow_any_host":true,"serial_number":"CSD00000000000001"}}}},
  {{"method":"nvmf_subsystem_add_ns","params":{{"nqn":"{NQN}","namespace":{{"bdev_name":"Malloc0"}}}}}},
  {{"method":"nvmf_subsystem_add_listener","params":{{"nqn":"{NQN}","listen_address":{{"trtype":"TCP","adrfam":"IPv4","traddr":"127.0.0.1","trsvcid":"{port}"}}}}}}]}}]}}"#
        ),
    )
    .unwrap();
    let spdk = spdk_dir();
    let child = std::process::Command::new(spdk.join("build/bin/nvmf_tgt"))
        .args([
            "-m",
            "0x1",
            "--no-huge",
            "-s",
            "1024",
            "-u",
            "--disable-cpumask-locks",
        ])
        .arg("-r")
        .arg(dir.path().join("rpc.sock"))
        .arg("--json")
        .arg(&config)
        .env("LD_LIBRARY_PATH", spdk.join("build/lib"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("starting nvmf_tgt");
    let t0 = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "nvmf_tgt did not listen on {port}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Target { child, _dir: dir }
}

fn serve(port: u16) -> (std::process::Child, String) {
    let lib = spdk_dir().join("build/lib");
    let device = format!("spdk:tcp=127.0.0.1:{port}/{NQN}");
    spawn_listening_with(
        &[
            "serve",
            "--device",
            &device,
            "--listen",
            "127.0.0.1:0",
            "--memory",
            "512MiB",
        ],
        &[("LD_LIBRARY_PATH", lib.to_str().unwrap())],
    )
}

async fn ids(c: &NodeClient, table: &str) -> Vec<i64> {
    let batches: Vec<arrow::record_batch::RecordBatch> = c
        .scan(table, None, &[])
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let mut out: Vec<i64> = batches
        .iter()
        .flat_map(|b| {
            b.column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .values()
                .to_vec()
        })
        .collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_on_spdks_nvme_of_tcp_initiator_keeps_its_tables_across_kill_9() {
    let port = free_port();
    let _target = start_target(port);
    let (mut node, url) = serve(port);
    let c = NodeClient::connect(&url).await.unwrap();
    let geo = c.stats().await.unwrap().device.geometry;
    assert_eq!(geo.name, format!("spdk:tcp=127.0.0.1:{port}/{NQN}"));
    assert_eq!(geo.num_blocks, 65536, "256 MiB in 4 KiB blocks: {geo:?}");
    let schema = std::sync::Arc::new(arrow::datatypes::Schema::new(vec![
        arrow::datatypes::Field::new("id", arrow::datatypes::DataType::Int64, false),
    ]));
    let batch = |from: i64| {
        arrow::record_batch::RecordBatch::try_new(
            schema.clone(),
            vec![std::sync::Arc::new(Int64Array::from_iter_values(
                from..from + 200_000,
            ))],
        )
        .unwrap()
    };
    for (t, from) in [("a", 0), ("b", 1_000_000), ("gone", 5)] {
        c.put(
            t,
            "p0",
            schema.clone(),
            futures::stream::iter(vec![Ok(batch(from))]),
        )
        .await
        .unwrap();
    }
    c.delete("gone", None).await.unwrap();
    let stats = c.stats().await.unwrap().device.stats;
    assert!(
        stats.bytes_deallocated > 0,
        "no unmap reached the target: {stats:?}"
    );
    assert_eq!(ids(&c, "a").await, (0..200_000).collect::<Vec<_>>());
    node.kill().unwrap();
    node.wait().unwrap();
    // The target still holds the namespace; a new node process finds the tables.
    let (mut node, url) = serve(port);
    let c = NodeClient::connect(&url).await.unwrap();
    assert_eq!(ids(&c, "a").await, (0..200_000).collect::<Vec<_>>());
    assert_eq!(
        ids(&c, "b").await,
        (1_000_000..1_200_000).collect::<Vec<_>>()
    );
    let names: Vec<String> = c
        .list_tables("")
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names, ["a", "b"]);
    node.kill().unwrap();
    let _ = node.wait();
}
