//! Which prefill and decode nodes the router may use: the [`Membership`] trait, fed in
//! production by the registry's membership view (see [`crate::grpc_client::CardMembership`]),
//! and [`StaticMembership`], its in-memory twin.

use crate::node::NodeClient;
use parking_lot::RwLock;
use pdnode_core::{NodeCard, NodeId, Role};
use std::sync::Arc;

/// One usable node: its card and a client to call it.
#[derive(Clone)]
pub struct Worker {
    pub card: NodeCard,
    pub client: Arc<dyn NodeClient>,
}

impl Worker {
    pub fn id(&self) -> &NodeId {
        &self.card.id
    }
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("id", &self.card.id).finish()
    }
}

/// The current nodes of a role. Cheap to call per request.
pub trait Membership: Send + Sync + 'static {
    /// Nodes that serve `role` (Prefill or Decode) now.
    fn workers(&self, role: Role) -> Vec<Worker>;
}

/// A fixed, editable set of workers (tests, `role = "all"`).
#[derive(Default)]
pub struct StaticMembership {
    workers: RwLock<Vec<Worker>>,
}

impl StaticMembership {
    pub fn new(workers: Vec<Worker>) -> Self {
        Self {
            workers: RwLock::new(workers),
        }
    }

    pub fn add(&self, w: Worker) {
        let mut ws = self.workers.write();
        ws.retain(|x| x.card.id != w.card.id);
        ws.push(w);
    }

    pub fn remove(&self, id: &NodeId) {
        self.workers.write().retain(|x| &x.card.id != id);
    }
}

impl Membership for StaticMembership {
    fn workers(&self, role: Role) -> Vec<Worker> {
        self.workers
            .read()
            .iter()
            .filter(|w| {
                // As the registry's view: `all` nodes serve prefill and decode work too.
                w.card.role == role
                    || (w.card.role == Role::All && matches!(role, Role::Prefill | Role::Decode))
            })
            .cloned()
            .collect()
    }
}

/// A worker that serves both phases itself on its node API: role `All` with `colocated` set
/// on its card. A role-`All` card without it (prefill and decode engines kept in process, or an
/// older node) is not a worker for this router at all.
pub fn is_colocated(w: &Worker) -> bool {
    w.card.role == Role::All && w.card.colocated
}

/// Prefill candidates (role `Prefill` workers) and decode candidates (role `Decode` workers plus
/// the colocated ones, each once). A colocated worker is picked by the decode policy and then
/// prefills for itself; the prefill policy never pairs it with another decode node. A card
/// marked `draining` (a decode node draining by migration) is no candidate: it takes no new
/// request and no moved stream, though it stays a member (its streams are watched as before).
pub fn candidates(m: &dyn Membership) -> (Vec<Worker>, Vec<Worker>) {
    let prefills: Vec<Worker> = m
        .workers(Role::Prefill)
        .into_iter()
        .filter(|w| w.card.role == Role::Prefill && !w.card.draining)
        .collect();
    let mut decodes: Vec<Worker> = m
        .workers(Role::Decode)
        .into_iter()
        .filter(|w| w.card.role == Role::Decode && !w.card.draining)
        .collect();
    for w in m
        .workers(Role::All)
        .into_iter()
        .filter(|w| is_colocated(w) && !w.card.draining)
    {
        if !decodes.iter().any(|x| x.id() == w.id()) {
            decodes.push(w);
        }
    }
    (prefills, decodes)
}
