//! [`CardMembership`]: a [`Membership`] built from node cards (the registry's membership view)
//! with one lazily connected gRPC client per node. The client itself,
//! [`GrpcNodeClient`], lives in `pdnode-nodeapi` (re-exported here).

use crate::membership::{Membership, Worker};
use parking_lot::Mutex;
use pdnode_core::{NodeCard, NodeId, Role};
use std::collections::HashMap;
use std::sync::Arc;

pub use pdnode_nodeapi::grpc::{ChannelOptions, GrpcNodeClient};

/// A [`Membership`] over node cards: `cards(role)` gives the current cards; each card gets a gRPC
/// client, reused while the card's id, start time and address stay the same. With the registry:
///
/// ```ignore
/// let live = Arc::new(pdnode_registry::LiveMembership::start(&registry, cluster).await?);
/// let membership = CardMembership::new(move |role| live.serving(role));
/// ```
pub struct CardMembership<F> {
    cards: F,
    channel: ChannelOptions,
    clients: Mutex<HashMap<(NodeId, u64, String), Arc<GrpcNodeClient>>>,
}

impl<F> CardMembership<F>
where
    F: Fn(Role) -> Vec<NodeCard> + Send + Sync + 'static,
{
    pub fn new(cards: F) -> Self {
        Self {
            cards,
            channel: ChannelOptions::default(),
            clients: Mutex::new(HashMap::new()),
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
        let cards = (self.cards)(role);
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
