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
