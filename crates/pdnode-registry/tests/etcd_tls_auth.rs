//! The etcd registry against a real etcd with TLS on its client port (`--client-cert-auth`,
//! certificates from `pdnode certs init`'s code) and etcd auth on (a read-write `pdnode` user,
//! a read-only `reader`): only credentialed writers register a card, the router sees it over
//! TLS, plaintext and foreign-CA clients are refused, and a registration outlives etcd's auth
//! token TTL.

use pdnode_core::config::{RegistryConfig, RegistryKind};
use pdnode_core::{NodeCard, NodeId, Role};
use pdnode_nodeapi::certs::{self, CertsInit};
use pdnode_registry::{
    EtcdRegistry, MembershipView, MembershipWatch, RegistrationStatus, Registry, RegistryError,
};
use pdnode_testkit::{EtcdAccess, EtcdOptions, EtcdServer, EtcdTls, EtcdUser, skip_etcd_tests};
use std::path::PathBuf;
use std::time::Duration;

const PDNODE_PW: &str = "pdnode-secret";
const READER_PW: &str = "reader-secret";

fn card(role: Role, id: &str) -> NodeCard {
    NodeCard::placeholder("t", role, id)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The files of the tests: the cluster CA `a` (nodes p1, r1, a node named like the etcd user
/// `pdnode`, the etcd server cert for 127.0.0.1), another CA `b` (node x), and the password
/// files.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        for (sub, nodes) in [
            ("a", &["p1:prefill", "r1:router", "pdnode:prefill"][..]),
            ("b", &["x:prefill"]),
        ] {
            certs::init(&CertsInit {
                dir: dir.path().join(sub),
                cluster: "t".into(),
                nodes: nodes.iter().map(|n| n.parse().unwrap()).collect(),
                force: false,
                days: 30,
            })
            .unwrap();
        }
        certs::etcd_server(
            &dir.path().join("a"),
            "t",
            &["127.0.0.1".to_string()],
            30,
            false,
        )
        .unwrap();
        for (name, pw) in [
            ("pdnode.pw", PDNODE_PW),
            ("reader.pw", READER_PW),
            ("wrong.pw", "not-the-password"),
        ] {
            std::fs::write(dir.path().join(name), format!("{pw}\n")).unwrap();
        }
        Self { dir }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn s(&self, rel: &str) -> String {
        self.path(rel).display().to_string()
    }

    /// etcd with TLS (client certificates of CA `a` required) and auth on.
    fn etcd(&self, auth_token_ttl_s: Option<u32>) -> EtcdServer {
        let etcd = EtcdServer::start_with(EtcdOptions {
            tls: Some(EtcdTls {
                ca: self.path("a/ca.pem"),
                cert: self.path("a/etcd-server.pem"),
                key: self.path("a/etcd-server.key"),
                client_cert_auth: true,
                server_ca: self.path("a/ca.pem"),
                admin_cert: Some((self.path("a/r1.pem"), self.path("a/r1.key"))),
            }),
            auth_token_ttl_s,
        })
        .expect("etcd with TLS");
        enable_auth(&etcd);
        etcd
    }

    /// The registry config of a client presenting `cert` (`a/p1`: `a/p1.pem`, `a/p1.key`), as
    /// `user` with the password file `pw` (empty: no credentials).
    fn cfg(&self, etcd: &EtcdServer, cert: &str, user: &str, pw: &str) -> RegistryConfig {
        RegistryConfig {
            kind: RegistryKind::Etcd,
            endpoints: vec![etcd.endpoint()],
            lease_ttl_s: 2,
            timeout_ms: 1000,
            start_wait_s: 0,
            etcd_tls_ca: self.s("a/ca.pem"),
            etcd_tls_cert: self.s(&format!("{cert}.pem")),
            etcd_tls_key: self.s(&format!("{cert}.key")),
            etcd_user: user.into(),
            etcd_password_file: if pw.is_empty() {
                String::new()
            } else {
                self.s(pw)
            },
        }
    }
}

fn enable_auth(etcd: &EtcdServer) {
    etcd.enable_auth(
        "root-secret",
        &[
            EtcdUser {
                name: "pdnode".into(),
                password: PDNODE_PW.into(),
                prefix: "pdnode/".into(),
                access: EtcdAccess::ReadWrite,
            },
            EtcdUser {
                name: "reader".into(),
                password: READER_PW.into(),
                prefix: "pdnode/".into(),
                access: EtcdAccess::Read,
            },
        ],
    )
    .expect("enable etcd auth");
}

async fn until(
    w: &mut MembershipWatch,
    view: &mut MembershipView,
    deadline: Duration,
    what: &str,
    pred: impl Fn(&MembershipView) -> bool,
) {
    let end = tokio::time::Instant::now() + deadline;
    while !pred(view) {
        match tokio::time::timeout_at(end, w.next()).await {
            Ok(Some(ev)) => {
                view.apply(&ev);
            }
            Ok(None) => panic!("watch ended"),
            Err(_) => panic!("{what}: not reached within {deadline:?}; view: {view:?}"),
        }
    }
}

/// A connect that etcd's TLS refuses: an error, within the call timeout and a margin.
async fn refused(cfg: RegistryConfig) -> RegistryError {
    let t0 = tokio::time::Instant::now();
    let r = EtcdRegistry::from_config(&cfg).await;
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    match r {
        Ok(reg) => panic!("connected: {reg:?}"),
        Err(e) => {
            eprintln!("refused as expected: {e}");
            e
        }
    }
}

#[test]
fn a_node_registers_and_the_router_sees_it_over_tls_and_auth() {
    if skip_etcd_tests() {
        return;
    }
    let pki = Pki::new();
    let etcd = pki.etcd(None);
    rt().block_on(async {
        // The router: read-only user, its own certificate.
        let router = EtcdRegistry::from_config(&pki.cfg(&etcd, "a/r1", "reader", "reader.pw"))
            .await
            .unwrap();
        let mut w = router.watch("t").await.unwrap();
        let mut view = MembershipView::new();
        until(&mut w, &mut view, Duration::from_secs(5), "snapshot", |v| {
            v.revision() > 0
        })
        .await;
        let node = EtcdRegistry::from_config(&pki.cfg(&etcd, "a/p1", "pdnode", "pdnode.pw"))
            .await
            .unwrap();
        let r = node.register(card(Role::Prefill, "p1")).await.unwrap();
        until(
            &mut w,
            &mut view,
            Duration::from_secs(5),
            "p1 appears",
            |v| v.get(Role::Prefill, &NodeId::new("p1")).is_some(),
        )
        .await;
        r.shutdown().await.unwrap();
        until(
            &mut w,
            &mut view,
            Duration::from_secs(2),
            "p1 revoked",
            |v| v.is_empty(),
        )
        .await;
    });
}

#[test]
fn a_card_write_without_etcd_credentials_fails() {
    if skip_etcd_tests() {
        return;
    }
    let pki = Pki::new();
    let etcd = pki.etcd(None);
    rt().block_on(async {
        // TLS is fine (a certificate of the CA), but no user: etcd takes the certificate's CN
        // ("p1") as the user, who does not exist.
        let anon = EtcdRegistry::from_config(&pki.cfg(&etcd, "a/p1", "", ""))
            .await
            .expect("TLS alone connects");
        let e = anon.register(card(Role::Prefill, "p1")).await.unwrap_err();
        assert!(
            matches!(&e, RegistryError::NotAuthorized { user, .. } if user.is_empty()),
            "{e:?}"
        );
        assert_eq!(
            pdnode_core::error::Classify::kind(&e),
            pdnode_core::error::ErrorKind::Unauthenticated
        );
        // A wrong password fails at connect, naming the user.
        let e = refused(pki.cfg(&etcd, "a/p1", "pdnode", "wrong.pw")).await;
        assert!(
            matches!(&e, RegistryError::AuthFailed { user, .. } if user == "pdnode"),
            "{e:?}"
        );
        // A read-only user connects and lists, but cannot register.
        let reader = EtcdRegistry::from_config(&pki.cfg(&etcd, "a/r1", "reader", "reader.pw"))
            .await
            .unwrap();
        assert!(reader.list("t").await.unwrap().cards.is_empty());
        let e = reader
            .register(card(Role::Prefill, "p1"))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, RegistryError::NotAuthorized { user, .. } if user == "reader"),
            "{e:?}"
        );
        // Nothing got in.
        let node = EtcdRegistry::from_config(&pki.cfg(&etcd, "a/p1", "pdnode", "pdnode.pw"))
            .await
            .unwrap();
        assert!(node.list("t").await.unwrap().cards.is_empty());

        // etcd's rule, which docs/runtime-semantics.md warns of: without a token, a client
        // certificate's CN is the user. A node certificate named like the etcd user writes
        // without any password.
        let cn = EtcdRegistry::from_config(&pki.cfg(&etcd, "a/pdnode", "", ""))
            .await
            .unwrap();
        cn.register(card(Role::Prefill, "p9"))
            .await
            .expect("CN = etcd user: etcd lets it write")
            .shutdown()
            .await
            .unwrap();
    });
}

#[test]
fn plaintext_and_foreign_ca_clients_are_refused() {
    if skip_etcd_tests() {
        return;
    }
    let pki = Pki::new();
    let etcd = pki.etcd(None);
    rt().block_on(async {
        let good = pki.cfg(&etcd, "a/p1", "pdnode", "pdnode.pw");
        // Plaintext (no TLS keys, http://) to the TLS port.
        let plain = RegistryConfig {
            endpoints: vec![etcd.endpoint().replace("https://", "http://")],
            etcd_tls_ca: String::new(),
            etcd_tls_cert: String::new(),
            etcd_tls_key: String::new(),
            ..good.clone()
        };
        let e = refused(plain).await;
        assert!(
            matches!(
                e,
                RegistryError::Unavailable { .. } | RegistryError::Timeout { .. }
            ),
            "{e:?}"
        );
        // A client certificate of another CA: etcd drops the handshake.
        let foreign = RegistryConfig {
            etcd_tls_cert: pki.s("b/x.pem"),
            etcd_tls_key: pki.s("b/x.key"),
            ..good.clone()
        };
        let e = refused(foreign).await;
        assert!(
            matches!(
                e,
                RegistryError::Unavailable { .. } | RegistryError::Timeout { .. }
            ),
            "{e:?}"
        );
        // No client certificate at all (etcd requires one).
        let no_cert = RegistryConfig {
            etcd_tls_cert: String::new(),
            etcd_tls_key: String::new(),
            ..good.clone()
        };
        let e = refused(no_cert).await;
        assert!(
            matches!(
                e,
                RegistryError::Unavailable { .. } | RegistryError::Timeout { .. }
            ),
            "{e:?}"
        );
        // The client does not trust etcd's certificate (another CA).
        let wrong_ca = RegistryConfig {
            etcd_tls_ca: pki.s("b/ca.pem"),
            ..good.clone()
        };
        let e = refused(wrong_ca).await;
        assert!(
            matches!(
                e,
                RegistryError::Unavailable { .. } | RegistryError::Timeout { .. }
            ),
            "{e:?}"
        );
        // The good one still works (the refusals were about the clients).
        let reg = EtcdRegistry::from_config(&good).await.unwrap();
        reg.register(card(Role::Prefill, "p1"))
            .await
            .unwrap()
            .shutdown()
            .await
            .unwrap();
    });
}

/// etcd's `--auth-token-ttl 2`: the node's and the router's tokens expire many times over;
/// the lease stays alive, a card update after expiry is written (a refreshed token), and the
/// router's watch and listing still see it.
#[test]
fn the_registration_outlives_the_auth_token_ttl() {
    if skip_etcd_tests() {
        return;
    }
    let pki = Pki::new();
    let etcd = pki.etcd(Some(2));
    rt().block_on(async {
        let router = EtcdRegistry::from_config(&pki.cfg(&etcd, "a/r1", "reader", "reader.pw"))
            .await
            .unwrap();
        let node = EtcdRegistry::from_config(&pki.cfg(&etcd, "a/p1", "pdnode", "pdnode.pw"))
            .await
            .unwrap();
        let r = node.register(card(Role::Prefill, "p1")).await.unwrap();
        let RegistrationStatus::Registered { lease } = r.status() else {
            panic!("{:?}", r.status());
        };
        let mut w = router.watch("t").await.unwrap();
        let mut view = MembershipView::new();
        until(&mut w, &mut view, Duration::from_secs(5), "p1", |v| {
            v.len() == 1
        })
        .await;

        // 3.5 token TTLs with no call but keepalives.
        tokio::time::sleep(Duration::from_millis(7000)).await;
        assert_eq!(
            r.status(),
            RegistrationStatus::Registered { lease },
            "the first lease still holds the card"
        );
        assert_eq!(r.keepalive_failures(), 0);
        // Both clients' tokens have expired: these calls re-authenticate.
        assert_eq!(router.list("t").await.unwrap().cards.len(), 1);
        let mut c = r.card();
        c.capacity.queued_requests = 7;
        r.update(c).unwrap();
        until(&mut w, &mut view, Duration::from_secs(5), "update", |v| {
            v.get(Role::Prefill, &NodeId::new("p1"))
                .is_some_and(|c| c.capacity.queued_requests == 7)
        })
        .await;
        assert_eq!(r.status(), RegistrationStatus::Registered { lease });
        r.shutdown().await.unwrap();
    });
}

/// A misconfigured or unreachable TLS etcd is an error naming the key or the endpoints, never
/// a panic or a hang.
#[test]
fn misconfigured_or_unreachable_tls_etcd_is_a_clear_error() {
    let pki = Pki::new();
    let port = pdnode_testkit::free_port().unwrap();
    let base = RegistryConfig {
        kind: RegistryKind::Etcd,
        endpoints: vec![format!("https://127.0.0.1:{port}")],
        lease_ttl_s: 2,
        timeout_ms: 500,
        start_wait_s: 0,
        etcd_tls_ca: pki.s("a/ca.pem"),
        etcd_tls_cert: pki.s("a/p1.pem"),
        etcd_tls_key: pki.s("a/p1.key"),
        etcd_user: "pdnode".into(),
        etcd_password_file: pki.s("pdnode.pw"),
    };
    rt().block_on(async {
        let err = |c: RegistryConfig| async move {
            match EtcdRegistry::from_config(&c).await {
                Ok(r) => panic!("connected: {r:?}"),
                Err(e) => e,
            }
        };
        let key_of = |e: &RegistryError| match e {
            RegistryError::BadFile { key, .. } | RegistryError::BadConfig { key, .. } => *key,
            e => panic!("not a config error: {e:?}"),
        };
        let e = err(RegistryConfig {
            etcd_tls_ca: "/nonexistent/ca.pem".into(),
            ..base.clone()
        })
        .await;
        assert_eq!(key_of(&e), "registry.etcd_tls_ca", "{e}");
        let e = err(RegistryConfig {
            etcd_tls_ca: String::new(),
            ..base.clone()
        })
        .await;
        assert_eq!(key_of(&e), "registry.etcd_tls_ca", "{e}");
        let e = err(RegistryConfig {
            etcd_tls_key: String::new(),
            ..base.clone()
        })
        .await;
        assert_eq!(key_of(&e), "registry.etcd_tls_key", "{e}");
        let e = err(RegistryConfig {
            etcd_tls_key: pki.s("a/p1.pem"),
            ..base.clone()
        })
        .await;
        assert_eq!(key_of(&e), "registry.etcd_tls_key", "{e}");
        let e = err(RegistryConfig {
            etcd_password_file: pki.s("missing.pw"),
            ..base.clone()
        })
        .await;
        assert_eq!(key_of(&e), "registry.etcd_password_file", "{e}");
        let e = err(RegistryConfig {
            etcd_password_file: String::new(),
            ..base.clone()
        })
        .await;
        assert_eq!(key_of(&e), "registry.etcd_password_file", "{e}");
        let e = err(RegistryConfig {
            endpoints: vec![format!("http://127.0.0.1:{port}")],
            ..base.clone()
        })
        .await;
        assert_eq!(key_of(&e), "registry.endpoints", "{e}");
        // Nothing listens: unreachable within the call timeout.
        let t0 = tokio::time::Instant::now();
        let e = err(base.clone()).await;
        assert!(
            matches!(
                e,
                RegistryError::Unavailable { .. } | RegistryError::Timeout { .. }
            ),
            "{e:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    });
}
