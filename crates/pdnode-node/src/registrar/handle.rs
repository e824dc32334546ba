//! Typed calls to the Registrar, each with a timeout.

use super::messages::RegistrarMsg;
use crate::NodeError;
use pdnode_registry::RegistrationStatus;
use ractor::{ActorRef, rpc::CallResult};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct RegistrarHandle {
    actor: ActorRef<RegistrarMsg>,
    timeout: Duration,
}

fn unwrap_call<T>(
    op: &'static str,
    r: Result<CallResult<T>, impl std::fmt::Display>,
) -> Result<T, NodeError> {
    let reason = match r {
        Ok(CallResult::Success(v)) => return Ok(v),
        Ok(CallResult::Timeout) => "timed out".to_string(),
        Ok(CallResult::SenderError) => "the actor dropped the reply".to_string(),
        Err(e) => e.to_string(),
    };
    Err(NodeError::Call {
        actor: "registrar",
        op,
        reason,
    })
}

impl RegistrarHandle {
    pub fn new(actor: ActorRef<RegistrarMsg>, timeout: Duration) -> Self {
        Self { actor, timeout }
    }

    pub async fn status(&self) -> Result<Option<RegistrationStatus>, NodeError> {
        unwrap_call(
            "status",
            self.actor
                .call(RegistrarMsg::Status, Some(self.timeout))
                .await,
        )
    }

    /// Revokes the lease; the node's key disappears at once.
    pub async fn deregister(&self) -> Result<(), NodeError> {
        unwrap_call(
            "deregister",
            self.actor
                .call(RegistrarMsg::Deregister, Some(self.timeout))
                .await,
        )?
        .map_err(NodeError::Registry)
    }
}
