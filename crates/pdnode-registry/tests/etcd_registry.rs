//! The etcd registry against a real etcd (Debian etcd-server) from the testkit.

use pdnode_core::{NodeCard, NodeId, Role};
use pdnode_registry::{
    EtcdRegistry, MembershipView, MembershipWatch, RegistrationStatus, Registry, RegistryError,
    RegistryOptions,
};
use pdnode_testkit::{EtcdServer, skip_etcd_tests};
use std::time::{Duration, Instant};

fn card(role: Role, id: &str) -> NodeCard {
    NodeCard::placeholder("t", role, id)
}

fn opts() -> RegistryOptions {
    RegistryOptions {
        lease_ttl: Duration::from_secs(2),
        call_timeout: Duration::from_millis(1000),
        max_backoff: Duration::from_millis(500),
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
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

#[test]
fn register_list_watch_update_and_revoke() {
    if skip_etcd_tests() {
        return;
    }
    let etcd = EtcdServer::start().expect("etcd");
    rt().block_on(async {
        let reg = EtcdRegistry::connect(&[etcd.endpoint()], opts())
            .await
            .unwrap();
        let mut w = reg.watch("t").await.unwrap();
        let mut view = MembershipView::new();
        until(&mut w, &mut view, Duration::from_secs(5), "snapshot", |v| {
            v.revision() > 0
        })
        .await;
        assert!(view.is_empty());

        let p = reg.register(card(Role::Prefill, "p0")).await.unwrap();
        until(
            &mut w,
            &mut view,
            Duration::from_secs(5),
            "p0 appears",
            |v| v.get(Role::Prefill, &NodeId::new("p0")).is_some(),
        )
        .await;
        let listed = reg.list("t").await.unwrap();
        assert_eq!(listed.cards, vec![card(Role::Prefill, "p0")]);

        let mut c = p.card();
        c.capacity.queued_requests = 3;
        p.update(c).unwrap();
        until(
            &mut w,
            &mut view,
            Duration::from_secs(5),
            "load update",
            |v| {
                v.get(Role::Prefill, &NodeId::new("p0"))
                    .is_some_and(|c| c.capacity.queued_requests == 3)
            },
        )
        .await;

        // Kept alive past several TTLs.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(reg.list("t").await.unwrap().cards.len(), 1);
        assert_eq!(p.keepalive_failures(), 0);

        // Revoke: gone at once, not after the TTL.
        let t0 = Instant::now();
        p.shutdown().await.unwrap();
        until(
            &mut w,
            &mut view,
            Duration::from_millis(1500),
            "p0 revoked",
            |v| v.is_empty(),
        )
        .await;
        assert!(t0.elapsed() < Duration::from_millis(1500));
    });
}

#[test]
fn duplicate_ids_are_refused_and_a_crashed_node_expires_within_the_ttl() {
    if skip_etcd_tests() {
        return;
    }
    let etcd = EtcdServer::start().expect("etcd");
    // A "process" that registers and then dies without revoking: its runtime is dropped.
    {
        let doomed = rt();
        doomed.block_on(async {
            let reg = EtcdRegistry::connect(&[etcd.endpoint()], opts())
                .await
                .unwrap();
            let r = reg.register(card(Role::Decode, "d0")).await.unwrap();
            std::mem::forget(r); // no revoke from the handle either
        });
        drop(doomed);
    }
    rt().block_on(async {
        let reg = EtcdRegistry::connect(&[etcd.endpoint()], opts())
            .await
            .unwrap();
        let mut w = reg.watch("t").await.unwrap();
        let mut view = MembershipView::new();
        until(&mut w, &mut view, Duration::from_secs(2), "snapshot", |v| {
            v.len() == 1
        })
        .await;
        // While the dead node's lease lives, its id is taken.
        let e = reg.register(card(Role::Decode, "d0")).await.unwrap_err();
        assert!(
            matches!(e, RegistryError::AlreadyRegistered { ref id, .. } if id == "d0"),
            "{e:?}"
        );
        // The lease expires within its TTL (2 s; etcd checks expiry every 500 ms).
        until(
            &mut w,
            &mut view,
            Duration::from_secs(4),
            "dead node expires",
            |v| v.is_empty(),
        )
        .await;
        let again = reg.register(card(Role::Decode, "d0")).await.unwrap();
        again.shutdown().await.unwrap();
    });
}

#[test]
fn nodes_and_watches_recover_when_etcd_restarts() {
    if skip_etcd_tests() {
        return;
    }
    let mut etcd = EtcdServer::start().expect("etcd");
    let runtime = rt();
    let (reg, r, mut w, mut view) = runtime.block_on(async {
        let reg = EtcdRegistry::connect(&[etcd.endpoint()], opts())
            .await
            .unwrap();
        let r = reg.register(card(Role::Prefill, "p0")).await.unwrap();
        let mut w = reg.watch("t").await.unwrap();
        let mut view = MembershipView::new();
        until(&mut w, &mut view, Duration::from_secs(5), "p0", |v| {
            v.len() == 1
        })
        .await;
        (reg, r, w, view)
    });

    etcd.stop();
    runtime.block_on(async {
        until(&mut w, &mut view, Duration::from_secs(10), "stale", |v| {
            v.is_stale()
        })
        .await;
        assert_eq!(view.len(), 1, "the view keeps its last state");
        let mut st = r.subscribe();
        tokio::time::timeout(Duration::from_secs(10), async {
            while !matches!(
                *st.borrow_and_update(),
                RegistrationStatus::Reconnecting { .. }
            ) {
                st.changed().await.unwrap();
            }
        })
        .await
        .expect("registration notices the outage");
    });

    etcd.restart().expect("etcd restarts");
    runtime.block_on(async {
        let mut st = r.subscribe();
        tokio::time::timeout(Duration::from_secs(15), async {
            while !matches!(
                *st.borrow_and_update(),
                RegistrationStatus::Registered { .. }
            ) {
                st.changed().await.unwrap();
            }
        })
        .await
        .expect("registration restored after etcd restart");
        until(
            &mut w,
            &mut view,
            Duration::from_secs(15),
            "membership recovers",
            |v| !v.is_stale() && v.len() == 1,
        )
        .await;
        // Updates flow again.
        let mut c = r.card();
        c.capacity.running_requests = 5;
        r.update(c).unwrap();
        until(
            &mut w,
            &mut view,
            Duration::from_secs(5),
            "update after restart",
            |v| {
                v.get(Role::Prefill, &NodeId::new("p0"))
                    .is_some_and(|c| c.capacity.running_requests == 5)
            },
        )
        .await;
        assert!(reg.list("t").await.unwrap().cards.len() == 1);
        r.shutdown().await.unwrap();
    });
}

#[test]
fn an_unreachable_etcd_is_a_clear_error() {
    let port = pdnode_testkit::free_port().unwrap();
    rt().block_on(async {
        let t0 = Instant::now();
        let e = EtcdRegistry::connect(&[format!("http://127.0.0.1:{port}")], opts())
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                RegistryError::Unavailable { .. } | RegistryError::Timeout { .. }
            ),
            "{e:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(3));
    });
}
