//! Messages of the NodeSupervisor. Callers use [`super::SupervisorHandle`].

use crate::engine::EngineMsg;
use crate::registrar::RegistrarMsg;
use ractor::{ActorRef, RpcReplyPort};

/// What the supervisor knows without asking its children.
#[derive(Debug, Clone)]
pub struct SupervisorView {
    pub draining: bool,
    pub failed: Option<String>,
    pub engine: Option<ActorRef<EngineMsg>>,
    pub registrar: Option<ActorRef<RegistrarMsg>>,
    /// (child, restarts) for every child restarted at least once.
    pub restarts: Vec<(String, u64)>,
}

pub enum SupervisorMsg {
    View(RpcReplyPort<SupervisorView>),
    /// Shutdown began: children that stop from now on are not restarted.
    BeginShutdown,
}
