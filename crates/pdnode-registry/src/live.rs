//! A [`MembershipView`] kept up to date by a background task: what a router reads from.

use crate::{MembershipEvent, MembershipView, Registry, RegistryError};
use pdnode_core::{NodeCard, Role};
use std::sync::{Arc, RwLock};
use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, DropGuard};

/// The membership of one cluster, fed by [`Registry::watch`]. Cheap to clone; the task stops
/// when the last clone is dropped.
#[derive(Clone)]
pub struct LiveMembership {
    view: Arc<RwLock<MembershipView>>,
    changes: watch::Receiver<u64>,
    _guard: Arc<DropGuard>,
}

impl std::fmt::Debug for LiveMembership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveMembership")
            .field("view", &self.snapshot())
            .finish()
    }
}

impl LiveMembership {
    /// Lists and watches `cluster`; fails only if the first listing fails.
    pub async fn start(registry: &dyn Registry, cluster: &str) -> Result<Self, RegistryError> {
        let mut w = registry.watch(cluster).await?;
        let view = Arc::new(RwLock::new(MembershipView::new()));
        let (tx, changes) = watch::channel(0u64);
        // The first event is the snapshot: apply it before returning.
        if let Some(ev) = w.next().await {
            apply(&view, &tx, &ev);
        }
        let cancel = CancellationToken::new();
        let stop = cancel.clone();
        let v = view.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    ev = w.next() => match ev {
                        Some(ev) => apply(&v, &tx, &ev),
                        None => return,
                    },
                }
            }
        });
        Ok(Self {
            view,
            changes,
            _guard: Arc::new(cancel.drop_guard()),
        })
    }

    /// Cards that can serve `role` (that role, plus `all` nodes for prefill and decode).
    pub fn serving(&self, role: Role) -> Vec<NodeCard> {
        self.read(|v| v.serving(role).cloned().collect())
    }

    /// SGLang workers' cards of `role`, ordered by node id.
    pub fn sglang_workers(&self, role: Role) -> Vec<NodeCard> {
        self.read(|v| v.sglang_workers(role).cloned().collect())
    }

    /// A copy of the whole view.
    pub fn snapshot(&self) -> MembershipView {
        self.read(MembershipView::clone)
    }

    pub fn is_stale(&self) -> bool {
        self.read(MembershipView::is_stale)
    }

    /// A receiver that changes whenever the set of cards (or a card) changes.
    /// Changes already applied count as seen.
    pub fn changes(&self) -> watch::Receiver<u64> {
        let mut rx = self.changes.clone();
        rx.borrow_and_update();
        rx
    }

    fn read<T>(&self, f: impl FnOnce(&MembershipView) -> T) -> T {
        // A panic while holding the lock cannot leave a half-applied event: apply() is one step.
        match self.view.read() {
            Ok(g) => f(&g),
            Err(p) => f(&p.into_inner()),
        }
    }
}

fn apply(view: &RwLock<MembershipView>, tx: &watch::Sender<u64>, ev: &MembershipEvent) {
    let changed = match view.write() {
        Ok(mut g) => g.apply(ev),
        Err(p) => p.into_inner().apply(ev),
    };
    if changed {
        tx.send_modify(|n| *n += 1);
    }
}
