//! pdnode-nodeapi: the contract between a router and a prefill or decode node.
//!
//! [`NodeClient`] (reserve KV, prefill, decode, abort, stats) and its request and answer types,
//! [`NodeError`], and [`grpc::GrpcNodeClient`], the client over the `pdnode.v1.Node` gRPC API.
//! The router calls it; the node implements it (in process) and serves it (gRPC). A node
//! process needs this crate, not the router's policies and frontends. The KV target is the one
//! `pdnode_core::KvTarget`.
//!
//! Implementations: [`grpc::GrpcNodeClient`], the node runtime's in-process clients
//! (`pdnode-node`), and `pdnode_router::testing::FakeNode` for tests. The router puts a
//! deadline around every call (dropping the future cancels it).
//!
//! The node plane's security lives here too, beside the client it secures: [`tls`] (mutual TLS,
//! node identities, who may call what) and [`certs`] (`pdnode certs init`).

pub mod certs;
pub mod grpc;
pub mod tls;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use pdnode_core::error::{Classify, ErrorKind};
use pdnode_core::request::{SamplerState, TokenLogprob};
use pdnode_core::{FinishReason, NodeId, RequestId, SamplingParams};

pub use pdnode_core::KvTarget;

/// A failure of a call to a prefill or decode node, as the [`NodeClient`] reports it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct NodeError {
    pub kind: ErrorKind,
    pub message: String,
}

impl NodeError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

impl Classify for NodeError {
    fn kind(&self) -> ErrorKind {
        self.kind
    }
}

/// Router -> decode: reserve KV blocks for a prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct ReserveKv {
    pub request_id: RequestId,
    /// The prefill node paired with this reservation (decode may refuse hand-offs from others).
    pub prefill_node: NodeId,
    pub prompt_token_ids: Vec<u32>,
    pub max_tokens: u32,
}

/// Router -> prefill: run the prompt and push its KV to `target`.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillCall {
    pub request_id: RequestId,
    pub prompt_token_ids: Vec<u32>,
    pub sampling: SamplingParams,
    pub target: KvTarget,
}

/// What prefill answers once the KV is handed off.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillOutcome {
    pub first_token_id: u32,
    pub first_logprob: Option<TokenLogprob>,
    /// `Some` when the request already ended at its first token (no decode follows).
    pub finish: Option<FinishReason>,
    /// Prompt tokens served from the prefill node's prefix cache.
    pub cached_tokens: u32,
    /// KV bytes pushed and the hand-off time, as the prefill node measured them.
    pub transfer_bytes: u64,
    pub transfer_us: u64,
    /// The prefill node's sampler after the first token, for [`DecodeCall::sampler`]; `None`
    /// from nodes that do not say (the decode node then reseeds).
    pub sampler: Option<SamplerState>,
}

/// Router -> decode: continue a prefilled request from its first token.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeCall {
    pub request_id: RequestId,
    pub secret: Vec<u8>,
    pub first_token_id: u32,
    pub first_logprob: Option<TokenLogprob>,
    pub sampling: SamplingParams,
    pub prompt_token_ids: Vec<u32>,
    /// Where prefill's sampler stopped ([`PrefillOutcome::sampler`]): decode continues it.
    pub sampler: Option<SamplerState>,
}

/// One message of a decode stream.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DecodeChunk {
    /// New tokens (never the first token, which came from prefill).
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    /// Set on the last message.
    pub finish: Option<FinishReason>,
    /// Set when `finish == Some(Error)`.
    pub error: Option<NodeError>,
    /// The node asks to move this stream elsewhere ([`NodeClient::migrate`]); no tokens.
    pub migrate: bool,
}

/// Router -> decode node: park a running decode (`target: None`), or push a parked one's KV to
/// another decode node's reservation.
#[derive(Debug, Clone, PartialEq)]
pub struct MigrateCall {
    pub request_id: RequestId,
    pub capability: Vec<u8>,
    pub target: Option<KvTarget>,
}

/// What [`NodeClient::migrate`] answers: the parked request (park), or the push's figures.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MigrateOutcome {
    /// Prompt, then output tokens; the last one is sampled, not computed.
    pub token_ids: Vec<u32>,
    pub prompt_len: u32,
    /// Output tokens so far, the first (from prefill) included.
    pub generated: u32,
    pub sampler: Option<SamplerState>,
    pub transfer_bytes: u64,
    pub transfer_us: u64,
}

pub type DecodeStream = BoxStream<'static, Result<DecodeChunk, NodeError>>;

/// A node's current load, for the policies and `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeStats {
    pub running_requests: u32,
    pub queued_requests: u32,
    pub max_running_requests: u32,
    pub kv_blocks_free: u64,
    pub kv_blocks_total: u64,
    pub kv_blocks_reserved: u64,
    /// Who holds the node's KV blocks and staging spans; `None` when the node does not say
    /// (an older node, a node without an engine).
    pub accounting: Option<pdnode_core::Accounting>,
}

/// Calls on one prefill or decode node.
pub trait NodeClient: Send + Sync + 'static {
    /// Decode: reserve KV blocks for the prompt under a lease; answers where prefill writes.
    fn reserve_kv(&self, req: ReserveKv) -> BoxFuture<'_, Result<KvTarget, NodeError>>;
    /// Prefill: compute the prompt, push KV to the target, return the first token.
    fn prefill(&self, req: PrefillCall) -> BoxFuture<'_, Result<PrefillOutcome, NodeError>>;
    /// Decode: continue from the first token; streams the rest.
    fn decode(&self, req: DecodeCall) -> BoxFuture<'_, Result<DecodeStream, NodeError>>;
    /// Stop a request and free what it holds on the node; `Ok(found)`. `capability` is the
    /// request's KV capability (the `secret` of the target its `reserve_kv` answered; empty
    /// before that answer). A node that holds a capability for `id` (a reservation, a running
    /// decode, a prefill with its target) stops the request only when `capability` matches it,
    /// else answers [`ErrorKind::PermissionDenied`] and the request goes on; where none exists
    /// yet (a reservation still being made) none is needed (docs/protocol.md, "Capabilities").
    fn abort(
        &self,
        id: RequestId,
        capability: Vec<u8>,
        reason: String,
    ) -> BoxFuture<'_, Result<bool, NodeError>>;
    /// Current load.
    fn stats(&self) -> BoxFuture<'_, Result<NodeStats, NodeError>>;
    /// Node side, not a call: asks every decode stream's router to move the stream to another
    /// decode node (a `migrate` message on it; draining with `node.drain = "migrate"`).
    /// Returns how many streams were asked; a node that cannot move decodes asks none.
    fn request_migrations(&self) -> usize {
        0
    }
    /// Decode: move a running request off this node (docs/protocol.md, "Live decode
    /// migration"). A node that cannot answers `InvalidRequest`.
    fn migrate(&self, req: MigrateCall) -> BoxFuture<'_, Result<MigrateOutcome, NodeError>> {
        let _ = req;
        Box::pin(async {
            Err(NodeError::new(
                ErrorKind::InvalidRequest,
                "this node does not move decodes",
            ))
        })
    }
}
