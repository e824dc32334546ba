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
    clients: Mutex<HashMap<(NodeId, u64, String), Arc<GrpcNodeClient>>>,
    /// Per role: when its cards were last seen non-empty, and those cards.
    last: Mutex<HashMap<Role, (Instant, Vec<NodeCard>)>>,
    grace: Duration,
}

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
                Some(c) => c.clone(),
                None => match GrpcNodeClient::connect_lazy_with(
                    card.id.clone(),
                    card.role,
                    &card.addresses.grpc,
                    &self.channel,
                ) {
                    Ok(c) => {
                        let c = Arc::new(c);
                        clients.retain(|(id, _, _), _| id != &card.id);
                        clients.insert(key, c.clone());
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
}
