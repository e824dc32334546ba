//! Step planning: a [`ForwardBatch`] checked against the pool and the workspace, and laid out as
//! the per-step metadata the kernels read (token ids, positions, KV slots, block tables, rows).

use super::CudaBackend;
use crate::prefill::LongSeq;
use pdnode_engine::backend::{BackendError, ForwardBatch};

/// Byte offsets of the per-step metadata inside `Workspace::meta`.
pub(super) struct MetaOffsets {
    pub(super) ids: usize,
    pub(super) pos: usize,
    pub(super) slots: usize,
    pub(super) tok_seq: usize,
    pub(super) tables: usize,
    pub(super) rows: usize,
    /// Token indices taking the paged-attention kernel (when some take the GEMM path).
    pub(super) short: usize,
}

impl MetaOffsets {
    /// One step's metadata arrays in one buffer, each 16-byte aligned, in field order.
    pub(super) fn pack(
        ids: &[u32],
        pos: &[i32],
        slots: &[i64],
        tok_seq: &[i32],
        tables: &[i32],
        rows: &[i32],
        short: &[i32],
    ) -> (Vec<u8>, Self) {
        let mut bytes = Vec::new();
        let off = MetaOffsets {
            ids: push(&mut bytes, ids),
            pos: push(&mut bytes, pos),
            slots: push(&mut bytes, slots),
            tok_seq: push(&mut bytes, tok_seq),
            tables: push(&mut bytes, tables),
            rows: push(&mut bytes, rows),
            short: push(&mut bytes, short),
        };
        (bytes, off)
    }
}

/// Host-side plan of one step, built and validated from a [`ForwardBatch`].
pub(super) struct StepPlan {
    pub(super) bytes: Vec<u8>,
    pub(super) off: MetaOffsets,
    pub(super) tokens: usize,
    pub(super) rows: usize,
    pub(super) max_blocks: usize,
    pub(super) max_ctx: usize,
    pub(super) long: Vec<LongSeq>,
    pub(super) short_len: usize,
}

/// What [`CudaBackend::encode`] needs of a step: the metadata layout and the launch shapes.
pub(super) struct StepShape<'a> {
    pub(super) off: &'a MetaOffsets,
    pub(super) tokens: usize,
    pub(super) rows: usize,
    pub(super) max_blocks: usize,
    pub(super) max_ctx: usize,
    pub(super) long: &'a [LongSeq],
    pub(super) short_len: usize,
}

impl<'a> StepShape<'a> {
    pub(super) fn of(p: &'a StepPlan) -> Self {
        Self {
            off: &p.off,
            tokens: p.tokens,
            rows: p.rows,
            max_blocks: p.max_blocks,
            max_ctx: p.max_ctx,
            long: &p.long,
            short_len: p.short_len,
        }
    }
}

pub(super) fn push<T: Copy>(buf: &mut Vec<u8>, data: &[T]) -> usize {
    let off = buf.len().next_multiple_of(16);
    buf.resize(off, 0);
    // SAFETY: T is a plain integer type here (u32/i32/i64); reading its bytes is sound.
    let bytes = unsafe {
        std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
    };
    buf.extend_from_slice(bytes);
    off
}

impl CudaBackend {
    pub(super) fn plan(&self, batch: &ForwardBatch<'_>) -> Result<StepPlan, BackendError> {
        let bad = |reason: String| BackendError::InvalidBatch { reason };
        let bs = self.opts.block_size as usize;
        let tokens = batch.num_tokens();
        if tokens > self.opts.max_batch_tokens {
            return Err(bad(format!(
                "{tokens} tokens > max_batch_tokens {}",
                self.opts.max_batch_tokens
            )));
        }
        let rows = batch.logits_rows();
        if rows > self.opts.max_seqs {
            return Err(bad(format!(
                "{rows} logits rows > max_seqs {}",
                self.opts.max_seqs
            )));
        }
        let mut max_blocks = 1usize;
        let mut max_ctx = 1usize;
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(bad(format!("sequence {i} has no tokens")));
            }
            let end = s.start_pos + s.tokens.len();
            let nb = end.div_ceil(bs);
            if s.block_table.len() < nb {
                return Err(bad(format!(
                    "sequence {i}: {} blocks cover fewer than {end} positions",
                    s.block_table.len()
                )));
            }
            if let Some(b) = s.block_table[..nb]
                .iter()
                .find(|b| b.0 as usize >= self.num_blocks)
            {
                return Err(BackendError::BlockOutOfRange {
                    block: *b,
                    num_blocks: self.num_blocks,
                });
            }
            if let Some(t) = s
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.spec.vocab_size)
            {
                return Err(bad(format!(
                    "sequence {i}: token {t} outside the vocabulary"
                )));
            }
            if end > i32::MAX as usize {
                return Err(bad(format!("sequence {i}: position {end} too large")));
            }
            max_blocks = max_blocks.max(nb);
            max_ctx = max_ctx.max(end);
        }
        let mut ids = Vec::with_capacity(tokens);
        let mut pos = Vec::with_capacity(tokens);
        let mut slots = Vec::with_capacity(tokens);
        let mut tok_seq = Vec::with_capacity(tokens);
        let mut tables = vec![0i32; batch.seqs.len() * max_blocks];
        let mut row_idx = Vec::with_capacity(rows);
        let mut long = Vec::new();
        let mut short = Vec::new();
        for (i, s) in batch.seqs.iter().enumerate() {
            let row0 = ids.len();
            if s.tokens.len() >= self.opts.prefill_gemm_min_tokens {
                long.push(LongSeq {
                    row0,
                    n: s.tokens.len(),
                    start: s.start_pos,
                    seq: i,
                });
            } else {
                short.extend((row0..row0 + s.tokens.len()).map(|r| r as i32));
            }
            let nb = (s.start_pos + s.tokens.len()).div_ceil(bs);
            for (j, b) in s.block_table[..nb].iter().enumerate() {
                tables[i * max_blocks + j] = b.0 as i32;
            }
            for (k, &t) in s.tokens.iter().enumerate() {
                let p = s.start_pos + k;
                ids.push(t);
                pos.push(p as i32);
                slots.push(s.block_table[p / bs].0 as i64 * bs as i64 + (p % bs) as i64);
                tok_seq.push(i as i32);
            }
            if s.want_logits {
                row_idx.push((ids.len() - 1) as i32);
            }
        }
        // Two tokens writing one KV slot in one step would race in rope_qkv (the CPU backend
        // refuses the same batches).
        let mut seen = std::collections::HashSet::with_capacity(slots.len());
        if let Some(dup) = slots.iter().find(|s| !seen.insert(**s)) {
            return Err(bad(format!(
                "two tokens of this step write KV slot {} of block {}",
                dup % bs as i64,
                dup / bs as i64
            )));
        }
        let (bytes, off) =
            MetaOffsets::pack(&ids, &pos, &slots, &tok_seq, &tables, &row_idx, &short);
        Ok(StepPlan {
            bytes,
            off,
            tokens,
            rows,
            max_blocks,
            max_ctx,
            short_len: short.len(),
            long,
        })
    }
}
