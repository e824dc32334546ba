//! Latent attention of a sequence with many new tokens (at least
//! `CudaOptions::prefill_gemm_min_tokens`, 64) on tensor cores: the absorbed form is multi-query
//! attention with one shared "head" of the latent's width, so per query chunk
//! `S_h = [q_lat_h | q_pe_h] L^T` (every head against the same gathered latent rows `L`, one
//! strided-batched GEMM with a zero stride on `L`), the causal softmax of the prefill path, and
//! `O_h = P_h L[:, ..rank]` (a second GEMM); the decode kernel (`mla_attention`) keeps the
//! step's other tokens. Scratch grows on demand (prefill steps are never captured).

use crate::CudaError;
use crate::blas::{Operand, OutType, gemm_strided_batched};
use crate::device::{DevBuf, Gpu};
use crate::ops::{self, MlaDims};
use crate::prefill::{LongSeq, SCORE_BUDGET, causal_softmax, ensure, transpose_heads};

const BF16: usize = 2;

/// The GEMM path's buffers: gathered latents, head-major queries and outputs, scores and
/// probabilities of one query chunk.
#[derive(Default)]
pub(super) struct MlaPrefill {
    lc: Option<DevBuf>,
    qc: Option<DevBuf>,
    oh: Option<DevBuf>,
    s: Option<DevBuf>,
    p: Option<DevBuf>,
}

/// What one layer's GEMM prefill reads and writes.
pub(super) struct LayerIo<'a> {
    pub pool: &'a DevBuf,
    pub layer: usize,
    /// f32 `[tokens][heads][rank]`, bf16 `[tokens][heads][qk]`, bf16 `[tokens][heads][rank]`.
    pub q_lat: &'a DevBuf,
    pub q: &'a DevBuf,
    pub o_lat: &'a DevBuf,
    pub tokens: usize,
    /// Device i32 block tables `[seqs][max_blocks]`.
    pub tables: u64,
    pub max_blocks: usize,
    pub scale: f32,
}

impl MlaPrefill {
    /// `o_lat` rows of the new tokens of `s` from the latents of positions `0..s.start + s.n`.
    pub(super) fn run(
        &mut self,
        gpu: &Gpu,
        d: &MlaDims,
        io: &LayerIo<'_>,
        s: &LongSeq,
    ) -> Result<(), CudaError> {
        let op = "mla_prefill";
        let (nh, rank, row) = (d.heads, d.rank, d.latent());
        let e = s.start + s.n;
        if s.n == 0 || s.row0 + s.n > io.tokens || e > io.max_blocks * d.block_size {
            return Err(CudaError::Shape {
                op,
                reason: format!("{s:?} outside the step"),
            });
        }
        let lc = ensure(gpu, &mut self.lc, e * row * BF16)?.ptr();
        let qc = ensure(gpu, &mut self.qc, nh * s.n * row * BF16)?.ptr();
        let oh = ensure(gpu, &mut self.oh, nh * s.n * rank * BF16)?.ptr();
        let tq = s.n.min((SCORE_BUDGET / (nh * e * 6)).max(1));
        let sp = ensure(gpu, &mut self.s, nh * tq * e * 4)?.ptr();
        let pp = ensure(gpu, &mut self.p, nh * tq * e * BF16)?.ptr();
        let table = io.tables + (s.seq * io.max_blocks * 4) as u64;
        let (lcb, qcb) = (
            self.lc.as_ref().ok_or_else(|| gone(op))?,
            self.qc.as_ref().ok_or_else(|| gone(op))?,
        );
        ops::mla_gather_seq(gpu, d, io.pool, io.layer, table, e, lcb)?;
        ops::mla_q_head_major(gpu, d, io.q_lat, io.q, io.tokens, s.row0, s.n, qcb)?;
        let mut c0 = 0;
        while c0 < s.n {
            let tqc = tq.min(s.n - c0);
            let q0 = s.start + c0;
            // keys 0 ..= the chunk's last query
            let tk = q0 + tqc;
            // SAFETY: lc holds e >= tk rows of `row`; qc holds nh * n rows of `row`; the score
            // buffer nh * tq * e f32 >= nh * tqc * tk (all ensured above).
            unsafe {
                gemm_strided_batched(
                    &gpu.blas,
                    tk,
                    tqc,
                    row,
                    Operand {
                        ptr: lc,
                        ld: row,
                        stride: 0,
                        trans: true,
                    },
                    Operand {
                        ptr: qc + (c0 * row * BF16) as u64,
                        ld: row,
                        stride: s.n * row,
                        trans: false,
                    },
                    Operand {
                        ptr: sp,
                        ld: tk,
                        stride: tqc * tk,
                        trans: false,
                    },
                    OutType::F32,
                    nh,
                )?;
            }
            // SAFETY: s and p hold nh * tqc rows of tk (ensured).
            unsafe { causal_softmax(gpu, sp, pp, nh, tqc, tk, q0, io.scale, 0) }?;
            // SAFETY: as above; the values are the first `rank` of each latent row; oh holds
            // nh * n rows of rank.
            unsafe {
                gemm_strided_batched(
                    &gpu.blas,
                    rank,
                    tqc,
                    tk,
                    Operand {
                        ptr: lc,
                        ld: row,
                        stride: 0,
                        trans: false,
                    },
                    Operand {
                        ptr: pp,
                        ld: tk,
                        stride: tqc * tk,
                        trans: false,
                    },
                    Operand {
                        ptr: oh + (c0 * rank * BF16) as u64,
                        ld: rank,
                        stride: s.n * rank,
                        trans: false,
                    },
                    OutType::Bf16,
                    nh,
                )?;
            }
            c0 += tqc;
        }
        // head-major -> the step's o_lat rows
        // SAFETY: o_lat holds `tokens` rows of nh * rank >= row0 + n; oh nh * n rows of rank.
        unsafe { transpose_heads(gpu, io.o_lat.ptr(), oh, s.row0, s.n, nh, rank, false) }?;
        Ok(())
    }
}

fn gone(op: &'static str) -> CudaError {
    CudaError::Shape {
        op,
        reason: "scratch allocation vanished".into(),
    }
}
