//! In-memory twins for tests: a byte-level [`FakeTokenizer`] (also a [`ChatRender`]) and a
//! scriptable [`FakeNode`] that records every call it gets. Used by this crate's tests and by
//! anyone testing against the router without real nodes.

use crate::error::NodeError;
use crate::membership::Worker;
use crate::node::{
    DecodeCall, DecodeChunk, DecodeStream, KvTarget, NodeClient, NodeStats, PrefillCall,
    PrefillOutcome, ReserveKv,
};
use crate::tokenize::{ChatMessage, ChatRender, Tokenize, TokenizeError};
use futures::future::BoxFuture;
use parking_lot::Mutex;
use pdnode_core::card::{NodeAddresses, NodeCapacity};
use pdnode_core::request::TokenLogprob;
use pdnode_core::{ErrorKind, FinishReason, NodeCard, NodeId, RequestId, Role};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Byte-level tokenizer: token id = byte value. Chat renders `role: content\n` lines and ends
/// with `assistant:`.
#[derive(Debug, Clone, Default)]
pub struct FakeTokenizer;

impl Tokenize for FakeTokenizer {
    fn encode(&self, text: &str, _add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError> {
        let bytes: Result<Vec<u8>, _> = ids.iter().map(|&i| u8::try_from(i)).collect();
        let bytes = bytes.map_err(|_| TokenizeError("token id above 255".into()))?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn vocab_size(&self) -> u32 {
        256
    }
}

impl ChatRender for FakeTokenizer {
    fn render(&self, messages: &[ChatMessage]) -> Result<String, TokenizeError> {
        let mut s = String::new();
        for m in messages {
            s.push_str(&format!("{}: {}\n", m.role, m.content));
        }
        s.push_str("assistant:");
        Ok(s)
    }
}

/// The fake's log-probability of `token` with `k` alternatives: the token itself at -0.25,
/// then `token + 1`, `token + 2`, ... at -1, -2, ...
pub fn fake_logprob(token: u32, k: u32) -> TokenLogprob {
    TokenLogprob {
        token_id: token,
        logprob: -0.25,
        top: std::iter::once((token, -0.25))
            .chain((1..k).map(|i| (token.wrapping_add(i) % 256, -(i as f32))))
            .collect(),
    }
}

/// How a [`FakeNode`] behaves; change it between requests with [`FakeNode::set`].
#[derive(Debug, Clone)]
pub struct FakeBehavior {
    /// The tokens a request generates (first from prefill, the rest from decode); the request
    /// ends with `stop` when they run out before `max_tokens`.
    pub output: Vec<u32>,
    /// Delay before each decoded token.
    pub token_interval: Duration,
    /// Delay of prefill before it answers.
    pub prefill_delay: Duration,
    /// The hand-off time prefill reports (reported, not waited; the KV bytes are 4096 per prompt
    /// token).
    pub transfer_us: u64,
    /// Delay of `ReserveKv` before it answers (a decode node waiting for staging room).
    pub reserve_delay: Duration,
    /// Delay of `ReserveKv`'s answer after the reservation is made (an answer on its way).
    pub reserve_answer_delay: Duration,
    pub fail_reserve: Option<NodeError>,
    pub fail_prefill: Option<NodeError>,
    /// `Stats` (the router's liveness probe) fails with this: a node that stopped answering.
    pub fail_stats: Option<NodeError>,
    /// `Stats` answers only after this long: a hung node.
    pub stats_delay: Duration,
    /// The decode stream breaks with this error after this many chunks.
    pub die_after: Option<(usize, NodeError)>,
    pub stats: NodeStats,
}

impl Default for FakeBehavior {
    fn default() -> Self {
        Self {
            output: b"Hello from the fake node."
                .iter()
                .map(|&b| u32::from(b))
                .collect(),
            token_interval: Duration::ZERO,
            prefill_delay: Duration::ZERO,
            transfer_us: 100,
            reserve_delay: Duration::ZERO,
            reserve_answer_delay: Duration::ZERO,
            fail_reserve: None,
            fail_prefill: None,
            fail_stats: None,
            stats_delay: Duration::ZERO,
            die_after: None,
            stats: NodeStats {
                kv_blocks_total: 100,
                kv_blocks_free: 100,
                max_running_requests: 8,
                ..NodeStats::default()
            },
        }
    }
}

/// A recorded call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FakeCall {
    ReserveKv(RequestId),
    Prefill(RequestId),
    Decode(RequestId),
    /// An abort that stopped the request (or found nothing): it presented the request's KV
    /// capability, or the node held none for it.
    Abort(RequestId),
    /// An abort refused (`PermissionDenied`): not the capability this node holds for it.
    AbortRefused(RequestId),
    Stats,
}

/// KV block size of the fake's block accounting, tokens.
pub const FAKE_BLOCK_TOKENS: usize = 16;

fn blocks_for(tokens: usize) -> u64 {
    tokens.div_ceil(FAKE_BLOCK_TOKENS) as u64
}

/// A scriptable prefill or decode node.
///
/// It keeps KV block accounting per request ([`FakeNode::kv_blocks_held`]): `ReserveKv` holds the
/// prompt's blocks until the decode stream ends or `Abort`; `Prefill` holds them while it
/// computes and frees them when it answers or on `Abort`. A prefill call the caller merely drops
/// keeps its blocks (as a remote node that never heard of the cancel would), so a test can tell
/// whether the router sent the Abort.
pub struct FakeNode {
    id: NodeId,
    behavior: Mutex<FakeBehavior>,
    calls: Mutex<Vec<FakeCall>>,
    /// Per request: cancelled by Abort.
    live: Mutex<HashMap<RequestId, CancellationToken>>,
    /// KV blocks held per request.
    held: Arc<Mutex<HashMap<RequestId, u64>>>,
    /// The KV capability of each request this node reserved or prefills (the target's
    /// secret): an Abort must present it, as a real node's must.
    caps: Mutex<HashMap<RequestId, Vec<u8>>>,
    changed: Notify,
}

impl FakeNode {
    pub fn new(id: &str) -> Arc<Self> {
        Arc::new(Self {
            id: NodeId::new(id),
            behavior: Mutex::new(FakeBehavior::default()),
            calls: Mutex::new(Vec::new()),
            live: Mutex::new(HashMap::new()),
            held: Arc::new(Mutex::new(HashMap::new())),
            caps: Mutex::new(HashMap::new()),
            changed: Notify::new(),
        })
    }

    pub fn set(&self, f: impl FnOnce(&mut FakeBehavior)) {
        f(&mut self.behavior.lock());
    }

    pub fn calls(&self) -> Vec<FakeCall> {
        self.calls.lock().clone()
    }

    /// Requests this node was told to abort.
    pub fn aborts(&self) -> Vec<RequestId> {
        self.calls
            .lock()
            .iter()
            .filter_map(|c| match c {
                FakeCall::Abort(r) => Some(*r),
                _ => None,
            })
            .collect()
    }

    pub fn count(&self, pred: impl Fn(&FakeCall) -> bool) -> usize {
        self.calls.lock().iter().filter(|c| pred(c)).count()
    }

    /// Waits until `pred` holds over the recorded calls, or `timeout` passes; returns whether it
    /// held. On tokio's clock, so it also works in tests with paused time.
    pub async fn wait_for(&self, timeout: Duration, pred: impl Fn(&[FakeCall]) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            if pred(&self.calls.lock()) {
                return true;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            let _ = tokio::time::timeout(left, notified).await;
        }
    }

    /// KV blocks the node's requests hold now (0: every block free).
    pub fn kv_blocks_held(&self) -> u64 {
        self.held.lock().values().sum()
    }

    fn hold(&self, id: RequestId, blocks: u64) {
        *self.held.lock().entry(id).or_default() += blocks;
    }

    fn free(&self, id: RequestId) {
        self.held.lock().remove(&id);
    }

    /// A [`Worker`] for this node with the given role.
    pub fn worker(self: &Arc<Self>, role: Role) -> Worker {
        Worker {
            card: fake_card(self.id.as_str(), role),
            client: self.clone(),
        }
    }

    fn record(&self, c: FakeCall) {
        self.calls.lock().push(c);
        self.changed.notify_waiters();
    }

    fn token(&self, id: RequestId) -> CancellationToken {
        self.live.lock().entry(id).or_default().clone()
    }
}

/// A well-formed KV target of `blocks` blocks for tests (one UCX rank, a 16-byte secret
/// derived from the request id).
pub fn fake_target(request: RequestId, decode_node: &NodeId, blocks: usize) -> KvTarget {
    let mut secret = request.0.to_le_bytes().to_vec();
    secret.resize(pdnode_core::kv_target::SECRET_LEN, 0xA5);
    KvTarget {
        request,
        decode_node: decode_node.clone(),
        decode_grpc_addr: String::new(),
        transport: pdnode_core::TargetTransport::Ucx,
        worker_address: vec![1; 8],
        ranks: vec![pdnode_core::RankTarget {
            rank: 0,
            rkey: vec![2; 8],
            base_addr: 0,
            region_len: 1 << 20,
            worker_address: Vec::new(),
            device_memory: false,
        }],
        blocks: (0..blocks as u32).map(pdnode_core::BlockId).collect(),
        layout: pdnode_core::KvLayout {
            dtype: pdnode_core::DType::F32,
            num_layers: 1,
            block_size: FAKE_BLOCK_TOKENS as u32,
            kv_heads_per_rank: 1,
            head_dim: 1,
            tp_size: 1,
            model_fingerprint: "fake".into(),
            kind: pdnode_core::KvKind::KeyValue,
        },
        secret,
        lease_deadline_ms: 0,
        placement: pdnode_core::Placement::Staging { offset: 0 },
        staging_generation: 0,
        fence_record: false,
        verify: false,
    }
}

/// A card for tests.
pub fn fake_card(id: &str, role: Role) -> NodeCard {
    NodeCard {
        id: NodeId::new(id),
        role,
        cluster: "test".into(),
        model_id: "fake-model".into(),
        model_fingerprint: "fake".into(),
        kv_layout: None,
        tp_size: 1,
        addresses: NodeAddresses::default(),
        capacity: NodeCapacity::default(),
        version: "test".into(),
        started_at_ms: 0,
        // Role `all` cards of tests are colocated engines unless a test says otherwise.
        colocated: role == Role::All,
        sglang: None,
        draining: false,
    }
}

impl NodeClient for FakeNode {
    fn reserve_kv(&self, req: ReserveKv) -> BoxFuture<'_, Result<KvTarget, NodeError>> {
        Box::pin(async move {
            self.record(FakeCall::ReserveKv(req.request_id));
            let b = self.behavior.lock().clone();
            tokio::time::sleep(b.reserve_delay).await;
            if let Some(e) = b.fail_reserve {
                return Err(e);
            }
            self.token(req.request_id);
            self.hold(req.request_id, blocks_for(req.prompt_token_ids.len()));
            let target = fake_target(
                req.request_id,
                &self.id,
                blocks_for(req.prompt_token_ids.len()).max(1) as usize,
            );
            self.caps
                .lock()
                .insert(req.request_id, target.secret.clone());
            tokio::time::sleep(b.reserve_answer_delay).await;
            Ok(target)
        })
    }

    fn prefill(&self, req: PrefillCall) -> BoxFuture<'_, Result<PrefillOutcome, NodeError>> {
        Box::pin(async move {
            self.record(FakeCall::Prefill(req.request_id));
            self.caps
                .lock()
                .entry(req.request_id)
                .or_insert_with(|| req.target.secret.clone());
            let b = self.behavior.lock().clone();
            let cancel = self.token(req.request_id);
            self.hold(req.request_id, blocks_for(req.prompt_token_ids.len()));
            tokio::select! {
                _ = tokio::time::sleep(b.prefill_delay) => {}
                _ = cancel.cancelled() => {
                    return Err(NodeError::new(ErrorKind::Cancelled, "aborted"));
                }
            }
            // Answered (handed off or failed): the blocks are free again.
            self.free(req.request_id);
            if let Some(e) = b.fail_prefill {
                return Err(e);
            }
            let first = b.output.first().copied().unwrap_or(0);
            let finish = if b.output.len() <= 1 {
                Some(FinishReason::Stop)
            } else if req.sampling.max_tokens <= 1 {
                Some(FinishReason::Length)
            } else {
                None
            };
            Ok(PrefillOutcome {
                first_token_id: first,
                first_logprob: req.sampling.logprobs.map(|k| fake_logprob(first, k)),
                finish,
                cached_tokens: 0,
                transfer_bytes: 4096 * req.prompt_token_ids.len() as u64,
                transfer_us: b.transfer_us,
                sampler: None,
            })
        })
    }

    fn decode(&self, req: DecodeCall) -> BoxFuture<'_, Result<DecodeStream, NodeError>> {
        Box::pin(async move {
            self.record(FakeCall::Decode(req.request_id));
            let b = self.behavior.lock().clone();
            let cancel = self.token(req.request_id);
            let max = req.sampling.max_tokens as usize;
            let logprobs = req.sampling.logprobs;
            let rest: Vec<u32> = b.output.iter().skip(1).copied().collect();
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let held = self.held.clone();
            let id = req.request_id;
            tokio::spawn(async move {
                // However the stream ends, the request's blocks are free.
                struct Free(Arc<Mutex<HashMap<RequestId, u64>>>, RequestId);
                impl Drop for Free {
                    fn drop(&mut self) {
                        self.0.lock().remove(&self.1);
                    }
                }
                let _free = Free(held, id);
                let mut sent = 1usize;
                for (n, tok) in rest.iter().enumerate() {
                    if let Some((after, e)) = &b.die_after
                        && n >= *after
                    {
                        let _ = tx.send(Err(e.clone())).await;
                        return;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(b.token_interval) => {}
                        _ = cancel.cancelled() => return,
                    }
                    sent += 1;
                    let finish = if sent >= max {
                        Some(FinishReason::Length)
                    } else if n + 1 == rest.len() {
                        Some(FinishReason::Stop)
                    } else {
                        None
                    };
                    let chunk = DecodeChunk {
                        token_ids: vec![*tok],
                        logprobs: logprobs
                            .map(|k| fake_logprob(*tok, k))
                            .into_iter()
                            .collect(),
                        finish,
                        error: None,
                        migrate: false,
                    };
                    if tx.send(Ok(chunk)).await.is_err() || finish.is_some() {
                        return;
                    }
                }
            });
            let s: DecodeStream = Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx));
            Ok(s)
        })
    }

    fn abort(
        &self,
        id: RequestId,
        capability: Vec<u8>,
        _reason: String,
    ) -> BoxFuture<'_, Result<bool, NodeError>> {
        Box::pin(async move {
            {
                let mut caps = self.caps.lock();
                if caps.get(&id).is_some_and(|c| *c != capability) {
                    drop(caps);
                    self.record(FakeCall::AbortRefused(id));
                    return Err(NodeError::new(
                        ErrorKind::PermissionDenied,
                        format!("abort of {id}: not its KV capability"),
                    ));
                }
                caps.remove(&id);
            }
            let found = self.live.lock().remove(&id);
            if let Some(t) = &found {
                t.cancel();
            }
            self.free(id);
            self.record(FakeCall::Abort(id));
            Ok(found.is_some())
        })
    }

    fn stats(&self) -> BoxFuture<'_, Result<NodeStats, NodeError>> {
        Box::pin(async move {
            self.record(FakeCall::Stats);
            let b = self.behavior.lock().clone();
            tokio::time::sleep(b.stats_delay).await;
            match b.fail_stats {
                Some(e) => Err(e),
                None => Ok(b.stats),
            }
        })
    }
}
