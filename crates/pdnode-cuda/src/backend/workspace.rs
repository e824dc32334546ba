//! The backend's activations and scratch on the device, allocated once at start.

use crate::CudaError;
use crate::device::{DevBuf, Gpu};
use pdnode_engine::spec::ModelSpec;

/// Activations and scratch, sized for `max_batch_tokens` / `max_seqs`.
pub(super) struct Workspace {
    pub(super) resid: DevBuf,   // f32 [T, H]
    pub(super) normed: DevBuf,  // bf16 [T, H]
    pub(super) qkv: DevBuf,     // bf16 [T, q + 2 kv]
    pub(super) q: DevBuf,       // bf16 [T, q]
    pub(super) attn: DevBuf,    // bf16 [T, q]
    pub(super) gate_up: DevBuf, // bf16 [T, 2 I]
    pub(super) act: DevBuf,     // bf16 [T, I]
    pub(super) logits: DevBuf,  // f32 [S, V]
    pub(super) tokens: DevBuf,  // i32 [S]: arg-max of each logits row
    pub(super) part_ml: DevBuf,
    pub(super) part_acc: DevBuf,
    pub(super) meta: DevBuf,
    pub(super) ticket: DevBuf, // u32, 0 between launches: the fused linear + RMSNorm's block counter
}

const ATTN_WS_BYTES: usize = 64 << 20;

impl Workspace {
    pub(super) fn new(gpu: &Gpu, s: &ModelSpec, t: usize, seqs: usize) -> Result<Self, CudaError> {
        let (h, q, kv, i) = (s.hidden_size, s.q_dim(), s.kv_dim(), s.intermediate_size);
        let rows_splits = ATTN_WS_BYTES / (s.head_dim * 4);
        Ok(Self {
            resid: gpu.alloc(t * h * 4)?,
            normed: gpu.alloc(t.max(seqs) * h * 2)?,
            qkv: gpu.alloc(t * (q + 2 * kv) * 2)?,
            q: gpu.alloc(t * q * 2)?,
            attn: gpu.alloc(t * q * 2)?,
            gate_up: gpu.alloc(t * 2 * i * 2)?,
            act: gpu.alloc(t * i * 2)?,
            logits: gpu.alloc(seqs * s.vocab_size * 4)?,
            tokens: gpu.alloc(seqs * 4)?,
            part_ml: gpu.alloc(rows_splits * 2 * 4)?,
            part_acc: gpu.alloc(rows_splits * s.head_dim * 4)?,
            meta: gpu.alloc(1 << 20)?,
            ticket: {
                let b = gpu.alloc(256)?;
                gpu.memset(&b, 0)?;
                b
            },
        })
    }

    pub(super) fn bytes(&self) -> usize {
        [
            &self.resid,
            &self.normed,
            &self.qkv,
            &self.q,
            &self.attn,
            &self.gate_up,
            &self.act,
            &self.logits,
            &self.tokens,
            &self.part_ml,
            &self.part_acc,
            &self.meta,
            &self.ticket,
        ]
        .iter()
        .map(|b| b.bytes())
        .sum()
    }
}
