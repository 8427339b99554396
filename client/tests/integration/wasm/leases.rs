//! Shipped code over kept answers and on leased slots: hot invocations, silent
//! holders, pushed fragments that skip admission.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_runs_over_a_kept_answer_at_the_node() {
    let node = start(&config("emulated:mem")).await;
    load_lineitem(&node.url).await;
    let kept = session(&node.url)
        .await
        .keep(
            "SELECT l_orderkey, l_extendedprice, l_discount, l_shipmode FROM lineitem WHERE l_quantity < 30",
            std::time::Duration::from_secs(60),
        )
        .await
        .unwrap();
    let table = kept[0].reference.table.clone();
    // A session made after the keep sees the kept table; the module's input is
    // pushed to it like to any table.
    let s = session(&node.url).await;
    let mut j = job("filter_map", FILTER_MAP_COLUMNS, None, &[("mode", "AIR")]);
    j.table = table;
    let run = s.run_wasm(&j).await.unwrap();
    assert!(run.endpoints.iter().all(|e| e.pushed_back.is_none()));
    let want = pairs(&sql(&s, FILTER_MAP_SQL).await);
    assert!(!want.is_empty());
    assert_eq!(pairs(&run.batches), want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_slots_invoke_functions_hot_and_come_back() {
    let mut cfg = config("emulated:mem");
    cfg.cpus = 2;
    let node = start(&cfg).await;
    load_lineitem(&node.url).await;
    let c = NodeClient::connect(&node.url).await.unwrap();
    let module = guest("functions");
    let digest = csd_runtime::sandbox::ModuleDigest::of(&module);

    // Granted within capacity: one of two slots (one is always kept for others).
    let lease = c
        .lease(1, std::time::Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(lease.slots, 1);
    let st = c.stats().await.unwrap();
    assert_eq!(st.admission.leased, 1);
    assert_eq!(st.leases.live, 1);
    // Beyond it: refused, with when to retry (the first lease's end at the latest).
    match c.lease(1, std::time::Duration::from_secs(30)).await {
        Err(csd_runtime::node_client::Error::Busy {
            message,
            retry_after,
        }) => {
            assert!(message.contains("cannot be leased"), "{message}");
            assert!(
                retry_after <= std::time::Duration::from_secs(30),
                "{retry_after:?}"
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // Admitted work still runs beside the lease.
    let s = session(&node.url).await;
    assert!(!sql(&s, FILTER_MAP_SQL).await.is_empty());

    // Cold (the module is sent), then hot; the answer is the function's.
    let price = arrow::array::Float64Array::from(vec![100.0, 50.0, 10.0]);
    let disc = arrow::array::Float64Array::from(vec![0.1, 0.5, 0.0]);
    let args = RecordBatch::try_from_iter([
        ("p", std::sync::Arc::new(price) as arrow::array::ArrayRef),
        ("d", std::sync::Arc::new(disc) as arrow::array::ArrayRef),
    ])
    .unwrap();
    let first = c
        .invoke(&lease.id, &digest, &module, "discounted", &args)
        .await
        .unwrap();
    assert_eq!(first.start, csd_runtime::lease::Start::Cold);
    let again = c
        .invoke(&lease.id, &digest, &module, "discounted", &args)
        .await
        .unwrap();
    assert_eq!(again.start, csd_runtime::lease::Start::Hot);
    let out = again.out.as_primitive::<Float64Type>();
    assert_eq!(out.values().to_vec(), vec![90.0, 25.0, 10.0]);
    // A guest's error is the caller's, with the function named.
    let neg = RecordBatch::try_from_iter([(
        "x",
        std::sync::Arc::new(arrow::array::Float64Array::from(vec![-1.0])) as arrow::array::ArrayRef,
    )])
    .unwrap();
    let e = c
        .invoke(&lease.id, &digest, &module, "strict_sqrt", &neg)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("negative"), "{e}");

    // Released: the slot comes back and the lease is gone.
    c.release_lease(&lease.id).await.unwrap();
    assert_eq!(c.stats().await.unwrap().admission.leased, 0);
    let e = c
        .invoke(&lease.id, &digest, &module, "discounted", &args)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::NotFound), "{e}");
    // Expiry gives slots back too.
    let short = c
        .lease(1, std::time::Duration::from_millis(500))
        .await
        .unwrap();
    assert_eq!(c.stats().await.unwrap().admission.leased, 1);
    tokio::time::sleep(std::time::Duration::from_millis(2200)).await;
    let st = c.stats().await.unwrap();
    assert_eq!(st.admission.leased, 0, "{:?}", st.leases);
    assert_eq!(st.leases.expired, 1);
    let e = c.release_lease(&short.id).await.unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::NotFound), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_holder_goes_silent_gives_its_slots_back() {
    let mut cfg = config("emulated:mem");
    cfg.cpus = 2;
    let node = start(&cfg).await;
    let c = NodeClient::connect(&node.url).await.unwrap();
    let idle = std::time::Duration::from_millis(600);
    let held = c
        .hold_lease(1, std::time::Duration::from_secs(60), idle)
        .await
        .unwrap();
    assert_eq!(held.info.idle_ms, Some(600));
    // Held (touched in the background) well past its idle limit.
    tokio::time::sleep(std::time::Duration::from_millis(2000)).await;
    let st = c.stats().await.unwrap();
    assert_eq!(st.admission.leased, 1, "{:?}", st.leases);
    // The holder goes away: the node ends the lease within the limit (plus its
    // sweeper's second).
    let id = held.info.id.clone();
    drop(held);
    tokio::time::sleep(std::time::Duration::from_millis(2200)).await;
    let st = c.stats().await.unwrap();
    assert_eq!(st.admission.leased, 0, "{:?}", st.leases);
    let e = c.release_lease(&id).await.unwrap_err();
    assert_eq!(e.code(), Some(tonic::Code::NotFound), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_fragments_on_a_lease_skip_admission_and_answer_alike() {
    use csd_runtime::node_client::Credentials;
    use csd_runtime::protocol::LeaseRequest;
    let node = start(&config("emulated:mem")).await;
    load_lineitem(&node.url).await;
    let c = NodeClient::connect(&node.url).await.unwrap();
    let q = "SELECT l_returnflag, count(*) AS n, sum(l_quantity) AS q FROM lineitem \
             WHERE l_shipdate < DATE '1998-01-01' GROUP BY l_returnflag ORDER BY l_returnflag";
    let text = |b: &[RecordBatch]| {
        arrow::util::pretty::pretty_format_batches(b)
            .unwrap()
            .to_string()
    };
    let plain = session(&node.url).await.run(q).await.unwrap();
    assert!(
        plain
            .node_runs
            .iter()
            .all(|r| r.report.admission.lease.is_none())
    );
    let on = |leases: Vec<String>| {
        let url = node.url.clone();
        async move {
            Cluster::connect_with(
                &[url],
                &Credentials {
                    leases,
                    ..Default::default()
                },
            )
            .await
            .unwrap()
            .session(SessionOptions::default())
            .await
            .unwrap()
        }
    };
    let admitted =
        |c: NodeClient| async move { c.stats().await.unwrap().admission.counters.admitted };
    let ask = |memory: u64| LeaseRequest {
        slots: 1,
        seconds: 30.0,
        idle_seconds: None,
        memory: Some(ByteSize(memory)),
    };
    let lease = c.lease_with(&ask(256 << 20)).await.unwrap();
    assert_eq!(lease.memory, 256 << 20);
    assert_eq!(c.stats().await.unwrap().admission.lease_memory, 256 << 20);
    // Another node's lease id first: each node uses the one it holds.
    let before = admitted(c.clone()).await;
    let leased = on(vec!["0".repeat(32), lease.id.clone()])
        .await
        .run(q)
        .await
        .unwrap();
    assert_eq!(text(&leased.batches), text(&plain.batches));
    assert!(
        leased
            .node_runs
            .iter()
            .all(|r| r.report.admission.lease.as_ref() == Some(&lease.id)),
        "{:?}",
        leased.node_runs
    );
    assert_eq!(
        admitted(c.clone()).await,
        before,
        "fragments on a lease do not go through admission"
    );
    // One fragment ran on it: the aggregate read the node's partitions as one.
    assert_eq!(c.stats().await.unwrap().leases.runs, 1);
    c.release_lease(&lease.id).await.unwrap();
    // A released lease, or one too small for the request's memory: admission runs
    // it, with the same answer.
    let tiny = c.lease_with(&ask(1)).await.unwrap();
    for ids in [vec![lease.id.clone()], vec![tiny.id.clone()]] {
        let before = admitted(c.clone()).await;
        let r = on(ids).await.run(q).await.unwrap();
        assert_eq!(text(&r.batches), text(&plain.batches));
        assert!(
            r.node_runs
                .iter()
                .all(|r| r.report.admission.lease.is_none())
        );
        assert_eq!(admitted(c.clone()).await, before + 1);
    }
    c.release_lease(&tiny.id).await.unwrap();
    let st = c.stats().await.unwrap().admission;
    assert_eq!((st.leased, st.lease_memory, st.memory_reserved), (0, 0, 0));
}
