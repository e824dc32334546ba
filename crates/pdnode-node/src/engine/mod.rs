//! EngineActor: wraps the node's engine (which runs on its own OS threads) behind actor
//! messages. It refreshes the [`LoadBoard`] every `refresh` period, answers health, and stops
//! admission when shutdown begins. A restart of this actor does not restart the engine: the
//! engine lives in [`EngineService`], shared through the arguments.

pub mod adapter;
mod handle;
mod messages;
pub mod service;
mod state;

pub use handle::EngineActorHandle;
pub use messages::{EngineHealth, EngineMsg};
pub use service::{EngineDescription, EngineLoad, EngineService};
pub use state::EngineActorState;

use crate::board::LoadBoard;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::Arc;
use std::time::Duration;

/// Immutable configuration of the actor.
#[derive(Debug, Clone, Copy)]
pub struct EngineActor {
    pub refresh: Duration,
}

#[derive(Clone)]
pub struct EngineActorArgs {
    pub engine: Arc<dyn EngineService>,
    pub load: LoadBoard,
}

pub struct EngineRuntime {
    state: EngineActorState,
    engine: Arc<dyn EngineService>,
    load: LoadBoard,
    backend: String,
    ticker: tokio::task::JoinHandle<()>,
}

impl Actor for EngineActor {
    type Msg = EngineMsg;
    type State = EngineRuntime;
    type Arguments = EngineActorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<EngineMsg>,
        args: EngineActorArgs,
    ) -> Result<EngineRuntime, ActorProcessingErr> {
        let refresh = self.refresh;
        let me = myself.clone();
        let ticker = tokio::spawn(async move {
            let mut iv = tokio::time::interval(refresh);
            iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                iv.tick().await;
                if me.cast(EngineMsg::Tick).is_err() {
                    return;
                }
            }
        });
        let backend = args.engine.describe().backend;
        Ok(EngineRuntime {
            state: EngineActorState::new(),
            engine: args.engine,
            load: args.load,
            backend,
            ticker,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<EngineMsg>,
        st: &mut EngineRuntime,
    ) -> Result<(), ActorProcessingErr> {
        st.ticker.abort();
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<EngineMsg>,
        msg: EngineMsg,
        st: &mut EngineRuntime,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            EngineMsg::Tick => {
                let r = match st.engine.load().await {
                    Ok(l) => {
                        st.load.publish_accounting(l.accounting);
                        st.load.publish(l.capacity);
                        Ok(())
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "engine load read failed");
                        Err(e)
                    }
                };
                st.state.on_load(&r);
            }
            EngineMsg::Health(reply) => {
                let _ = reply.send(st.state.health(&st.backend));
            }
            EngineMsg::StopAdmitting => {
                st.state.admitting = false;
                st.engine.stop_admitting();
            }
            EngineMsg::InFlight(reply) => {
                let _ = reply.send(st.engine.in_flight().await);
            }
        }
        Ok(())
    }
}
