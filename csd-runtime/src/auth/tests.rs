//! Tenants files, credentials, permissions, quotas and sealed tickets.

use std::time::Duration;

use hmac::Mac;

use super::*;

const ETL: &str = r#"
[[tenant]]
name = "etl"
token_sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
tables = ["lineitem", "orders"]
can = ["read", "write"]
weight = 3
reserve = 1

[[tenant]]
name = "ops"
token_sha256 = "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752"
tables = ["*"]
can = ["read", "delete", "admin"]
max_requests = 1
"#;

#[test]
fn the_issue_example_parses_and_checks() {
    let auth = Auth::from_text(ETL).unwrap();
    assert!(ETL.contains(&token_digest("test")));
    let p = auth
        .principal(Some(b"Bearer test"), None, "whatever")
        .unwrap();
    assert_eq!(p.name(), "etl");
    p.check(Permission::Read, "orders").unwrap();
    p.check(Permission::Write, "lineitem").unwrap();
    let e = p.check(Permission::Delete, "orders").unwrap_err();
    assert!(e.to_string().contains("lacks the 'delete'"), "{e}");
    let e = p.check(Permission::Read, "part").unwrap_err();
    assert!(e.to_string().contains("not in its tables"), "{e}");
    assert_eq!(e.status_code(), crate::StatusCode::PermissionDenied);
    assert!(p.check_admin("read node figures").is_err());
    assert_eq!(auth.shares()["etl"].weight, 3.0);
    assert_eq!(auth.shares()["etl"].reserve, 1);
    assert_eq!(auth.counters.permission_denied.load(Ordering::Relaxed), 3);
}

#[test]
fn unknown_missing_and_malformed_credentials_are_unauthenticated() {
    let auth = Auth::from_text(ETL).unwrap();
    for bad in [
        &b"Bearer nope"[..],
        b"Bearer",
        b"Bearer  ",
        b"Token test",
        b"\xff\xfe",
        b"Basic !!!",
        b"Basic ZXRsOnRlc3Q=x",
    ] {
        let e = auth.principal(Some(bad), None, "etl").err().unwrap();
        assert_eq!(
            e.status_code(),
            crate::StatusCode::Unauthenticated,
            "{bad:?}"
        );
    }
    let e = auth.principal(None, None, "etl").err().unwrap();
    assert!(e.to_string().contains("requires a token"), "{e}");
    // Basic etl:test is the handshake form; the name must match the token's.
    assert_eq!(
        auth.principal(Some(b"Basic ZXRsOnRlc3Q="), None, "")
            .unwrap()
            .name(),
        "etl"
    );
    // Without its `=` padding too (ADBC's Flight SQL driver sends none).
    assert_eq!(
        auth.principal(Some(b"Basic ZXRsOnRlc3Q"), None, "")
            .unwrap()
            .name(),
        "etl"
    );
    assert!(
        auth.principal(Some(b"Basic b3BzOnRlc3Q="), None, "")
            .is_err()
    );
    assert_eq!(auth.counters.unauthenticated.load(Ordering::Relaxed), 9);
}

#[test]
fn quotas_and_patterns() {
    let auth = Auth::from_text(ETL).unwrap();
    assert!(auth.principal(Some(b"Bearer ops-token"), None, "").is_err());
    let text = ETL.replace(
        "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752",
        &token_digest("ops-token"),
    );
    let auth = Auth::from_text(&text).unwrap();
    let ops = auth.principal(Some(b"bearer ops-token"), None, "").unwrap();
    assert!(ops.may(Permission::Read, "anything"));
    let slot = ops.request_slot().unwrap();
    let e = ops.request_slot().err().unwrap();
    assert!(e.to_string().contains("max_requests"), "{e}");
    drop(slot);
    let _again = ops.request_slot().unwrap();
    let t = Tenant {
        name: "x".into(),
        digest: None,
        cert_subject: None,
        tables: vec!["tpch_*".into()],
        can: [Permission::Read].into(),
        share: TenantShare::default(),
        max_stored_bytes: None,
        max_requests: None,
    };
    assert!(t.may(Permission::Read, "tpch_lineitem"));
    assert!(!t.may(Permission::Read, "tpc"));
}

#[test]
fn random_metadata_never_panics_nor_proves_a_tenant() {
    let auth = Auth::from_text(ETL).unwrap();
    let mut x = 0x9e37_79b9u32;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    for seed in [&b"Bearer test"[..], b"Basic ZXRsOnRlc3Q=", b"bearer x"] {
        for _ in 0..3000 {
            let mut v = seed.to_vec();
            for _ in 0..1 + next() % 3 {
                let i = next() as usize % v.len();
                match next() % 3 {
                    0 => v[i] = next() as u8,
                    1 => v.insert(i, next() as u8),
                    _ => {
                        v.remove(i);
                        if v.is_empty() {
                            v.push(b' ');
                        }
                    }
                }
            }
            match auth.principal(Some(&v), None, "etl") {
                Ok(p) => {
                    // Only the real token (or the scheme's spelling) still proves it.
                    let t = match parse_authorization(&v).unwrap() {
                        Credential::Bearer(t) => t,
                        Credential::Basic { password, .. } => password,
                    };
                    assert_eq!((p.name(), t.as_str()), ("etl", "test"), "{v:?}");
                }
                Err(e) => assert_eq!(e.status_code(), crate::StatusCode::Unauthenticated),
            }
        }
    }
}

#[test]
fn bad_files_name_what_is_wrong() {
    for (text, says) in [
        ("[[tenant]]\nname = \"a\"\n", "neither token_sha256"),
        (
            "[[tenant]]\nname = \"a\"\ntoken_sha256 = \"abc\"\n",
            "64 hex digits",
        ),
        (
            "[[tenant]]\nname = \"a b\"\ncert_subject = \"a\"\n",
            "tenant name",
        ),
        (
            "[[tenant]]\nname = \"a\"\ncert_subject = \"a\"\ncan = [\"fly\"]\n",
            "fly",
        ),
        (
            "[[tenant]]\nname = \"a\"\ncert_subject = \"a\"\ntables = [\"a*b\"]\n",
            "pattern",
        ),
        (
            "[[tenant]]\nname = \"a\"\ncert_subject = \"a\"\ntoken = \"x\"\n",
            "token",
        ),
    ] {
        let e = parse_tenants(text, "t.toml").err().unwrap().to_string();
        assert!(e.contains(says), "{text}: {e}");
    }
}

#[test]
fn seals_bind_tenant_expiry_and_bytes() {
    let auth = Auth::from_text(ETL).unwrap();
    let etl = auth.principal(Some(b"Bearer test"), None, "").unwrap();
    let key = TicketKey::random();
    let sealed = key.seal(b"\x01ticket".to_vec(), "etl", Duration::from_secs(60));
    let seal = crate::protocol::ticket::Seal::decode(&sealed).unwrap();
    key.verify(&seal, &etl).unwrap();
    let other = Principal {
        name: "ops".into(),
        tenant: auth.tenants().iter().find(|t| t.name == "ops").cloned(),
        counters: auth.counters.clone(),
        in_flight: None,
    };
    assert!(
        key.verify(&seal, &other)
            .unwrap_err()
            .to_string()
            .contains("issued to tenant etl")
    );
    let mut altered = seal.clone();
    altered.ticket[1] ^= 1;
    assert!(key.verify(&altered, &etl).is_err());
    assert!(TicketKey::random().verify(&seal, &etl).is_err());
    let old = key.seal(b"\x01t".to_vec(), "etl", Duration::ZERO);
    let mut old = crate::protocol::ticket::Seal::decode(&old).unwrap();
    old.expires_unix_ms -= 5000;
    // Re-sealed with the old expiry so only the time is wrong.
    old.mac = key
        .mac(&old.ticket, &old.tenant, old.expires_unix_ms)
        .finalize()
        .into_bytes()
        .to_vec();
    assert!(
        key.verify(&old, &etl)
            .unwrap_err()
            .to_string()
            .contains("expired")
    );
}
