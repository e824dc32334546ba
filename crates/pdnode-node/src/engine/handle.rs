//! Typed calls to the EngineActor, each with a timeout.

use super::messages::{EngineHealth, EngineMsg};
use crate::NodeError;
use ractor::{ActorRef, rpc::CallResult};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct EngineActorHandle {
    actor: ActorRef<EngineMsg>,
    timeout: Duration,
}

fn call_err<T>(
    op: &'static str,
    r: Result<CallResult<T>, impl std::fmt::Display>,
) -> Result<T, NodeError> {
    match r {
        Ok(CallResult::Success(v)) => Ok(v),
        Ok(CallResult::Timeout) => Err(NodeError::Call {
            actor: "engine",
            op,
            reason: "timed out".into(),
        }),
        Ok(CallResult::SenderError) => Err(NodeError::Call {
            actor: "engine",
            op,
            reason: "the actor dropped the reply".into(),
        }),
        Err(e) => Err(NodeError::Call {
            actor: "engine",
            op,
            reason: e.to_string(),
        }),
    }
}

impl EngineActorHandle {
    pub fn new(actor: ActorRef<EngineMsg>, timeout: Duration) -> Self {
        Self { actor, timeout }
    }

    pub async fn health(&self) -> Result<EngineHealth, NodeError> {
        call_err(
            "health",
            self.actor.call(EngineMsg::Health, Some(self.timeout)).await,
        )
    }

    pub fn stop_admitting(&self) -> Result<(), NodeError> {
        self.actor
            .cast(EngineMsg::StopAdmitting)
            .map_err(|e| NodeError::Call {
                actor: "engine",
                op: "stop_admitting",
                reason: e.to_string(),
            })
    }

    pub async fn in_flight(&self) -> Result<usize, NodeError> {
        call_err(
            "in_flight",
            self.actor
                .call(EngineMsg::InFlight, Some(self.timeout))
                .await,
        )?
        .map_err(NodeError::EngineCall)
    }
}
