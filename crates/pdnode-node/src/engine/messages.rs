//! Messages of the EngineActor. Callers use [`super::EngineActorHandle`], never these.

use pdnode_engine::engine::EngineError;
use ractor::RpcReplyPort;

/// The engine as the actor sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineHealth {
    pub serving: bool,
    pub detail: String,
}

pub enum EngineMsg {
    /// Refresh the load board from the engine.
    Tick,
    Health(RpcReplyPort<EngineHealth>),
    /// Shutdown began: refuse new work.
    StopAdmitting,
    InFlight(RpcReplyPort<Result<usize, EngineError>>),
}
