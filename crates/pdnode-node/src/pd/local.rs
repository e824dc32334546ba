//! [`PdNode`]: one prefill or decode engine behind the router's `NodeClient` seam. The all-in-one
//! node hands these to its router directly; prefill and decode processes serve them over the
//! `pdnode.v1.Node` gRPC API (`super::wire`).
//!
//! Decode side: `reserve_kv` reserves blocks under the engine's transfer lease, mints a secret and
//! (UCX) a registered receive staging region, and answers the KV target. `decode` checks the
//! secret, scatters the staged bytes into the reserved blocks, admits the request and streams.
//! Prefill side: `prefill` runs the prompt (prefill-only engine), reads the request's KV out of
//! its hand-off lease, pushes it to the target, releases the lease and answers the first token.
//! Every failure after a reservation or a lease releases it; a reservation nobody claims is freed
//! by the engine at its lease deadline, and its staging here by [`PdNode::sweep`].

use super::kv::{KvMover, copy_out};
use futures::future::BoxFuture;
use pdnode_core::error::{Classify, ErrorKind};
use pdnode_core::request::GenerateRequest;
use pdnode_core::{KvLayout, NodeId, RequestId, Role};
use pdnode_engine::engine::{EngineEvent, EngineHandle};
use pdnode_proto::v1;
use pdnode_router::{
    DecodeCall, DecodeChunk, DecodeStream, KvTarget, NodeClient, NodeError, NodeStats, PrefillCall,
    PrefillOutcome, ReserveKv,
};
use pdnode_transfer::{Registration, Secret};
use prost::Message;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

struct DecodeSlot {
    secret: Secret,
    blocks: usize,
    staging: Option<Registration>,
    expires: Instant,
}

/// A prefill or decode engine as a router sees it.
pub struct PdNode {
    id: NodeId,
    role: Role,
    engine: EngineHandle,
    mover: KvMover,
    lease: Duration,
    slots: Mutex<HashMap<RequestId, DecodeSlot>>,
}

fn nerr(kind: ErrorKind, msg: impl Into<String>) -> NodeError {
    NodeError::new(kind, msg)
}

fn eerr(e: &pdnode_engine::engine::EngineError) -> NodeError {
    NodeError::new(e.kind(), e.to_string())
}

impl PdNode {
    pub fn new(
        id: NodeId,
        role: Role,
        engine: EngineHandle,
        mover: KvMover,
        lease: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            id,
            role,
            engine,
            mover,
            lease,
            slots: Mutex::new(HashMap::new()),
        })
    }

    pub fn id(&self) -> &NodeId {
        &self.id
    }

    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    fn layout(&self) -> &KvLayout {
        &self.engine.info().kv_layout
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<RequestId, DecodeSlot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops reservations whose lease has passed, after a grace of one more lease: the engine
    /// freed their blocks at the deadline already, but a prefill node may still be putting into
    /// the receive staging until its own push deadline (its start + one lease), so the staging
    /// region stays registered until then. Returns how many were dropped.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let grace = self.lease;
        let mut slots = self.slots();
        let before = slots.len();
        slots.retain(|_, s| s.expires + grace > now);
        before - slots.len()
    }

    /// Reservations waiting for their `decode` call.
    pub fn pending_reservations(&self) -> usize {
        self.slots().len()
    }

    fn expect_role(&self, want: Role, what: &str) -> Result<(), NodeError> {
        if self.role == want || self.role == Role::All {
            Ok(())
        } else {
            Err(nerr(
                ErrorKind::InvalidRequest,
                format!(
                    "{what} goes to a {want} node; {} is a {} node",
                    self.id, self.role
                ),
            ))
        }
    }

    async fn do_reserve(&self, req: ReserveKv) -> Result<KvTarget, NodeError> {
        self.expect_role(Role::Decode, "ReserveKv")?;
        self.sweep();
        let id = req.request_id;
        let prompt_len = req.prompt_token_ids.len();
        let blocks = self
            .engine
            .reserve_for_transfer(id, prompt_len)
            .await
            .map_err(|e| eerr(&e))?;
        let layout = self.layout().clone();
        let bytes = layout.num_layers as usize * blocks.len() * layout.block_layer_bytes();
        let staging = match self.mover.receive_staging(bytes) {
            Ok(s) => s,
            Err(e) => {
                let _ = self.engine.release_transfer(id).await;
                return Err(nerr(ErrorKind::Retryable, e));
            }
        };
        let secret = Secret::random();
        let deadline_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
            + self.lease.as_millis() as u64;
        let mut target = v1::KvTarget {
            request_id: id.0,
            decode_node_id: self.id.to_string(),
            transport: self.mover.transport_kind() as i32,
            block_ids: blocks.iter().map(|b| b.0).collect(),
            layout: Some((&layout).into()),
            secret: secret.as_bytes().to_vec(),
            lease_deadline_ms: deadline_ms,
            placement: v1::KvPlacement::Staging as i32,
            staging_offset: 0,
            ..Default::default()
        };
        if let (Some(reg), KvMover::Ucx(t)) = (&staging, &self.mover) {
            use pdnode_transfer::KvTransport;
            let d = reg.descriptor();
            target.ucx_worker_address = t.local_address();
            target.ranks = vec![v1::RankTarget {
                rank: 0,
                rkey: d.rkey.clone(),
                remote_base_addr: d.base_addr,
                region_len: d.len,
                ucx_worker_address: Vec::new(),
            }];
        }
        self.slots().insert(
            id,
            DecodeSlot {
                secret,
                blocks: blocks.len(),
                staging,
                expires: Instant::now() + self.lease,
            },
        );
        Ok(KvTarget {
            decode_node: self.id.clone(),
            secret: target.secret.clone(),
            encoded: target.encode_to_vec().into(),
        })
    }

    async fn do_prefill(&self, req: PrefillCall) -> Result<PrefillOutcome, NodeError> {
        self.expect_role(Role::Prefill, "Prefill")?;
        let id = req.request_id;
        let target = v1::KvTarget::decode(req.target.encoded.clone()).map_err(|e| {
            nerr(
                ErrorKind::InvalidRequest,
                format!("KV target does not decode: {e}"),
            )
        })?;
        if target.request_id != id.0 {
            return Err(nerr(
                ErrorKind::InvalidRequest,
                format!("KV target is for request {:x}, not {id}", target.request_id),
            ));
        }
        let theirs: KvLayout = target
            .layout
            .as_ref()
            .ok_or_else(|| nerr(ErrorKind::InvalidRequest, "KV target has no layout"))
            .and_then(|l| {
                KvLayout::try_from(l).map_err(|e| nerr(ErrorKind::InvalidRequest, e.to_string()))
            })?;
        if let Err(m) = self.layout().check_compatible(&theirs) {
            return Err(nerr(ErrorKind::InvalidRequest, m.to_string()));
        }
        let started = Instant::now();
        let mut stream = self
            .engine
            .add_request(GenerateRequest {
                id,
                prompt_token_ids: req.prompt_token_ids.clone(),
                sampling: req.sampling.clone(),
            })
            .map_err(|e| eerr(&e))?;
        let (first, logprob, finish, blocks) = loop {
            match stream.next().await {
                Some(EngineEvent::PrefillDone {
                    first_token,
                    logprob,
                    finish,
                    blocks,
                    ..
                }) => break (first_token, logprob, finish, blocks),
                Some(EngineEvent::Error { error }) => return Err(eerr(&error)),
                Some(EngineEvent::Finished { reason, .. }) => {
                    return Err(nerr(
                        ErrorKind::Internal,
                        format!(
                            "prefill engine finished {id} ({}) without a hand-off",
                            reason.as_str()
                        ),
                    ));
                }
                Some(EngineEvent::Token { .. }) => continue,
                None => return Err(nerr(ErrorKind::Unavailable, "the prefill engine stopped")),
            }
        };
        if let Some(f) = finish {
            return Ok(PrefillOutcome {
                first_token_id: first,
                first_logprob: logprob,
                finish: Some(f),
                cached_tokens: 0,
                transfer_bytes: 0,
                transfer_us: 0,
            });
        }
        let result = self.push(id, &target, blocks.len(), started).await;
        let released = self.engine.release_transfer(id).await;
        let (bytes, us) = result?;
        released.map_err(|e| eerr(&e))?;
        Ok(PrefillOutcome {
            first_token_id: first,
            first_logprob: logprob,
            finish: None,
            cached_tokens: 0,
            transfer_bytes: bytes,
            transfer_us: us,
        })
    }

    async fn push(
        &self,
        id: RequestId,
        target: &v1::KvTarget,
        ours: usize,
        started: Instant,
    ) -> Result<(u64, u64), NodeError> {
        if target.block_ids.len() != ours {
            return Err(nerr(
                ErrorKind::Internal,
                format!(
                    "decode reserved {} blocks for {id}, prefill holds {ours}",
                    target.block_ids.len()
                ),
            ));
        }
        let layers = self.layout().num_layers;
        let data = self
            .engine
            .read_kv(id, 0..layers)
            .await
            .map_err(|e| eerr(&e))?;
        let bytes = data.len() as u64;
        let t0 = Instant::now();
        let deadline = (started + self.lease).max(Instant::now() + Duration::from_secs(1));
        self.mover
            .push(id, target, layers, data, deadline)
            .await
            .map_err(|m| nerr(ErrorKind::Retryable, format!("KV hand-off of {id}: {m}")))?;
        Ok((bytes, t0.elapsed().as_micros() as u64))
    }

    async fn do_decode(&self, req: DecodeCall) -> Result<DecodeStream, NodeError> {
        self.expect_role(Role::Decode, "Decode")?;
        let id = req.request_id;
        let slot = {
            let mut slots = self.slots();
            match slots.get(&id) {
                None => {
                    return Err(nerr(
                        ErrorKind::InvalidRequest,
                        format!(
                            "no KV reservation for {id} on {} (expired or never made)",
                            self.id
                        ),
                    ));
                }
                Some(s) if !s.secret.matches(&req.secret) => {
                    return Err(nerr(
                        ErrorKind::InvalidRequest,
                        format!("wrong secret for the KV reservation of {id}"),
                    ));
                }
                Some(_) => slots.remove(&id).expect("present"),
            }
        };
        if let Some(reg) = &slot.staging {
            let layout = self.layout();
            let len = layout.num_layers as usize * slot.blocks * layout.block_layer_bytes();
            let scattered = match copy_out(reg, len) {
                Ok(data) => self
                    .engine
                    .write_kv(id, 0..layout.num_layers, data)
                    .await
                    .map_err(|e| eerr(&e)),
                Err(m) => Err(nerr(ErrorKind::Internal, m)),
            };
            if let Err(e) = scattered {
                let _ = self.engine.release_transfer(id).await;
                return Err(e);
            }
        }
        drop(slot);
        let prompt = req.prompt_token_ids.clone();
        if prompt.is_empty() {
            self.engine.abort(id);
            return Err(nerr(
                ErrorKind::InvalidRequest,
                "Decode needs the prompt token ids",
            ));
        }
        let stream = self
            .engine
            .admit_transferred(
                GenerateRequest {
                    id,
                    prompt_token_ids: prompt,
                    sampling: req.sampling.clone(),
                },
                req.first_token_id,
                None,
            )
            .map_err(|e| eerr(&e))?;
        let rx = stream.into_receiver();
        let s = futures::stream::unfold((rx, false), |(mut rx, done)| async move {
            if done {
                return None;
            }
            let ev = rx.recv().await?;
            let (item, last) = decode_chunk(ev, "decode engine answered like a prefill engine");
            Some((item, (rx, last)))
        });
        Ok(Box::pin(s))
    }
}

impl NodeClient for PdNode {
    fn reserve_kv(&self, req: ReserveKv) -> BoxFuture<'_, Result<KvTarget, NodeError>> {
        Box::pin(self.do_reserve(req))
    }

    fn prefill(&self, req: PrefillCall) -> BoxFuture<'_, Result<PrefillOutcome, NodeError>> {
        Box::pin(self.do_prefill(req))
    }

    fn decode(&self, req: DecodeCall) -> BoxFuture<'_, Result<DecodeStream, NodeError>> {
        Box::pin(self.do_decode(req))
    }

    fn abort(&self, id: RequestId, reason: String) -> BoxFuture<'_, Result<bool, NodeError>> {
        Box::pin(async move {
            tracing::debug!(request = %id, %reason, node = %self.id, "abort");
            // The engine frees whatever the request holds (queued, running, lease); a
            // reservation's staging goes with its slot.
            let had_slot = self.slots().remove(&id).is_some();
            self.engine.abort(id);
            Ok(had_slot || self.role != Role::Decode)
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
            })
        })
    }
}

/// One engine event of a decode stream as a [`DecodeChunk`], and whether it is the last one.
/// `PrefillDone` never belongs in a decode stream: it becomes an internal error saying `unexpected`.
pub(super) fn decode_chunk(
    ev: EngineEvent,
    unexpected: &'static str,
) -> (Result<DecodeChunk, NodeError>, bool) {
    match ev {
        EngineEvent::Token { token, logprob, .. } => (
            Ok(DecodeChunk {
                token_ids: vec![token],
                logprobs: logprob.into_iter().collect(),
                finish: None,
                error: None,
            }),
            false,
        ),
        EngineEvent::Finished { reason, .. } => (
            Ok(DecodeChunk {
                finish: Some(reason),
                ..Default::default()
            }),
            true,
        ),
        EngineEvent::Error { error } => (Err(eerr(&error)), true),
        EngineEvent::PrefillDone { .. } => (Err(nerr(ErrorKind::Internal, unexpected)), false),
    }
}
