//! The prefill node's KV push: overlapped with the prompt's forward pass through the staging
//! arena (`super::super::overlap`), or after prefill (arena or host staging).

use super::*;
use crate::pd::fence::SourceHold;
use crate::pd::handoff::PushWait;

impl PdNode {
    /// When the prefill node stops issuing puts for a hand-off that started at `started`: its
    /// start plus one lease (at least a second from now), and never past the lease deadline the
    /// decode node put in the target (after it, the decode node may give the span away; puts
    /// still in flight then are fenced there).
    pub(super) fn push_deadline(&self, started: Instant, target: &KvTarget) -> Instant {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        crate::pd::handoff::push_deadline(
            started,
            self.lease,
            Instant::now(),
            now_ms,
            target.lease_deadline_ms,
        )
    }

    /// How a push that started at `started` waits on its puts: until the push deadline, and
    /// no longer than a stall allowance past the time its bytes need.
    pub(super) fn push_wait(&self, started: Instant, target: &KvTarget) -> PushWait {
        PushWait {
            deadline: self.push_deadline(started, target),
            stall: Duration::from_millis(self.stall_ms.load(Ordering::Relaxed)),
            min_bytes_per_s: self.stall_rate.load(Ordering::Relaxed),
        }
    }

    /// A failed hand-off as the node answers it. A stalled one also stops pushes to its decode
    /// node for [`STALLED_PEER_COOL_OFF`]: the link or the peer is likely still stalled, and
    /// every request sent there meanwhile would wait `transfer.stall_ms` before its retry.
    pub(super) fn handoff_failed(
        &self,
        id: RequestId,
        target: &KvTarget,
        e: HandoffError,
    ) -> NodeError {
        if matches!(e, HandoffError::Stalled { .. }) {
            let until = Instant::now() + STALLED_PEER_COOL_OFF;
            tracing::warn!(request = %id, decode = %target.decode_node, error = %e,
                "KV push stalled: no pushes to this decode node for {} s, then one probe", STALLED_PEER_COOL_OFF.as_secs());
            self.stalled_peers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(
                    target.decode_node.clone(),
                    PeerStall {
                        until,
                        probing: false,
                    },
                );
        }
        nerr(e.kind(), format!("KV hand-off of {id}: {e}"))
    }

    /// Whether a push to `target`'s decode node may go: `Retryable` (the router retries on
    /// another prefill node at once) while a push there stalled less than
    /// [`STALLED_PEER_COOL_OFF`] ago, and after that while one probe push is in flight. The
    /// probe holds the returned guard; [`PdNode::peer_ok`] ends the stall.
    pub(super) fn check_peer(
        &self,
        id: RequestId,
        target: &KvTarget,
    ) -> Result<Option<Probe<'_>>, NodeError> {
        let mut peers = self.stalled_peers.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let node = &target.decode_node;
        match peers.get_mut(node) {
            None => Ok(None),
            Some(p) if p.until > now || p.probing => Err(nerr(
                ErrorKind::Retryable,
                format!(
                    "KV hand-off of {id}: a push to decode node {node} stalled; none goes there for {} ms more{}",
                    p.until.saturating_duration_since(now).as_millis(),
                    if p.probing {
                        ", and one probe push is in flight"
                    } else {
                        ""
                    }
                ),
            )),
            Some(p) => {
                p.probing = true;
                Ok(Some(Probe {
                    node: self,
                    peer: node.clone(),
                }))
            }
        }
    }

    /// A push to `peer` completed: pushes there go on as before.
    pub(super) fn peer_ok(&self, peer: &NodeId) {
        let mut peers = self.stalled_peers.lock().unwrap_or_else(|p| p.into_inner());
        if peers.remove(peer).is_some() {
            tracing::info!(decode = %peer, "KV pushes to this decode node go through again");
        }
    }

    /// How long a push's source is kept for puts still in flight after the push ended.
    pub(super) fn hold_until(&self, deadline: Instant) -> Instant {
        deadline + self.lease
    }

    /// The overlapped push (`super::overlap`) when this node and the target allow it: a UCX
    /// mover, an arena of the engine's rank count facing the same number of rank regions (of
    /// device memory when the arena is), and room in it. `Ok(None)`: push after prefill.
    pub(super) fn start_overlap(
        &self,
        target: &KvTarget,
    ) -> Result<Option<OverlapPush>, HandoffError> {
        let ranks = self.tp_ranks();
        let (KvMover::Ucx(t), Some(arena)) = (&self.mover, self.arena.as_ref()) else {
            return Ok(None);
        };
        if arena.ranks() != ranks
            || target.ranks.len() != ranks
            || (arena.is_device() && !target.ranks.iter().all(|r| r.device_memory))
        {
            return Ok(None);
        }
        let deadline = self.push_deadline(Instant::now(), target);
        OverlapPush::start(
            t,
            arena,
            target,
            self.layout(),
            target.blocks.len(),
            (deadline, self.hold_until(deadline)),
            &self.fence,
        )
    }

    /// After `PrefillDone`: the engine's last counts, the rest of the puts and the flush.
    /// Returns what [`PdNode::push`] does, and how many blocks went out before the last
    /// chunk's step (the part hidden behind the forward pass). When the engine found no room
    /// in the arena all through the prefill, this is [`PdNode::push`] (which waits for room).
    pub(super) async fn finish_overlap(
        &self,
        id: RequestId,
        target: &KvTarget,
        mut o: OverlapPush,
        ready: Option<tokio::sync::mpsc::Receiver<StagedReady>>,
        ours: usize,
        started: Instant,
    ) -> (Result<(u64, u64, bool), NodeError>, usize) {
        let t0 = Instant::now();
        let deadline = self.push_deadline(started, target);
        let fail = |e: HandoffError| self.handoff_failed(id, target, e);
        if ours != o.blocks() {
            let m = format!(
                "decode reserved {} blocks for {id}, prefill holds {ours}",
                o.blocks()
            );
            return (Err(nerr(ErrorKind::Internal, m)), 0);
        }
        if let Some(mut r) = ready {
            // The loop drops the sender when the request leaves it (it just did).
            while let Ok(Some(u)) = tokio::time::timeout_at(deadline.into(), r.recv()).await {
                if let Err(m) = o.on_ready(u, deadline) {
                    return (Err(fail(m)), 0);
                }
            }
        }
        if !o.has_slice() {
            o.hand_over();
            drop(o);
            return (self.push(id, target, ours, started).await, 0);
        }
        let early = o.sent_early();
        let (puts_done, puts) = o.puts_done();
        tracing::debug!(
            request = %id,
            puts_done,
            puts,
            layer_puts = o.layer_puts,
            drained_us = t0.elapsed().as_micros() as u64,
            "KV hand-off: puts finished when prefill ended"
        );
        self.early_blocks.fetch_add(early as u64, Ordering::Relaxed);
        self.layer_puts
            .fetch_add(o.layer_puts as u64, Ordering::Relaxed);
        let r = o
            .finish(&self.engine, id, target, self.push_wait(started, target))
            .await
            .map(|bytes| {
                self.via_arena.fetch_add(1, Ordering::Relaxed);
                (bytes, t0.elapsed().as_micros() as u64, true)
            })
            .map_err(fail);
        (r, early)
    }

    pub(super) async fn push(
        &self,
        id: RequestId,
        target: &KvTarget,
        ours: usize,
        started: Instant,
    ) -> Result<(u64, u64, bool), NodeError> {
        if target.blocks.len() != ours {
            return Err(nerr(
                ErrorKind::Internal,
                format!(
                    "decode reserved {} blocks for {id}, prefill holds {ours}",
                    target.blocks.len()
                ),
            ));
        }
        let layout = self.layout();
        let layers = layout.num_layers;
        let per_rank = layers as usize * ours * layout.block_layer_bytes();
        let ranks = self.tp_ranks();
        // The decode node's ranks, each filled from one of ours (`KvTarget::source_ranks`: its
        // own, or a latent's whole copy between TP degrees).
        let sent = per_rank.saturating_mul(target.layout.tp_size as usize);
        let t0 = Instant::now();
        let deadline = self.push_deadline(started, target);
        let failed = |e: HandoffError| self.handoff_failed(id, target, e);
        // Room for the fence record behind each rank's bytes when the decode node asks for it.
        let span = per_rank + if target.fence_record { RECORD_LEN } else { 0 };
        if let KvMover::Ucx(t) = &self.mover
            && let Some(arena) = self.arena.as_ref().filter(|a| {
                a.ranks() == ranks
                    && target.source_ranks(ranks).is_ok()
                    && (!a.is_device() || target.ranks.iter().all(|r| r.device_memory))
            })
            && span <= arena.len()
            && let Some(slice) = arena.reserve_wait(span, self.room_deadline(deadline)).await
        {
            let offset = slice.offset();
            // The span stays allocated until every put reading it is done and the engine ran
            // the gather into it, whatever happens (this call dropped mid-gather included).
            let mut hold = SourceHold::of_span(
                Arc::new(slice),
                self.hold_until(deadline),
                self.fence.clone(),
            );
            let span = hold
                .span()
                .ok_or_else(|| nerr(ErrorKind::Internal, "no arena span"))?;
            self.engine
                .gather_kv(id, 0..layers, offset, span)
                .await
                .map_err(|e| eerr(&e))?;
            let sources: Vec<_> = (0..ranks)
                .filter_map(|r| arena.registration(r))
                .map(|reg| (reg, offset as u64))
                .collect();
            put_ranks(
                t,
                id,
                target,
                &sources,
                per_rank as u64,
                self.push_wait(started, target),
                &mut hold,
                Some(&self.engine),
            )
            .await
            .map_err(failed)?;
            drop(hold);
            self.via_arena.fetch_add(1, Ordering::Relaxed);
            return Ok((sent as u64, t0.elapsed().as_micros() as u64, true));
        }
        if matches!(self.mover, KvMover::Ucx(_)) {
            self.note_fallback("prefill", sent);
        }
        let data = self
            .engine
            .read_kv(id, 0..layers)
            .await
            .map_err(|e| eerr(&e))?;
        let bytes = sent as u64;
        self.mover
            .push(
                id,
                target,
                layers,
                ranks,
                data,
                self.push_wait(started, target),
                |keep| SourceHold::new(keep, self.hold_until(deadline), self.fence.clone()),
            )
            .await
            .map_err(failed)?;
        Ok((bytes, t0.elapsed().as_micros() as u64, false))
    }
}

/// A decode node a push to stalled: no push goes there before `until`, then one probe at a time.
#[derive(Debug, Clone, Copy)]
pub(super) struct PeerStall {
    pub(super) until: Instant,
    pub(super) probing: bool,
}

/// The one probe push to a stalled decode node; dropped without [`PdNode::peer_ok`] (failed),
/// it lets the next request probe.
pub(super) struct Probe<'a> {
    node: &'a PdNode,
    peer: NodeId,
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        let mut peers = self
            .node
            .stalled_peers
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(p) = peers.get_mut(&self.peer) {
            p.probing = false;
        }
    }
}
