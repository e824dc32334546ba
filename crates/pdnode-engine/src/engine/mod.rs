//! The engine loop: one dedicated OS thread per engine (never the async runtime) that owns the
//! [`Backend`], the [`Scheduler`] and each request's sampler and output assembler, and an
//! [`EngineHandle`] (cloneable, async-friendly) to drive it.
//!
//! # Loop
//! Between steps the loop drains its command channel; when it has nothing to run it waits on the
//! channel for at most [`EngineLoopConfig::idle_wait`] (or until the next transfer lease deadline),
//! so an idle engine sleeps and a lease still expires on time. Each step: plan
//! ([`Scheduler::next_step`]), forward, sample each logits row with the request's
//! [`SequenceSampler`], feed the token to its [`OutputAssembler`] (EOS / stop ids / stop strings /
//! `max_tokens` / context length), send events, then [`Scheduler::on_step_done`].
//!
//! # Detokenization and stop strings
//! The loop takes an optional tokenizer. With one, every `Token` event carries the text delta and
//! stop strings are applied here (the assembler holds back text that may start a stop string);
//! without one (token-id clients, the mock with no tokenizer) deltas are empty and a request with
//! stop strings is refused. Keeping it in the loop means a stop string ends the request in the
//! same step, so no extra tokens are computed or streamed.
//!
//! # Events and their order (per request)
//! - colocated / decode-only: `Token`* then exactly one `Finished` or `Error`. The token that
//!   finishes a request (an EOS, a stop id) is sent as the last `Token`, with no text.
//! - prefill-only: exactly one `PrefillDone` (first token, its logprob and text, the KV blocks
//!   now under the hand-off lease, the sampler state for the decode side; `finish` set when the
//!   first token already ends the request, in which case no blocks are kept) or one `Error`.
//!   The lease lives until [`EngineHandle::release_transfer`] or its deadline.
//!
//! Dropping a [`RequestStream`] aborts the request (the loop notices the closed channel before
//! its next step); [`EngineHandle::abort`] does it explicitly. Either frees every block the
//! request owns, including a hand-off lease.

mod handle;
mod run;

pub use handle::{
    COMMAND_QUEUE, EVENT_QUEUE, EngineHandle, MakeRecords, RequestStream, ScatterCheck, SpanHold,
    StagedReady, StagingAlloc, StagingSeal,
};
pub use run::{spawn, spawn_with_memory, spawn_with_regions};

use crate::backend::{BackendError, KvRegion};
use crate::sampling::SamplerState;
use crate::scheduler::{Mode, SchedulerError, SchedulerStats};
use pdnode_core::config::{Backend as BackendKind, EngineConfig};
use pdnode_core::error::Classify;
use pdnode_core::request::TokenLogprob;
use pdnode_core::{BlockId, ErrorKind, FinishReason, KvLayout, RequestId};
use std::time::Duration;

#[allow(unused_imports)] // doc links
use crate::{
    backend::Backend,
    sampling::{OutputAssembler, SequenceSampler},
    scheduler::Scheduler,
};

/// Settings of one engine loop.
#[derive(Debug, Clone)]
pub struct EngineLoopConfig {
    pub mode: Mode,
    pub max_batch_tokens: usize,
    pub max_running_requests: usize,
    /// Requests waiting beyond this are refused (`Overloaded`).
    pub max_queued_requests: usize,
    /// Longest sequence (prompt + output).
    pub context_length: usize,
    pub prefix_cache: bool,
    /// How long a hand-off lease (prefill side) or a reservation (decode side) holds blocks.
    pub lease: Duration,
    /// Logits row width (the model's vocabulary).
    pub vocab_size: usize,
    /// The model's EOS ids.
    pub eos_token_ids: Vec<u32>,
    /// A cap on generated tokens per request (the mock's `output_len`); `None`: no cap.
    pub max_output_tokens: Option<u32>,
    /// Longest sleep of an idle loop between looks at its channel.
    pub idle_wait: Duration,
    /// Deadline of each [`EngineHandle`] call that waits for a reply.
    pub call_timeout: Duration,
}

impl EngineLoopConfig {
    /// From the node's engine config. `backend = "mock"` caps outputs at `engine.mock.output_len`.
    pub fn from_config(
        cfg: &EngineConfig,
        mode: Mode,
        lease: Duration,
        vocab_size: usize,
        eos_token_ids: Vec<u32>,
    ) -> Self {
        Self {
            mode,
            max_batch_tokens: cfg.max_batch_tokens as usize,
            max_running_requests: cfg.max_running_requests as usize,
            max_queued_requests: cfg.max_queued_requests as usize,
            context_length: cfg.context_length as usize,
            prefix_cache: cfg.prefix_cache,
            lease,
            vocab_size,
            eos_token_ids,
            max_output_tokens: (cfg.backend == BackendKind::Mock).then_some(cfg.mock.output_len),
            idle_wait: Duration::from_millis(20),
            call_timeout: Duration::from_secs(30),
        }
    }
}

/// What the engine tells a request's stream.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Token {
        token: u32,
        logprob: Option<TokenLogprob>,
        /// New output text (empty without a tokenizer, or while held back).
        delta: String,
    },
    /// Prefill-only: the prompt is done; the KV waits in `blocks` under the hand-off lease.
    PrefillDone {
        first_token: u32,
        logprob: Option<TokenLogprob>,
        delta: String,
        /// Set when the first token already finished the request (no blocks are kept then).
        finish: Option<FinishReason>,
        blocks: Vec<BlockId>,
        /// Where the sampler's random stream stands, for [`EngineHandle::admit_transferred`].
        sampler: SamplerState,
        prompt_tokens: usize,
        /// Leading prompt tokens whose KV came from the prefix cache (not computed) when the
        /// request was first admitted (OpenAI's `usage.prompt_tokens_details.cached_tokens`).
        cached_tokens: usize,
    },
    /// Prefill-only: a chunk of the prompt (positions `start_pos..start_pos + tokens`) goes
    /// into the next forward step. The first one ends the request's queue wait. Best effort
    /// (for traces): skipped while the consumer has events unread.
    Prefilling {
        start_pos: usize,
        tokens: usize,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        output_tokens: usize,
    },
    Error {
        error: EngineError,
    },
}

/// A request parked for a migration ([`EngineHandle::park`]): out of the batch, its KV under
/// its transfer lease.
#[derive(Debug, Clone, PartialEq)]
pub struct Parked {
    /// Prompt and output tokens; the last one is sampled, not computed.
    pub tokens: Vec<u32>,
    /// The prompt's length as the request was added (or admitted).
    pub prompt_len: usize,
    /// Output tokens so far (the first, from prefill, included).
    pub generated: usize,
    /// Leading positions the leased blocks hold: `tokens.len() - 1`.
    pub computed: usize,
    pub blocks: Vec<BlockId>,
    /// Where the sampler's random stream stands, for [`EngineHandle::admit_transferred`].
    pub sampler: SamplerState,
}

/// Engine facts callers need without a round trip.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub backend_name: String,
    pub kv_layout: KvLayout,
    pub num_kv_blocks: usize,
    pub mode: Mode,
    pub context_length: usize,
    pub vocab_size: usize,
    pub max_running_requests: usize,
    /// The pool's memory, one region per TP rank, when the backend exposes it
    /// ([`spawn_with_memory`]); empty otherwise. Block `b` of layer `l` starts at
    /// `crate::backend::layer_block_offset(layout, num_kv_blocks, l, b)` in each region. Only
    /// blocks under a request's hand-off lease may be read or written through it, and only
    /// between the reservation (or `PrefillDone`) and the admission (or release).
    pub kv_regions: Vec<KvRegion>,
    /// The backend's KV staging arenas ([`crate::backend::KvStaging`]), one per TP rank, for
    /// [`EngineHandle::gather_kv`] / [`EngineHandle::scatter_kv`]; empty when it has none.
    /// Allocated once for the engine's life: a transport registers them once.
    pub staging_regions: Vec<KvRegion>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineStats {
    pub scheduler: SchedulerStats,
    pub steps_total: u64,
    pub prompt_tokens_total: u64,
    pub output_tokens_total: u64,
    /// The backend's forward pass of each step that ran a prompt chunk (beside decodes or not),
    /// and of each decode-only step.
    pub step_prefill: pdnode_core::StepTimes,
    pub step_decode: pdnode_core::StepTimes,
}

impl EngineStats {
    /// Requests admitted and not finished, plus hand-off leases still holding blocks.
    pub fn in_flight(&self) -> usize {
        let s = &self.scheduler;
        s.waiting + s.running + s.transferred + s.kv.leases
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("request {id}: {reason}")]
    InvalidRequest { id: RequestId, reason: String },
    #[error(
        "request {id}: prompt of {prompt_len} tokens does not fit the context of {context_length}"
    )]
    ContextLength {
        id: RequestId,
        prompt_len: usize,
        context_length: usize,
    },
    #[error("request {id} refused: {queued} requests already queued")]
    Overloaded { id: RequestId, queued: usize },
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    #[error("request {id}: backend failed: {message}")]
    Backend { id: RequestId, message: String },
    #[error("KV copy failed: {message}")]
    KvIo { message: String },
    #[error("request {id}: sampling failed: {message}")]
    Sampling { id: RequestId, message: String },
    #[error("request {id}: the transfer lease expired")]
    LeaseExpired { id: RequestId },
    #[error("request {id} holds no transfer lease")]
    NoLease { id: RequestId },
    #[error("the engine stopped")]
    Stopped,
    #[error("the engine is draining and admits no new requests")]
    Draining,
    #[error("engine misconfigured: {reason}")]
    Config { reason: String },
    #[error("engine call `{op}` timed out after {after:?}")]
    Timeout { op: &'static str, after: Duration },
    /// The engine's command queue holds `capacity` commands already (the loop is behind).
    #[error("the engine is busy: its command queue of {capacity} is full")]
    Busy { capacity: usize },
    /// The request's consumer left `capacity` events unread; the engine cut it off (aborted,
    /// its blocks freed) instead of waiting for it.
    #[error("request {id}: its consumer fell {capacity} events behind; the engine cancelled it")]
    SlowConsumer { id: RequestId, capacity: usize },
}

impl From<BackendError> for EngineError {
    fn from(e: BackendError) -> Self {
        EngineError::KvIo {
            message: e.to_string(),
        }
    }
}

impl Classify for EngineError {
    fn kind(&self) -> ErrorKind {
        match self {
            EngineError::InvalidRequest { .. } => ErrorKind::InvalidRequest,
            EngineError::ContextLength { .. } => ErrorKind::ContextLengthExceeded,
            EngineError::Overloaded { .. } => ErrorKind::Overloaded,
            EngineError::Scheduler(e) => e.kind(),
            EngineError::Backend { .. } | EngineError::KvIo { .. } => ErrorKind::Retryable,
            EngineError::Sampling { .. } => ErrorKind::Internal,
            // No lease: almost always one that expired and was reaped while the request waited
            // (a prefill queued past `transfer.lease_ms`); never the client's doing.
            EngineError::LeaseExpired { .. }
            | EngineError::NoLease { .. }
            | EngineError::Timeout { .. } => ErrorKind::Timeout,
            EngineError::Stopped | EngineError::Draining | EngineError::Busy { .. } => {
                ErrorKind::Unavailable
            }
            EngineError::SlowConsumer { .. } => ErrorKind::Unavailable,
            EngineError::Config { .. } => ErrorKind::Internal,
        }
    }
}
