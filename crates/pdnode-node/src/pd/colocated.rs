//! [`ColocatedNode`]: one colocated engine (prefill and decode in one continuous batch) behind the
//! router's `NodeClient` seam, so the router's prefill/decode flow serves it unchanged: the router
//! pairs a colocated worker with itself (D == P) and the three calls become
//!
//! - `reserve_kv`: records the request under a lease and a fresh secret; answers a target with no
//!   blocks (`TransportKind::InProcess`, nothing to move).
//! - `prefill`: checks the secret, starts the generation, waits for the first token and keeps the
//!   engine stream for `decode`.
//! - `decode`: checks the secret and answers the rest of that stream.
//!
//! A decode node serves its own prefills the same way (`PdNode`, "prefill here"): its
//! decode-only engine runs local prompts, so it keeps one of these over that engine.
//!
//! A reservation or a kept stream nobody claims within the lease is aborted by [`ColocatedNode::sweep`]
//! (run on every `reserve_kv`); `abort` and dropping the decode stream before its end abort the
//! request in the engine, which frees its KV blocks.

use super::build::{BuildError, BuiltEngine, build_engine};
use super::held::{HeldCaps, Hold, Presented};
use super::local::decode_chunk;
use super::{card, router_model};
use futures::future::BoxFuture;
use pdnode_core::config::Config;
use pdnode_core::error::{Classify, ErrorKind};
use pdnode_core::request::GenerateRequest;
use pdnode_core::{NodeId, Placement, RequestId, Role, TargetTransport};
use pdnode_engine::engine::{EngineEvent, EngineHandle, RequestStream};
use pdnode_engine::scheduler::Mode;
use pdnode_nodeapi::{
    DecodeCall, DecodeStream, KvTarget, NodeClient, NodeError, NodeStats, PrefillCall,
    PrefillOutcome, ReserveKv,
};
use pdnode_router::{RouterDeps, StaticMembership, Worker};
use pdnode_transfer::Secret;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

struct Slot {
    secret: Secret,
    /// The capability held for `abort` while the request lives (moved into the decode stream).
    hold: Hold,
    /// The engine stream once `prefill` started the request.
    stream: Option<RequestStream>,
    expires: Instant,
}

/// A colocated engine as a router sees it: prefill and decode on the same node.
pub struct ColocatedNode {
    id: NodeId,
    engine: EngineHandle,
    lease: Duration,
    slots: Mutex<HashMap<RequestId, Slot>>,
    /// Every live request's capability (the reservation's secret), for `abort`.
    caps: HeldCaps,
}

fn eerr(e: &pdnode_engine::engine::EngineError) -> NodeError {
    NodeError::new(e.kind(), e.to_string())
}

fn invalid(msg: impl Into<String>) -> NodeError {
    NodeError::new(ErrorKind::InvalidRequest, msg)
}

impl ColocatedNode {
    /// `engine` runs in `Mode::Colocated`, or `Mode::DecodeOnly` (a decode node's own prefills).
    pub fn new(id: NodeId, engine: EngineHandle, lease: Duration) -> Arc<Self> {
        Arc::new(Self {
            id,
            engine,
            lease,
            slots: Mutex::new(HashMap::new()),
            caps: HeldCaps::default(),
        })
    }

    pub fn id(&self) -> &NodeId {
        &self.id
    }

    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<RequestId, Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Aborts requests reserved or prefilled but not claimed within the lease. Returns how many.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let expired: Vec<RequestId> = {
            let mut slots = self.slots();
            let ids: Vec<RequestId> = slots
                .iter()
                .filter(|(_, s)| s.expires <= now)
                .map(|(id, _)| *id)
                .collect();
            for id in &ids {
                slots.remove(id);
            }
            ids
        };
        for id in &expired {
            self.engine.abort(*id);
        }
        expired.len()
    }

    /// Requests reserved or prefilled, waiting for their next call.
    pub fn pending(&self) -> usize {
        self.slots().len()
    }

    /// Whether `id` is reserved or prefilled here, waiting for its next call.
    pub(super) fn knows(&self, id: RequestId) -> bool {
        self.slots().contains_key(&id)
    }

    /// Takes the slot of `id` after checking `secret`.
    fn claim(&self, id: RequestId, secret: &[u8], what: &str) -> Result<Slot, NodeError> {
        let mut slots = self.slots();
        match slots.get(&id) {
            None => Err(invalid(format!(
                "{what}: no reservation for {id} on {} (expired or never made)",
                self.id
            ))),
            Some(s) if !s.secret.matches(secret) => Err(invalid(format!(
                "{what}: wrong secret for the reservation of {id}"
            ))),
            Some(_) => slots.remove(&id).ok_or_else(|| invalid("raced")),
        }
    }

    pub(super) async fn do_reserve(&self, req: ReserveKv) -> Result<KvTarget, NodeError> {
        self.sweep();
        if req.prompt_token_ids.is_empty() {
            return Err(invalid("ReserveKv needs the prompt token ids"));
        }
        let id = req.request_id;
        let secret = Secret::random();
        // The colocated engine keeps the KV where prefill wrote it: the target carries only
        // the secret (no rank regions, no blocks).
        let target = KvTarget {
            request: id,
            decode_node: self.id.clone(),
            decode_grpc_addr: String::new(),
            transport: TargetTransport::InProcess,
            worker_address: Vec::new(),
            ranks: Vec::new(),
            blocks: Vec::new(),
            layout: self.engine.info().kv_layout.clone(),
            secret: secret.as_bytes().to_vec(),
            lease_deadline_ms: 0,
            placement: Placement::Staging { offset: 0 },
            staging_generation: 0,
            fence_record: false,
            verify: false,
        };
        let mut slots = self.slots();
        let hold = match self.caps.try_hold(id, secret) {
            Some(h) if !slots.contains_key(&id) => h,
            _ => return Err(invalid(format!("request {id} is already reserved"))),
        };
        slots.insert(
            id,
            Slot {
                secret,
                hold,
                stream: None,
                expires: Instant::now() + self.lease,
            },
        );
        Ok(target)
    }

    pub(super) async fn do_prefill(&self, req: PrefillCall) -> Result<PrefillOutcome, NodeError> {
        let id = req.request_id;
        let mut slot = self.claim(id, &req.target.secret, "Prefill")?;
        if slot.stream.is_some() {
            self.engine.abort(id);
            return Err(invalid(format!("request {id} was prefilled already")));
        }
        let mut stream = self
            .engine
            .add_request(GenerateRequest {
                id,
                prompt_token_ids: req.prompt_token_ids,
                sampling: super::engine_sampling(req.sampling),
            })
            .map_err(|e| eerr(&e))?;
        // On any early return the request is aborted (the router aborts too; both are cheap).
        let abort = |e: NodeError| {
            self.engine.abort(id);
            e
        };
        let (first, logprob) = match stream.next().await {
            Some(EngineEvent::Token { token, logprob, .. }) => (token, logprob),
            Some(EngineEvent::Error { error }) => return Err(abort(eerr(&error))),
            Some(EngineEvent::Finished { reason, .. }) => {
                return Err(abort(NodeError::new(
                    ErrorKind::Internal,
                    format!(
                        "colocated engine finished {id} ({}) before a token",
                        reason.as_str()
                    ),
                )));
            }
            Some(EngineEvent::PrefillDone { .. } | EngineEvent::Prefilling { .. }) => {
                return Err(abort(NodeError::new(
                    ErrorKind::Internal,
                    "colocated engine answered like a prefill-only engine",
                )));
            }
            None => {
                return Err(NodeError::new(
                    ErrorKind::Unavailable,
                    "the colocated engine stopped",
                ));
            }
        };
        slot.stream = Some(stream);
        slot.expires = Instant::now() + self.lease;
        self.slots().insert(id, slot);
        Ok(PrefillOutcome {
            first_token_id: first,
            first_logprob: logprob,
            // The finish (EOS at the first token, say) arrives on the decode stream.
            finish: None,
            cached_tokens: 0,
            transfer_bytes: 0,
            transfer_us: 0,
            // One engine samples the whole request: nothing to hand over.
            sampler: None,
        })
    }

    pub(super) async fn do_decode(&self, req: DecodeCall) -> Result<DecodeStream, NodeError> {
        let id = req.request_id;
        let slot = self.claim(id, &req.secret, "Decode")?;
        let Some(stream) = slot.stream else {
            self.engine.abort(id);
            return Err(invalid(format!(
                "Decode of {id} before its Prefill on {}",
                self.id
            )));
        };
        let guard = AbortOnDrop {
            engine: self.engine.clone(),
            id,
            done: false,
            _hold: slot.hold,
        };
        let s = futures::stream::unfold((stream, guard), |(mut rx, mut guard)| async move {
            if guard.done {
                return None;
            }
            let ev = rx.next().await?;
            let (item, last) =
                decode_chunk(ev, "colocated engine answered like a prefill-only engine");
            guard.done = last;
            Some((item, (rx, guard)))
        });
        Ok(Box::pin(s))
    }
}

/// Aborts the request in the engine when a decode stream is dropped before its end; holds
/// the request's capability for `abort` as long as the stream.
struct AbortOnDrop {
    engine: EngineHandle,
    id: RequestId,
    done: bool,
    _hold: Hold,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.done {
            self.engine.abort(self.id);
        }
    }
}

impl NodeClient for ColocatedNode {
    fn reserve_kv(&self, req: ReserveKv) -> BoxFuture<'_, Result<KvTarget, NodeError>> {
        Box::pin(self.do_reserve(req))
    }

    fn prefill(&self, req: PrefillCall) -> BoxFuture<'_, Result<PrefillOutcome, NodeError>> {
        Box::pin(self.do_prefill(req))
    }

    fn decode(&self, req: DecodeCall) -> BoxFuture<'_, Result<DecodeStream, NodeError>> {
        Box::pin(self.do_decode(req))
    }

    fn abort(
        &self,
        id: RequestId,
        capability: Vec<u8>,
        reason: String,
    ) -> BoxFuture<'_, Result<bool, NodeError>> {
        Box::pin(async move {
            tracing::debug!(request = %id, %reason, node = %self.id, "abort");
            // `reserve_kv` answers at once: every request this node knows has a capability.
            match self.caps.check(id, &capability) {
                Presented::Unknown => Ok(false),
                Presented::Wrong => {
                    tracing::warn!(request = %id, node = %self.id,
                        "abort refused: not the request's KV capability; the request goes on");
                    Err(NodeError::new(
                        ErrorKind::PermissionDenied,
                        format!(
                            "Abort of {id} on {}: not the request's KV capability (the request goes on)",
                            self.id
                        ),
                    ))
                }
                Presented::Matches => {
                    self.slots().remove(&id);
                    self.engine.abort(id);
                    Ok(true)
                }
            }
        })
    }

    fn stats(&self) -> BoxFuture<'_, Result<NodeStats, NodeError>> {
        Box::pin(async move {
            let s = self.engine.stats().await.map_err(|e| eerr(&e))?;
            let sch = s.scheduler;
            Ok(NodeStats {
                running_requests: sch.running as u32,
                queued_requests: (sch.waiting + sch.transferred) as u32,
                max_running_requests: self.engine.info().max_running_requests as u32,
                kv_blocks_free: sch.kv.free as u64,
                kv_blocks_total: sch.kv.total as u64,
                kv_blocks_reserved: sch.kv.leases as u64,
                accounting: Some(super::engine_accounting(&s)),
            })
        })
    }
}

/// role = "all" with `engine.colocated = true`: one colocated engine, its node client and the
/// router's deps (membership = this one worker, role `All`).
pub struct Colocated {
    pub deps: RouterDeps,
    pub node: Arc<ColocatedNode>,
    pub built: BuiltEngine,
}

/// Builds the colocated engine and the router's deps. Blocking (loads the model): call from a
/// blocking context.
pub fn colocated(cfg: &Config, node_id: &NodeId) -> Result<Colocated, BuildError> {
    let built = build_engine(cfg, Mode::Colocated)?;
    let node = ColocatedNode::new(
        node_id.clone(),
        built.handle.clone(),
        Duration::from_millis(cfg.transfer.lease_ms),
    );
    let membership = StaticMembership::new(vec![Worker {
        card: card(cfg, node_id, Role::All, &built, "in-process"),
        client: node.clone(),
    }]);
    let deps = router_model(cfg, built.tokenizer.clone(), built.context_length)?
        .into_deps(cfg, Arc::new(membership))?;
    Ok(Colocated { deps, node, built })
}
