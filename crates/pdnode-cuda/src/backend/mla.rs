//! The step encoder of a DeepSeek-family model on one GPU, or one tensor-parallel rank of it
//! (`Shard`: its share of the heads and intermediate sizes, the latent whole; the residual
//! all-reduced after o_proj and after the MLP or experts): multi-head latent attention over the
//! latent pool (absorbed projections, as the CPU backend's `cpu/mla.rs`), then a dense MLP or a
//! mixture of experts. Same step metadata, staging, graphs and logits as the Llama path.
//!
//! Per layer: `q` (one projection, or the low-rank pair with its norm), the `kv_a` projection,
//! then `mla_rope_latent` (the latent's norm, RoPE of the query and key parts, the latent
//! written to the pool); each head's query taken into the latent space through its slice of
//! `kv_b_proj` (one strided-batched GEMM over heads), `mla_attention` over the cached latents,
//! the values brought out through `kv_b_proj`'s other slice (a second batched GEMM), o_proj into
//! the residual. MoE layers route on the device (`moe_route`); up to
//! [`ops::MOE_GEMV_MAX_PAIRS`] token-expert pairs run the expert-major GEMV kernels (each
//! touched expert's weights read once, no host round trip: decode steps stay capturable), more
//! (prefill) group the pairs per expert on the host and run cuBLAS GEMMs per expert.

use super::CudaBackend;
use super::mla_prefill::{LayerIo, MlaPrefill};
use crate::CudaError;
use crate::blas::{self, Operand, OutType};
use crate::device::{DevBuf, Gpu};
use crate::mla_weights::{DevFfn, DevMlaQuery, DevMlp, DevMoe};
use crate::ops::{self, AttnMeta, MlaDims};
use pdnode_engine::spec::{
    MLA_LORA_NORM_EPS, ModelSpec, MoeSpec, mla_softmax_scale, rope_attention_factor,
};

/// Activations and scratch of the MLA step, sized for `max_batch_tokens` tokens.
pub(super) struct MlaWorkspace {
    q: DevBuf,        // bf16 [T][heads][qk]
    qa_f32: DevBuf,   // f32 [T][q_lora_rank] (low-rank q)
    qa: DevBuf,       // bf16 [T][q_lora_rank]
    kva: DevBuf,      // f32 [T][rank + rope]
    q_lat: DevBuf,    // f32 [T][heads][rank]
    o_lat: DevBuf,    // bf16 [T][heads][rank]
    att: DevBuf,      // bf16 [T][heads * v]
    part_ml: DevBuf,  // mla_attention's split partials
    part_acc: DevBuf, //
    gu: DevBuf,       // bf16 [T][2 inter] (dense or shared MLP; grouped experts: [T k][2 ei])
    act: DevBuf,      // bf16 [T][inter]   (grouped experts: [T k][ei])
    logits: DevBuf,   // f32 [T][experts]: the router's
    ids: Vec<DevBuf>, // i32 [T][k] per MoE layer: its picks (kept for the stats)
    weights: DevBuf,  // f32 [T][k]
    y: DevBuf,        // f32 [T k][hidden]: each pair's expert output
    xg: DevBuf,       // bf16 [T k][hidden]: rows grouped per expert (host-grouped path)
    order: DevBuf,    // i32 [2][T k]: grouped pair -> token, pair -> grouped row
    /// Scratch of the GEMM path of long prompts (grown on demand; `mla_prefill.rs`).
    prefill: MlaPrefill,
    /// Tokens the buffers hold; experts' picks per token.
    tokens: usize,
    top_k: usize,
}

/// Rows of the dense and shared MLPs (the larger sizes `gu` and `act`).
fn mlp_inter(s: &ModelSpec) -> usize {
    let shared = s.moe.as_ref().map_or(0, |e| e.shared_intermediate());
    s.intermediate_size.max(shared)
}

impl MlaWorkspace {
    pub(super) fn new(gpu: &Gpu, s: &ModelSpec, t: usize) -> Result<Self, CudaError> {
        let m = s.mla.as_ref().ok_or_else(|| CudaError::Unsupported {
            reason: "an MLA workspace for a spec without latent attention".into(),
        })?;
        let (h, nh, r) = (s.hidden_size, s.num_heads, m.kv_lora_rank);
        let qr = m.q_lora_rank.unwrap_or(0);
        let (experts, k, ei, moe_layers) = match &s.moe {
            Some(e) => (
                e.num_experts,
                e.top_k,
                e.expert_intermediate,
                s.num_layers.saturating_sub(e.first_dense_layers),
            ),
            None => (0, 0, 0, 0),
        };
        let inter = mlp_inter(s);
        let pairs = t * k;
        let (ml, acc) = ops::mla_scratch_bytes(gpu.sm_count as usize, t, nh, r);
        let a = |bytes: usize| gpu.alloc(bytes.max(16));
        Ok(Self {
            q: a(t * nh * m.qk_head_dim() * 2)?,
            qa_f32: a(t * qr * 4)?,
            qa: a(t * qr * 2)?,
            kva: a(t * m.latent_dim() * 4)?,
            q_lat: a(t * nh * r * 4)?,
            o_lat: a(t * nh * r * 2)?,
            att: a(t * nh * m.v_head_dim * 2)?,
            part_ml: a(ml)?,
            part_acc: a(acc)?,
            gu: a((t * 2 * inter).max(pairs * 2 * ei) * 2)?,
            act: a((t * inter).max(pairs * ei) * 2)?,
            logits: a(t * experts * 4)?,
            ids: (0..moe_layers)
                .map(|_| a(pairs * 4))
                .collect::<Result<_, _>>()?,
            weights: a(pairs * 4)?,
            y: a(pairs * h * 4)?,
            xg: a(pairs * h * 2)?,
            order: a(2 * pairs * 4)?,
            prefill: MlaPrefill::default(),
            tokens: t,
            top_k: k,
        })
    }

    pub(super) fn bytes(&self) -> usize {
        [
            &self.q,
            &self.qa_f32,
            &self.qa,
            &self.kva,
            &self.q_lat,
            &self.o_lat,
            &self.att,
            &self.part_ml,
            &self.part_acc,
            &self.gu,
            &self.act,
            &self.logits,
            &self.weights,
            &self.y,
            &self.xg,
            &self.order,
        ]
        .iter()
        .map(|b| b.bytes())
        .sum::<usize>()
            + self.ids.iter().map(|b| b.bytes()).sum::<usize>()
    }
}

impl CudaBackend {
    /// [`CudaBackend::encode`] for a latent-attention model (the caller checked `w.mla`).
    pub(super) fn encode_mla(
        &mut self,
        meta: u64,
        p: &super::plan::StepShape<'_>,
    ) -> Result<(), CudaError> {
        // The GEMM path's scratch is borrowed mutably beside the rest of the backend.
        let mut pf = match self.mla_ws.as_mut() {
            Some(w) => std::mem::take(&mut w.prefill),
            None => MlaPrefill::default(),
        };
        let r = self.encode_mla_with(meta, p, &mut pf);
        if let Some(w) = self.mla_ws.as_mut() {
            w.prefill = pf;
        }
        r
    }

    fn encode_mla_with(
        &mut self,
        meta: u64,
        p: &super::plan::StepShape<'_>,
        pf: &mut MlaPrefill,
    ) -> Result<(), CudaError> {
        let m = |o: usize| meta + o as u64;
        let mut stage = self.stage_run.take();
        let s = &self.spec;
        let (Some(ml), Some(dw), Some(mws)) = (&s.mla, &self.w.mla, &self.mla_ws) else {
            return Err(CudaError::Unsupported {
                reason: "encode_mla without latent-attention weights".into(),
            });
        };
        let (g, w, ws) = (&self.gpu, &self.w, &self.ws);
        let (h, t, nh, eps) = (s.hidden_size, p.tokens, s.num_heads, s.rms_norm_eps);
        let (r, qk, vd, nope) = (
            ml.kv_lora_rank,
            ml.qk_head_dim(),
            ml.v_head_dim,
            ml.qk_nope_head_dim,
        );
        let ph = nope + vd;
        let dims = MlaDims {
            heads: nh,
            nope,
            rope: ml.qk_rope_head_dim,
            rank: r,
            block_size: self.opts.block_size as usize,
            num_blocks: self.num_blocks,
        };
        let lin = self.opts.linear;
        let rope_factor = rope_attention_factor(s.rope_scaling.as_ref());
        let scale = mla_softmax_scale(ml, s.rope_scaling.as_ref());
        let attn_meta = AttnMeta {
            tok_seq: m(p.off.tok_seq),
            tok_pos: m(p.off.pos),
            block_tables: m(p.off.tables),
            max_blocks: p.max_blocks,
            max_ctx: p.max_ctx,
            window: 0,
        };
        ops::embed_gather(g, &w.embed, s.vocab_size, m(p.off.ids), t, &ws.resid, h)?;
        self.op_mark("embed")?;
        let mut moe_layer = 0usize;
        for (li, l) in dw.layers.iter().enumerate() {
            ops::add_rmsnorm(
                g,
                &ws.resid,
                t,
                None,
                &l.attn_norm,
                &ws.normed,
                None,
                t,
                h,
                eps,
            )?;
            self.op_mark("attn_norm")?;
            match &l.q {
                DevMlaQuery::Direct { wq } => {
                    let how = lin.for_call(t, h, wq, &ws.normed);
                    ops::linear(
                        g,
                        nh * qk,
                        t,
                        h,
                        wq,
                        &ws.normed,
                        &mws.q,
                        OutType::Bf16,
                        false,
                        how,
                    )?;
                }
                DevMlaQuery::LowRank {
                    wq_a,
                    q_a_norm,
                    wq_b,
                    rank: qr,
                } => {
                    let how = lin.for_call(t, h, wq_a, &ws.normed);
                    ops::linear(
                        g,
                        *qr,
                        t,
                        h,
                        wq_a,
                        &ws.normed,
                        &mws.qa_f32,
                        OutType::F32,
                        false,
                        how,
                    )?;
                    let e = MLA_LORA_NORM_EPS;
                    ops::add_rmsnorm(g, &mws.qa_f32, t, None, q_a_norm, &mws.qa, None, t, *qr, e)?;
                    let how = lin.for_call(t, *qr, wq_b, &mws.qa);
                    ops::linear(
                        g,
                        nh * qk,
                        t,
                        *qr,
                        wq_b,
                        &mws.qa,
                        &mws.q,
                        OutType::Bf16,
                        false,
                        how,
                    )?;
                }
            }
            self.op_mark("q")?;
            let how = lin.for_call(t, h, &l.wkv_a, &ws.normed);
            let ld = ml.latent_dim();
            ops::linear(
                g,
                ld,
                t,
                h,
                &l.wkv_a,
                &ws.normed,
                &mws.kva,
                OutType::F32,
                false,
                how,
            )?;
            self.op_mark("kv_a")?;
            ops::mla_rope_latent(
                g,
                &dims,
                &mws.kva,
                &l.kv_a_norm,
                MLA_LORA_NORM_EPS,
                &mws.q,
                &w.inv_freq,
                rope_factor,
                ml.rope_interleave,
                m(p.off.pos),
                m(p.off.slots),
                t,
                &self.pool,
                li,
            )?;
            self.op_mark("rope_latent")?;
            if let Some(run) = stage.as_mut() {
                // This layer's latents are final: at a group's end, its gather and the hand-off.
                self.stage_after_layer(run, li)?;
            }
            // q_lat[t][h] = W_UK[h]^T q_nope[t][h]: per head, C (r x T) = A (r x nope) B (nope x T)
            // in column-major terms, A = head h's `nope` rows of kv_b_proj read as is.
            // SAFETY: kv_b_proj holds nh * ph rows of r; q holds T rows of nh * qk; q_lat T rows
            // of nh * r (workspace sized for max_batch_tokens >= T).
            unsafe {
                blas::gemm_strided_batched(
                    &g.blas,
                    r,
                    t,
                    nope,
                    Operand {
                        ptr: l.wkv_b.ptr(),
                        ld: r,
                        stride: ph * r,
                        trans: false,
                    },
                    Operand {
                        ptr: mws.q.ptr(),
                        ld: nh * qk,
                        stride: qk,
                        trans: false,
                    },
                    Operand {
                        ptr: mws.q_lat.ptr(),
                        ld: nh * r,
                        stride: r,
                        trans: false,
                    },
                    OutType::F32,
                    nh,
                )?;
            }
            self.op_mark("absorb")?;
            if p.short_len > 0 {
                // the sequences of few new tokens (all of them when none takes the GEMM path)
                let list = (!p.long.is_empty()).then(|| (m(p.off.short), p.short_len));
                let scratch = ops::MlaScratch {
                    part_ml: &mws.part_ml,
                    part_acc: &mws.part_acc,
                };
                ops::mla_attention_ex(
                    g,
                    &dims,
                    &mws.q_lat,
                    &mws.q,
                    &self.pool,
                    li,
                    &attn_meta,
                    t,
                    list,
                    scale,
                    &scratch,
                    &mws.o_lat,
                    ops::MlaKernel::Auto,
                )?;
                self.op_mark("mla_attention")?;
            }
            let io = LayerIo {
                pool: &self.pool,
                layer: li,
                q_lat: &mws.q_lat,
                q: &mws.q,
                o_lat: &mws.o_lat,
                tokens: t,
                tables: m(p.off.tables),
                max_blocks: p.max_blocks,
                scale,
            };
            for s in p.long {
                pf.run(g, &dims, &io, s)?;
                self.op_mark("prefill_attention")?;
            }
            // att[t][h] = W_UV[h] o_lat[t][h]: C (v x T) = op_T(A) (v x r) B (r x T), A = head h's
            // `v` rows of kv_b_proj after its `nope` rows.
            // SAFETY: as above; att holds T rows of nh * v.
            unsafe {
                blas::gemm_strided_batched(
                    &g.blas,
                    vd,
                    t,
                    r,
                    Operand {
                        ptr: l.wkv_b.at(nope * r * 2),
                        ld: r,
                        stride: ph * r,
                        trans: true,
                    },
                    Operand {
                        ptr: mws.o_lat.ptr(),
                        ld: nh * r,
                        stride: r,
                        trans: false,
                    },
                    Operand {
                        ptr: mws.att.ptr(),
                        ld: nh * vd,
                        stride: vd,
                        trans: false,
                    },
                    OutType::Bf16,
                    nh,
                )?;
            }
            self.op_mark("values")?;
            // With tensor parallelism rank 0 adds its heads' share to the residual, every other
            // rank writes its share in place of it, and the sum over ranks is the residual.
            let rank0 = self.shard.rank == 0;
            let how = lin.for_call(t, nh * vd, &l.wo, &mws.att);
            ops::linear(
                g,
                h,
                t,
                nh * vd,
                &l.wo,
                &mws.att,
                &ws.resid,
                OutType::F32,
                rank0,
                how,
            )?;
            self.op_mark("o_proj")?;
            self.all_reduce_resid(t * h)?;
            ops::add_rmsnorm(
                g,
                &ws.resid,
                t,
                None,
                &l.mlp_norm,
                &ws.normed,
                None,
                t,
                h,
                eps,
            )?;
            self.op_mark("mlp_norm")?;
            // As o_proj: each rank's share of the intermediate sizes (routed and shared experts
            // summed on the rank first), one all-reduce.
            match &l.ffn {
                DevFfn::Dense(mlp) => {
                    self.mlp_add(mlp, t, rank0)?;
                    self.op_mark("dense_mlp")?;
                }
                DevFfn::Moe(moe) => {
                    let Some(spec) = &s.moe else {
                        return Err(CudaError::Unsupported {
                            reason: "MoE weights for a spec without experts".into(),
                        });
                    };
                    if !rank0 {
                        // the experts add into the residual: start this rank's share at zero
                        ops::fill_f32(g, &ws.resid, t * h, 0.0)?;
                    }
                    self.moe_add(moe, spec, t, moe_layer)?;
                    moe_layer += 1;
                }
            }
            self.all_reduce_resid(t * h)?;
        }
        self.stage_run = stage;
        self.encode_logits(meta, p)
    }

    /// An event after the work enqueued so far, labelled `name`, when per-op timing is on
    /// (benchmarks: the `op-timing` feature); else nothing.
    #[cfg(feature = "op-timing")]
    fn op_mark(&self, name: &'static str) -> Result<(), CudaError> {
        self.prof
            .as_ref()
            .map_or(Ok(()), |pr| pr.mark(&self.gpu, name))
    }

    #[cfg(not(feature = "op-timing"))]
    fn op_mark(&self, _: &'static str) -> Result<(), CudaError> {
        Ok(())
    }

    /// `resid += down(silu(gate normed) * up normed)` over `t` rows (`resid =` without
    /// `accumulate`).
    fn mlp_add(&self, mlp: &DevMlp, t: usize, accumulate: bool) -> Result<(), CudaError> {
        let (Some(mws), g, ws) = (&self.mla_ws, &self.gpu, &self.ws) else {
            return Ok(());
        };
        let (h, i) = (self.spec.hidden_size, mlp.inter);
        let lin = self.opts.linear;
        let how = lin.for_call(t, h, &mlp.gate_up, &ws.normed);
        let f = self.opts.fusion;
        ops::gate_up_swiglu(
            g,
            i,
            t,
            h,
            &mlp.gate_up,
            &ws.normed,
            &mws.gu,
            &mws.act,
            how,
            f,
        )?;
        let how = lin.for_call(t, i, &mlp.down, &mws.act);
        ops::linear(
            g,
            h,
            t,
            i,
            &mlp.down,
            &mws.act,
            &ws.resid,
            OutType::F32,
            accumulate,
            how,
        )
    }

    /// `resid += shared(normed) + sum over each row's routed experts of weight * expert(normed)`.
    fn moe_add(&self, moe: &DevMoe, e: &MoeSpec, t: usize, layer: usize) -> Result<(), CudaError> {
        let (Some(mws), g, ws) = (&self.mla_ws, &self.gpu, &self.ws) else {
            return Ok(());
        };
        let (h, k, ne, ei) = (
            self.spec.hidden_size,
            e.top_k,
            e.num_experts,
            e.expert_intermediate,
        );
        let how = self.opts.linear.for_call(t, h, &moe.router, &ws.normed);
        ops::linear(
            g,
            ne,
            t,
            h,
            &moe.router,
            &ws.normed,
            &mws.logits,
            OutType::F32,
            false,
            how,
        )?;
        self.op_mark("router")?;
        let ids = mws.ids.get(layer).ok_or_else(|| CudaError::Shape {
            op: "moe",
            reason: format!("MoE layer {layer} past the workspace's {}", mws.ids.len()),
        })?;
        ops::moe_route(
            g,
            e,
            &mws.logits,
            moe.score_bias.as_ref(),
            t,
            ids,
            &mws.weights,
        )?;
        self.op_mark("route")?;
        let pairs = t * k;
        if pairs <= ops::MOE_GEMV_MAX_PAIRS {
            ops::moe_gate_up_swiglu(g, ne, ei, h, k, &moe.gate_up, &ws.normed, ids, t, &mws.act)?;
            self.op_mark("experts_gate_up")?;
            ops::moe_down(g, ne, h, ei, k, &moe.down, &mws.act, ids, t, &mws.y)?;
            self.op_mark("experts_down")?;
            ops::moe_combine(g, h, k, &mws.y, None, &mws.weights, t, &ws.resid)?;
            self.op_mark("experts_combine")?;
        } else {
            self.moe_grouped(moe, e, t, ids)?;
            self.op_mark("experts_grouped")?;
        }
        if let Some(sh) = &moe.shared {
            self.mlp_add(sh, t, true)?;
            self.op_mark("shared_experts")?;
        }
        Ok(())
    }

    /// The routed experts of a large step: the picks brought to the host, the pairs grouped per
    /// expert, each expert's rows gathered and run through two cuBLAS GEMMs, the outputs summed
    /// per row in pick order (`moe_combine` through the pair -> grouped row map).
    fn moe_grouped(
        &self,
        moe: &DevMoe,
        e: &MoeSpec,
        t: usize,
        ids: &DevBuf,
    ) -> Result<(), CudaError> {
        let (Some(mws), g, ws) = (&self.mla_ws, &self.gpu, &self.ws) else {
            return Ok(());
        };
        let (h, k, ne, ei) = (
            self.spec.hidden_size,
            e.top_k,
            e.num_experts,
            e.expert_intermediate,
        );
        let pairs = t * k;
        let mut picks = vec![0i32; pairs];
        g.download(&mut picks, ids, 0)?;
        // Counting sort of the pairs by expert (stable: pick order within an expert).
        let mut count = vec![0usize; ne + 1];
        for &x in &picks {
            let x =
                usize::try_from(x)
                    .ok()
                    .filter(|&x| x < ne)
                    .ok_or_else(|| CudaError::Shape {
                        op: "moe_grouped",
                        reason: format!("the router picked expert {x} of {ne}"),
                    })?;
            count[x + 1] += 1;
        }
        for i in 0..ne {
            count[i + 1] += count[i];
        }
        let starts = count.clone();
        let mut next = count;
        let mut order = vec![0i32; 2 * pairs];
        for (pair, &x) in picks.iter().enumerate() {
            let row = next[x as usize];
            next[x as usize] += 1;
            order[row] = (pair / k) as i32;
            order[pairs + pair] = row as i32;
        }
        g.upload(&mws.order, 0, &order)?;
        ops::gather_rows_bf16(g, &ws.normed, t, mws.order.ptr(), pairs, h, &mws.xg)?;
        for x in 0..ne {
            let (r0, n) = (starts[x], starts[x + 1] - starts[x]);
            if n == 0 {
                continue;
            }
            // SAFETY: expert x's gate_up is rows [x 2ei, (x + 1) 2ei) of the stacked matrix;
            // rows r0..r0 + n of xg / gu lie inside the T k rows the workspace holds.
            unsafe {
                blas::gemm(
                    &g.blas,
                    2 * ei,
                    n,
                    h,
                    moe.gate_up.at(x * 2 * ei * h * 2),
                    mws.xg.at(r0 * h * 2),
                    mws.gu.at(r0 * 2 * ei * 2),
                    OutType::Bf16,
                    0.0,
                )?;
            }
        }
        ops::swiglu(g, &mws.gu, &mws.act, pairs, ei)?;
        for x in 0..ne {
            let (r0, n) = (starts[x], starts[x + 1] - starts[x]);
            if n == 0 {
                continue;
            }
            // SAFETY: as above for the down matrices ([x h, (x + 1) h) rows of ei) and y.
            unsafe {
                blas::gemm(
                    &g.blas,
                    h,
                    n,
                    ei,
                    moe.down.at(x * h * ei * 2),
                    mws.act.at(r0 * ei * 2),
                    mws.y.at(r0 * h * 4),
                    OutType::F32,
                    0.0,
                )?;
            }
        }
        let map = mws.order.at(pairs * 4);
        ops::moe_combine(g, h, k, &mws.y, Some(map), &mws.weights, t, &ws.resid)
    }

    /// Distinct routed experts each MoE layer picked in the last step of `tokens` tokens
    /// (benchmarks: the roofline counts the expert bytes a step touches).
    pub fn experts_touched(&self, tokens: usize) -> Result<Vec<usize>, CudaError> {
        let Some(mws) = &self.mla_ws else {
            return Ok(Vec::new());
        };
        let n = tokens.min(mws.tokens) * mws.top_k;
        let mut out = Vec::with_capacity(mws.ids.len());
        self.gpu.sync()?;
        for ids in &mws.ids {
            let mut picks = vec![0i32; n];
            self.gpu.download(&mut picks, ids, 0)?;
            picks.sort_unstable();
            picks.dedup();
            out.push(picks.len());
        }
        Ok(out)
    }
}
