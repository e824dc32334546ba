//! The forward step of a DeepSeek-family model on the CPU: multi-head latent attention over
//! the cached latents, then a dense MLP or a mixture of experts.
//!
//! Attention runs in the absorbed form (the one a decode kernel uses): each head's query is
//! taken into the latent space through its slice of `kv_b_proj` (`q_lat = W_UK^T q_nope`), its
//! scores are `q_lat . c_j + q_pe . k_pe_j` against the cached latents `c_j` and RoPE keys, its
//! output the softmax-weighted sum of latents brought out through `W_UV`. Mathematically the same
//! as expanding every cached latent into keys and values (what transformers does); the pool holds
//! only the latents (`[layer][block][slot][kv_lora_rank + qk_rope_head_dim]`).

use super::attention::{PoolDims, SeqView, dot, exp_shifted};
use super::{CpuBackend, CpuWeights, moe, ops, output_logits, step_rows};
use crate::backend::{ForwardBatch, Logits, StepStaging};
use crate::spec::{MLA_LORA_NORM_EPS, MlaSpec, mla_softmax_scale};
use crate::weights::{Ffn, MlaQuery};
use rayon::prelude::*;

impl CpuBackend {
    pub(super) fn forward_mla(
        &mut self,
        batch: &ForwardBatch<'_>,
        tables: &[Vec<usize>],
        mut stage: Option<StepStaging>,
    ) -> Logits {
        let CpuWeights::Mla(w) = &self.w else {
            unreachable!("forward_inner dispatches on the weights");
        };
        let s = &self.spec;
        let Some(m) = &s.mla else {
            unreachable!("new_mla checks the spec has latent attention");
        };
        let (h, nh, eps) = (s.hidden_size, s.num_heads, s.rms_norm_eps);
        let (nope, rope, vd, r) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        );
        let qk = nope + rope;
        let (seqs, positions, mut x) = step_rows(batch, tables, &w.embed.data, h);
        let t = positions.len();
        let (mut cos, mut sin) = ops::rope_tables(&positions, &self.inv_freq);
        for v in cos.iter_mut().chain(sin.iter_mut()) {
            *v *= self.rope_factor;
        }
        let scale = mla_softmax_scale(m, s.rope_scaling.as_ref());
        let mut xn = vec![0f32; t * h];
        let mut q = vec![0f32; t * nh * qk];
        let mut kva = vec![0f32; t * m.latent_dim()];
        let mut att = vec![0f32; t * nh * vd];
        let num_layers = w.layers.len() as u32;
        let mut group_start = 0u32;
        for (li, l) in w.layers.iter().enumerate() {
            ops::rms_norm(&mut xn, &x, &l.attn_norm.data, h, eps);
            match &l.q {
                MlaQuery::Direct { wq } => {
                    ops::matmul_wt(&mut q, &xn, &wq.data, t, nh * qk, h, false)
                }
                MlaQuery::LowRank {
                    wq_a,
                    q_a_norm,
                    wq_b,
                } => {
                    let qr = q_a_norm.numel();
                    let mut qa = vec![0f32; t * qr];
                    ops::matmul_wt(&mut qa, &xn, &wq_a.data, t, qr, h, false);
                    ops::rms_norm_inplace(&mut qa, &q_a_norm.data, qr, MLA_LORA_NORM_EPS);
                    ops::matmul_wt(&mut q, &qa, &wq_b.data, t, nh * qk, qr, false);
                }
            }
            ops::matmul_wt(&mut kva, &xn, &l.wkv_a.data, t, m.latent_dim(), h, false);
            // The latent row: the normalized compression, then the RoPE key.
            for row in kva.chunks_mut(m.latent_dim()) {
                let (c, _) = row.split_at_mut(r);
                ops::rms_norm_inplace(c, &l.kv_a_norm.data, r, MLA_LORA_NORM_EPS);
            }
            rope_parts(&mut q, qk, nope, rope, m.rope_interleave, &cos, &sin);
            rope_parts(
                &mut kva,
                m.latent_dim(),
                r,
                rope,
                m.rope_interleave,
                &cos,
                &sin,
            );
            write_latents(&mut self.pool, self.dims, li, &seqs, &kva);
            if let Some(plan) = stage.as_mut() {
                let done = li as u32 + 1;
                if done.is_multiple_of(plan.group.max(1)) || done == num_layers {
                    self.stage_layers(plan, group_start..done);
                    group_start = done;
                }
            }
            let q_lat = absorb_queries(&q, &l.wkv_b.data, m, nh);
            let o_lat =
                latent_attention(&self.pool, self.dims, li, &seqs, &q_lat, &q, m, nh, scale);
            values_out(&mut att, &o_lat, &l.wkv_b.data, m, nh);
            ops::matmul_wt(&mut x, &att, &l.wo.data, t, h, nh * vd, true);
            ops::rms_norm(&mut xn, &x, &l.mlp_norm.data, h, eps);
            match &l.ffn {
                Ffn::Dense(e) => moe::swiglu_add(&mut x, &xn, e, t, h),
                Ffn::Moe(e) => {
                    let Some(spec) = &s.moe else {
                        unreachable!("check_shapes: MoE weights only with a MoE spec");
                    };
                    moe::moe_add(&mut x, &xn, e, spec, t, h);
                }
            }
        }
        output_logits(batch, &seqs, &x, s, &w.final_norm.data, &w.output().data)
    }
}

/// RoPE on the `rope`-long part at `offset` of every `stride`-long piece of `x` (a query head,
/// or a latent row), with position `t`'s angles for row `t` (pieces per row = its length over
/// `stride`). Pairs are `(2i, 2i+1)` when `interleave`, else `(i, i + rope/2)`.
fn rope_parts(
    x: &mut [f32],
    stride: usize,
    offset: usize,
    rope: usize,
    interleave: bool,
    cos: &[f32],
    sin: &[f32],
) {
    let half = rope / 2;
    let tokens = cos.len() / half.max(1);
    if tokens == 0 {
        return;
    }
    let row_len = x.len() / tokens;
    x.par_chunks_mut(row_len).enumerate().for_each(|(t, row)| {
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        for piece in row.chunks_mut(stride) {
            let p = &mut piece[offset..offset + rope];
            for i in 0..half {
                let (a, b) = if interleave {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let (x1, x2) = (p[a], p[b]);
                p[a] = x1 * c[i] - x2 * s[i];
                p[b] = x2 * c[i] + x1 * s[i];
            }
        }
    });
}

/// Writes each new token's latent row (`[tokens][latent_dim]`) into its slot of `layer`.
fn write_latents(pool: &mut [f32], d: PoolDims, layer: usize, seqs: &[SeqView<'_>], rows: &[f32]) {
    let ld = d.head_dim;
    for s in seqs {
        for i in 0..s.len {
            let p = s.start_pos + i;
            let o = d.at(layer, s.blocks[p / d.block_size], 0, p % d.block_size);
            let r = (s.row + i) * ld;
            pool[o..o + ld].copy_from_slice(&rows[r..r + ld]);
        }
    }
}

/// Each head's query nope part taken into the latent space: `q_lat[t][h] = W_UK[h]^T q_nope[t][h]`
/// (`[tokens][heads][kv_lora_rank]`), `W_UK[h]` being head `h`'s first `qk_nope_head_dim` rows of
/// `kv_b_proj`.
fn absorb_queries(q: &[f32], wkv_b: &[f32], m: &MlaSpec, nh: usize) -> Vec<f32> {
    let (nope, r, qk) = (m.qk_nope_head_dim, m.kv_lora_rank, m.qk_head_dim());
    let per_head = nope + m.v_head_dim;
    let mut out = vec![0f32; q.len() / qk * r];
    out.par_chunks_mut(r).enumerate().for_each(|(i, o)| {
        let (t, hh) = (i / nh, i % nh);
        let qn = &q[(t * nh + hh) * qk..(t * nh + hh) * qk + nope];
        let w = &wkv_b[hh * per_head * r..(hh * per_head + nope) * r];
        for (&qv, row) in qn.iter().zip(w.chunks_exact(r)) {
            for (o, &wv) in o.iter_mut().zip(row) {
                *o += qv * wv;
            }
        }
    });
    out
}

/// Causal attention of every new token's heads over the cached latents of positions
/// `0..=position`: returns the softmax-weighted sums of latents, `[tokens][heads][kv_lora_rank]`.
#[allow(clippy::too_many_arguments)]
fn latent_attention(
    pool: &[f32],
    d: PoolDims,
    layer: usize,
    seqs: &[SeqView<'_>],
    q_lat: &[f32],
    q: &[f32],
    m: &MlaSpec,
    nh: usize,
    scale: f32,
) -> Vec<f32> {
    let (nope, rope, r, qk) = (
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.kv_lora_rank,
        m.qk_head_dim(),
    );
    // Each row's position and sequence.
    let mut rows = Vec::with_capacity(q.len() / (nh * qk));
    for s in seqs {
        for i in 0..s.len {
            rows.push((s.start_pos + i, s));
        }
    }
    let mut out = vec![0f32; rows.len() * nh * r];
    out.par_chunks_mut(nh * r)
        .zip(rows.par_iter())
        .enumerate()
        .for_each(|(t, (o_row, &(pos, s)))| {
            let mut scores = vec![0f32; pos + 1];
            for hh in 0..nh {
                let ql = &q_lat[(t * nh + hh) * r..(t * nh + hh + 1) * r];
                let qo = (t * nh + hh) * qk + nope;
                let qp = &q[qo..qo + rope];
                let mut max = f32::NEG_INFINITY;
                for (j, sc) in scores.iter_mut().enumerate() {
                    let o = d.at(layer, s.blocks[j / d.block_size], 0, j % d.block_size);
                    let lat = &pool[o..o + r + rope];
                    *sc = (dot(ql, &lat[..r]) + dot(qp, &lat[r..])) * scale;
                    max = max.max(*sc);
                }
                let inv = exp_shifted(&mut scores, max);
                let oh = &mut o_row[hh * r..(hh + 1) * r];
                oh.fill(0.0);
                for (j, &p) in scores.iter().enumerate() {
                    let o = d.at(layer, s.blocks[j / d.block_size], 0, j % d.block_size);
                    let w = p * inv;
                    for (a, &c) in oh.iter_mut().zip(&pool[o..o + r]) {
                        *a += w * c;
                    }
                }
            }
        });
    out
}

/// Each head's output from its latent sum: `att[t][h] = W_UV[h] o_lat[t][h]`, `W_UV[h]` being
/// head `h`'s last `v_head_dim` rows of `kv_b_proj`.
fn values_out(att: &mut [f32], o_lat: &[f32], wkv_b: &[f32], m: &MlaSpec, nh: usize) {
    let (nope, vd, r) = (m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank);
    let per_head = nope + vd;
    att.par_chunks_mut(vd).enumerate().for_each(|(i, a)| {
        let hh = i % nh;
        let ol = &o_lat[i * r..(i + 1) * r];
        let w = &wkv_b[(hh * per_head + nope) * r..(hh + 1) * per_head * r];
        for (a, row) in a.iter_mut().zip(w.chunks_exact(r)) {
            *a = dot(ol, row);
        }
    });
}
