//! Kept results and leases under a tenant's quotas: bound to their tenant, counted
//! against it, released with it.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_results_are_bound_to_their_tenant_and_count_against_its_quota() {
    use csd_query_pushdown::{Cluster, SessionOptions};
    let s = secure_node(false).await;
    let etl = s.client("etl-token").await;
    put(&etl, "lineitem", lineitem(0.002, 1, 1).unwrap())
        .await
        .unwrap();
    let session = |token: &'static str| {
        let creds = s.creds(Some(token));
        let url = s.node.url.clone();
        async move {
            Cluster::connect_with(&[url], &creds)
                .await
                .unwrap()
                .session(SessionOptions::default())
                .await
                .unwrap()
        }
    };
    let q = "SELECT l_orderkey, l_quantity FROM lineitem WHERE l_quantity < 10";
    let expected = session("etl-token").await.run(q).await.unwrap().rows();
    let kept = session("etl-token")
        .await
        .keep(q, std::time::Duration::from_secs(60))
        .await
        .unwrap();
    let r = &kept[0].reference;
    let sealed = r.ticket_bytes().unwrap();
    assert_eq!(
        sealed[0], 2,
        "a kept result's ticket is sealed for its tenant"
    );
    let mut as_etl = flight(&s, "etl-token").await;
    assert_eq!(
        do_get_rows(&mut as_etl, sealed.clone()).await.unwrap(),
        expected
    );
    // Another tenant, with the ticket or with one built by hand from the id.
    let mut as_reader = flight(&s, "reader-token").await;
    let (c, m) = do_get_rows(&mut as_reader, sealed.clone())
        .await
        .unwrap_err();
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("issued to tenant etl"), "{m}");
    let inner = csd_runtime::protocol::ticket::Seal::decode(&sealed)
        .unwrap()
        .ticket;
    let (c, m) = do_get_rows(&mut as_reader, inner.clone())
        .await
        .unwrap_err();
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("belongs to tenant etl"), "{m}");
    let reader = s.client("reader-token").await;
    let (c, m) = code(reader.release(r).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(reader.refs().await.unwrap().is_empty());
    // An admin may read (and list) any tenant's.
    let mut as_ops = flight(&s, "ops-token").await;
    assert_eq!(do_get_rows(&mut as_ops, inner).await.unwrap(), expected);
    assert_eq!(s.client("ops-token").await.refs().await.unwrap().len(), 1);

    // Granted, the other tenant resolves it with its own ticket and reads its table
    // in the next query; it may not renew, free or grant it; revoked, it is refused.
    let (c, m) = code(etl.grant(r, "nobody", false).await);
    assert_eq!(c, Code::InvalidArgument, "{m}");
    assert!(m.contains("no tenant named"), "{m}");
    let (c, m) = code(reader.grant(r, "reader", false).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    let granted = etl.grant(r, "reader", false).await.unwrap();
    assert_eq!(granted.table, r.table);
    assert_ne!(
        granted.ticket, r.ticket,
        "the grantee's ticket is sealed for it"
    );
    let as_grantee = granted.ticket_bytes().unwrap();
    assert_eq!(
        do_get_rows(&mut as_reader, as_grantee.clone())
            .await
            .unwrap(),
        expected
    );
    let (c, m) = do_get_rows(&mut as_etl, as_grantee.clone())
        .await
        .unwrap_err();
    assert_eq!(
        c,
        Code::PermissionDenied,
        "a grantee's ticket is its own: {m}"
    );
    let listed = reader.refs().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].info.readers, vec!["reader".to_string()]);
    let next = format!("SELECT count(*) AS n FROM {}", r.table);
    let count = |rows: Vec<RecordBatch>| {
        rows[0]
            .column(0)
            .as_any()
            .downcast_ref::<arrow::array::Int64Array>()
            .unwrap()
            .value(0) as usize
    };
    let grantee_session = session("reader-token").await;
    assert_eq!(
        count(grantee_session.run(&next).await.unwrap().batches),
        expected
    );
    let (c, m) = code(reader.release(&granted).await);
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(m.contains("granted to read"), "{m}");
    let (c, m) = code(
        reader
            .renew(&granted, std::time::Duration::from_secs(600))
            .await,
    );
    assert_eq!(c, Code::PermissionDenied, "{m}");
    let (c, _) = code(reader.grant(&granted, "small", false).await);
    assert_eq!(c, Code::PermissionDenied);
    etl.grant(r, "reader", true).await.unwrap();
    let (c, m) = do_get_rows(&mut as_reader, as_grantee).await.unwrap_err();
    assert_eq!(c, Code::PermissionDenied, "{m}");
    assert!(reader.refs().await.unwrap().is_empty());
    let e = session("reader-token")
        .await
        .run(&next)
        .await
        .expect_err("a revoked grantee reads nothing")
        .to_string();
    assert!(e.contains("not found") || e.contains("csd_ref_"), "{e}");

    // Kept bytes count against max_stored_bytes: `small` (64 KiB) keeps until refused.
    let small = s.client("small-token").await;
    // 2,000 integers: a few KiB of Parquet, 16 KiB kept as Arrow IPC.
    let tiny = RecordBatch::try_from_iter([(
        "x",
        Arc::new(arrow::array::Int64Array::from_iter_values(0..2000)) as arrow::array::ArrayRef,
    )])
    .unwrap();
    put(&small, "q_tiny", vec![tiny]).await.unwrap();
    let small_session = session("small-token").await;
    let mut kept_small = Vec::new();
    let refused = loop {
        match small_session
            .keep("SELECT * FROM q_tiny", std::time::Duration::from_secs(60))
            .await
        {
            Ok(k) => kept_small.extend(k),
            Err(e) => break e.to_string(),
        }
        assert!(kept_small.len() < 20, "never refused");
    };
    assert!(refused.contains("max_stored_bytes"), "{refused}");
    let live = small.refs().await.unwrap();
    assert_eq!(live.len(), kept_small.len(), "a refused keep keeps nothing");
    // Releasing one makes room again.
    small.release(&kept_small[0].reference).await.unwrap();
    small_session
        .keep("SELECT * FROM q_tiny", std::time::Duration::from_secs(60))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_holds_its_tenants_request_quota_and_runs_its_requests_within_it() {
    use csd_query_pushdown::{Cluster, SessionOptions};
    let s = secure_node(false).await;
    let etl = s.client("etl-token").await;
    put(&etl, "lineitem", lineitem(0.002, 1, 1).unwrap())
        .await
        .unwrap();
    let leaser = s.client("leaser-token").await;
    // max_requests = 1: a lease of 2 slots would hold 2 requests.
    let (c, m) = code(leaser.lease(2, std::time::Duration::from_secs(30)).await);
    assert_eq!(c, Code::ResourceExhausted, "{m}");
    assert!(
        m.contains("max_requests") && m.contains("counts as 2"),
        "{m}"
    );
    let lease = leaser
        .lease(1, std::time::Duration::from_secs(30))
        .await
        .unwrap();
    // Another tenant may not run on it.
    let q = "SELECT count(*) AS n, sum(l_quantity) AS q FROM lineitem";
    let session = |token: &'static str, leases: Vec<String>| {
        let mut creds = s.creds(Some(token));
        creds.leases = leases;
        let url = s.node.url.clone();
        async move {
            Cluster::connect_with(&[url], &creds)
                .await
                .unwrap()
                .session(SessionOptions::default())
                .await
                .unwrap()
        }
    };
    let expected = session("etl-token", vec![]).await.run(q).await.unwrap();
    let e = session("etl-token", vec![lease.id.clone()])
        .await
        .run(q)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("belongs to tenant leaser"), "{e}");
    // The lease holds leaser's one request: without it, its queries are refused...
    let e = session("leaser-token", vec![])
        .await
        .run(q)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_requests"), "{e}");
    // ...and on it, they run (taking no more), with the same answer.
    let on_lease = session("leaser-token", vec![lease.id.clone()])
        .await
        .run(q)
        .await
        .unwrap();
    assert_eq!(
        arrow::util::pretty::pretty_format_batches(&on_lease.batches)
            .unwrap()
            .to_string(),
        arrow::util::pretty::pretty_format_batches(&expected.batches)
            .unwrap()
            .to_string()
    );
    assert!(
        on_lease
            .node_runs
            .iter()
            .all(|r| r.report.admission.lease.as_ref() == Some(&lease.id)),
        "{:?}",
        on_lease.node_runs
    );
    // Released, the quota's request comes back.
    leaser.release_lease(&lease.id).await.unwrap();
    session("leaser-token", vec![]).await.run(q).await.unwrap();
    // A lease too small for the request (1 byte of memory): it goes through
    // admission, and takes a request slot there — the lease holds the only one.
    let small = leaser
        .lease_with(&csd_runtime::protocol::LeaseRequest {
            slots: 1,
            seconds: 30.0,
            idle_seconds: None,
            memory: Some(ByteSize(1)),
        })
        .await
        .unwrap();
    let e = session("leaser-token", vec![small.id.clone()])
        .await
        .run(q)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_requests"), "{e}");
    leaser.release_lease(&small.id).await.unwrap();
}
