//! The controller against a controllable clock.

use super::costs::MAX_SHAPES;
use super::*;

const MS: Duration = Duration::from_millis(1);

fn ask(tenant: &str, bytes: u64) -> Ask {
    Ask {
        operator: "sql".into(),
        tenant: tenant.into(),
        bytes,
        memory: 1 << 20,
        patient: false,
        asker: Asker::default(),
        shape: None,
    }
}

fn cfg(slots: usize) -> AdmissionConfig {
    let mut c = AdmissionConfig::new(slots, 1 << 30);
    c.prior_ns_per_byte = 1.0; // 1 MB = 1 ms
    c.trust_prior = true;
    c.overhead = Duration::ZERO;
    c
}

fn id(o: &Offer) -> u64 {
    match o {
        Offer::Run(i) | Offer::Queued(i) => *i,
        other => panic!("expected run or queue, got {other:?}"),
    }
}

#[test]
fn handing_back_is_priced_by_the_askers_link_and_load() {
    let mut c = Controller::new(cfg(1));
    let t = Duration::ZERO;
    // 20 ms of work each, one slot, target 50 ms: 20 running + 40 queued ahead.
    for _ in 0..3 {
        id(&c.offer(ask("x", 20_000_000), t));
    }
    let with = |link_mbit: f64, load: f64| Ask {
        asker: Asker {
            link_bytes_per_s: Some(link_mbit * 1e6 / 8.0),
            load,
            backlog_bytes: 0,
            shares_cores: false,
        },
        ..ask("x", 20_000_000)
    };
    // Here: 60 ms queued + 20 ms run. There, over 3.2 Gbit/s with idle cores:
    // 50 ms of link + 20 ms of decoding.
    match c.offer(with(3_200.0, 0.0), t) {
        Offer::PushBack(p) => assert!(p.reason.contains("sooner"), "{}", p.reason),
        o => panic!("expected push back, got {o:?}"),
    }
    // The same link, but each of the asker's cores has a fragment to finish
    // first: 50 + 20 + 20 ms there.
    assert!(matches!(c.offer(with(3_200.0, 1.0), t), Offer::Queued(_)));
    assert_eq!(c.stats().counters.kept_for_link, 1);
    // A load past 1 (or nonsense) counts as 1 or 0.
    match c.offer(with(3_200.0, f64::NAN), t) {
        Offer::PushBack(_) => {}
        o => panic!("expected push back, got {o:?}"),
    }
    // Here now 80 + 20. There, over 100 Mbit/s: 1.6 s of link.
    assert!(matches!(c.offer(with(100.0, 0.0), t), Offer::Queued(_)));
    // An unknown link is not priced: the plain rule pushes it back.
    assert!(matches!(
        c.offer(ask("x", 20_000_000), t),
        Offer::PushBack(_)
    ));
    assert_eq!(c.stats().counters.kept_for_link, 2);
    // Here 100 + 20 ms. There, over 3.2 Gbit/s behind 40 MB handed back to the
    // same link before: 150 ms of link + 20 of decoding. Without them, 70 ms.
    match c.offer(with(3_200.0, 0.0), t) {
        Offer::PushBack(p) => assert_eq!(p.bytes, 20_000_000),
        o => panic!("expected push back, got {o:?}"),
    }
    let behind = Ask {
        asker: Asker {
            backlog_bytes: 40_000_000,
            ..with(3_200.0, 0.0).asker
        },
        ..ask("x", 20_000_000)
    };
    assert!(matches!(c.offer(behind, t), Offer::Queued(_)));
    assert_eq!(c.stats().counters.kept_for_link, 3);
}

#[test]
fn an_asker_on_the_nodes_own_cores_is_not_handed_work_back() {
    let shared = || Ask {
        asker: Asker {
            shares_cores: true,
            ..Asker::default()
        },
        ..ask("x", 20_000_000)
    };
    let mut c = Controller::new(cfg(1));
    let t = Duration::ZERO;
    for _ in 0..3 {
        id(&c.offer(ask("x", 20_000_000), t));
    }
    // 60 ms queued ahead, over the 50 ms target: elsewhere, it goes back.
    assert!(matches!(
        c.offer(ask("x", 20_000_000), t),
        Offer::PushBack(_)
    ));
    assert!(matches!(c.offer(shared(), t), Offer::Queued(_)));
    assert_eq!(c.last_offer.kept, Some(Kept::SharedCores));
    let s = c.stats().counters;
    assert_eq!((s.kept_shared_cores, s.pushed_back), (1, 1));
    // A full queue still hands it back.
    let mut c = Controller::new(AdmissionConfig {
        max_queued: 1,
        ..cfg(1)
    });
    id(&c.offer(ask("x", 20_000_000), t));
    id(&c.offer(ask("x", 20_000_000), t));
    assert!(matches!(c.offer(shared(), t), Offer::PushBack(_)));
}

#[test]
fn runs_then_queues_within_target_then_pushes_back() {
    let mut c = Controller::new(cfg(1));
    let t = Duration::ZERO;
    // 20 ms of work each, one slot, target 50 ms.
    let a = c.offer(ask("x", 20_000_000), t);
    assert!(matches!(a, Offer::Run(_)));
    // Residual 20 ms: queue.
    assert!(matches!(c.offer(ask("x", 20_000_000), t), Offer::Queued(_)));
    // Residual 20 + 20 queued = 40 ms: queue.
    assert!(matches!(c.offer(ask("x", 20_000_000), t), Offer::Queued(_)));
    // 20 + 40 = 60 ms > 50: push back, with the prediction.
    match c.offer(ask("x", 20_000_000), t) {
        Offer::PushBack(p) => {
            assert!((p.predicted_delay_ms - 60.0).abs() < 0.01, "{p:?}");
            assert!(p.reason.contains("busy"), "{}", p.reason);
        }
        o => panic!("expected push back, got {o:?}"),
    }
    // 15 ms later the running one has 5 ms left: 5 + 40 = 45 ms, queue again.
    assert!(matches!(
        c.offer(ask("x", 20_000_000), 15 * MS),
        Offer::Queued(_)
    ));
    // 5 + 60 = 65 ms > 50, but the asker is saturated itself: it queues.
    let patient = Ask {
        patient: true,
        ..ask("x", 20_000_000)
    };
    assert!(matches!(c.offer(patient, 15 * MS), Offer::Queued(_)));
    let s = c.stats();
    assert_eq!((s.running, s.waiting, s.counters.pushed_back), (1, 4, 1));
    assert_eq!(s.counters.patient, 1);
    // Finishing dispatches the oldest waiting request, which waited 20 ms.
    let started = c.finish(id(&a), 20 * MS, 20 * MS, true);
    assert_eq!(started.len(), 1);
    assert_eq!(started[0].1, 20 * MS);
}

/// A prior nobody checked against this node's cores (the default) promises no long
/// wait: before a request of its kind has finished here, one wave of requests waits
/// for the CPU workers and the next is handed back; once one has finished, the
/// learned cost decides as above.
#[test]
fn a_cold_node_queues_one_wave_and_hands_back_the_rest_until_it_has_learned() {
    let mut cfg = cfg(2);
    cfg.trust_prior = false;
    let mut c = Controller::new(cfg);
    let t = Duration::ZERO;
    // 2 ms each by the prior: two run, two wait (well within the target) ...
    let first = c.offer(ask("x", 2_000_000), t);
    assert!(matches!(first, Offer::Run(_)));
    assert!(matches!(c.offer(ask("x", 2_000_000), t), Offer::Run(_)));
    assert!(matches!(c.offer(ask("x", 2_000_000), t), Offer::Queued(_)));
    assert!(matches!(c.offer(ask("x", 2_000_000), t), Offer::Queued(_)));
    // ... and the next is handed back, saying why.
    match c.offer(ask("x", 2_000_000), t) {
        Offer::PushBack(p) => assert!(
            p.reason.contains("no sql request has finished here yet"),
            "{}",
            p.reason
        ),
        o => panic!("expected push back, got {o:?}"),
    }
    // A patient asker still waits.
    let patient = Ask {
        patient: true,
        ..ask("x", 2_000_000)
    };
    assert!(matches!(c.offer(patient, t), Offer::Queued(_)));
    // One finished, as fast as the prior said: the prediction decides again.
    let next = c.finish(id(&first), 2 * MS, 2 * MS, true);
    assert_eq!(next.len(), 1);
    assert!(matches!(
        c.offer(ask("x", 2_000_000), 2 * MS),
        Offer::Queued(_)
    ));
    assert_eq!(c.stats().counters.pushed_back, 1);
}

#[test]
fn cost_is_learned_from_finished_requests() {
    let mut c = Controller::new(cfg(1));
    // Prior: 1 ns/byte; actual: 5 ns/byte.
    for i in 0..30u64 {
        let now = Duration::from_millis(i * 100);
        let o = c.offer(ask("x", 10_000_000), now);
        c.finish(id(&o), now + 50 * MS, 50 * MS, true);
    }
    let m = &c.stats().costs["sql"];
    assert!((m.ns_per_byte - 5.0).abs() < 0.01, "{m:?}");
    assert!(m.mean_abs_error < 0.01, "{m:?}");
    assert_eq!(c.estimate(&ask("x", 10_000_000)), 50 * MS);
    // An abandoned or failed run teaches nothing.
    let o = c.offer(ask("x", 10_000_000), Duration::from_secs(10));
    c.finish(
        id(&o),
        Duration::from_secs(11),
        Duration::from_secs(1),
        false,
    );
    assert!((c.stats().costs["sql"].ns_per_byte - 5.0).abs() < 0.01);
}

#[test]
fn repeated_shapes_learn_their_own_cost_and_are_bounded() {
    let mut c = Controller::new(cfg(1));
    let shaped = |shape: u64| Ask {
        shape: Some(shape),
        ..ask("x", 10_000_000)
    };
    // Two shapes of one operator, alternating: 1 and 9 ns/byte.
    for i in 0..40u64 {
        let now = Duration::from_millis(i * 200);
        let (shape, took) = if i % 2 == 0 {
            (1, 10 * MS)
        } else {
            (2, 90 * MS)
        };
        let o = c.offer(shaped(shape), now);
        c.finish(id(&o), now + took, took, true);
    }
    let near = |d: Duration, ms: f64| (d.as_secs_f64() * 1e3 - ms).abs() < 0.01;
    // Each shape is estimated from its own runs, not the operator's mean.
    assert!(
        near(c.estimate(&shaped(1)), 10.0),
        "{:?}",
        c.estimate(&shaped(1))
    );
    assert!(
        near(c.estimate(&shaped(2)), 90.0),
        "{:?}",
        c.estimate(&shaped(2))
    );
    // An unseen shape, or none, falls back to the operator's mean (between).
    let mean = c.estimate(&shaped(3));
    assert!(mean > 20 * MS && mean < 80 * MS, "{mean:?}");
    assert_eq!(c.estimate(&ask("x", 10_000_000)), mean);
    assert_eq!(c.stats().cost_shapes, 2);
    // At most MAX_SHAPES are kept; the least recently used goes first.
    for s in 0..MAX_SHAPES as u64 {
        let now = Duration::from_secs(100) + Duration::from_millis(s);
        if s == 10 {
            // Shape 2 is asked for again, so shape 1 is now the oldest.
            let o = c.offer(shaped(2), now);
            c.finish(id(&o), now, Duration::ZERO, false);
        }
        let o = c.offer(shaped(1000 + s), now);
        c.finish(id(&o), now, MS, true);
    }
    assert_eq!(c.stats().cost_shapes, MAX_SHAPES);
    assert!(near(c.estimate(&shaped(2)), 90.0), "recently used: kept");
    assert_eq!(
        c.estimate(&shaped(1)),
        c.estimate(&ask("x", 10_000_000)),
        "least recently used: forgotten"
    );
}

#[test]
fn queueing_predictions_are_scaled_by_their_recent_error() {
    let mut c = Controller::new(cfg(1));
    // 10 MB requests are estimated at 10 ms but hold the slot 30 ms (finished
    // without teaching the cost model: only the queueing prediction can learn).
    let mut now = Duration::ZERO;
    let mut running = id(&c.offer(ask("x", 10_000_000), now));
    for i in 0..40 {
        let next = c.offer(ask("x", 10_000_000), now);
        assert!(matches!(next, Offer::Queued(_)), "{next:?}");
        if i < 31 {
            assert_eq!(c.stats().queue_prediction_scale, 1.0, "not learned yet");
        }
        now += 30 * MS;
        let started = c.finish(running, now, 30 * MS, false);
        assert_eq!(started, vec![(id(&next), 30 * MS)]);
        running = id(&next);
    }
    // Predicted 10 ms, waited 30: the scale is 3.
    assert!((c.stats().queue_prediction_scale - 3.0).abs() < 1e-6);
    // One running (10 ms residual): queued, predicted 30 ms.
    assert!(matches!(
        c.offer(ask("x", 10_000_000), now),
        Offer::Queued(_)
    ));
    // 20 ms ahead unscaled (within the 50 ms target), 60 ms scaled: pushed back.
    match c.offer(ask("x", 10_000_000), now) {
        Offer::PushBack(p) => assert!((p.predicted_delay_ms - 60.0).abs() < 0.01, "{p:?}"),
        o => panic!("expected push back, got {o:?}"),
    }
}

#[test]
fn a_flooding_tenant_does_not_starve_another() {
    let mut c = Controller::new(cfg(2));
    let t0 = Duration::ZERO;
    let mut running = Vec::new();
    // Tenant "flood" fills both slots and the queue up to its delay target.
    let mut pushed = 0;
    for _ in 0..40 {
        match c.offer(ask("flood", 10_000_000), t0) {
            Offer::Run(i) => running.push(i),
            Offer::Queued(_) => {}
            Offer::PushBack(_) => pushed += 1,
            o => panic!("{o:?}"),
        }
    }
    assert_eq!(running.len(), 2);
    assert!(
        pushed > 20,
        "the flood is pushed back once its queue is full: {pushed}"
    );
    // The quiet tenant's request is queued (its own queue is empty, so its
    // predicted delay is the residual only) ...
    let quiet = c.offer(ask("quiet", 10_000_000), t0);
    assert!(matches!(quiet, Offer::Queued(_)), "{quiet:?}");
    // ... and starts with the first free slot, ahead of the flood's backlog.
    let started = c.finish(running[0], 10 * MS, 10 * MS, true);
    assert_eq!(started.len(), 1);
    assert_eq!(started[0].0, id(&quiet));
}

#[test]
fn leases_keep_the_reserves_and_a_slot_and_shrink_what_admitted_work_sees() {
    let mut cf = cfg(4);
    cf.policy = Policy::Always;
    cf.tenants.insert(
        "etl".into(),
        TenantShare {
            weight: 1.0,
            reserve: 2,
        },
    );
    let mut c = Controller::new(cf);
    // etl reserves 2 of 4 slots: others may lease at most 2 (etl itself 3).
    let e = c.lease("bulk", 3, 0).unwrap_err();
    assert!(
        matches!(e, LeaseRefused::KeptForOthers { asked: 3, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("cannot be leased"), "{e}");
    c.lease("bulk", 2, 0).unwrap();
    assert!(
        c.lease("bulk", 1, 0).is_err(),
        "the reserves hold under a lease flood"
    );
    assert_eq!(c.stats().leased, 2);
    // Admitted work sees 2 slots: the third request waits.
    let t0 = Duration::ZERO;
    let a = c.offer(ask("bulk", 1_000_000), t0);
    let b = c.offer(ask("bulk", 1_000_000), t0);
    let q = c.offer(ask("bulk", 1_000_000), t0);
    assert!(
        matches!(a, Offer::Run(_)) && matches!(b, Offer::Run(_)),
        "{a:?} {b:?}"
    );
    assert!(matches!(q, Offer::Queued(_)), "{q:?}");
    // Slots given back: the queued request can start.
    c.unlease("bulk", 2, 0);
    let started = c.dispatch(MS);
    assert_eq!(started.len(), 1, "{started:?}");
    // Under load, a lease waits for idle slots.
    let d = c.offer(ask("bulk", 1_000_000), t0);
    assert!(matches!(d, Offer::Run(_)), "{d:?}");
    let e = c.lease("bulk", 1, 0).unwrap_err();
    assert!(matches!(e, LeaseRefused::Busy { idle: 0, .. }), "{e}");
    assert!(e.to_string().contains("idle"), "{e}");
    assert_eq!(c.lease("bulk", 0, 0).unwrap_err(), LeaseRefused::NoSlots);
}

#[test]
fn a_tenants_leases_count_toward_its_reserve_and_lease_memory_is_held() {
    let mut cf = cfg(4);
    cf.policy = Policy::Always;
    cf.memory = 100 << 20;
    cf.tenants.insert(
        "etl".into(),
        TenantShare {
            weight: 1.0,
            reserve: 2,
        },
    );
    let mut c = Controller::new(cf);
    // etl may lease into its own reserve (others could lease only 2 of 4).
    c.lease("etl", 2, 0).unwrap();
    let t0 = Duration::ZERO;
    assert!(matches!(c.offer(ask("etl", 1_000), t0), Offer::Run(_)));
    // etl's next request waits for memory, with a slot free.
    let waiting = c.offer(
        Ask {
            memory: 100 << 20,
            ..ask("etl", 1_000)
        },
        t0,
    );
    assert!(matches!(waiting, Offer::Queued(_)), "{waiting:?}");
    // Its reserve is met by its lease and its running request: the free slot is
    // not held back from others for it.
    assert_eq!(c.free_for("bulk"), 1);
    c.unlease("etl", 2, 0);
    assert!(c.tenants.leased_by.is_empty());
    // Memory a lease holds is not offered to admitted work.
    c.lease("bulk", 1, 60 << 20).unwrap();
    let big = 50 << 20;
    assert!(!c.memory_fits(big));
    let e = c.lease("bulk", 1, 60 << 20).unwrap_err();
    assert!(matches!(e, LeaseRefused::Memory { .. }), "{e}");
    assert!(e.to_string().contains("memory"), "{e}");
    c.unlease("bulk", 1, 60 << 20);
    assert!(c.memory_fits(big));
}

#[test]
fn weights_split_the_slots() {
    let mut cf = cfg(1);
    cf.policy = Policy::Always;
    cf.tenants.insert(
        "gold".into(),
        TenantShare {
            weight: 3.0,
            reserve: 0,
        },
    );
    let mut c = Controller::new(cf);
    let t0 = Duration::ZERO;
    let first = id(&c.offer(ask("bronze", 1_000_000), t0));
    let mut owner = HashMap::new();
    for _ in 0..40 {
        owner.insert(id(&c.offer(ask("gold", 1_000_000), t0)), "gold");
        owner.insert(id(&c.offer(ask("bronze", 1_000_000), t0)), "bronze");
    }
    let mut order = Vec::new();
    let mut cur = first;
    for k in 1..=40u32 {
        let s = c.finish(cur, MS * k, MS, true);
        cur = s[0].0;
        order.push(owner[&cur]);
    }
    let gold = order.iter().filter(|o| **o == "gold").count();
    assert!(
        (28..=32).contains(&gold),
        "gold got {gold} of 40: {order:?}"
    );
}

#[test]
fn reserves_hold_slots_back() {
    let mut cf = cfg(2);
    cf.tenants.insert(
        "vip".into(),
        TenantShare {
            weight: 1.0,
            reserve: 1,
        },
    );
    let mut c = Controller::new(cf);
    let t0 = Duration::ZERO;
    assert!(matches!(
        c.offer(ask("other", 1_000_000), t0),
        Offer::Run(_)
    ));
    // The vip has no work: the other may take the second slot too.
    let b = c.offer(ask("other", 1_000_000), t0);
    assert!(matches!(b, Offer::Run(_)));
    // Both busy; a vip request queues and gets the next slot.
    let v = c.offer(ask("vip", 1_000_000), t0);
    let o = c.offer(ask("other", 1_000_000), t0);
    assert!(matches!((&v, &o), (Offer::Queued(_), Offer::Queued(_))));
    let started = c.finish(id(&b), MS, MS, true);
    assert_eq!(started, vec![(id(&v), MS)]);
}

#[test]
fn a_long_wait_says_why() {
    let ms = Duration::from_millis;
    let mut cf = AdmissionConfig::new(1, 1 << 30);
    cf.queue_target = ms(50);
    let adaptive = Admission::new(cf.clone());
    assert_eq!(adaptive.why_waited(ms(40), ms(10), None), None);
    let own = adaptive.why_waited(ms(300), ms(200), None).unwrap();
    assert!(own.contains("own run time (200.0 ms)"), "{own}");
    let wrong = adaptive.why_waited(ms(2000), ms(100), None).unwrap();
    assert!(wrong.contains("prediction was wrong"), "{wrong}");
    let patient = adaptive
        .why_waited(ms(10_800), ms(100), Some(Kept::Patient))
        .unwrap();
    assert!(patient.contains("compute tier was saturated"), "{patient}");
    let link = adaptive
        .why_waited(ms(400), ms(100), Some(Kept::ForLink))
        .unwrap();
    assert!(link.contains("priced slower"), "{link}");
    let shared = adaptive
        .why_waited(ms(400), ms(100), Some(Kept::SharedCores))
        .unwrap();
    assert!(shared.contains("this node's own cores"), "{shared}");
    cf.policy = Policy::Always;
    let always = Admission::new(cf)
        .why_waited(ms(2000), ms(100), None)
        .unwrap();
    assert!(always.contains("policy always"), "{always}");
}

#[test]
fn memory_bounds_what_runs() {
    let mut cf = cfg(4);
    cf.memory = 100 << 20;
    let mut c = Controller::new(cf);
    let t0 = Duration::ZERO;
    let big = |mb: u64| Ask {
        memory: mb << 20,
        ..ask("x", 1_000_000)
    };
    let a = c.offer(big(60), t0);
    assert!(matches!(a, Offer::Run(_)));
    // Slots are free but memory is not: it waits.
    let b = c.offer(big(60), t0);
    assert!(matches!(b, Offer::Queued(_)));
    assert!(c.stats().memory_reserved <= 100 << 20);
    // More than the whole budget: pushed back at once.
    match c.offer(big(200), t0) {
        Offer::PushBack(p) => assert!(p.reason.contains("memory"), "{}", p.reason),
        o => panic!("{o:?}"),
    }
    let started = c.finish(id(&a), MS, MS, true);
    assert_eq!(started[0].0, id(&b));
    assert_eq!(c.stats().memory_reserved, 60 << 20);
}

#[test]
fn policies_always_and_never() {
    let mut cf = cfg(1);
    cf.policy = Policy::Never;
    let mut c = Controller::new(cf.clone());
    assert!(matches!(
        c.offer(ask("x", 1), Duration::ZERO),
        Offer::PushBack(_)
    ));
    cf.policy = Policy::Always;
    cf.max_queued = 3;
    let mut c = Controller::new(cf);
    let outcomes: Vec<Offer> = (0..5)
        .map(|_| c.offer(ask("x", 100_000_000), Duration::ZERO))
        .collect();
    assert!(matches!(outcomes[0], Offer::Run(_)));
    assert!(outcomes[1..4].iter().all(|o| matches!(o, Offer::Queued(_))));
    assert!(
        matches!(outcomes[4], Offer::PushBack(_)),
        "queue bound holds"
    );
}

#[test]
fn raw_reads_reject_only_when_saturated() {
    let mut cf = cfg(1);
    cf.io_in_flight = 2;
    cf.io_queue = 2;
    let mut c = Controller::new(cf);
    assert_eq!(c.io_offer(), Ok(true));
    assert_eq!(c.io_offer(), Ok(true));
    assert_eq!(c.io_offer(), Ok(false));
    assert_eq!(c.io_offer(), Ok(false));
    let r = c.io_offer().unwrap_err();
    assert!(r.retry_after >= Duration::from_millis(10));
    // An operator request that would be pushed back is rejected instead: the
    // compute tier could not read the ranges either.
    let mut busy = c.config().clone();
    busy.policy = Policy::Never;
    let mut c2 = Controller::new(busy);
    for _ in 0..4 {
        let _ = c2.io_offer();
    }
    assert!(matches!(
        c2.offer(ask("x", 1), Duration::ZERO),
        Offer::Reject(_)
    ));
    // Reads finish, waiting ones start.
    c.io_finish(MS);
    assert!(c.io_dispatch());
    assert!(!c.io_dispatch());
    assert_eq!(c.stats().counters.rejected, 1);
}

#[test]
fn parses_tenants() {
    assert_eq!(
        parse_tenant("etl=2:1").unwrap(),
        (
            "etl".into(),
            TenantShare {
                weight: 2.0,
                reserve: 1
            }
        )
    );
    assert_eq!(parse_tenant("bi=0.5").unwrap().1.reserve, 0);
    for bad in ["etl", "etl=0", "etl=-1", "=2", "etl=2:x", "etl=nan"] {
        assert!(parse_tenant(bad).is_err(), "{bad}");
    }
}

#[tokio::test]
async fn queued_permits_are_woken_and_abandoned_ones_skipped() {
    let mut cf = cfg(1);
    cf.queue_target = Duration::from_secs(10);
    let adm = Admission::new(cf);
    let p1 = adm.admit(ask("x", 1_000_000)).await.unwrap();
    // A queued request whose client goes away.
    let gone = tokio::spawn({
        let adm = adm.clone();
        async move { adm.admit(ask("x", 1_000_000)).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let waiting = tokio::spawn({
        let adm = adm.clone();
        async move { adm.admit(ask("x", 1_000_000)).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(adm.stats().waiting, 2);
    gone.abort();
    let _ = gone.await;
    assert_eq!(adm.stats().waiting, 1);
    drop(p1);
    let p3 = waiting.await.unwrap().unwrap();
    assert!(p3.waited >= Duration::from_millis(15), "{:?}", p3.waited);
    assert_eq!(adm.stats().running, 1);
    drop(p3);
    let s = adm.stats();
    assert_eq!((s.running, s.waiting, s.counters.abandoned), (0, 0, 1));
}
