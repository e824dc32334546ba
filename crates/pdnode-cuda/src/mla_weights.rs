//! Device weights of a DeepSeek-family model (multi-head latent attention, mixture of experts):
//! projections in bf16, norms and the router's correction bias in f32. Each MoE layer's routed
//! experts lie in two stacked matrices (`[experts][2 inter][hidden]` gate rows then up rows, and
//! `[experts][hidden][inter]`) so one launch reaches any expert by its index.

use super::CudaError;
use super::device::{DevBuf, Gpu};
use super::ops;
use pdnode_engine::spec::{MlaSpec, ModelSpec};
use pdnode_engine::weights::{Expert, Ffn, MlaQuery, MlaWeights};

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

fn mla_of(spec: &ModelSpec) -> Result<&MlaSpec, CudaError> {
    spec.mla.as_ref().ok_or_else(|| CudaError::Unsupported {
        reason: "latent-attention weights for a spec without latent attention".into(),
    })
}

impl DevMla {
    /// Uploads host f32 weights; returns the layers and the bytes they take.
    pub fn upload(gpu: &Gpu, spec: &ModelSpec, w: &MlaWeights) -> Result<(Self, usize), CudaError> {
        w.check_shapes(spec).map_err(|e| CudaError::Shape {
            op: "weights",
            reason: e.to_string(),
        })?;
        mla_of(spec)?;
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
    /// bias 0. Returns the layers and the bytes they take.
    pub fn dummy(
        gpu: &Gpu,
        spec: &ModelSpec,
        seed: u64,
        std: Option<f32>,
    ) -> Result<(Self, usize), CudaError> {
        let m = mla_of(spec)?;
        let (h, nh) = (spec.hidden_size, spec.num_heads);
        let mut bytes = 0usize;
        let mut n = 0u64;
        let fixed = std.map(|s| s * 3f32.sqrt());
        // A bf16 `[rows][cols]` matrix uniform in ±1/sqrt(cols).
        let mut rnd = |rows: usize, cols: usize| -> Result<DevBuf, CudaError> {
            let scale = fixed.unwrap_or(1.0 / (cols as f32).sqrt());
            let b = gpu.alloc(rows * cols * 2)?;
            n += 1;
            let tseed = seed.wrapping_mul(1_000_003).wrapping_add(n);
            ops::fill_uniform_bf16(gpu, &b, rows * cols, tseed, scale)?;
            bytes += rows * cols * 2;
            Ok(b)
        };
        let ones = |elems: usize, v: f32| -> Result<DevBuf, CudaError> {
            let b = gpu.alloc(elems * 4)?;
            ops::fill_f32(gpu, &b, elems, v)?;
            Ok(b)
        };
        let (r, qk) = (m.kv_lora_rank, m.qk_head_dim());
        let mut layers = Vec::with_capacity(spec.num_layers);
        for li in 0..spec.num_layers {
            let q = match m.q_lora_rank {
                None => DevMlaQuery::Direct {
                    wq: rnd(nh * qk, h)?,
                },
                Some(qr) => DevMlaQuery::LowRank {
                    wq_a: rnd(qr, h)?,
                    q_a_norm: ones(qr, 1.0)?,
                    wq_b: rnd(nh * qk, qr)?,
                    rank: qr,
                },
            };
            let moe = spec.moe.as_ref().filter(|e| e.is_moe_layer(li));
            let ffn = match moe {
                None => {
                    let i = spec.intermediate_size;
                    DevFfn::Dense(DevMlp {
                        gate_up: rnd(2 * i, h)?,
                        down: rnd(h, i)?,
                        inter: i,
                    })
                }
                Some(e) => {
                    let (ne, ei, si) = (
                        e.num_experts,
                        e.expert_intermediate,
                        e.shared_intermediate(),
                    );
                    let router = rnd(ne, h)?;
                    let score_bias = match e.scoring {
                        pdnode_engine::spec::MoeScoring::SigmoidBiased => Some(ones(ne, 0.0)?),
                        _ => None,
                    };
                    let gate_up = rnd(ne * 2 * ei, h)?;
                    // Each expert's down matrix has `ei` columns: the scale of rnd(.., ei).
                    let down = rnd(ne * h, ei)?;
                    let shared = if si > 0 {
                        Some(DevMlp {
                            gate_up: rnd(2 * si, h)?,
                            down: rnd(h, si)?,
                            inter: si,
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
                wkv_a: rnd(m.latent_dim(), h)?,
                kv_a_norm: ones(r, 1.0)?,
                wkv_b: rnd(nh * (m.qk_nope_head_dim + m.v_head_dim), r)?,
                wo: rnd(h, nh * m.v_head_dim)?,
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
