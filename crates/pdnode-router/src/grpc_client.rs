//! [`CardMembership`]: a [`Membership`] built from node cards (the registry's membership view)
//! with one lazily connected gRPC client per node. The client itself,
//! [`GrpcNodeClient`], lives in `pdnode-nodeapi` (re-exported here).

use crate::membership::{Membership, Worker};
use parking_lot::Mutex;
use pdnode_core::{NodeCard, NodeId, Role};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use pdnode_nodeapi::grpc::{ChannelOptions, GrpcNodeClient};

/// A [`Membership`] over node cards: `cards(role)` gives the current cards; each card gets a gRPC
/// client, reused while the card's id, start time and address stay the same. With the registry:
///
/// ```ignore
/// let live = Arc::new(pdnode_registry::LiveMembership::start(&registry, cluster).await?);
/// let membership = CardMembership::new(move |role| live.serving(role));
/// ```
///
/// When a role's cards are all gone at once, the last ones seen stay in use for a grace
/// ([`LAPSED_GRACE`] unless [`CardMembership::with_lapsed_grace`]; `pdnode start` sets one lease
/// TTL): etcd back after more than a lease TTL may expire every node's lease before their
/// keepalives land, and the nodes register again within a keepalive; in between, a node that
/// is really gone fails its calls (the router retries or answers 503) as it would anyway.
pub struct CardMembership<F> {
    cards: F,
    channel: ChannelOptions,
    /// One client per card (id, process start, address), with the role asked for when it was
    /// made: a client whose card that role no longer lists is dropped (calls in flight keep
    /// theirs), so nodes that left for good hold no channel here.
    clients: Mutex<HashMap<CardKey, (Role, Arc<GrpcNodeClient>)>>,
    /// Per role: when its cards were last seen non-empty, and those cards.
    last: Mutex<HashMap<Role, (Instant, Vec<NodeCard>)>>,
    grace: Duration,
}

/// A card's identity for its client: node id, process start, gRPC address.
type CardKey = (NodeId, u64, String);

/// How long a role whose cards all vanished keeps its last cards by default (see
/// [`CardMembership`]): the default lease TTL.
pub const LAPSED_GRACE: Duration = Duration::from_secs(10);

impl<F> CardMembership<F>
where
    F: Fn(Role) -> Vec<NodeCard> + Send + Sync + 'static,
{
    pub fn new(cards: F) -> Self {
        Self {
            cards,
            channel: ChannelOptions::default(),
            clients: Mutex::new(HashMap::new()),
            last: Mutex::new(HashMap::new()),
            grace: LAPSED_GRACE,
        }
    }

    /// How long the last cards of a role that emptied stay in use.
    pub fn with_lapsed_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// The role's cards now, or, when there are none, the last ones seen within the grace.
    fn cards_of(&self, role: Role) -> Vec<NodeCard> {
        let cards = (self.cards)(role);
        let mut last = self.last.lock();
        if !cards.is_empty() {
            last.insert(role, (Instant::now(), cards.clone()));
            return cards;
        }
        match last.get(&role) {
            Some((seen, prev)) if seen.elapsed() < self.grace => prev.clone(),
            _ => cards,
        }
    }

    /// Channels to nodes set up with `opts` (clients made from now on).
    pub fn with_channel_options(mut self, opts: ChannelOptions) -> Self {
        self.channel = opts;
        self
    }
}

impl<F> Membership for CardMembership<F>
where
    F: Fn(Role) -> Vec<NodeCard> + Send + Sync + 'static,
{
    fn workers(&self, role: Role) -> Vec<Worker> {
        let cards = self.cards_of(role);
        let mut clients = self.clients.lock();
        let mut out = Vec::with_capacity(cards.len());
        for card in cards {
            let key = (
                card.id.clone(),
                card.started_at_ms,
                card.addresses.grpc.clone(),
            );
            let client = match clients.get(&key) {
                Some((_, c)) => c.clone(),
                None => match GrpcNodeClient::connect_lazy_with(
                    card.id.clone(),
                    card.role,
                    &card.addresses.grpc,
                    &self.channel,
                ) {
                    Ok(c) => {
                        let c = Arc::new(c);
                        clients.retain(|(id, _, _), _| id != &card.id);
                        clients.insert(key, (role, c.clone()));
                        c
                    }
                    Err(e) => {
                        tracing::warn!(node = %card.id, error = %e, "skipping node with a bad address");
                        continue;
                    }
                },
            };
            out.push(Worker { card, client });
        }
        clients.retain(|(id, started, grpc), (made_for, _)| {
            *made_for != role
                || out.iter().any(|w| {
                    &w.card.id == id
                        && w.card.started_at_ms == *started
                        && &w.card.addresses.grpc == grpc
                })
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn card(id: &str, role: Role) -> NodeCard {
        NodeCard::placeholder("c", role, id)
    }

    #[tokio::test]
    async fn a_role_whose_cards_all_vanish_keeps_its_last_ones_for_the_grace() {
        let gone = Arc::new(AtomicBool::new(false));
        let g = gone.clone();
        let cards = move |role: Role| {
            if g.load(Ordering::Relaxed) || role != Role::Decode {
                Vec::new()
            } else {
                vec![card("d0", Role::Decode)]
            }
        };
        let m = CardMembership::new(cards);
        assert_eq!(m.workers(Role::Decode).len(), 1);
        gone.store(true, Ordering::Relaxed);
        let kept = m.workers(Role::Decode);
        assert_eq!(kept.len(), 1, "the last card stays within the grace");
        assert_eq!(kept[0].id().as_str(), "d0");
        // A role never seen stays empty.
        assert!(m.workers(Role::Prefill).is_empty());

        let g = gone.clone();
        g.store(false, Ordering::Relaxed);
        let cards = move |role: Role| {
            if g.load(Ordering::Relaxed) || role != Role::Decode {
                Vec::new()
            } else {
                vec![card("d0", Role::Decode)]
            }
        };
        let m = CardMembership::new(cards).with_lapsed_grace(Duration::ZERO);
        assert_eq!(m.workers(Role::Decode).len(), 1);
        gone.store(true, Ordering::Relaxed);
        assert!(m.workers(Role::Decode).is_empty(), "past the grace: gone");
    }

    #[tokio::test]
    async fn clients_of_nodes_that_left_are_dropped() {
        let n = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let k = n.clone();
        // decode nodes come and go with fresh ids; one prefill node stays
        let cards = move |role: Role| match role {
            Role::Decode => {
                let i = k.load(Ordering::Relaxed);
                vec![
                    card(&format!("d{i}"), role),
                    card(&format!("d{}", i + 1), role),
                ]
            }
            Role::Prefill => vec![card("p0", role)],
            _ => Vec::new(),
        };
        let m = CardMembership::new(cards);
        assert_eq!(m.workers(Role::Prefill).len(), 1);
        for i in 0..50 {
            n.store(i, Ordering::Relaxed);
            let ws = m.workers(Role::Decode);
            assert_eq!(ws.len(), 2);
            assert_eq!(ws[0].id().as_str(), format!("d{i}"));
        }
        let held: Vec<String> = m
            .clients
            .lock()
            .keys()
            .map(|(id, _, _)| id.to_string())
            .collect();
        assert_eq!(held.len(), 3, "{held:?}");
        for id in ["p0", "d49", "d50"] {
            assert!(held.iter().any(|h| h == id), "{id} missing from {held:?}");
        }
    }
}
