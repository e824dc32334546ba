//! Host weights of a DeepSeek-family model (multi-head latent attention, mixture of experts), in
//! Hugging Face orientation like [`super::Weights`].

use super::{ShapeError, Tensor, want, want_layers, want_opt};
use crate::spec::{MlaSpec, ModelSpec, MoeScoring};

/// The query projection of an MLA layer.
#[derive(Debug, Clone, PartialEq)]
pub enum MlaQuery {
    /// `q_proj` `[heads * qk_head_dim, hidden]` (no `q_lora_rank`, as DeepSeek-V2-Lite).
    Direct { wq: Tensor },
    /// `q_a_proj` `[q_lora_rank, hidden]`, `q_a_layernorm` `[q_lora_rank]`, `q_b_proj`
    /// `[heads * qk_head_dim, q_lora_rank]`.
    LowRank {
        wq_a: Tensor,
        q_a_norm: Tensor,
        wq_b: Tensor,
    },
}

/// A SwiGLU MLP: `down(silu(gate x) * up x)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Expert {
    pub w_gate: Tensor, // [inter, hidden]
    pub w_up: Tensor,   // [inter, hidden]
    pub w_down: Tensor, // [hidden, inter]
}

/// A MoE layer's router and experts.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeWeights {
    /// `mlp.gate.weight` `[num_experts, hidden]`.
    pub router: Tensor,
    /// `mlp.gate.e_score_correction_bias` `[num_experts]` (DeepSeek-V3 only).
    pub score_bias: Option<Tensor>,
    pub experts: Vec<Expert>,
    /// The shared experts as one MLP (`num_shared * expert_intermediate` rows); `None` when
    /// there are none.
    pub shared: Option<Expert>,
}

/// A layer's feed-forward part.
#[derive(Debug, Clone, PartialEq)]
pub enum Ffn {
    Dense(Expert),
    Moe(MoeWeights),
}

#[derive(Debug, Clone, PartialEq)]
pub struct MlaLayerWeights {
    pub attn_norm: Tensor, // [hidden]
    pub q: MlaQuery,
    /// `kv_a_proj_with_mqa` `[kv_lora_rank + qk_rope_head_dim, hidden]`.
    pub wkv_a: Tensor,
    /// `kv_a_layernorm` `[kv_lora_rank]`.
    pub kv_a_norm: Tensor,
    /// `kv_b_proj` `[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`: per head, the
    /// rows that make its k (nope part) then its v from the latent.
    pub wkv_b: Tensor,
    pub wo: Tensor,       // [hidden, heads * v_head_dim]
    pub mlp_norm: Tensor, // [hidden]
    pub ffn: Ffn,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MlaWeights {
    pub embed: Tensor, // [vocab, hidden]
    pub layers: Vec<MlaLayerWeights>,
    pub final_norm: Tensor,      // [hidden]
    pub lm_head: Option<Tensor>, // [vocab, hidden]; None when tied to `embed`
}

fn want_expert(name: &str, e: &Expert, h: usize, inter: usize) -> Result<(), ShapeError> {
    want(&format!("{name}.w_gate"), &e.w_gate, &[inter, h])?;
    want(&format!("{name}.w_up"), &e.w_up, &[inter, h])?;
    want(&format!("{name}.w_down"), &e.w_down, &[h, inter])
}

impl MlaWeights {
    /// Checks every tensor's shape against the spec (which must have `mla`); `Err` names the
    /// first tensor that is off, missing or not used.
    pub fn check_shapes(&self, s: &ModelSpec) -> Result<(), ShapeError> {
        let Some(m) = &s.mla else {
            return Err(ShapeError::Unused {
                name: "the latent-attention weights (the spec has no `mla`)".into(),
            });
        };
        let (h, nh) = (s.hidden_size, s.num_heads);
        want("embed", &self.embed, &[s.vocab_size, h])?;
        want_layers(self.layers.len(), s)?;
        for (n, l) in self.layers.iter().enumerate() {
            let p = |x: &str| format!("layers.{n}.{x}");
            want(&p("attn_norm"), &l.attn_norm, &[h])?;
            check_query(&p("q"), &l.q, m, nh, h)?;
            want(&p("wkv_a"), &l.wkv_a, &[m.latent_dim(), h])?;
            want(&p("kv_a_norm"), &l.kv_a_norm, &[m.kv_lora_rank])?;
            want(
                &p("wkv_b"),
                &l.wkv_b,
                &[nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
            )?;
            want(&p("wo"), &l.wo, &[h, nh * m.v_head_dim])?;
            want(&p("mlp_norm"), &l.mlp_norm, &[h])?;
            match (&l.ffn, &s.moe) {
                (Ffn::Moe(e), Some(spec)) if spec.is_moe_layer(n) => {
                    want(&p("router"), &e.router, &[spec.num_experts, h])?;
                    want_opt(
                        &p("score_bias"),
                        &e.score_bias,
                        spec.scoring == MoeScoring::SigmoidBiased,
                        &[spec.num_experts],
                    )?;
                    if e.experts.len() != spec.num_experts {
                        return Err(ShapeError::Shape {
                            name: p("experts"),
                            got: vec![e.experts.len()],
                            expected: vec![spec.num_experts],
                        });
                    }
                    for (i, x) in e.experts.iter().enumerate() {
                        want_expert(&p(&format!("experts.{i}")), x, h, spec.expert_intermediate)?;
                    }
                    match (&e.shared, spec.num_shared > 0) {
                        (Some(x), true) => {
                            want_expert(&p("shared"), x, h, spec.shared_intermediate())?
                        }
                        (None, false) => {}
                        (None, true) => return Err(ShapeError::Missing { name: p("shared") }),
                        (Some(_), false) => {
                            return Err(ShapeError::Unused { name: p("shared") });
                        }
                    }
                }
                (Ffn::Dense(x), spec) if spec.as_ref().is_none_or(|e| !e.is_moe_layer(n)) => {
                    want_expert(&p("mlp"), x, h, s.intermediate_size)?
                }
                (Ffn::Moe(_), _) => return Err(ShapeError::Unused { name: p("experts") }),
                (Ffn::Dense(_), _) => return Err(ShapeError::Missing { name: p("experts") }),
            }
        }
        want("final_norm", &self.final_norm, &[h])?;
        want_opt(
            "lm_head",
            &self.lm_head,
            !s.tie_word_embeddings,
            &[s.vocab_size, h],
        )
    }

    /// Every tensor with a name, in a fixed order (fingerprints, dummy weights).
    pub fn tensors(&self) -> Vec<(String, &Tensor)> {
        let mut out = vec![("embed".to_string(), &self.embed)];
        for (n, l) in self.layers.iter().enumerate() {
            let p = |x: &str| format!("layers.{n}.{x}");
            out.push((p("attn_norm"), &l.attn_norm));
            match &l.q {
                MlaQuery::Direct { wq } => out.push((p("q.wq"), wq)),
                MlaQuery::LowRank {
                    wq_a,
                    q_a_norm,
                    wq_b,
                } => {
                    out.push((p("q.wq_a"), wq_a));
                    out.push((p("q.q_a_norm"), q_a_norm));
                    out.push((p("q.wq_b"), wq_b));
                }
            }
            out.push((p("wkv_a"), &l.wkv_a));
            out.push((p("kv_a_norm"), &l.kv_a_norm));
            out.push((p("wkv_b"), &l.wkv_b));
            out.push((p("wo"), &l.wo));
            out.push((p("mlp_norm"), &l.mlp_norm));
            match &l.ffn {
                Ffn::Dense(e) => push_expert(&mut out, p("mlp"), e),
                Ffn::Moe(m) => {
                    out.push((p("router"), &m.router));
                    if let Some(b) = &m.score_bias {
                        out.push((p("score_bias"), b));
                    }
                    for (i, e) in m.experts.iter().enumerate() {
                        push_expert(&mut out, p(&format!("experts.{i}")), e);
                    }
                    if let Some(e) = &m.shared {
                        push_expert(&mut out, p("shared"), e);
                    }
                }
            }
        }
        out.push(("final_norm".into(), &self.final_norm));
        if let Some(t) = &self.lm_head {
            out.push(("lm_head".into(), t));
        }
        out
    }

    /// The output projection: `lm_head`, or the embedding when tied.
    pub fn output(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

fn push_expert<'a>(out: &mut Vec<(String, &'a Tensor)>, name: String, e: &'a Expert) {
    out.push((format!("{name}.w_gate"), &e.w_gate));
    out.push((format!("{name}.w_up"), &e.w_up));
    out.push((format!("{name}.w_down"), &e.w_down));
}

fn check_query(
    name: &str,
    q: &MlaQuery,
    m: &MlaSpec,
    heads: usize,
    h: usize,
) -> Result<(), ShapeError> {
    let rows = heads * m.qk_head_dim();
    match (q, m.q_lora_rank) {
        (MlaQuery::Direct { wq }, None) => want(&format!("{name}.wq"), wq, &[rows, h]),
        (
            MlaQuery::LowRank {
                wq_a,
                q_a_norm,
                wq_b,
            },
            Some(r),
        ) => {
            want(&format!("{name}.wq_a"), wq_a, &[r, h])?;
            want(&format!("{name}.q_a_norm"), q_a_norm, &[r])?;
            want(&format!("{name}.wq_b"), wq_b, &[rows, r])
        }
        (MlaQuery::Direct { .. }, Some(_)) => Err(ShapeError::Missing {
            name: format!("{name}.wq_a (q_lora_rank is set)"),
        }),
        (MlaQuery::LowRank { .. }, None) => Err(ShapeError::Unused {
            name: format!("{name}.wq_a (no q_lora_rank)"),
        }),
    }
}
