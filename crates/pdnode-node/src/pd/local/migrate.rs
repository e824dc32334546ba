//! Live decode migration, the decode node's side (docs/protocol.md, "Live decode migration"):
//! `Migrate` without a target parks a running request (the engine takes it out of the batch
//! between two decode steps, its blocks under its transfer lease; its decode stream here ends)
//! and answers its tokens and sampler; `Migrate` with a target (another decode node's
//! reservation for every computed position) pushes the parked KV there as a prefill node pushes
//! a prompt's, then releases the lease. Both need the request's KV capability. A parked request
//! nobody pushes is freed at its lease deadline (the engine's), or by an `Abort` with its
//! capability. Draining with `node.drain = "migrate"` asks every decode stream's router to move
//! it ([`PdNode::request_migrations`]).

use super::*;
use crate::pd::held::Presented;
use pdnode_nodeapi::{MigrateCall, MigrateOutcome};

/// How long `Migrate` waits for a request to come between two decode steps (one admitted
/// moments ago may still be queued for its first step).
const PARK_WAIT: Duration = Duration::from_secs(2);

/// A request parked here, waiting for its push.
pub(super) struct ParkedSlot {
    capability: Secret,
    blocks: usize,
    parked_at: Instant,
}

impl PdNode {
    pub(super) fn parked(&self) -> std::sync::MutexGuard<'_, HashMap<RequestId, ParkedSlot>> {
        self.parked.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every decode stream here sends its router one `migrate` message (once per stream);
    /// returns how many streams were asked. Streams opened later are asked at once.
    pub fn request_migrations(&self) -> usize {
        self.migrate_asked.send_replace(true);
        self.held.len()
    }

    /// Decode streams here that were asked to move (`request_migrations`) or will be.
    pub(super) fn migration_watch(&self) -> tokio::sync::watch::Receiver<bool> {
        self.migrate_asked.subscribe()
    }

    /// Aborts a parked request presenting `capability`: `Some(found)`, or `None` when `id` is
    /// not parked here.
    pub(super) fn abort_parked(
        &self,
        id: RequestId,
        capability: &[u8],
    ) -> Option<Result<bool, NodeError>> {
        let mut parked = self.parked();
        let slot = parked.get(&id)?;
        if !slot.capability.matches(capability) {
            return Some(Err(nerr(
                ErrorKind::PermissionDenied,
                format!(
                    "Abort of {id} on {}: not the request's KV capability",
                    self.id
                ),
            )));
        }
        parked.remove(&id);
        drop(parked);
        // The engine frees the lease.
        self.engine.abort(id);
        Some(Ok(true))
    }

    /// Forgets parked requests whose lease has passed (the engine freed their blocks then):
    /// no router pushed or aborted them. Returns how many.
    pub(super) fn sweep_parked(&self, now: Instant) -> usize {
        let mut parked = self.parked();
        let before = parked.len();
        parked.retain(|_, p| now.saturating_duration_since(p.parked_at) < self.lease);
        before - parked.len()
    }

    pub(super) async fn do_migrate(&self, req: MigrateCall) -> Result<MigrateOutcome, NodeError> {
        self.expect_role(Role::Decode, "Migrate")?;
        let id = req.request_id;
        match req.target {
            None => self.park(id, &req.capability).await,
            Some(target) => self.push_parked(id, &req.capability, target).await,
        }
    }

    async fn park(&self, id: RequestId, capability: &[u8]) -> Result<MigrateOutcome, NodeError> {
        match self.held.check(id, capability) {
            Presented::Matches => {}
            Presented::Unknown => {
                return Err(nerr(
                    ErrorKind::InvalidRequest,
                    format!("Migrate: {id} is not decoding on {}", self.id),
                ));
            }
            Presented::Wrong => {
                return Err(nerr(
                    ErrorKind::PermissionDenied,
                    format!(
                        "Migrate of {id} on {}: not the request's KV capability",
                        self.id
                    ),
                ));
            }
        }
        let cap = Secret::from_bytes(capability)
            .ok_or_else(|| nerr(ErrorKind::InvalidRequest, "Migrate: not a KV capability"))?;
        let until = Instant::now() + PARK_WAIT;
        let parked = loop {
            match self.engine.park(id).await {
                Ok(p) => break p,
                Err(e) if e.kind() == ErrorKind::Unavailable && Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err(e) => return Err(eerr(&e)),
            }
        };
        self.parked().insert(
            id,
            ParkedSlot {
                capability: cap,
                blocks: parked.blocks.len(),
                parked_at: Instant::now(),
            },
        );
        tracing::debug!(request = %id, tokens = parked.tokens.len(), blocks = parked.blocks.len(), "parked for a migration");
        Ok(MigrateOutcome {
            token_ids: parked.tokens,
            prompt_len: parked.prompt_len as u32,
            generated: parked.generated as u32,
            sampler: Some(SamplerState {
                seed: parked.sampler.seed,
                word_pos: parked.sampler.word_pos,
            }),
            transfer_bytes: 0,
            transfer_us: 0,
        })
    }

    async fn push_parked(
        &self,
        id: RequestId,
        capability: &[u8],
        target: KvTarget,
    ) -> Result<MigrateOutcome, NodeError> {
        target
            .validate()
            .map_err(|e| nerr(ErrorKind::InvalidRequest, e.to_string()))?;
        if target.request != id {
            return Err(nerr(
                ErrorKind::InvalidRequest,
                format!("KV target is for request {}, not {id}", target.request),
            ));
        }
        if target.decode_node == self.id {
            return Err(nerr(
                ErrorKind::InvalidRequest,
                format!("Migrate of {id}: the target is this node"),
            ));
        }
        if let Err(m) = self.layout().check_compatible(&target.layout) {
            return Err(nerr(ErrorKind::InvalidRequest, m.to_string()));
        }
        // As a prefill node's push: a UCX endpoint only to a registered decode node, at the
        // worker its card names. Checked before the parked request is taken, which stays
        // parked (an `Abort` or its lease frees it).
        let peers = self.peers.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let (KvMover::Ucx(_), Some(peers)) = (&self.mover, peers)
            && let Err(e) = peers.admit(&target, PEER_VIEW_WAIT).await
        {
            return Err(nerr(e.kind(), format!("Migrate of {id}: KV target: {e}")));
        }
        let slot = {
            let mut parked = self.parked();
            match parked.get(&id) {
                None => {
                    return Err(nerr(
                        ErrorKind::InvalidRequest,
                        format!("Migrate: {id} is not parked on {}", self.id),
                    ));
                }
                Some(s) if !s.capability.matches(capability) => {
                    return Err(nerr(
                        ErrorKind::PermissionDenied,
                        format!(
                            "Migrate of {id} on {}: not the request's KV capability",
                            self.id
                        ),
                    ));
                }
                Some(_) => parked.remove(&id),
            }
        };
        let Some(slot) = slot else {
            return Err(nerr(ErrorKind::Internal, "parked request vanished"));
        };
        // From here the push owns the lease: released whatever happens, also when this call is
        // dropped midway (the router gave up on it): the entry is out of `parked`, so an `Abort`
        // would find nothing to free. The push's sources are its own staging span (held until
        // its puts are done), so the blocks may go at once.
        let mut lease = EngineAbortOnDrop {
            engine: &self.engine,
            id,
            armed: true,
        };
        let started = Instant::now();
        let pushed = self.push(id, &target, slot.blocks, started).await;
        if let Err(e) = self.engine.release_transfer(id).await {
            tracing::warn!(request = %id, error = %e, "releasing a migrated request's KV lease failed; freed at its deadline");
        }
        lease.armed = false;
        let (bytes, us, _) = pushed?;
        tracing::info!(request = %id, to = %target.decode_node, bytes, transfer_us = us,
            parked_ms = slot.parked_at.elapsed().as_millis() as u64, "decode migrated");
        Ok(MigrateOutcome {
            transfer_bytes: bytes,
            transfer_us: us,
            ..Default::default()
        })
    }
}
