//! [`ModelSpec::validate`]: what every loader checks before it sizes anything from a spec. Every
//! dimension is non-zero and under a bound no published model comes near, the floats are finite
//! and in range, and every derived size (`q_dim`, matrix element counts, the parameter count) is
//! computed with checked arithmetic, so a `config.json` or GGUF header can neither make a loader
//! reserve memory without bound nor wrap a product to a size that passes the shape checks.

use super::{ModelSpec, MoeScoring, RopeScaling};

/// Layers (the largest published models have under 200).
pub const MAX_LAYERS: usize = 4096;
/// Attention heads, and KV heads (published: at most 128).
pub const MAX_HEADS: usize = 4096;
/// The head dimension, and each part of a latent-attention head (published: at most 256).
pub const MAX_HEAD_DIM: usize = 1024;
/// Hidden size, intermediate sizes and latent ranks (published: hidden at most 16384,
/// intermediate at most 53248).
pub const MAX_WIDTH: usize = 1 << 20;
/// Vocabulary (published: at most 262144).
pub const MAX_VOCAB: usize = 1 << 24;
/// Routed experts (published: at most 512).
pub const MAX_EXPERTS: usize = 4096;
/// Parameters (published: about 2^41); keeps `num_params() * bytes per parameter` in range.
pub const MAX_PARAMS: usize = 1 << 48;

/// The first value of a [`ModelSpec`] that cannot be served.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("`{field}` {reason}")]
pub struct SpecError {
    /// The spec's name for the value (`num_heads`, `mla.kv_lora_rank`, `rope_scaling.factor`);
    /// a loader maps it to its own key ([`crate::loader::LoadError::ConfigValue`]).
    pub field: &'static str,
    pub reason: String,
}

fn err(field: &'static str, reason: String) -> SpecError {
    SpecError { field, reason }
}

/// `v` is within `1..=max`.
fn dim(field: &'static str, v: usize, max: usize) -> Result<usize, SpecError> {
    if v == 0 || v > max {
        return Err(err(field, format!("= {v} is not within 1..={max}")));
    }
    Ok(v)
}

/// `a * b`, blaming `field` if it does not fit.
fn mul(field: &'static str, a: usize, b: usize) -> Result<usize, SpecError> {
    a.checked_mul(b)
        .ok_or_else(|| err(field, format!(": {a} * {b} overflows")))
}

fn add(field: &'static str, a: usize, b: usize) -> Result<usize, SpecError> {
    a.checked_add(b)
        .ok_or_else(|| err(field, format!(": {a} + {b} overflows")))
}

/// `v` is finite and above `min` (or at least `min` when `inclusive`).
fn float(field: &'static str, v: f32, min: f32, inclusive: bool) -> Result<(), SpecError> {
    let ok = v.is_finite() && if inclusive { v >= min } else { v > min };
    if !ok {
        let op = if inclusive { ">=" } else { ">" };
        return Err(err(field, format!("= {v} must be finite and {op} {min}")));
    }
    Ok(())
}

fn positions(field: &'static str, v: u32) -> Result<(), SpecError> {
    if v == 0 {
        return Err(err(field, "= 0 must be at least 1".into()));
    }
    Ok(())
}

fn rope_scaling(s: &RopeScaling) -> Result<(), SpecError> {
    match *s {
        RopeScaling::Linear { factor } => float("rope_scaling.factor", factor, 0.0, false),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            float("rope_scaling.factor", factor, 0.0, false)?;
            float("rope_scaling.low_freq_factor", low_freq_factor, 0.0, false)?;
            // The smoothing between the two divides by their difference.
            float(
                "rope_scaling.high_freq_factor",
                high_freq_factor,
                low_freq_factor,
                false,
            )?;
            positions(
                "rope_scaling.original_max_position_embeddings",
                original_max_position_embeddings,
            )
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            mscale_all_dim,
            ..
        } => {
            float("rope_scaling.factor", factor, 0.0, false)?;
            positions(
                "rope_scaling.original_max_position_embeddings",
                original_max_position_embeddings,
            )?;
            // Rotation counts: their logarithm places the ramp.
            float("rope_scaling.beta_fast", beta_fast, 0.0, false)?;
            float("rope_scaling.beta_slow", beta_slow, 0.0, false)?;
            float(
                "rope_scaling.attention_factor",
                attention_factor,
                0.0,
                false,
            )?;
            match mscale_all_dim {
                Some(m) if !m.is_finite() => Err(err(
                    "rope_scaling.mscale_all_dim",
                    format!("= {m} is not finite"),
                )),
                _ => Ok(()),
            }
        }
    }
}

impl ModelSpec {
    /// Checks that the spec describes a model that can be sized and served (see the module
    /// docs); every loader calls it before it allocates from the spec. `Err` names the first
    /// value that is off.
    pub fn validate(&self) -> Result<(), SpecError> {
        let h = dim("hidden_size", self.hidden_size, MAX_WIDTH)?;
        let inter = dim("intermediate_size", self.intermediate_size, MAX_WIDTH)?;
        let layers = dim("num_layers", self.num_layers, MAX_LAYERS)?;
        let heads = dim("num_heads", self.num_heads, MAX_HEADS)?;
        let kv_heads = dim("num_kv_heads", self.num_kv_heads, heads)?;
        if !heads.is_multiple_of(kv_heads) {
            return Err(err(
                "num_kv_heads",
                format!("= {kv_heads} does not divide the {heads} heads"),
            ));
        }
        let head_dim = dim("head_dim", self.head_dim, MAX_HEAD_DIM)?;
        let vocab = dim("vocab_size", self.vocab_size, MAX_VOCAB)?;
        dim(
            "max_position_embeddings",
            self.max_position_embeddings,
            usize::MAX,
        )?;
        float("rms_norm_eps", self.rms_norm_eps, 0.0, true)?;
        float("rope_theta", self.rope_theta, 0.0, false)?;
        if let Some(s) = &self.rope_scaling {
            rope_scaling(s)?;
        }
        if let Some(w) = &self.sliding_window {
            dim("sliding_window.size", w.size, usize::MAX)?;
            if w.layers.len() != layers {
                return Err(err(
                    "sliding_window.layers",
                    format!("lists {} layers of {layers}", w.layers.len()),
                ));
            }
        }
        // The matrices every architecture has.
        mul("vocab_size", vocab, h)?;
        mul("intermediate_size", inter, h)?;
        match &self.mla {
            None => {
                // RoPE rotates pairs of the head.
                if !head_dim.is_multiple_of(2) {
                    return Err(err("head_dim", format!("= {head_dim} is odd")));
                }
                let q = mul("num_heads", heads, head_dim)?;
                mul("num_heads", q, h)?;
                mul("num_kv_heads", kv_heads, head_dim)?;
            }
            Some(m) => {
                let nope = dim("mla.qk_nope_head_dim", m.qk_nope_head_dim, MAX_HEAD_DIM)?;
                let rope = dim("mla.qk_rope_head_dim", m.qk_rope_head_dim, MAX_HEAD_DIM)?;
                if !rope.is_multiple_of(2) {
                    return Err(err("mla.qk_rope_head_dim", format!("= {rope} is odd")));
                }
                let v = dim("mla.v_head_dim", m.v_head_dim, MAX_HEAD_DIM)?;
                let kv_rank = dim("mla.kv_lora_rank", m.kv_lora_rank, MAX_WIDTH)?;
                if let Some(r) = m.q_lora_rank {
                    dim("mla.q_lora_rank", r, MAX_WIDTH)?;
                }
                if add("head_dim", nope, rope)? != head_dim {
                    return Err(err(
                        "head_dim",
                        format!("= {head_dim}, not qk_nope_head_dim + qk_rope_head_dim"),
                    ));
                }
                mul("num_heads", heads, head_dim)?;
                let kv_b = mul("num_heads", heads, add("mla.v_head_dim", nope, v)?)?;
                mul("num_heads", kv_b, kv_rank)?;
                add("mla.kv_lora_rank", kv_rank, rope)?;
                mul("num_heads", mul("num_heads", heads, v)?, h)?;
            }
        }
        if let Some(e) = &self.moe {
            let n = dim("moe.num_experts", e.num_experts, MAX_EXPERTS)?;
            let groups = dim("moe.num_groups", e.num_groups, n)?;
            if !n.is_multiple_of(groups) {
                return Err(err(
                    "moe.num_groups",
                    format!("= {groups} does not divide the {n} experts"),
                ));
            }
            let topk_groups = dim("moe.topk_groups", e.topk_groups, groups)?;
            let per_group = n / groups;
            dim("moe.top_k", e.top_k, topk_groups * per_group)?;
            if e.scoring == MoeScoring::SigmoidBiased && per_group < 2 {
                return Err(err(
                    "moe.num_groups",
                    format!("leaves {per_group} expert per group; a group scores its best two"),
                ));
            }
            let ei = dim("moe.expert_intermediate", e.expert_intermediate, MAX_WIDTH)?;
            if e.num_shared > n {
                return Err(err(
                    "moe.num_shared",
                    format!("= {} is more than the {n} routed experts", e.num_shared),
                ));
            }
            let shared = mul("moe.num_shared", e.num_shared, ei)?;
            if shared > MAX_WIDTH {
                return Err(err(
                    "moe.num_shared",
                    format!("* expert_intermediate = {shared} is above {MAX_WIDTH}"),
                ));
            }
            mul("moe.num_experts", mul("moe.num_experts", n, ei)?, h)?;
            float(
                "moe.routed_scaling_factor",
                e.routed_scaling_factor,
                f32::MIN,
                true,
            )?;
        }
        match self.checked_num_params() {
            Some(p) if p <= MAX_PARAMS => Ok(()),
            p => Err(err(
                "num_layers",
                format!(
                    ": the model would have {} parameters (at most {MAX_PARAMS})",
                    p.map_or_else(|| "more than usize::MAX".to_string(), |p| p.to_string())
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::dummy::{PRESETS, preset};

    #[test]
    fn every_preset_is_valid() {
        for name in PRESETS {
            let s = preset(name).unwrap();
            assert_eq!(s.validate(), Ok(()), "{name}");
        }
    }

    #[test]
    fn each_bad_value_is_named() {
        let base = preset("llama-3.1-8b").unwrap();
        let v3 = preset("deepseek-v3").unwrap();
        type Edit = fn(&mut ModelSpec);
        let cases: &[(&str, &ModelSpec, Edit)] = &[
            ("hidden_size", &base, |s| s.hidden_size = 0),
            ("intermediate_size", &base, |s| {
                s.intermediate_size = 1 << 40
            }),
            ("num_layers", &base, |s| {
                s.num_layers = 1_000_000_000_000_000
            }),
            ("num_heads", &base, |s| s.num_heads = 1 << 24),
            ("num_kv_heads", &base, |s| s.num_kv_heads = 0),
            ("num_kv_heads", &base, |s| s.num_kv_heads = 7),
            ("head_dim", &base, |s| s.head_dim = 1 << 40),
            ("head_dim", &base, |s| s.head_dim = 127),
            ("vocab_size", &base, |s| s.vocab_size = 0),
            ("max_position_embeddings", &base, |s| {
                s.max_position_embeddings = 0
            }),
            ("rms_norm_eps", &base, |s| s.rms_norm_eps = -1e-6),
            ("rms_norm_eps", &base, |s| s.rms_norm_eps = f32::NAN),
            ("rope_theta", &base, |s| s.rope_theta = 0.0),
            ("rope_theta", &base, |s| s.rope_theta = f32::INFINITY),
            ("rope_scaling.factor", &base, |s| {
                s.rope_scaling = Some(RopeScaling::Linear { factor: -2.0 })
            }),
            ("rope_scaling.high_freq_factor", &base, |s| {
                if let Some(RopeScaling::Llama3 {
                    high_freq_factor, ..
                }) = &mut s.rope_scaling
                {
                    *high_freq_factor = 1.0;
                }
            }),
            (
                "rope_scaling.original_max_position_embeddings",
                &base,
                |s| {
                    if let Some(RopeScaling::Llama3 {
                        original_max_position_embeddings,
                        ..
                    }) = &mut s.rope_scaling
                    {
                        *original_max_position_embeddings = 0;
                    }
                },
            ),
            ("rope_scaling.beta_fast", &v3, |s| {
                if let Some(RopeScaling::Yarn { beta_fast, .. }) = &mut s.rope_scaling {
                    *beta_fast = 0.0;
                }
            }),
            ("head_dim", &v3, |s| s.head_dim = 128),
            ("mla.kv_lora_rank", &v3, |s| {
                s.mla.as_mut().unwrap().kv_lora_rank = 1 << 50
            }),
            ("mla.q_lora_rank", &v3, |s| {
                s.mla.as_mut().unwrap().q_lora_rank = Some(0)
            }),
            ("moe.num_experts", &v3, |s| {
                s.moe.as_mut().unwrap().num_experts = 1 << 30
            }),
            ("moe.top_k", &v3, |s| s.moe.as_mut().unwrap().top_k = 0),
            ("moe.top_k", &v3, |s| s.moe.as_mut().unwrap().top_k = 200),
            ("moe.num_groups", &v3, |s| {
                s.moe.as_mut().unwrap().num_groups = 3
            }),
            ("moe.num_shared", &v3, |s| {
                s.moe.as_mut().unwrap().num_shared = 1 << 40
            }),
            ("moe.expert_intermediate", &v3, |s| {
                s.moe.as_mut().unwrap().expert_intermediate = 0
            }),
            // Each bound holds, yet the whole is too large.
            ("num_layers", &v3, |s| {
                s.num_layers = MAX_LAYERS;
                s.hidden_size = MAX_WIDTH;
                s.moe.as_mut().unwrap().expert_intermediate = MAX_WIDTH;
            }),
        ];
        for (field, spec, edit) in cases {
            let mut s = (*spec).clone();
            edit(&mut s);
            match s.validate() {
                Err(e) => assert_eq!(e.field, *field, "{e}"),
                Ok(()) => panic!("{field}: accepted"),
            }
        }
    }
}
