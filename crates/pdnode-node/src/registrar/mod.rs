//! Registrar: owns the node's [`Registration`] (lease + keepalive live in the registry crate's
//! background task) and publishes the node's load into its card when it changes. A restart of
//! this actor keeps the registration: it lives in [`SharedRegistration`], not in actor state.

mod handle;
mod messages;
mod state;

pub use handle::RegistrarHandle;
pub use messages::RegistrarMsg;
pub use state::RegistrarState;

use crate::board::LoadBoard;
use pdnode_registry::Registration;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::Arc;
use std::time::Duration;

/// The registration, shared so that it outlives Registrar restarts; `None` once revoked.
pub type SharedRegistration = Arc<tokio::sync::Mutex<Option<Registration>>>;

#[derive(Debug, Clone, Copy)]
pub struct Registrar {
    /// How often the load is compared with the published card.
    pub refresh: Duration,
}

#[derive(Clone)]
pub struct RegistrarArgs {
    pub registration: SharedRegistration,
    pub load: LoadBoard,
}

pub struct RegistrarRuntime {
    state: RegistrarState,
    registration: SharedRegistration,
    load: LoadBoard,
    ticker: tokio::task::JoinHandle<()>,
}

impl Actor for Registrar {
    type Msg = RegistrarMsg;
    type State = RegistrarRuntime;
    type Arguments = RegistrarArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<RegistrarMsg>,
        args: RegistrarArgs,
    ) -> Result<RegistrarRuntime, ActorProcessingErr> {
        let published = match args.registration.lock().await.as_ref() {
            Some(r) => r.card().capacity,
            None => Default::default(),
        };
        let refresh = self.refresh;
        let me = myself.clone();
        let ticker = tokio::spawn(async move {
            let mut iv = tokio::time::interval(refresh);
            iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                iv.tick().await;
                if me.cast(RegistrarMsg::Tick).is_err() {
                    return;
                }
            }
        });
        Ok(RegistrarRuntime {
            state: RegistrarState::new(published),
            registration: args.registration,
            load: args.load,
            ticker,
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<RegistrarMsg>,
        st: &mut RegistrarRuntime,
    ) -> Result<(), ActorProcessingErr> {
        st.ticker.abort();
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<RegistrarMsg>,
        msg: RegistrarMsg,
        st: &mut RegistrarRuntime,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RegistrarMsg::Tick => {
                let g = st.registration.lock().await;
                if let Some(reg) = g.as_ref() {
                    let load = st.load.current();
                    if let Some(card) = st.state.next_card(&reg.card(), &load)
                        && let Err(e) = reg.update(card)
                    {
                        tracing::warn!(error = %e, "card update not accepted");
                    }
                }
            }
            RegistrarMsg::Status(reply) => {
                let s = st.registration.lock().await.as_ref().map(|r| r.status());
                let _ = reply.send(s);
            }
            RegistrarMsg::Deregister(reply) => {
                let reg = st.registration.lock().await.take();
                let r = match reg {
                    Some(r) => r.shutdown().await,
                    None => Ok(()),
                };
                let _ = reply.send(r);
            }
        }
        Ok(())
    }
}
