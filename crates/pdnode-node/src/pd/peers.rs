//! Where a prefill node may push KV: the decode nodes registered in its cluster, with the UCX
//! worker address each one's card publishes (`NodeAddresses::ucx_worker`). A target whose
//! decode node is not registered, or whose worker address (any rank's) is not that card's, is
//! refused before any UCX endpoint is made (docs/runtime-semantics.md, "Who may call what"): a
//! target alone, even from an authenticated router, never makes this node connect anywhere
//! else. A node without a registry view (tests, role `all` in process) checks nothing.

use pdnode_core::error::{Classify, ErrorKind};
use pdnode_core::{KvTarget, NodeId, Role};
use pdnode_registry::LiveMembership;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// Why a KV target's decode node is not one this node pushes to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    #[error(
        "decode node {node} is not a registered decode node of this cluster (or has no UCX worker on its card)"
    )]
    NotRegistered { node: NodeId },
    #[error(
        "rank {rank} of the KV target names a UCX worker that is not the one decode node {node} registered"
    )]
    WrongWorker { node: NodeId, rank: usize },
}

impl Classify for PeerError {
    /// Retryable: the registry view may lag a node that just (re)registered; the router tries
    /// another pair.
    fn kind(&self) -> ErrorKind {
        ErrorKind::Retryable
    }
}

/// Registered decode nodes and their UCX worker addresses; cheap to clone.
#[derive(Clone)]
pub struct RegisteredPeers {
    cache: Arc<Mutex<Cache>>,
    /// The registry view the cache is rebuilt from when it changed; `None`: fixed.
    view: Option<(LiveMembership, watch::Receiver<u64>)>,
}

#[derive(Default)]
struct Cache {
    /// The view's change count the map was built at.
    version: Option<u64>,
    workers: HashMap<NodeId, Vec<u8>>,
}

/// The bytes of a card's hex worker address; `None` when it is not hex.
fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
        .collect()
}

impl RegisteredPeers {
    /// Exactly these decode nodes (tests).
    pub fn fixed(peers: impl IntoIterator<Item = (NodeId, Vec<u8>)>) -> Self {
        Self {
            cache: Arc::new(Mutex::new(Cache {
                version: None,
                workers: peers.into_iter().collect(),
            })),
            view: None,
        }
    }

    /// The decode cards of `view`, as they change.
    pub fn follow(view: LiveMembership) -> Self {
        let changes = view.changes();
        Self {
            cache: Arc::default(),
            view: Some((view, changes)),
        }
    }

    /// Whether `target` names a registered decode node and, for every rank, that node's
    /// registered UCX worker (the view as it is now).
    pub fn check(&self, target: &KvTarget) -> Result<(), PeerError> {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((view, changes)) = &self.view {
            let now = *changes.borrow();
            if cache.version != Some(now) {
                cache.workers = view
                    .serving(Role::Decode)
                    .into_iter()
                    .filter(|c| c.role == Role::Decode)
                    .filter_map(|c| {
                        let w = unhex(c.addresses.ucx_worker.as_deref()?)?;
                        Some((c.id, w))
                    })
                    .collect();
                cache.version = Some(now);
            }
        }
        let node = &target.decode_node;
        let Some(registered) = cache.workers.get(node) else {
            return Err(PeerError::NotRegistered { node: node.clone() });
        };
        for r in 0..target.ranks.len() {
            let ok = target
                .worker_for(r)
                .is_ok_and(|w| w == registered.as_slice());
            if !ok {
                return Err(PeerError::WrongWorker {
                    node: node.clone(),
                    rank: r,
                });
            }
        }
        Ok(())
    }

    /// [`RegisteredPeers::check`], waiting up to `wait` for the registry view to change when
    /// it fails (a decode node that registered a moment ago, seen by the router first).
    pub async fn admit(&self, target: &KvTarget, wait: Duration) -> Result<(), PeerError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Marked seen before the check: a change after it wakes the wait below.
            let mut changes = self.view.as_ref().map(|(_, c)| {
                let mut c = c.clone();
                c.borrow_and_update();
                c
            });
            let checked = self.check(target);
            let Some(rx) = changes.as_mut().filter(|_| checked.is_err()) else {
                return checked;
            };
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => continue,
                // The deadline, or the view's task ended.
                Err(_) | Ok(Err(_)) => return checked,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdnode_core::{RankTarget, RequestId};

    fn target(node: &str, worker: &[u8], rank_workers: &[&[u8]]) -> KvTarget {
        KvTarget {
            request: RequestId(1),
            decode_node: NodeId::new(node),
            worker_address: worker.to_vec(),
            ranks: rank_workers
                .iter()
                .enumerate()
                .map(|(r, w)| RankTarget {
                    rank: r as u32,
                    rkey: vec![1],
                    base_addr: 0,
                    region_len: 1 << 20,
                    worker_address: w.to_vec(),
                    device_memory: false,
                })
                .collect(),
            ..pdnode_router::testing::fake_target(RequestId(1), &NodeId::new(node), 1)
        }
    }

    #[test]
    fn only_registered_decode_nodes_at_their_registered_workers() {
        let peers = RegisteredPeers::fixed([(NodeId::new("d0"), vec![1, 2, 3])]);
        assert_eq!(peers.check(&target("d0", &[1, 2, 3], &[&[], &[]])), Ok(()));
        // A rank's own worker address must be the registered one too.
        assert_eq!(
            peers.check(&target("d0", &[1, 2, 3], &[&[], &[1, 2, 3]])),
            Ok(())
        );
        assert_eq!(
            peers.check(&target("d0", &[1, 2, 3], &[&[], &[9]])),
            Err(PeerError::WrongWorker {
                node: NodeId::new("d0"),
                rank: 1
            })
        );
        assert_eq!(
            peers.check(&target("d0", &[1, 2, 4], &[&[]])),
            Err(PeerError::WrongWorker {
                node: NodeId::new("d0"),
                rank: 0
            })
        );
        let e = peers.check(&target("d9", &[1, 2, 3], &[&[]])).unwrap_err();
        assert_eq!(
            e,
            PeerError::NotRegistered {
                node: NodeId::new("d9")
            }
        );
        assert_eq!(e.kind(), ErrorKind::Retryable);
        assert_eq!(unhex("0aFf"), Some(vec![0x0a, 0xff]));
        assert_eq!(unhex("0a0"), None);
        assert_eq!(unhex("zz"), None);
        assert_eq!(unhex("é0"), None);
    }

    #[tokio::test]
    async fn a_view_follows_registrations_and_admit_waits_for_a_late_one() {
        use pdnode_registry::{MemoryRegistry, Registry, RegistryOptions};
        let reg = MemoryRegistry::new(RegistryOptions::default());
        let view = LiveMembership::start(&reg, "c").await.unwrap();
        let peers = RegisteredPeers::follow(view);
        let t = target("d0", &[0xab, 0x01], &[&[]]);
        assert!(matches!(
            peers.check(&t),
            Err(PeerError::NotRegistered { .. })
        ));
        // Unknown and nothing changes: refused at the wait's end.
        let t0 = tokio::time::Instant::now();
        assert!(peers.admit(&t, Duration::from_millis(100)).await.is_err());
        assert!(t0.elapsed() >= Duration::from_millis(100));
        // Registered while a prefill waits for it: admitted at once.
        let mut card = pdnode_core::NodeCard::placeholder("c", Role::Decode, "d0");
        card.addresses.ucx_worker = Some("ab01".into());
        let late = {
            let reg = reg.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                reg.register(card).await.unwrap()
            })
        };
        assert_eq!(peers.admit(&t, Duration::from_secs(5)).await, Ok(()));
        let registration = late.await.unwrap();
        // Another worker address than the card's: refused.
        let other = target("d0", &[0xab, 0x02], &[&[]]);
        assert!(matches!(
            peers.check(&other),
            Err(PeerError::WrongWorker { .. })
        ));
        // A prefill card of that name is no decode node.
        let mut p = pdnode_core::NodeCard::placeholder("c", Role::Prefill, "p0");
        p.addresses.ucx_worker = Some("cc".into());
        let _p = reg.register(p).await.unwrap();
        let tp = target("p0", &[0xcc], &[&[]]);
        assert!(peers.admit(&tp, Duration::from_millis(200)).await.is_err());
        // Gone from the registry: refused again.
        registration.shutdown().await.unwrap();
        let gone = async {
            while peers.check(&t).is_ok() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), gone)
            .await
            .expect("the card's removal reaches the check");
    }
}
