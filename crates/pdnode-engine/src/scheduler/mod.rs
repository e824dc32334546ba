//! The scheduler: continuous batching with chunked prefill over a paged KV cache, for the three
//! engine modes. Plain synchronous state ([`Scheduler`]) driven by the engine loop:
//! `next_step() -> StepPlan`, run the plan on the backend, sample, then `on_step_done(outputs)`.
//!
//! # Sequences
//! A sequence is its token list (prompt, then generated tokens) and `computed`, the number of
//! leading positions whose KV is in the cache. Each step runs `tokens[computed..]` (or a chunk of
//! it) and asks for logits only when the chunk reaches the end. So a prompt, a prefill chunk, a
//! decode step and a recompute after preemption are the same operation; a decode is simply a
//! sequence with one token left to run.
//!
//! # Step policy (decode first)
//! Each step has a budget of `max_batch_tokens` tokens and runs at most `max_running_requests`
//! sequences:
//! 1. every running sequence with one token left (decode), in admission order, one token each;
//!    one that needs a new block and finds none preempts the most recently admitted running
//!    sequence not yet scheduled in this step (LIFO, as vLLM), or itself if it is the last;
//! 2. running sequences in the middle of a chunked prefill, in admission order, one chunk each
//!    of at most the remaining budget;
//! 3. admission while there is budget and a running slot: first requests whose KV arrived by
//!    transfer (they already own their blocks), then the waiting queue in FIFO order (head of
//!    line: a request that does not fit blocks the ones behind it, so big prompts are not
//!    starved). Admission reuses prefix-cache hits (the matched positions are not recomputed;
//!    the last prompt token always is, for its logits) and allocates blocks for the whole rest
//!    of the prompt at once, keeping free at least one block per running sequence that will
//!    cross a block boundary next step.
//!
//! # Preemption by recompute
//! A victim's full computed blocks are published to the prefix cache, its blocks are freed, and
//! it goes back to the front of the waiting queue with its generated tokens kept in its token
//! list, so re-admission recomputes prompt + generated tokens (mostly prefix-cache hits).
//!
//! # Modes
//! - [`Mode::Colocated`]: prefill and decode here.
//! - [`Mode::PrefillOnly`]: after the first token is sampled, the request leaves the batch and its
//!   blocks go under a transfer lease (id [`lease_id`]) until [`Scheduler::release_transfer`] (the
//!   hand-off is done or aborted) or the lease deadline ([`Scheduler::expire`]).
//! - [`Mode::DecodeOnly`]: [`Scheduler::reserve_for_transfer`] reserves blocks under a lease,
//!   the transport fills them, and [`Scheduler::admit_transferred`] hands them to the request.
//!   A reservation that is never admitted expires. Local prompts are still accepted (they are
//!   recomputed after a preemption anyway).
//!
//! Parking ([`Scheduler::park`], a decode moving to another node): a running request between
//! two decode steps leaves the batch and its blocks go under its transfer lease, as a prefill
//! node's do after the first token; the node pushes them, then releases the lease.
//!
//! Abort at any point frees everything the request owns (table, lease, queue slot).

mod state;

pub use state::Scheduler;

use pdnode_core::error::Classify;
use pdnode_core::{BlockId, ErrorKind, FinishReason, RequestId, TransferId};
use pdnode_kvcache::{KvError, KvStats};
use std::time::Duration;

use crate::backend::{ForwardBatch, SeqStep};

/// The engine's role in a PD deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Colocated,
    PrefillOnly,
    DecodeOnly,
}

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub mode: Mode,
    pub num_blocks: u32,
    pub block_size: u32,
    pub max_batch_tokens: usize,
    pub max_running_requests: usize,
    pub prefix_cache: bool,
    /// How long a prefill-side hand-off (or a decode-side reservation) holds its blocks.
    pub lease: Duration,
}

/// The transfer lease that holds a request's blocks during its hand-off.
pub fn lease_id(id: RequestId) -> TransferId {
    TransferId(id.0)
}

/// One sequence's part of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduledSeq {
    pub id: RequestId,
    pub tokens: Vec<u32>,
    pub start_pos: usize,
    pub block_table: Vec<BlockId>,
    pub want_logits: bool,
}

impl ScheduledSeq {
    /// A decode step (one token after cached positions) rather than a (chunk of a) prefill.
    pub fn is_decode(&self) -> bool {
        self.tokens.len() == 1 && self.start_pos > 0
    }
}

/// What to run this step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    pub seqs: Vec<ScheduledSeq>,
    /// Requests preempted while planning (requeued for recompute).
    pub preempted: Vec<RequestId>,
    /// Requests the scheduler ended while planning (they can never fit the KV pool).
    pub finished: Vec<(RequestId, FinishReason)>,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
    /// The batch for [`crate::backend::Backend::forward`]; logits rows come back in the order of
    /// the sequences with `want_logits`.
    pub fn forward_batch(&self) -> ForwardBatch<'_> {
        ForwardBatch {
            seqs: self
                .seqs
                .iter()
                .map(|s| SeqStep {
                    tokens: &s.tokens,
                    start_pos: s.start_pos,
                    block_table: &s.block_table,
                    want_logits: s.want_logits,
                })
                .collect(),
        }
    }
}

/// The engine's result for one scheduled sequence that asked for logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeqOutput {
    pub id: RequestId,
    pub token: u32,
    /// The engine's stop logic ended the request with this token (it is not run).
    pub finished: bool,
}

/// A prefill-only request that finished its prompt: its blocks are under `lease` now.
#[derive(Debug, Clone, PartialEq)]
pub struct Handoff {
    pub id: RequestId,
    pub first_token: u32,
    pub lease: TransferId,
    pub blocks: Vec<BlockId>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SchedulerStats {
    pub waiting: usize,
    pub running: usize,
    /// Transferred requests waiting for a running slot.
    pub transferred: usize,
    pub preemptions_total: u64,
    pub kv: KvStats,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    #[error("request {id} is already known to the scheduler")]
    DuplicateRequest { id: RequestId },
    #[error("request {id} has an empty prompt")]
    EmptyPrompt { id: RequestId },
    #[error("request {id} needs {needed} KV blocks, the pool has {total}")]
    TooLarge {
        id: RequestId,
        needed: usize,
        total: usize,
    },
    #[error("request {id}: the transfer reserved {reserved} blocks, the prompt needs {needed}")]
    ReservationMismatch {
        id: RequestId,
        reserved: usize,
        needed: usize,
    },
    #[error("request {id}: {source}")]
    Kv {
        id: RequestId,
        #[source]
        source: KvError,
    },
    /// Parking for a migration takes a request only between two decode steps.
    #[error("request {id} is not decoding now ({why})")]
    NotDecoding { id: RequestId, why: &'static str },
    /// A reservation would take blocks the head of the waiting queue (a preempted request, or
    /// an older prompt) needs to run: it goes first.
    #[error(
        "request {id} needs {needed} KV blocks that {waiting} (waiting to run) needs first; {available} available"
    )]
    WaitingFirst {
        id: RequestId,
        waiting: RequestId,
        needed: usize,
        available: usize,
    },
}

impl Classify for SchedulerError {
    fn kind(&self) -> ErrorKind {
        match self {
            SchedulerError::DuplicateRequest { .. }
            | SchedulerError::EmptyPrompt { .. }
            | SchedulerError::ReservationMismatch { .. } => ErrorKind::InvalidRequest,
            SchedulerError::TooLarge { .. } => ErrorKind::ContextLengthExceeded,
            SchedulerError::NotDecoding { .. } | SchedulerError::WaitingFirst { .. } => {
                ErrorKind::Unavailable
            }
            SchedulerError::Kv { source, .. } => source.kind(),
        }
    }
}
