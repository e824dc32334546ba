//! The in-process registry: registration, watch, conflicts, outage and re-registration, on
//! paused tokio time.

use pdnode_core::{NodeCard, NodeId, Role};
use pdnode_registry::{
    MembershipEvent, MembershipView, MembershipWatch, MemoryRegistry, RegistrationStatus, Registry,
    RegistryError, RegistryOptions,
};
use std::time::Duration;

fn card(role: Role, id: &str) -> NodeCard {
    NodeCard::placeholder("t", role, id)
}

fn opts() -> RegistryOptions {
    RegistryOptions {
        lease_ttl: Duration::from_secs(2),
        call_timeout: Duration::from_millis(500),
        max_backoff: Duration::from_millis(500),
    }
}

/// Applies events until `pred(view)` holds; fails after `deadline` (tokio time).
async fn until(
    w: &mut MembershipWatch,
    view: &mut MembershipView,
    deadline: Duration,
    pred: impl Fn(&MembershipView) -> bool,
) {
    let end = tokio::time::Instant::now() + deadline;
    while !pred(view) {
        match tokio::time::timeout_at(end, w.next()).await {
            Ok(Some(ev)) => {
                view.apply(&ev);
            }
            Ok(None) => panic!("watch ended"),
            Err(_) => panic!("condition not reached within {deadline:?}; view: {view:?}"),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn register_list_watch_update_and_shutdown() {
    let reg = MemoryRegistry::new(opts());
    let mut w = reg.watch("t").await.unwrap();
    let mut view = MembershipView::new();
    let first = w.next().await.unwrap();
    assert!(matches!(first, MembershipEvent::Snapshot(ref s) if s.cards.is_empty()));
    view.apply(&first);

    let p = reg.register(card(Role::Prefill, "p0")).await.unwrap();
    let _d = reg.register(card(Role::Decode, "d0")).await.unwrap();
    until(&mut w, &mut view, Duration::from_secs(1), |v| v.len() == 2).await;
    assert_eq!(reg.list("t").await.unwrap().cards.len(), 2);
    assert!(reg.list("other").await.unwrap().cards.is_empty());

    let mut c = p.card();
    c.capacity.running_requests = 7;
    p.update(c).unwrap();
    until(&mut w, &mut view, Duration::from_secs(1), |v| {
        v.get(Role::Prefill, &NodeId::new("p0"))
            .is_some_and(|c| c.capacity.running_requests == 7)
    })
    .await;
    // A card update may not move the key.
    assert!(matches!(
        p.update(card(Role::Prefill, "elsewhere")),
        Err(RegistryError::BadCard { .. })
    ));

    // Leases are kept alive well past the TTL.
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(reg.list("t").await.unwrap().cards.len(), 2);

    p.shutdown().await.unwrap();
    until(&mut w, &mut view, Duration::from_millis(200), |v| {
        v.len() == 1
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_second_node_with_the_same_id_is_refused_until_the_first_leaves() {
    let reg = MemoryRegistry::new(opts());
    let first = reg.register(card(Role::Decode, "d0")).await.unwrap();
    let e = reg.register(card(Role::Decode, "d0")).await.unwrap_err();
    assert!(matches!(e, RegistryError::AlreadyRegistered { ref id, .. } if id == "d0"));
    assert!(e.to_string().contains("must be unique"), "{e}");
    // Same id in another role is another key.
    let _p = reg.register(card(Role::Prefill, "d0")).await.unwrap();
    // Dropping the handle revokes in the background.
    drop(first);
    let mut ok = None;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if let Ok(r) = reg.register(card(Role::Decode, "d0")).await {
            ok = Some(r);
            break;
        }
    }
    assert!(ok.is_some(), "the key was not freed after drop");
}

#[tokio::test(start_paused = true)]
async fn an_outage_longer_than_the_ttl_re_registers_under_a_new_lease() {
    let reg = MemoryRegistry::new(opts());
    let r = reg.register(card(Role::Decode, "d0")).await.unwrap();
    let RegistrationStatus::Registered { lease: old } = r.status() else {
        panic!("not registered: {:?}", r.status());
    };
    let mut w = reg.watch("t").await.unwrap();
    let mut view = MembershipView::new();
    until(&mut w, &mut view, Duration::from_secs(1), |v| v.len() == 1).await;

    reg.set_available(false);
    until(&mut w, &mut view, Duration::from_secs(1), |v| v.is_stale()).await;
    assert_eq!(view.len(), 1, "a stale view keeps its last state");
    tokio::time::sleep(Duration::from_secs(4)).await; // the lease expires meanwhile
    assert!(matches!(
        r.status(),
        RegistrationStatus::Reconnecting { .. }
    ));
    assert!(r.keepalive_failures() > 0);

    reg.set_available(true);
    let mut status = r.subscribe();
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let RegistrationStatus::Registered { lease } = *status.borrow_and_update()
                && lease != old
            {
                return;
            }
            status.changed().await.unwrap();
        }
    })
    .await
    .expect("re-registered under a new lease");
    until(&mut w, &mut view, Duration::from_secs(5), |v| {
        !v.is_stale() && v.len() == 1
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn live_membership_follows_the_registry() {
    let reg = MemoryRegistry::new(opts());
    let _p = reg.register(card(Role::Prefill, "p0")).await.unwrap();
    let live = pdnode_registry::LiveMembership::start(&reg, "t")
        .await
        .unwrap();
    assert_eq!(
        live.serving(Role::Prefill).len(),
        1,
        "the snapshot is applied at start"
    );
    let mut changes = live.changes();
    let d = reg.register(card(Role::All, "a0")).await.unwrap();
    tokio::time::timeout(Duration::from_secs(1), changes.changed())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(live.serving(Role::Decode).len(), 1);
    assert_eq!(live.serving(Role::Prefill).len(), 2);
    d.shutdown().await.unwrap();
    tokio::time::timeout(Duration::from_secs(1), changes.changed())
        .await
        .unwrap()
        .unwrap();
    assert!(live.serving(Role::Decode).is_empty());
    assert!(!live.is_stale());
}
