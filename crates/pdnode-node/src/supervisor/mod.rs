//! NodeSupervisor: starts the role's children (Registrar always, EngineActor on prefill, decode
//! and all nodes) and restarts a child that fails (a panic or an error in a handler) or stops
//! unexpectedly, within [`RestartLimits`] (default: 5 restarts of one child within 60 s). Past
//! the limit it marks the node failed on the [`HealthBoard`] and stops; the process then exits
//! non-zero. A child failure is never a process exit by itself.
//!
//! TransferActor: the KV transfer seam (`pdnode_transfer`) is not wired into the node yet; it
//! joins the children here when the node serves ReserveKv/Prefill/Decode.

mod handle;
mod messages;
mod state;

pub use handle::{NodeHealth, SupervisorHandle};
pub use messages::{SupervisorMsg, SupervisorView};
pub use state::{Decision, RestartLimits, RestartPolicy};

use crate::board::HealthBoard;
use crate::engine::{EngineActor, EngineActorArgs, EngineMsg};
use crate::registrar::{Registrar, RegistrarArgs, RegistrarMsg};
use pdnode_core::metrics::NODE_ACTOR_RESTARTS_TOTAL;
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use std::time::Instant;

#[derive(Debug, Clone, Copy)]
pub struct NodeSupervisor {
    pub limits: RestartLimits,
    pub registrar: Registrar,
    pub engine: EngineActor,
}

#[derive(Clone)]
pub struct SupervisorArgs {
    pub registrar: RegistrarArgs,
    pub engine: Option<EngineActorArgs>,
    pub health: HealthBoard,
}

pub struct SupervisorRuntime {
    policy: RestartPolicy,
    args: SupervisorArgs,
    registrar: Option<ActorRef<RegistrarMsg>>,
    engine: Option<ActorRef<EngineMsg>>,
    stopping: bool,
}

const REGISTRAR: &str = "registrar";
const ENGINE: &str = "engine";

impl NodeSupervisor {
    async fn spawn_registrar(
        &self,
        myself: &ActorRef<SupervisorMsg>,
        args: &SupervisorArgs,
    ) -> Result<ActorRef<RegistrarMsg>, ActorProcessingErr> {
        let (a, _) = Actor::spawn_linked(
            None,
            self.registrar,
            args.registrar.clone(),
            myself.get_cell(),
        )
        .await?;
        Ok(a)
    }

    async fn spawn_engine(
        &self,
        myself: &ActorRef<SupervisorMsg>,
        args: &SupervisorArgs,
    ) -> Result<Option<ActorRef<EngineMsg>>, ActorProcessingErr> {
        match &args.engine {
            Some(e) => {
                let (a, _) =
                    Actor::spawn_linked(None, self.engine, e.clone(), myself.get_cell()).await?;
                Ok(Some(a))
            }
            None => Ok(None),
        }
    }

    fn which(st: &SupervisorRuntime, id: ActorId) -> Option<&'static str> {
        if st.registrar.as_ref().is_some_and(|a| a.get_id() == id) {
            Some(REGISTRAR)
        } else if st.engine.as_ref().is_some_and(|a| a.get_id() == id) {
            Some(ENGINE)
        } else {
            None
        }
    }

    async fn child_down(
        &self,
        myself: &ActorRef<SupervisorMsg>,
        id: ActorId,
        what: String,
        st: &mut SupervisorRuntime,
    ) -> Result<(), ActorProcessingErr> {
        let Some(child) = Self::which(st, id) else {
            return Ok(());
        };
        match st.policy.on_failure(child, Instant::now()) {
            Decision::Restart => {
                tracing::error!(actor = child, reason = %what, metric = NODE_ACTOR_RESTARTS_TOTAL, "actor failed; restarting it");
                match child {
                    REGISTRAR => st.registrar = Some(self.spawn_registrar(myself, &st.args).await?),
                    _ => st.engine = self.spawn_engine(myself, &st.args).await?,
                }
            }
            Decision::GiveUp { restarts } => {
                let reason = crate::NodeError::RestartLimit {
                    actor: child.to_string(),
                    restarts,
                    window_s: st.policy.limits().window.as_secs(),
                }
                .to_string();
                tracing::error!(actor = child, last_failure = %what, "{reason}");
                st.stopping = true;
                st.args.health.set_failed(reason.clone());
                myself.stop(Some(reason));
            }
        }
        Ok(())
    }
}

impl Actor for NodeSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorRuntime;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        args: SupervisorArgs,
    ) -> Result<SupervisorRuntime, ActorProcessingErr> {
        let registrar = Some(self.spawn_registrar(&myself, &args).await?);
        let engine = self.spawn_engine(&myself, &args).await?;
        Ok(SupervisorRuntime {
            policy: RestartPolicy::new(self.limits),
            args,
            registrar,
            engine,
            stopping: false,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        st: &mut SupervisorRuntime,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::View(reply) => {
                let _ = reply.send(SupervisorView {
                    draining: st.args.health.is_draining(),
                    failed: st.args.health.failure(),
                    engine: st.engine.clone(),
                    registrar: st.registrar.clone(),
                    restarts: st.policy.totals(),
                });
            }
            SupervisorMsg::BeginShutdown => {
                st.stopping = true;
                st.args.health.set_draining();
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        evt: SupervisionEvent,
        st: &mut SupervisorRuntime,
    ) -> Result<(), ActorProcessingErr> {
        if st.stopping {
            return Ok(());
        }
        match evt {
            SupervisionEvent::ActorFailed(cell, err) => {
                self.child_down(&myself, cell.get_id(), format!("failed: {err}"), st)
                    .await?;
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                let why = format!(
                    "stopped unexpectedly ({})",
                    reason.unwrap_or_else(|| "no reason".into())
                );
                self.child_down(&myself, cell.get_id(), why, st).await?;
            }
            _ => {}
        }
        Ok(())
    }
}
