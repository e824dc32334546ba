//! The membership view: plain state fed by [`MembershipEvent`]s.

use crate::MembershipEvent;
use pdnode_core::{NodeCard, NodeId, Role};
use std::collections::BTreeMap;

/// The nodes of one cluster as the registry last said. Keeps its last state when the watch
/// breaks and says so with [`MembershipView::is_stale`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MembershipView {
    /// Keyed by (role name, id): `Role` is not `Ord`.
    nodes: BTreeMap<(&'static str, NodeId), NodeCard>,
    revision: i64,
    stale: Option<String>,
}

impl MembershipView {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event; returns whether the set of cards (or any card) changed.
    pub fn apply(&mut self, ev: &MembershipEvent) -> bool {
        match ev {
            MembershipEvent::Snapshot(snap) => {
                self.stale = None;
                self.revision = snap.revision;
                let new: BTreeMap<_, _> = snap
                    .cards
                    .iter()
                    .map(|c| ((c.role.as_str(), c.id.clone()), c.clone()))
                    .collect();
                let changed = new != self.nodes;
                self.nodes = new;
                changed
            }
            MembershipEvent::Put { card, revision } => {
                if *revision <= self.revision {
                    return false; // already seen (a snapshot at or after it)
                }
                self.revision = *revision;
                let k = (card.role.as_str(), card.id.clone());
                if self.nodes.get(&k) == Some(&**card) {
                    return false;
                }
                self.nodes.insert(k, (**card).clone());
                true
            }
            MembershipEvent::Delete { role, id, revision } => {
                if *revision <= self.revision {
                    return false;
                }
                self.revision = *revision;
                self.nodes.remove(&(role.as_str(), id.clone())).is_some()
            }
            MembershipEvent::Stale { reason } => {
                self.stale = Some(reason.clone());
                false
            }
        }
    }

    /// Cards of exactly this role, ordered by node id.
    pub fn by_role(&self, role: Role) -> impl Iterator<Item = &NodeCard> {
        self.nodes
            .iter()
            .filter(move |(_, c)| c.role == role)
            .map(|(_, c)| c)
    }

    /// pdnode nodes that can serve `role` work: that role, plus `all` nodes for prefill and
    /// decode. SGLang workers' cards are not among them (see [`Self::sglang_workers`]).
    pub fn serving(&self, role: Role) -> impl Iterator<Item = &NodeCard> {
        self.nodes
            .iter()
            .filter(move |(_, c)| {
                c.sglang.is_none()
                    && (c.role == role
                        || (c.role == Role::All && matches!(role, Role::Prefill | Role::Decode)))
            })
            .map(|(_, c)| c)
    }

    /// Cards of SGLang HTTP workers of `role` (registered by `pdnode sglang-register`).
    pub fn sglang_workers(&self, role: Role) -> impl Iterator<Item = &NodeCard> {
        self.nodes
            .iter()
            .filter(move |(_, c)| c.sglang.is_some() && c.role == role)
            .map(|(_, c)| c)
    }

    pub fn get(&self, role: Role, id: &NodeId) -> Option<&NodeCard> {
        self.nodes.get(&(role.as_str(), id.clone()))
    }

    /// Every card, ordered by role then id.
    pub fn cards(&self) -> impl Iterator<Item = &NodeCard> {
        self.nodes.values()
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The registry revision the view reflects.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// Whether the watch is broken (the view may be out of date), and why.
    pub fn is_stale(&self) -> bool {
        self.stale.is_some()
    }

    pub fn stale_reason(&self) -> Option<&str> {
        self.stale.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Snapshot;

    fn card(role: Role, id: &str, running: u32) -> NodeCard {
        let mut c = NodeCard::placeholder("c", role, id);
        c.capacity.running_requests = running;
        c.started_at_ms = 0;
        c
    }

    #[test]
    fn sglang_worker_cards_are_apart_from_pdnode_nodes() {
        let mut v = MembershipView::new();
        let mut sg = card(Role::Decode, "sg-d0", 0);
        sg.sglang = Some(pdnode_core::SglangWorker {
            url: "http://10.0.0.3:30000".into(),
            bootstrap_port: None,
        });
        let snap = Snapshot {
            cards: vec![card(Role::Decode, "d0", 0), sg],
            revision: 1,
        };
        v.apply(&MembershipEvent::Snapshot(snap));
        let ids = |it: Vec<&NodeCard>| it.iter().map(|c| c.id.to_string()).collect::<Vec<_>>();
        assert_eq!(ids(v.serving(Role::Decode).collect()), ["d0"]);
        assert_eq!(ids(v.sglang_workers(Role::Decode).collect()), ["sg-d0"]);
        assert_eq!(v.sglang_workers(Role::Prefill).count(), 0);
    }

    #[test]
    fn snapshot_put_delete_and_staleness() {
        let mut v = MembershipView::new();
        let snap = Snapshot {
            cards: vec![card(Role::Prefill, "p0", 0), card(Role::Decode, "d0", 0)],
            revision: 10,
        };
        assert!(v.apply(&MembershipEvent::Snapshot(snap.clone())));
        assert!(!v.apply(&MembershipEvent::Snapshot(snap)));
        assert_eq!(v.by_role(Role::Prefill).count(), 1);
        // Old revisions are ignored.
        assert!(!v.apply(&MembershipEvent::Put {
            card: Box::new(card(Role::Prefill, "p1", 0)),
            revision: 9
        }));
        assert!(v.apply(&MembershipEvent::Put {
            card: Box::new(card(Role::Prefill, "p1", 0)),
            revision: 11
        }));
        // Same card again: no change; new load: change.
        assert!(!v.apply(&MembershipEvent::Put {
            card: Box::new(card(Role::Prefill, "p1", 0)),
            revision: 12
        }));
        assert!(v.apply(&MembershipEvent::Put {
            card: Box::new(card(Role::Prefill, "p1", 3)),
            revision: 13
        }));
        assert_eq!(
            v.get(Role::Prefill, &NodeId::new("p1"))
                .unwrap()
                .capacity
                .running_requests,
            3
        );
        assert!(v.apply(&MembershipEvent::Delete {
            role: Role::Decode,
            id: NodeId::new("d0"),
            revision: 14
        }));
        assert!(!v.apply(&MembershipEvent::Delete {
            role: Role::Decode,
            id: NodeId::new("d0"),
            revision: 15
        }));
        assert!(!v.apply(&MembershipEvent::Stale {
            reason: "down".into()
        }));
        assert!(v.is_stale());
        assert_eq!(v.len(), 2, "a stale view keeps its last state");
        assert!(v.apply(&MembershipEvent::Snapshot(Snapshot {
            cards: vec![],
            revision: 20
        })));
        assert!(!v.is_stale());
        assert!(v.is_empty());
    }

    #[test]
    fn all_nodes_serve_prefill_and_decode() {
        let mut v = MembershipView::new();
        v.apply(&MembershipEvent::Snapshot(Snapshot {
            cards: vec![card(Role::All, "a0", 0), card(Role::Decode, "d0", 0)],
            revision: 1,
        }));
        assert_eq!(v.serving(Role::Prefill).count(), 1);
        assert_eq!(v.serving(Role::Decode).count(), 2);
        assert_eq!(v.by_role(Role::Decode).count(), 1);
        assert_eq!(v.serving(Role::Router).count(), 0);
    }
}
