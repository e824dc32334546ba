//! Device weights of a DeepSeek-family model (multi-head latent attention, mixture of experts):
//! projections in bf16, norms and the router's correction bias in f32. Each MoE layer's routed
//! experts lie in two stacked matrices (`[experts][2 inter][hidden]` gate rows then up rows, and
//! `[experts][hidden][inter]`) so one launch reaches any expert by its index.

use super::CudaError;
use super::device::{DevBuf, Gpu};
use super::ops;
use super::weights::{Shard, cols_of, rows_of};
use pdnode_engine::spec::{MlaSpec, ModelSpec};
use pdnode_engine::weights::{
    Expert, Ffn, MlaLayerWeights, MlaQuery, MlaWeights, MoeWeights, Tensor,
};
use std::borrow::Cow;
use std::ops::Range;

/// A SwiGLU MLP on the device: `gate_up` bf16 `[2 inter][hidden]`, `down` bf16 `[hidden][inter]`.
pub struct DevMlp {
    pub gate_up: DevBuf,
    pub down: DevBuf,
    pub inter: usize,
}

/// The query projection of an MLA layer.
pub enum DevMlaQuery {
    Direct {
        wq: DevBuf,
    },
    LowRank {
        wq_a: DevBuf,
        q_a_norm: DevBuf,
        wq_b: DevBuf,
        rank: usize,
    },
}

/// A MoE layer: the router (bf16 `[experts][hidden]`), V3's correction bias (f32), the routed
/// experts stacked, the shared experts as one MLP.
pub struct DevMoe {
    pub router: DevBuf,
    pub score_bias: Option<DevBuf>,
    pub gate_up: DevBuf,
    pub down: DevBuf,
    pub shared: Option<DevMlp>,
}

pub enum DevFfn {
    Dense(DevMlp),
    Moe(DevMoe),
}

pub struct DevMlaLayer {
    pub attn_norm: DevBuf,
    pub q: DevMlaQuery,
    /// `kv_a_proj_with_mqa` bf16 `[rank + rope][hidden]`.
    pub wkv_a: DevBuf,
    pub kv_a_norm: DevBuf,
    /// `kv_b_proj` bf16 `[heads (nope + v)][rank]`: the absorbed query and value projections
    /// read their per-head slices of it in place.
    pub wkv_b: DevBuf,
    pub wo: DevBuf,
    pub mlp_norm: DevBuf,
    pub ffn: DevFfn,
}

/// Layers of a latent-attention model (the embedding, final norm and lm_head are in
/// [`super::weights::DevWeights`]).
pub struct DevMla {
    pub layers: Vec<DevMlaLayer>,
}

/// (first row, rows, first column, columns) of a block of a matrix.
type Block = (usize, usize, usize, usize);
/// Fills a block of a whole `[..][cols]` random tensor (`DevMla::dummy`).
type Fill<'a> = dyn FnMut(usize, Block, f32) -> Result<DevBuf, CudaError> + 'a;

fn mla_of(spec: &ModelSpec) -> Result<&MlaSpec, CudaError> {
    spec.mla.as_ref().ok_or_else(|| CudaError::Unsupported {
        reason: "latent-attention weights for a spec without latent attention".into(),
    })
}

/// Rows `r` of a `[rows][cols]` tensor.
fn rows_t(t: &Tensor, r: Range<usize>) -> Tensor {
    let cols = t.shape.get(1).copied().unwrap_or(1);
    Tensor::new(vec![r.len(), cols], rows_of(&t.data, cols, r).to_vec())
}

/// Columns `c` of a `[rows][cols]` tensor.
fn cols_t(t: &Tensor, c: Range<usize>) -> Tensor {
    let cols = t.shape.get(1).copied().unwrap_or(1);
    let rows = t.shape.first().copied().unwrap_or(0);
    Tensor::new(vec![rows, c.len()], cols_of(&t.data, cols, c))
}

/// `shard`'s slice of a SwiGLU MLP: its part of the intermediate rows of gate and up, the same
/// columns of down.
fn shard_mlp(e: &Expert, shard: Shard) -> Expert {
    let ir = shard.part(e.w_gate.shape[0]);
    Expert {
        w_gate: rows_t(&e.w_gate, ir.clone()),
        w_up: rows_t(&e.w_up, ir.clone()),
        w_down: cols_t(&e.w_down, ir),
    }
}

/// `shard`'s slice of one latent-attention layer of a model with `heads` query heads (shapes
/// checked by [`MlaWeights::check_shapes`] against the whole spec; the slice then passes it
/// against [`Shard::rank_spec`]): the query projection's rows (q, or q_b after the replicated
/// q_a and its norm), kv_b's rows and o_proj's input columns of the rank's heads; every MLP
/// (dense, each routed expert, the shared experts) by its intermediate size; kv_a, the norms,
/// the router and its bias whole. Borrowed as is for one rank.
pub fn shard_layer<'a>(
    l: &'a MlaLayerWeights,
    m: &MlaSpec,
    heads: usize,
    shard: Shard,
) -> Cow<'a, MlaLayerWeights> {
    if shard.size == 1 {
        return Cow::Borrowed(l);
    }
    let qr = shard.part(heads * m.qk_head_dim());
    let q = match &l.q {
        MlaQuery::Direct { wq } => MlaQuery::Direct { wq: rows_t(wq, qr) },
        MlaQuery::LowRank {
            wq_a,
            q_a_norm,
            wq_b,
        } => MlaQuery::LowRank {
            wq_a: wq_a.clone(),
            q_a_norm: q_a_norm.clone(),
            wq_b: rows_t(wq_b, qr),
        },
    };
    let ffn = match &l.ffn {
        Ffn::Dense(e) => Ffn::Dense(shard_mlp(e, shard)),
        Ffn::Moe(e) => Ffn::Moe(MoeWeights {
            router: e.router.clone(),
            score_bias: e.score_bias.clone(),
            experts: e.experts.iter().map(|x| shard_mlp(x, shard)).collect(),
            shared: e.shared.as_ref().map(|x| shard_mlp(x, shard)),
        }),
    };
    Cow::Owned(MlaLayerWeights {
        attn_norm: l.attn_norm.clone(),
        q,
        wkv_a: l.wkv_a.clone(),
        kv_a_norm: l.kv_a_norm.clone(),
        wkv_b: rows_t(
            &l.wkv_b,
            shard.part(heads * (m.qk_nope_head_dim + m.v_head_dim)),
        ),
        wo: cols_t(&l.wo, shard.part(heads * m.v_head_dim)),
        mlp_norm: l.mlp_norm.clone(),
        ffn,
    })
}

impl DevMla {
    /// Uploads `shard`'s slice of host f32 weights ([`shard_layer`]); returns the layers and
    /// the bytes they take. `spec` is the whole model's.
    pub fn upload(
        gpu: &Gpu,
        spec: &ModelSpec,
        w: &MlaWeights,
        shard: Shard,
    ) -> Result<(Self, usize), CudaError> {
        w.check_shapes(spec).map_err(|e| CudaError::Shape {
            op: "weights",
            reason: e.to_string(),
        })?;
        let m = mla_of(spec)?;
        shard.check(spec)?;
        let mut bytes = 0usize;
        let mut bf = |data: &[f32]| -> Result<DevBuf, CudaError> {
            bytes += data.len() * 2;
            gpu.upload_bf16(data)
        };
        let mlp = |bf: &mut dyn FnMut(&[f32]) -> Result<DevBuf, CudaError>, e: &Expert| {
            Ok::<_, CudaError>(DevMlp {
                gate_up: bf(&[e.w_gate.data.as_slice(), &e.w_up.data].concat())?,
                down: bf(&e.w_down.data)?,
                inter: e.w_gate.shape[0],
            })
        };
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let l = &*shard_layer(l, m, spec.num_heads, shard);
            let q = match &l.q {
                MlaQuery::Direct { wq } => DevMlaQuery::Direct { wq: bf(&wq.data)? },
                MlaQuery::LowRank {
                    wq_a,
                    q_a_norm,
                    wq_b,
                } => DevMlaQuery::LowRank {
                    wq_a: bf(&wq_a.data)?,
                    q_a_norm: gpu.upload_f32(&q_a_norm.data)?,
                    wq_b: bf(&wq_b.data)?,
                    rank: q_a_norm.numel(),
                },
            };
            let ffn = match &l.ffn {
                Ffn::Dense(e) => DevFfn::Dense(mlp(&mut bf, e)?),
                Ffn::Moe(m) => {
                    let gate_up: Vec<f32> = m
                        .experts
                        .iter()
                        .flat_map(|e| e.w_gate.data.iter().chain(&e.w_up.data).copied())
                        .collect();
                    let down: Vec<f32> = m
                        .experts
                        .iter()
                        .flat_map(|e| e.w_down.data.iter().copied())
                        .collect();
                    DevFfn::Moe(DevMoe {
                        router: bf(&m.router.data)?,
                        score_bias: m
                            .score_bias
                            .as_ref()
                            .map(|b| gpu.upload_f32(&b.data))
                            .transpose()?,
                        gate_up: bf(&gate_up)?,
                        down: bf(&down)?,
                        shared: m.shared.as_ref().map(|e| mlp(&mut bf, e)).transpose()?,
                    })
                }
            };
            layers.push(DevMlaLayer {
                attn_norm: gpu.upload_f32(&l.attn_norm.data)?,
                q,
                wkv_a: bf(&l.wkv_a.data)?,
                kv_a_norm: gpu.upload_f32(&l.kv_a_norm.data)?,
                wkv_b: bf(&l.wkv_b.data)?,
                wo: bf(&l.wo.data)?,
                mlp_norm: gpu.upload_f32(&l.mlp_norm.data)?,
                ffn,
            });
        }
        Ok((Self { layers }, bytes))
    }

    /// Random weights generated on the device at `spec`'s shapes (benchmarks): projections
    /// uniform in `±1/sqrt(in)` (or with standard deviation `std`), norms 1, the correction
    /// bias 0. Each element's value depends only on `seed`, the tensor and its index in the
    /// whole tensor, so every `shard` holds exactly its slice ([`shard_layer`]) of what
    /// `Shard::WHOLE` generates. Returns the layers and the bytes they take.
    pub fn dummy(
        gpu: &Gpu,
        spec: &ModelSpec,
        seed: u64,
        std: Option<f32>,
        shard: Shard,
    ) -> Result<(Self, usize), CudaError> {
        let m = mla_of(spec)?;
        shard.check(spec)?;
        let (h, nh) = (spec.hidden_size, spec.num_heads);
        let mut bytes = 0usize;
        let mut n = 0u64;
        let fixed = std.map(|s| s * 3f32.sqrt());
        // One whole bf16 tensor viewed as `[rows][cols]`, uniform in ±`scale`; `block`: (first
        // row, rows, first column, columns) of the part this rank keeps.
        let mut rnd = |cols: usize,
                       (r0, rows, c0, ncols): Block,
                       scale: f32|
         -> Result<DevBuf, CudaError> {
            let scale = fixed.unwrap_or(scale);
            let b = gpu.alloc(rows * ncols * 2)?;
            n += 1;
            let tseed = seed.wrapping_mul(1_000_003).wrapping_add(n);
            ops::fill_uniform_bf16_2d(gpu, &b, 0, rows, ncols, cols, r0 * cols + c0, tseed, scale)?;
            bytes += rows * ncols * 2;
            Ok(b)
        };
        let ones = |elems: usize, v: f32| -> Result<DevBuf, CudaError> {
            let b = gpu.alloc(elems * 4)?;
            ops::fill_f32(gpu, &b, elems, v)?;
            Ok(b)
        };
        let inv = |x: usize| 1.0 / (x as f32).sqrt();
        // All of a `[rows][cols]` tensor; this rank's rows `r` of it; its columns `c`.
        let whole = |rows: usize, cols: usize| (0, rows, 0, cols);
        let rows_of = |r: Range<usize>, cols: usize| (r.start, r.len(), 0, cols);
        let cols_of = |rows: usize, c: Range<usize>| (0, rows, c.start, c.len());
        let (r, qk, vd) = (m.kv_lora_rank, m.qk_head_dim(), m.v_head_dim);
        let ph = m.qk_nope_head_dim + vd;
        // A `[2 inter][hidden]` gate/up pair seen as `[2][inter hidden]` (each half's rows of
        // this rank are one run of columns) and a `[hidden][inter]` down, `stack` of them.
        let mlp = |rnd: &mut Fill<'_>,
                   stack: usize,
                   inter: usize|
         -> Result<(DevBuf, DevBuf), CudaError> {
            let ir = shard.part(inter);
            let gate_up = rnd(
                inter * h,
                (0, 2 * stack, ir.start * h, ir.len() * h),
                inv(h),
            )?;
            let down = rnd(inter, cols_of(stack * h, ir), inv(inter))?;
            Ok((gate_up, down))
        };
        let mut layers = Vec::with_capacity(spec.num_layers);
        for li in 0..spec.num_layers {
            let qrows = shard.part(nh * qk);
            let q = match m.q_lora_rank {
                None => DevMlaQuery::Direct {
                    wq: rnd(h, rows_of(qrows, h), inv(h))?,
                },
                Some(qr) => DevMlaQuery::LowRank {
                    wq_a: rnd(h, whole(qr, h), inv(h))?,
                    q_a_norm: ones(qr, 1.0)?,
                    wq_b: rnd(qr, rows_of(qrows, qr), inv(qr))?,
                    rank: qr,
                },
            };
            let moe = spec.moe.as_ref().filter(|e| e.is_moe_layer(li));
            let ffn = match moe {
                None => {
                    let i = spec.intermediate_size;
                    let (gate_up, down) = mlp(&mut rnd, 1, i)?;
                    DevFfn::Dense(DevMlp {
                        gate_up,
                        down,
                        inter: i / shard.size,
                    })
                }
                Some(e) => {
                    let (ne, ei, si) = (
                        e.num_experts,
                        e.expert_intermediate,
                        e.shared_intermediate(),
                    );
                    let router = rnd(h, whole(ne, h), inv(h))?;
                    let score_bias = match e.scoring {
                        pdnode_engine::spec::MoeScoring::SigmoidBiased => Some(ones(ne, 0.0)?),
                        _ => None,
                    };
                    // `[experts][2 ei][hidden]` and `[experts][hidden][ei]`: each expert's
                    // down matrix has `ei` columns (its scale).
                    let (gate_up, down) = mlp(&mut rnd, ne, ei)?;
                    let shared = if si > 0 {
                        let (gate_up, down) = mlp(&mut rnd, 1, si)?;
                        Some(DevMlp {
                            gate_up,
                            down,
                            inter: si / shard.size,
                        })
                    } else {
                        None
                    };
                    DevFfn::Moe(DevMoe {
                        router,
                        score_bias,
                        gate_up,
                        down,
                        shared,
                    })
                }
            };
            layers.push(DevMlaLayer {
                attn_norm: ones(h, 1.0)?,
                q,
                wkv_a: rnd(h, whole(m.latent_dim(), h), inv(h))?,
                kv_a_norm: ones(r, 1.0)?,
                wkv_b: rnd(r, rows_of(shard.part(nh * ph), r), inv(r))?,
                wo: rnd(nh * vd, cols_of(h, shard.part(nh * vd)), inv(nh * vd))?,
                mlp_norm: ones(h, 1.0)?,
                ffn,
            });
        }
        gpu.sync()?;
        Ok((Self { layers }, bytes))
    }

    /// Bytes of the layer weights one decode step must read when MoE layer `i` (counting MoE
    /// layers only) used `touched[i]` distinct routed experts: attention projections, dense
    /// MLPs, routers, shared experts and the touched experts (the roofline's count; the
    /// embedding rows, final norm and lm_head are the caller's).
    pub fn step_bytes(spec: &ModelSpec, touched: &[usize]) -> Result<usize, CudaError> {
        let m = mla_of(spec)?;
        let (h, nh) = (spec.hidden_size, spec.num_heads);
        let (r, qk) = (m.kv_lora_rank, m.qk_head_dim());
        let q = match m.q_lora_rank {
            None => nh * qk * h,
            Some(qr) => qr * h + nh * qk * qr,
        };
        let attn = q
            + m.latent_dim() * h
            + nh * (m.qk_nope_head_dim + m.v_head_dim) * r
            + h * nh * m.v_head_dim;
        let mut elems = 0usize;
        let mut moe_layer = 0usize;
        for li in 0..spec.num_layers {
            elems += attn;
            match spec.moe.as_ref().filter(|e| e.is_moe_layer(li)) {
                None => elems += 3 * spec.intermediate_size * h,
                Some(e) => {
                    let used = touched.get(moe_layer).copied().unwrap_or(e.top_k);
                    moe_layer += 1;
                    elems += e.num_experts * h
                        + used.min(e.num_experts) * 3 * e.expert_intermediate * h
                        + 3 * e.shared_intermediate() * h;
                }
            }
        }
        Ok(elems * 2)
    }
}

#[cfg(test)]
mod tests;
