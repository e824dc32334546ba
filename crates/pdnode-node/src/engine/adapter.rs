//! [`EngineService`] over the engine loop (`pdnode_engine::engine::EngineHandle`), and the
//! engine a node's config asks for.
//!
//! Wired today: `engine.backend = "mock"` (the simulated engine: a real host KV pool and
//! scheduler, timed steps; named "mock" in the card and logs). The cpu/cuda backends need the
//! model loader hooked into the node; until then [`engine_for`] returns `None` for them and the
//! node runs without an engine (it says so in its log).

use super::service::{EngineDescription, EngineLoad, EngineService};
use crate::NodeError;
use futures::FutureExt;
use futures::future::BoxFuture;
use pdnode_core::card::NodeCapacity;
use pdnode_core::config::{Backend, Config};
use pdnode_core::{KvLayout, Role};
use pdnode_engine::engine::{EngineError, EngineHandle, EngineLoopConfig};
use pdnode_engine::mock::MockBackend;
use pdnode_engine::scheduler::Mode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The engine loop as the node sees it.
pub struct EngineHandleService {
    handle: EngineHandle,
    model_id: String,
    max_running: u32,
    admitting: AtomicBool,
    /// The data path whose staging spans the accounting reports (prefill and decode nodes).
    staging: Option<Arc<crate::pd::PdNode>>,
}

impl EngineHandleService {
    pub fn new(handle: EngineHandle, model_id: String, max_running: u32) -> Self {
        Self {
            handle,
            model_id,
            max_running,
            admitting: AtomicBool::new(true),
            staging: None,
        }
    }

    /// Reports `node`'s staging spans and fence outcomes with each load read.
    pub fn with_staging(mut self, node: Arc<crate::pd::PdNode>) -> Self {
        self.staging = Some(node);
        self
    }

    pub fn handle(&self) -> &EngineHandle {
        &self.handle
    }

    /// Whether new requests may be admitted (false once shutdown began).
    pub fn is_admitting(&self) -> bool {
        self.admitting.load(Ordering::SeqCst)
    }

    fn layout(&self) -> &KvLayout {
        &self.handle.info().kv_layout
    }
}

impl EngineService for EngineHandleService {
    fn describe(&self) -> EngineDescription {
        let info = self.handle.info();
        EngineDescription {
            backend: info.backend_name.clone(),
            model_id: self.model_id.clone(),
            model_fingerprint: self.layout().model_fingerprint.clone(),
            kv_layout: Some(self.layout().clone()),
            tp_size: self.layout().tp_size,
        }
    }

    fn load(&self) -> BoxFuture<'_, Result<EngineLoad, EngineError>> {
        async move {
            let s = self.handle.stats().await?;
            let sch = s.scheduler;
            let mut accounting = crate::pd::engine_accounting(&s);
            if let Some(pd) = &self.staging {
                pd.staging_accounting(&mut accounting);
            }
            Ok(EngineLoad {
                capacity: NodeCapacity {
                    kv_blocks_total: sch.kv.total as u64,
                    kv_blocks_free: sch.kv.free as u64,
                    max_running_requests: self.max_running,
                    running_requests: sch.running as u32,
                    queued_requests: (sch.waiting + sch.transferred) as u32,
                },
                accounting: Some(accounting),
            })
        }
        .boxed()
    }

    fn stop_admitting(&self) {
        self.admitting.store(false, Ordering::SeqCst);
    }

    fn in_flight(&self) -> BoxFuture<'_, Result<usize, EngineError>> {
        async move {
            let s = self.handle.stats().await?;
            // KV leases are hand-offs in flight: a decode node's reservations whose `Decode`
            // has not come yet (a drain that ignored them failed those requests on a node that
            // had stopped), a prefill node's pushes. Each ends by its lease deadline.
            Ok(s.scheduler.running
                + s.scheduler.waiting
                + s.scheduler.transferred
                + s.scheduler.kv.leases)
        }
        .boxed()
    }

    fn shutdown(&self, timeout: Duration) -> BoxFuture<'_, bool> {
        async move { self.handle.shutdown(timeout).await }.boxed()
    }
}

/// The scheduler mode of a role.
pub fn mode_for(role: Role) -> Option<Mode> {
    match role {
        Role::Prefill => Some(Mode::PrefillOnly),
        Role::Decode => Some(Mode::DecodeOnly),
        Role::All => Some(Mode::Colocated),
        Role::Router => None,
    }
}

/// Starts the engine the config asks for, if the node runtime can run it (see the module
/// docs); `Ok(None)` for routers and for backends not wired yet.
pub fn engine_for(cfg: &Config) -> Result<Option<Arc<dyn EngineService>>, NodeError> {
    let Some(mode) = mode_for(cfg.node.role) else {
        return Ok(None);
    };
    if cfg.engine.backend != Backend::Mock {
        return Ok(None);
    }
    let e = &cfg.engine;
    let backend = MockBackend::new(e).map_err(|err| NodeError::Engine(err.to_string()))?;
    let loop_cfg = EngineLoopConfig::from_config(
        e,
        mode,
        Duration::from_millis(cfg.transfer.lease_ms),
        e.mock.vocab_size as usize,
        Vec::new(),
    );
    let handle = pdnode_engine::engine::spawn(Box::new(backend), loop_cfg, None)
        .map_err(|err| NodeError::Engine(err.to_string()))?;
    tracing::warn!(
        ?mode,
        "engine.backend = \"mock\": a SIMULATED engine (timed steps, generated tokens are not a \
         model's); for router benchmarks and fault tests only"
    );
    Ok(Some(Arc::new(EngineHandleService::new(
        handle,
        crate::served_model(cfg),
        e.max_running_requests,
    ))))
}
