//! The Backend trait: what the scheduler needs from a compute device, and nothing more.
//!
//! A backend owns the model weights and the paged KV pool of one node (one GPU group). The
//! scheduler hands it a [`ForwardBatch`] (for each sequence: the new tokens, their first position
//! and the block table covering every position up to the last new one) and gets back one logits row
//! per sequence that asked for it. Sampling is defined on the host (`crate::sampling`); the engine
//! steps through [`Backend::forward_select`], which returns only the arg-max of the rows of plain
//! greedy sequences ([`LogitsWant::Argmax`], computed on the device by the CUDA backends), only
//! the sampled token of rows a device samples ([`LogitsWant::Sample`], where
//! [`Backend::samples_on_device`]), and lands the other rows in a [`StepLogits`] reused from step
//! to step. KV blocks are copied in and out for the
//! hand-off through [`Backend::read_kv`] / [`Backend::write_kv`]; zero-copy access to the pool
//! memory (UCX registration) is the optional [`KvMemory`] capability, and a per-rank staging
//! arena that stays registered (gather/scatter device to device) the optional [`KvStaging`] one.
//!
//! # KV pool layout (every backend, every TP rank)
//! One rank's pool is `[num_layers][num_blocks][2][block_size][kv_heads_per_rank][head_dim]`,
//! row-major, in the layout's dtype. So one *layer-block* (K then V of one layer of one block) is
//! contiguous, `KvLayout::block_layer_bytes()` long, at byte offset
//! `(layer * num_blocks + block) * block_layer_bytes` ([`layer_block_offset`]). K of position `p`
//! of a sequence is in block `table[p / block_size]`, slot `p % block_size`.

pub mod cpu;

use crate::sampling::RowDraw;
use pdnode_core::{BlockId, KvLayout};
use std::ops::Range;

/// One sequence's part of a forward step.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    /// New tokens to run (a whole prompt, a prefill chunk, or one decode token).
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions `0..start_pos` are already in the KV cache.
    pub start_pos: usize,
    /// Blocks covering positions `0..start_pos + tokens.len()`, in order.
    pub block_table: &'a [BlockId],
    /// Whether the logits at the last new position are needed (false for non-final prefill chunks).
    pub want_logits: bool,
}

/// A batch of sequences run in one forward step.
#[derive(Debug, Clone, Default)]
pub struct ForwardBatch<'a> {
    pub seqs: Vec<SeqStep<'a>>,
}

impl ForwardBatch<'_> {
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// Sequences with `want_logits`: the logits rows the step returns.
    pub fn logits_rows(&self) -> usize {
        self.seqs.iter().filter(|s| s.want_logits).count()
    }
}

/// Logits rows, one per sequence with `want_logits`, in batch order: `rows x vocab`, f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    pub vocab: usize,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn rows(&self) -> usize {
        self.data.len().checked_div(self.vocab).unwrap_or(0)
    }
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// What the engine needs from the logits row of one sequence with `want_logits`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LogitsWant {
    /// The whole row (sampling, logprobs, penalties).
    Full,
    /// Only the id of its largest value, NaN and -inf skipped, the lowest id on ties: exactly
    /// [`crate::sampling::argmax`] of the row (a CUDA backend computes it on the device and
    /// copies one id instead of the row).
    Argmax,
    /// Only the token [`crate::sampling::sample_row`] picks from the row with these parameters
    /// and uniform (temperature > 0, top-k, top-p, min-p). A backend with
    /// [`Backend::samples_on_device`] computes it on the device and copies one id; every other
    /// backend computes it on the host ([`StepLogits::fill_from`]).
    Sample(RowDraw),
}

/// One sequence's result in [`StepLogits::rows`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowOut {
    /// Row `i` of the full rows ([`StepLogits::full_row`]).
    Full(usize),
    /// The arg-max id; `None` when the row holds only NaN and -inf.
    Argmax(Option<u32>),
    /// The sampled id of a [`LogitsWant::Sample`] row; `None` when the row has no finite value
    /// (or nothing with weight among its top-k).
    Sampled(Option<u32>),
}

impl RowOut {
    /// Whether this is the kind of result `want` asks for.
    pub fn answers(&self, want: &LogitsWant) -> bool {
        matches!(
            (want, self),
            (LogitsWant::Full, RowOut::Full(_))
                | (LogitsWant::Argmax, RowOut::Argmax(_))
                | (LogitsWant::Sample(_), RowOut::Sampled(_))
        )
    }
}

/// Host memory a backend lends to a [`StepLogits`] for its full rows (a CUDA backend: the
/// page-locked buffer the device copies into, so the rows are copied once). The `StepLogits`
/// owns it between steps (nothing else points to it); the backend that made it takes it back at
/// its next step ([`StepLogits::begin_store`], downcasting through `into_any`).
pub trait RowStore: Send {
    fn as_slice(&self) -> &[f32];
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
}

/// The result of [`Backend::forward_select`]: for each sequence with `want_logits`, in batch
/// order, its full row or its arg-max. Reused across steps (the engine hands the previous one
/// back): the full rows land in a buffer kept from step to step (a `Vec` whose capacity is kept,
/// or a backend's [`RowStore`]), so a step does not allocate and fault in tens of MB of memory.
#[derive(Default)]
pub struct StepLogits {
    vocab: usize,
    rows: Vec<RowOut>,
    /// The full rows, back to back, `vocab` each (when `store` is None).
    full: Vec<f32>,
    /// A backend's buffer holding the full rows in its first `store_len` values.
    store: Option<Box<dyn RowStore>>,
    store_len: usize,
}

impl std::fmt::Debug for StepLogits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepLogits")
            .field("vocab", &self.vocab)
            .field("rows", &self.rows)
            .field("full_rows", &self.full_rows())
            .field("backend_store", &self.store.is_some())
            .finish()
    }
}

impl StepLogits {
    pub fn vocab(&self) -> usize {
        self.vocab
    }
    /// One entry per sequence with `want_logits`, in batch order.
    pub fn rows(&self) -> &[RowOut] {
        &self.rows
    }
    /// Full row `i` (as named by [`RowOut::Full`]); `None` past the end.
    pub fn full_row(&self, i: usize) -> Option<&[f32]> {
        let (a, b) = (i.checked_mul(self.vocab)?, (i + 1).checked_mul(self.vocab)?);
        self.full_data().get(a..b)
    }
    /// Number of full rows held.
    pub fn full_rows(&self) -> usize {
        self.full_data().len().checked_div(self.vocab).unwrap_or(0)
    }

    fn full_data(&self) -> &[f32] {
        match &self.store {
            Some(s) => s.as_slice().get(..self.store_len).unwrap_or(&[]),
            None => &self.full,
        }
    }

    /// Lays the rows out as `want` says; returns the number of full rows.
    fn layout(&mut self, vocab: usize, want: &[LogitsWant]) -> usize {
        self.vocab = vocab;
        self.rows.clear();
        let mut full = 0;
        for w in want {
            self.rows.push(match w {
                LogitsWant::Full => {
                    full += 1;
                    RowOut::Full(full - 1)
                }
                LogitsWant::Argmax => RowOut::Argmax(None),
                LogitsWant::Sample(_) => RowOut::Sampled(None),
            });
        }
        full
    }

    /// As [`StepLogits::begin`] for a backend that lands the full rows in its own
    /// [`RowStore`]: lays the rows out and hands back the store of the previous step (if any)
    /// for reuse; returns the number of full rows. Finish with [`StepLogits::set_store`].
    pub fn begin_store(
        &mut self,
        vocab: usize,
        want: &[LogitsWant],
    ) -> (usize, Option<Box<dyn RowStore>>) {
        let full = self.layout(vocab, want);
        self.store_len = 0;
        (full, self.store.take())
    }

    /// Puts the store holding this step's full rows (in its first `full rows x vocab` values)
    /// into `self`. An error when it is shorter than that.
    pub fn set_store(&mut self, store: Box<dyn RowStore>) -> Result<(), BackendError> {
        let n = self
            .rows
            .iter()
            .filter(|r| matches!(r, RowOut::Full(_)))
            .count()
            * self.vocab;
        if store.as_slice().len() < n {
            return Err(BackendError::InvalidBatch {
                reason: format!("a row store of {} values for {n}", store.as_slice().len()),
            });
        }
        self.store = Some(store);
        self.store_len = n;
        Ok(())
    }

    /// Starts a step's result: `want` lays out the rows (full rows numbered in order, arg-max
    /// rows `Argmax(None)` until [`StepLogits::set_argmax`]); returns the buffer of the full rows
    /// (`full x vocab`, its old contents left in place: the caller overwrites all of it). Keeps
    /// the capacity of the previous step; grows (and so writes) only past it.
    pub fn begin(&mut self, vocab: usize, want: &[LogitsWant]) -> &mut [f32] {
        let full = self.layout(vocab, want);
        self.store = None;
        self.full.resize(full * vocab, 0.0);
        &mut self.full
    }

    /// Sets the arg-max of row `row` (an `Argmax` row of [`StepLogits::begin`]); false when
    /// that row is not an arg-max row.
    pub fn set_argmax(&mut self, row: usize, token: Option<u32>) -> bool {
        match self.rows.get_mut(row) {
            Some(r @ RowOut::Argmax(_)) => {
                *r = RowOut::Argmax(token);
                true
            }
            _ => false,
        }
    }

    /// Sets the sampled token of row `row` (a `Sample` row of [`StepLogits::begin`]); false
    /// when that row is not a sampled row.
    pub fn set_sampled(&mut self, row: usize, token: Option<u32>) -> bool {
        match self.rows.get_mut(row) {
            Some(r @ RowOut::Sampled(_)) => {
                *r = RowOut::Sampled(token);
                true
            }
            _ => false,
        }
    }

    /// Fills `self` from full logits rows (one per `want` entry): what a backend without a
    /// device arg-max or device sampling returns. The arg-max and sampled rows are computed on
    /// the host ([`crate::sampling::argmax`], [`crate::sampling::sample_row`]); the full rows
    /// are moved down in place (no copy of the buffer, no allocation).
    pub fn fill_from(&mut self, logits: Logits, want: &[LogitsWant]) -> Result<(), BackendError> {
        if logits.rows() != want.len() || logits.data.len() != want.len() * logits.vocab {
            return Err(BackendError::InvalidBatch {
                reason: format!(
                    "{} logits values of vocabulary {} for {} rows",
                    logits.data.len(),
                    logits.vocab,
                    want.len()
                ),
            });
        }
        let v = logits.vocab;
        self.vocab = v;
        self.store = None;
        self.full = logits.data;
        self.rows.clear();
        let mut kept = 0;
        for (i, w) in want.iter().enumerate() {
            let row = &self.full[i * v..(i + 1) * v];
            match w {
                LogitsWant::Argmax => {
                    self.rows
                        .push(RowOut::Argmax(crate::sampling::argmax(row).ok()));
                }
                LogitsWant::Sample(d) => {
                    self.rows
                        .push(RowOut::Sampled(crate::sampling::sample_row(row, d)));
                }
                LogitsWant::Full => {
                    if kept != i {
                        self.full.copy_within(i * v..(i + 1) * v, kept * v);
                    }
                    self.rows.push(RowOut::Full(kept));
                    kept += 1;
                }
            }
        }
        self.full.truncate(kept * v);
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("invalid batch: {reason}")]
    InvalidBatch { reason: String },
    #[error("KV block {block} is outside the pool of {num_blocks} blocks")]
    BlockOutOfRange { block: BlockId, num_blocks: usize },
    #[error("KV buffer of {got} bytes, expected {expected}")]
    KvBufferSize { got: usize, expected: usize },
    /// A device failure with no finer class (a lost rank thread, a step past its deadline):
    /// Retryable.
    #[error("device error: {0}")]
    Device(String),
    /// A device failure its backend classified (e.g. the CUDA backend's out of memory:
    /// Unavailable; an invalid shape or argument: Internal; a transient launch failure:
    /// Retryable).
    #[error("device error: {message}")]
    DeviceFailure {
        kind: pdnode_core::ErrorKind,
        message: String,
    },
    #[error("KV staging of {len} bytes at offset {offset} is outside the arena of {arena} bytes")]
    StagingRange {
        offset: usize,
        len: usize,
        arena: usize,
    },
    #[error("this backend has no KV staging arena")]
    NoStaging,
    #[error("KV staging rank {rank} does not exist (the arena has {ranks})")]
    StagingRank { rank: usize, ranks: usize },
}

impl pdnode_core::error::Classify for BackendError {
    fn kind(&self) -> pdnode_core::ErrorKind {
        match self {
            BackendError::InvalidBatch { .. }
            | BackendError::BlockOutOfRange { .. }
            | BackendError::KvBufferSize { .. }
            | BackendError::StagingRange { .. }
            | BackendError::StagingRank { .. }
            | BackendError::NoStaging => pdnode_core::ErrorKind::Internal,
            BackendError::Device(_) => pdnode_core::ErrorKind::Retryable,
            BackendError::DeviceFailure { kind, .. } => *kind,
        }
    }
}

/// A compute device running one model over one paged KV pool.
pub trait Backend: Send {
    /// Name for logs and `/v1/models` (e.g. "cpu", "cuda:0-3", "mock").
    fn name(&self) -> String;
    /// Shape of this backend's KV pool (per TP rank).
    fn kv_layout(&self) -> &KvLayout;
    /// Blocks in the KV pool.
    fn num_kv_blocks(&self) -> usize;
    /// Runs one step; writes K/V of the new positions into the pool and returns logits rows.
    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Logits, BackendError>;
    /// Runs one step as [`Backend::forward`] and puts, for each sequence with `want_logits` (in
    /// batch order; `want` has one entry per such sequence), its full row, its arg-max or its
    /// sampled token into `out`, reusing `out`'s buffers (pass the previous step's result back).
    /// The default runs [`Backend::forward`] and reduces the arg-max and sampled rows on the
    /// host ([`StepLogits::fill_from`]); a device backend computes them on the device and
    /// copies only the full rows.
    fn forward_select(
        &mut self,
        batch: &ForwardBatch<'_>,
        want: &[LogitsWant],
        out: &mut StepLogits,
    ) -> Result<(), BackendError> {
        check_logits_wants(want, batch.logits_rows())?;
        let logits = self.forward(batch)?;
        out.fill_from(logits, want)
    }
    /// Copies layers `layers` of `blocks` out of the pool into `out`, ordered
    /// `[layer][block][layer-block bytes]` (all ranks' pools back to back, rank-major, when TP > 1).
    fn read_kv(
        &self,
        layers: Range<u32>,
        blocks: &[BlockId],
        out: &mut [u8],
    ) -> Result<(), BackendError>;
    /// The inverse of [`Backend::read_kv`]: writes `data` into those layers of `blocks`.
    fn write_kv(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        data: &[u8],
    ) -> Result<(), BackendError>;
    /// Whether [`Backend::forward_select`] computes [`LogitsWant::Sample`] rows on the device
    /// (one id copied instead of the row). Every backend serves every want; the engine asks for
    /// `Sample` rows only where this is true, and keeps sampling full rows on the host (its
    /// own draw order) elsewhere.
    fn samples_on_device(&self) -> bool {
        false
    }
    /// The [`KvStaging`] capability, when this backend has a staging arena. A capability query
    /// (like `Any::downcast`), not a stub: a backend without an arena answers `None` and the
    /// hand-off copies through the host ([`Backend::read_kv`] / [`Backend::write_kv`]).
    fn kv_staging(&mut self) -> Option<&mut dyn KvStaging> {
        None
    }
    /// Runs what the backend needs once before it serves, so that no request pays for it
    /// (a CUDA backend: its kernels loaded, its decode graphs captured: [`run_warm_up`]). Called
    /// before the engine takes requests, with nothing in the KV pool. Returns the steps run;
    /// the default runs none.
    fn warm_up(&mut self) -> Result<usize, BackendError> {
        Ok(0)
    }
}

/// What a backend runs once before it serves ([`Backend::warm_up`], [`run_warm_up`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WarmUpPlan {
    /// Prefill steps first, one sequence of each of these lengths (tokens).
    pub prefill_lengths: Vec<usize>,
    /// Decode batch sizes (one new token per sequence, every sequence wanting logits), each run
    /// at each of `decode_contexts` (the context a step reads, new token included).
    pub decode_batches: Vec<usize>,
    pub decode_contexts: Vec<usize>,
}

/// Runs `plan` on `backend` with throwaway token ids in the first blocks of its KV pool: its
/// prefill steps, then every (decode batch, context). Nothing owns those blocks yet, and whoever
/// gets them later writes each position before reading it. The sequences of one decode step
/// share the blocks before their last position and each writes its new token into a block of
/// its own (a step may not write one slot twice). A step needing more blocks than the pool has
/// is skipped. Returns the steps run.
pub fn run_warm_up(backend: &mut dyn Backend, plan: &WarmUpPlan) -> Result<usize, BackendError> {
    let bs = backend.kv_layout().block_size.max(1) as usize;
    let blocks = backend.num_kv_blocks();
    let table = |tokens: usize| -> Option<Vec<BlockId>> {
        let n = tokens.div_ceil(bs);
        (n <= blocks).then(|| (0..n as u32).map(BlockId).collect())
    };
    let mut out = StepLogits::default();
    let mut steps = 0;
    for &n in &plan.prefill_lengths {
        let Some(t) = table(n).filter(|_| n > 0) else {
            continue;
        };
        let tokens = vec![0u32; n];
        let batch = ForwardBatch {
            seqs: vec![SeqStep {
                tokens: &tokens,
                start_pos: 0,
                block_table: &t,
                want_logits: true,
            }],
        };
        backend.forward_select(&batch, &[LogitsWant::Argmax], &mut out)?;
        steps += 1;
    }
    let token = [0u32];
    for &ctx in &plan.decode_contexts {
        let ctx = ctx.max(1);
        let shared = ctx.div_ceil(bs) - 1;
        for &b in &plan.decode_batches {
            if shared + b > blocks {
                continue;
            }
            let tables: Vec<Vec<BlockId>> = (0..b)
                .map(|i| {
                    (0..shared as u32)
                        .chain(std::iter::once((shared + i) as u32))
                        .map(BlockId)
                        .collect()
                })
                .collect();
            let batch = ForwardBatch {
                seqs: tables
                    .iter()
                    .map(|t| SeqStep {
                        tokens: &token,
                        start_pos: ctx - 1,
                        block_table: t,
                        want_logits: true,
                    })
                    .collect(),
            };
            backend.forward_select(&batch, &vec![LogitsWant::Argmax; b], &mut out)?;
            steps += 1;
        }
    }
    Ok(steps)
}

/// Optional capability: one KV staging arena per TP rank, allocated once (device memory on
/// CUDA, exportable; host memory on CPU) so that a transport registers it once, and copies
/// between the pool and the arena that never leave the device.
///
/// Layout in each rank's arena, at the caller's `offset`: `[layer][block][layer-block bytes]`
/// over `layers` and `blocks` in order (what [`Backend::read_kv`] gives for one rank). Rank `r`
/// moves its own pool's bytes to and from its own arena at the same offset. Both copies are
/// complete (synchronized) when they return. The caller owns the arena's sub-allocation: the
/// backend only checks that the span lies inside the arena.
/// Says whether data a step is producing is in place: `Ok(true)` ready, `Ok(false)` not yet,
/// `Err` it never will be (the failed copy or device call, with its class). Polled from another
/// thread (the transport's), so it must not block.
pub type LayerGate = Box<dyn FnMut() -> Result<bool, BackendError> + Send>;

/// One sequence whose KV a prefill step gathers into the staging arena layer group by layer
/// group as the step computes ([`KvStaging::stage_next_step`]).
#[derive(Debug, Clone)]
pub struct StageSeq {
    /// The blocks to gather, in span order.
    pub blocks: Vec<BlockId>,
    /// Arena offset of `blocks[0]` in layer 0.
    pub offset: usize,
    /// Bytes from one layer of the span to the next (`[layer][block]` spans hold more blocks
    /// per layer than `blocks` when earlier chunks filled the front).
    pub layer_stride: usize,
}

/// The next step's in-step staging: after the KV of every `group` layers (and of the last
/// layer) is written, the backend enqueues the gather of those layers of each sequence and
/// calls `notify(sequence index, layers, gate)` on the step's thread, at once; `gate` opens when
/// the gathered bytes are in the arena. The hand-off puts them while later layers compute.
pub struct StepStaging {
    pub seqs: Vec<StageSeq>,
    pub group: u32,
    pub notify: Box<dyn FnMut(usize, Range<u32>, LayerGate) + Send>,
}

impl std::fmt::Debug for StepStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepStaging")
            .field("seqs", &self.seqs)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

pub trait KvStaging {
    /// One region per TP rank, in rank order; all of one length.
    fn staging_regions(&self) -> Vec<KvRegion>;
    /// Copies layers `layers` of `blocks` from the pool into each rank's arena at `offset`.
    fn gather_kv_to_staging(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<(), BackendError>;
    /// As [`KvStaging::gather_kv_to_staging`] for part of a larger span: layer `layers.start + i`
    /// of `blocks` goes to `offset + i * layer_stride` (`[layer][block]` with room for more
    /// blocks per layer than `blocks`; a prefill fills its span chunk by chunk). `offset` and
    /// `layer_stride` are multiples of 16.
    fn gather_kv_layers_to_staging(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
        layer_stride: usize,
    ) -> Result<(), BackendError>;
    /// The inverse: writes each rank's arena bytes at `offset` into those layers of `blocks`.
    fn scatter_kv_from_staging(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<(), BackendError>;
    /// Copies `out.len()` bytes of rank `rank`'s arena at `offset` into `out` (a fence record
    /// a peer put behind its KV).
    fn staging_read(
        &mut self,
        rank: usize,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), BackendError>;
    /// Writes `data` into rank `rank`'s arena at `offset` (a fence record behind the KV a
    /// transport then puts); complete when this returns.
    fn staging_write(
        &mut self,
        rank: usize,
        offset: usize,
        data: &[u8],
    ) -> Result<(), BackendError>;
    /// KVH64 (`pdnode_core::kvh64`) of `len` bytes at `offset` of every rank's arena, in rank
    /// order (`offset` and `len` multiples of 16), after every copy issued before it.
    fn staging_kvh64(&mut self, offset: usize, len: usize) -> Result<Vec<u64>, BackendError>;
    /// Asks the gathers that fill `offset .. offset + len` of every rank's arena (a span the
    /// next [`KvStaging::staging_kvh64`] of exactly that range hashes) to hash what they write,
    /// so that hash reads no byte again. `true` where the backend does so (CUDA); the default
    /// does nothing and `staging_kvh64` reads the span. Either way `staging_kvh64` answers the
    /// same: a span not covered exactly once by such gathers is read again.
    fn staging_hash_begin(&mut self, _offset: usize, _len: usize) -> Result<bool, BackendError> {
        Ok(false)
    }
    /// [`KvStaging::scatter_kv_from_staging`] that also returns each rank's KVH64 of the span
    /// it read (the bytes now in the blocks), in rank order: on the GPU the copy hashes what it
    /// moves (`kv_scatter_h64`), instead of a second read of the span.
    fn scatter_kv_from_staging_h64(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<Vec<u64>, BackendError>;
    /// Whether [`KvStaging::stage_next_step`] works here (default: no; the engine then gathers
    /// after each step).
    fn supports_step_staging(&self) -> bool {
        false
    }
    /// Arms the next `forward` with an in-step staging plan (consumed by it, whether it runs or
    /// fails). Only where [`KvStaging::supports_step_staging`].
    fn stage_next_step(&mut self, plan: StepStaging) -> Result<(), BackendError> {
        drop(plan);
        Err(BackendError::NoStaging)
    }
}

/// Arena offsets (and so span starts) are multiples of this (the copy kernels move 16-byte
/// vectors; 256 keeps every span on its own cache lines).
pub const STAGING_ALIGN: usize = 256;

/// Checks a staging copy against a pool and an arena of `arena_len` bytes; returns the byte
/// count it moves per rank.
pub fn check_staging_io(
    layout: &KvLayout,
    num_blocks: usize,
    layers: &Range<u32>,
    blocks: &[BlockId],
    offset: usize,
    arena_len: usize,
) -> Result<usize, BackendError> {
    let per_rank = layers.end.saturating_sub(layers.start) as usize
        * blocks.len()
        * layout.block_layer_bytes();
    check_kv_io(layout, num_blocks, layers, blocks, per_rank, 1)?;
    if !offset.is_multiple_of(STAGING_ALIGN)
        || offset
            .checked_add(per_rank)
            .is_none_or(|end| end > arena_len)
    {
        return Err(BackendError::StagingRange {
            offset,
            len: per_rank,
            arena: arena_len,
        });
    }
    Ok(per_rank)
}

/// Checks `len` bytes at `offset` of rank `rank` against an arena of `ranks` ranks of
/// `arena_len` bytes each (for [`KvStaging::staging_read`] and friends).
pub fn check_staging_span(
    rank: usize,
    ranks: usize,
    offset: usize,
    len: usize,
    arena_len: usize,
) -> Result<(), BackendError> {
    if rank >= ranks {
        return Err(BackendError::StagingRank { rank, ranks });
    }
    if offset.checked_add(len).is_none_or(|end| end > arena_len) {
        return Err(BackendError::StagingRange {
            offset,
            len,
            arena: arena_len,
        });
    }
    Ok(())
}

/// Where a backend's KV pool lives, for registering it with a transport (zero-copy hand-off).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    Host,
    /// Device memory of a CUDA device (ordinal), allocated with `cuMemAlloc` (exportable).
    Cuda(u32),
}

/// One contiguous pool region (one TP rank's pool).
#[derive(Debug, Clone, Copy)]
pub struct KvRegion {
    pub ptr: u64,
    pub len: usize,
    pub mem: MemKind,
}

/// Optional capability: direct access to the pool's memory for zero-copy transfer.
pub trait KvMemory {
    /// One region per TP rank, in rank order, laid out as the module docs say.
    fn kv_regions(&self) -> Vec<KvRegion>;
}

/// Byte offset of `(layer, block)` inside one rank's pool.
pub fn layer_block_offset(
    layout: &KvLayout,
    num_blocks: usize,
    layer: u32,
    block: BlockId,
) -> usize {
    (layer as usize * num_blocks + block.0 as usize) * layout.block_layer_bytes()
}

/// Checks the [`Backend::forward_select`] contract: one [`LogitsWant`] per logits row, and
/// every [`LogitsWant::Sample`] with a finite temperature > 0, a uniform in `[0, 1)`, `top_p`
/// > 0 and `min_p` in `[0, 1]`.
pub fn check_logits_wants(want: &[LogitsWant], rows: usize) -> Result<(), BackendError> {
    if want.len() != rows {
        return Err(BackendError::InvalidBatch {
            reason: format!("{} logits wishes for {rows} rows", want.len()),
        });
    }
    for (i, w) in want.iter().enumerate() {
        if let LogitsWant::Sample(d) = w {
            let ok = d.temperature.is_finite()
                && d.temperature > 0.0
                && (0.0..1.0).contains(&d.u)
                && d.top_p > 0.0
                && (0.0..=1.0).contains(&d.min_p);
            if !ok {
                return Err(BackendError::InvalidBatch {
                    reason: format!("row {i}: sampling parameters out of range: {d:?}"),
                });
            }
        }
    }
    Ok(())
}

/// Checks a read/write request against a pool; returns the byte count it moves per rank.
pub fn check_kv_io(
    layout: &KvLayout,
    num_blocks: usize,
    layers: &Range<u32>,
    blocks: &[BlockId],
    buf_len: usize,
    ranks: usize,
) -> Result<usize, BackendError> {
    if layers.start > layers.end || layers.end > layout.num_layers {
        return Err(BackendError::InvalidBatch {
            reason: format!("layers {layers:?} outside 0..{}", layout.num_layers),
        });
    }
    if let Some(b) = blocks.iter().find(|b| b.0 as usize >= num_blocks) {
        return Err(BackendError::BlockOutOfRange {
            block: *b,
            num_blocks,
        });
    }
    let per_rank = (layers.end - layers.start) as usize * blocks.len() * layout.block_layer_bytes();
    if buf_len != per_rank * ranks {
        return Err(BackendError::KvBufferSize {
            got: buf_len,
            expected: per_rank * ranks,
        });
    }
    Ok(per_rank)
}

/// Checks a strided staging gather ([`KvStaging::gather_kv_layers_to_staging`]); returns the
/// bytes per layer (`blocks.len()` layer-blocks).
pub fn check_staging_strided(
    layout: &KvLayout,
    num_blocks: usize,
    layers: &Range<u32>,
    blocks: &[BlockId],
    offset: usize,
    layer_stride: usize,
    arena_len: usize,
) -> Result<usize, BackendError> {
    let per_layer = blocks.len() * layout.block_layer_bytes();
    let nl = layers.end.saturating_sub(layers.start) as usize;
    check_kv_io(layout, num_blocks, layers, blocks, nl * per_layer, 1)?;
    let end = (nl.saturating_sub(1))
        .checked_mul(layer_stride)
        .and_then(|x| x.checked_add(offset))
        .and_then(|x| x.checked_add(per_layer));
    if !offset.is_multiple_of(16)
        || !layer_stride.is_multiple_of(16)
        || layer_stride < per_layer
        || end.is_none_or(|e| e > arena_len)
    {
        return Err(BackendError::StagingRange {
            offset,
            len: nl * per_layer,
            arena: arena_len,
        });
    }
    Ok(per_layer)
}

#[cfg(test)]
mod tests;
