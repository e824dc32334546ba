//! Typed calls to the NodeSupervisor (and through it to the current children), with timeouts.

use super::messages::{SupervisorMsg, SupervisorView};
use crate::NodeError;
use crate::engine::EngineActorHandle;
use crate::registrar::RegistrarHandle;
use ractor::{ActorRef, rpc::CallResult};
use std::time::Duration;

/// The node's health as served on `/health` and gRPC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeHealth {
    pub serving: bool,
    pub detail: String,
    pub restarts: Vec<(String, u64)>,
}

#[derive(Debug, Clone)]
pub struct SupervisorHandle {
    actor: ActorRef<SupervisorMsg>,
    timeout: Duration,
}

impl SupervisorHandle {
    pub fn new(actor: ActorRef<SupervisorMsg>, timeout: Duration) -> Self {
        Self { actor, timeout }
    }

    pub fn actor(&self) -> &ActorRef<SupervisorMsg> {
        &self.actor
    }

    pub async fn view(&self) -> Result<SupervisorView, NodeError> {
        let reason = match self
            .actor
            .call(SupervisorMsg::View, Some(self.timeout))
            .await
        {
            Ok(CallResult::Success(v)) => return Ok(v),
            Ok(CallResult::Timeout) => "timed out".to_string(),
            Ok(CallResult::SenderError) => "the actor dropped the reply".to_string(),
            Err(e) => e.to_string(),
        };
        Err(NodeError::Call {
            actor: "supervisor",
            op: "view",
            reason,
        })
    }

    /// The current engine actor, if the role has one.
    pub async fn engine(&self) -> Result<Option<EngineActorHandle>, NodeError> {
        Ok(self
            .view()
            .await?
            .engine
            .map(|a| EngineActorHandle::new(a, self.timeout)))
    }

    pub async fn registrar(&self) -> Result<RegistrarHandle, NodeError> {
        match self.view().await?.registrar {
            Some(a) => Ok(RegistrarHandle::new(a, self.timeout)),
            None => Err(NodeError::Call {
                actor: "registrar",
                op: "lookup",
                reason: "no registrar is running (restarting?)".into(),
            }),
        }
    }

    /// Serving when the supervisor answers, is neither draining nor failed, and the engine actor
    /// (if any) answers that it serves.
    pub async fn health(&self) -> NodeHealth {
        let view = match self.view().await {
            Ok(v) => v,
            Err(e) => {
                return NodeHealth {
                    serving: false,
                    detail: e.to_string(),
                    restarts: Vec::new(),
                };
            }
        };
        let restarts = view.restarts.clone();
        if let Some(f) = view.failed {
            return NodeHealth {
                serving: false,
                detail: format!("failed: {f}"),
                restarts,
            };
        }
        if view.draining {
            return NodeHealth {
                serving: false,
                detail: "draining".into(),
                restarts,
            };
        }
        if let Some(engine) = view.engine {
            let h = EngineActorHandle::new(engine, self.timeout).health().await;
            return match h {
                Ok(h) => NodeHealth {
                    serving: h.serving,
                    detail: h.detail,
                    restarts,
                },
                Err(e) => NodeHealth {
                    serving: false,
                    detail: e.to_string(),
                    restarts,
                },
            };
        }
        NodeHealth {
            serving: true,
            detail: "serving".into(),
            restarts,
        }
    }

    pub fn begin_shutdown(&self) {
        let _ = self.actor.cast(SupervisorMsg::BeginShutdown);
    }
}
