//! DeepSeek-V2/V3 in a Hugging Face directory: the latent-attention and MoE parts of
//! `config.json` ([`MlaSpec`], [`MoeSpec`], YaRN) and the weights under the names the published
//! checkpoints use (`mlp.experts.{e}.gate_proj.weight`, ...).

use super::LoadError;
use super::hf::Cfg;
use super::safetensors_io::SafetensorsSet;
use crate::spec::{Arch, MlaSpec, ModelSpec, MoeScoring, MoeSpec, RopeScaling, yarn_mscale};
use crate::weights::{Expert, Ffn, MlaLayerWeights, MlaQuery, MlaWeights, MoeWeights};
use serde_json::Value;

/// The latent-attention part of a DeepSeek config.
pub(super) fn mla_spec(c: &Cfg<'_>, arch: Arch) -> Result<MlaSpec, LoadError> {
    if c.bool("attention_bias") {
        return Err(c.unsupported("attention_bias = true on a latent-attention model".into()));
    }
    let m = MlaSpec {
        q_lora_rank: c.opt_u("q_lora_rank")?.filter(|&r| r > 0),
        kv_lora_rank: c.req_u("kv_lora_rank")?,
        qk_nope_head_dim: c.req_u("qk_nope_head_dim")?,
        qk_rope_head_dim: c.req_u("qk_rope_head_dim")?,
        v_head_dim: c.req_u("v_head_dim")?,
        // transformers' DeepseekV2 always pairs interleaved dimensions; V3 unless told not to.
        rope_interleave: arch == Arch::DeepseekV2
            || c.v.get("rope_interleave").and_then(Value::as_bool) != Some(false),
    };
    if m.kv_lora_rank == 0 || m.v_head_dim == 0 || m.qk_nope_head_dim == 0 {
        return Err(c.err("kv_lora_rank, qk_nope_head_dim and v_head_dim must be positive".into()));
    }
    if m.qk_rope_head_dim == 0 || !m.qk_rope_head_dim.is_multiple_of(2) {
        return Err(c.err(format!(
            "qk_rope_head_dim {} must be even and non-zero",
            m.qk_rope_head_dim
        )));
    }
    Ok(m)
}

/// The mixture-of-experts part of a DeepSeek config; `None` when it has no routed experts.
pub(super) fn moe_spec(c: &Cfg<'_>, arch: Arch) -> Result<Option<MoeSpec>, LoadError> {
    let num_experts = c.opt_u("n_routed_experts")?.unwrap_or(0);
    if num_experts == 0 {
        return Ok(None);
    }
    if let Some(f) = c.opt_u("moe_layer_freq")?.filter(|&f| f != 1) {
        return Err(c.unsupported(format!(
            "moe_layer_freq = {f} (every layer from first_k_dense_replace on is a MoE layer)"
        )));
    }
    let str_of = |k: &str| c.v.get(k).and_then(Value::as_str);
    let scoring = match arch {
        Arch::DeepseekV3 => {
            if let Some(m) = str_of("topk_method").filter(|m| *m != "noaux_tc") {
                return Err(c.unsupported(format!("topk_method `{m}` on deepseek_v3")));
            }
            if let Some(f) = str_of("scoring_func").filter(|f| *f != "sigmoid") {
                return Err(c.unsupported(format!("scoring_func `{f}` on deepseek_v3")));
            }
            MoeScoring::SigmoidBiased
        }
        _ => {
            if let Some(f) = str_of("scoring_func").filter(|f| *f != "softmax") {
                return Err(c.unsupported(format!("scoring_func `{f}` on deepseek_v2")));
            }
            match str_of("topk_method").unwrap_or("greedy") {
                "greedy" => MoeScoring::Softmax {
                    group_limited: false,
                },
                "group_limited_greedy" => MoeScoring::Softmax {
                    group_limited: true,
                },
                m => {
                    return Err(c.unsupported(format!(
                        "topk_method `{m}` (supported on deepseek_v2: greedy, group_limited_greedy)"
                    )));
                }
            }
        }
    };
    let grouped = scoring
        != MoeScoring::Softmax {
            group_limited: false,
        };
    let num_groups = if grouped {
        c.opt_u("n_group")?.unwrap_or(1)
    } else {
        1
    };
    let topk_groups = if grouped {
        c.opt_u("topk_group")?.unwrap_or(num_groups)
    } else {
        1
    };
    let e = MoeSpec {
        num_experts,
        top_k: c.req_u("num_experts_per_tok")?,
        num_shared: c.opt_u("n_shared_experts")?.unwrap_or(0),
        expert_intermediate: c.req_u("moe_intermediate_size")?,
        first_dense_layers: c.opt_u("first_k_dense_replace")?.unwrap_or(0),
        num_groups,
        topk_groups,
        scoring,
        // Honoured on V2 too, as DeepSeek's own modeling code does (transformers' V2 router
        // ignores it; the published V2 configs set it false, where both agree).
        norm_topk_prob: c.bool("norm_topk_prob"),
        routed_scaling_factor: c.opt_f("routed_scaling_factor")?.unwrap_or(1.0),
    };
    if num_groups == 0 || !num_experts.is_multiple_of(num_groups) {
        return Err(c.err(format!(
            "{num_experts} routed experts do not split into n_group = {num_groups} groups"
        )));
    }
    let per_group = num_experts / num_groups;
    if topk_groups == 0 || topk_groups > num_groups {
        return Err(c.err(format!(
            "topk_group = {topk_groups} must be within 1..={num_groups}"
        )));
    }
    if e.top_k == 0 || e.top_k > topk_groups * per_group {
        return Err(c.err(format!(
            "num_experts_per_tok = {} must be within 1..={} (the experts of topk_group groups)",
            e.top_k,
            topk_groups * per_group
        )));
    }
    if scoring == MoeScoring::SigmoidBiased && per_group < 2 {
        return Err(c.err(format!(
            "a group's score is the sum of its best two experts: {per_group} per group"
        )));
    }
    if e.expert_intermediate == 0 {
        return Err(c.err("moe_intermediate_size is 0".into()));
    }
    Ok(Some(e))
}

/// `rope_scaling` of type `yarn` (`rs` is its object), with `attention_factor` resolved as
/// transformers does.
pub(super) fn yarn(
    c: &Cfg<'_>,
    rs: &Value,
    max_position_embeddings: usize,
) -> Result<RopeScaling, LoadError> {
    let num = |k: &str| -> Result<Option<f32>, LoadError> {
        match rs.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| c.err(format!("`rope_scaling.{k}` = {v} is not a number"))),
        }
    };
    let orig_positions = super::hf::positions(c, rs, "original_max_position_embeddings")?;
    let orig = orig_positions as f32;
    let factor = num("factor")?.unwrap_or(max_position_embeddings as f32 / orig);
    if !(factor.is_finite() && factor > 0.0) {
        return Err(c.err(format!("`rope_scaling.factor` = {factor}")));
    }
    let (mscale, mscale_all_dim) = (
        num("mscale")?.filter(|&x| x != 0.0),
        num("mscale_all_dim")?.filter(|&x| x != 0.0),
    );
    let attention_factor = match (num("attention_factor")?, mscale, mscale_all_dim) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) => yarn_mscale(factor, m) / yarn_mscale(factor, all),
        (None, _, _) => yarn_mscale(factor, 1.0),
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: orig_positions,
        beta_fast: num("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
        beta_slow: num("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
        attention_factor,
        mscale_all_dim,
        truncate: rs.get("truncate").and_then(Value::as_bool).unwrap_or(true),
    })
}

/// `quantization_config` of a block-FP8 checkpoint (DeepSeek-V3): the block its
/// `weight_scale_inv` tensors cover, `None` without one; any other method is refused.
pub(super) fn fp8_block(
    config: &Value,
    path: &std::path::Path,
) -> Result<Option<[usize; 2]>, LoadError> {
    let Some(q) = config.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(None);
    };
    let unsupported = |reason: String| LoadError::Unsupported {
        path: path.to_path_buf(),
        reason,
    };
    match q.get("quant_method").and_then(Value::as_str) {
        Some("fp8") => {}
        m => {
            return Err(unsupported(format!(
                "quantization_config.quant_method {m:?} (supported: fp8 with weight_block_size)"
            )));
        }
    }
    if let Some(f) = q
        .get("fmt")
        .and_then(Value::as_str)
        .filter(|f| *f != "e4m3")
    {
        return Err(unsupported(format!("FP8 format `{f}` (supported: e4m3)")));
    }
    let block: Option<Vec<usize>> = q
        .get("weight_block_size")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok()))
                .collect()
        });
    match block.as_deref() {
        Some(&[b0, b1]) if b0 > 0 && b1 > 0 => Ok(Some([b0, b1])),
        _ => Err(unsupported(
            "block FP8 needs quantization_config.weight_block_size = [rows, columns]".into(),
        )),
    }
}

fn expert(st: &SafetensorsSet, p: &str, h: usize, inter: usize) -> Result<Expert, LoadError> {
    Ok(Expert {
        w_gate: st.load(&format!("{p}.gate_proj.weight"), &[inter, h])?,
        w_up: st.load(&format!("{p}.up_proj.weight"), &[inter, h])?,
        w_down: st.load(&format!("{p}.down_proj.weight"), &[h, inter])?,
    })
}

/// Reads every weight of a DeepSeek `spec` (whose `mla` is `m`) from the safetensors set. Tensors
/// of layers past `num_hidden_layers` (DeepSeek-V3's multi-token-prediction layer) are not read.
pub(super) fn weights(
    st: &SafetensorsSet,
    s: &ModelSpec,
    m: &MlaSpec,
) -> Result<MlaWeights, LoadError> {
    let (h, nh) = (s.hidden_size, s.num_heads);
    let rows = nh * m.qk_head_dim();
    // Never more than the file has tensors, whatever spec the caller passes.
    let mut layers = Vec::with_capacity(s.num_layers.min(st.len()));
    for n in 0..s.num_layers {
        let p = |x: &str| format!("model.layers.{n}.{x}");
        let q = match m.q_lora_rank {
            None => MlaQuery::Direct {
                wq: st.load(&p("self_attn.q_proj.weight"), &[rows, h])?,
            },
            Some(r) => MlaQuery::LowRank {
                wq_a: st.load(&p("self_attn.q_a_proj.weight"), &[r, h])?,
                q_a_norm: st.load(&p("self_attn.q_a_layernorm.weight"), &[r])?,
                wq_b: st.load(&p("self_attn.q_b_proj.weight"), &[rows, r])?,
            },
        };
        let ffn = match &s.moe {
            Some(e) if e.is_moe_layer(n) => Ffn::Moe(MoeWeights {
                router: st.load(&p("mlp.gate.weight"), &[e.num_experts, h])?,
                score_bias: if e.scoring == MoeScoring::SigmoidBiased {
                    Some(st.load(&p("mlp.gate.e_score_correction_bias"), &[e.num_experts])?)
                } else {
                    None
                },
                experts: (0..e.num_experts)
                    .map(|i| {
                        expert(
                            st,
                            &p(&format!("mlp.experts.{i}")),
                            h,
                            e.expert_intermediate,
                        )
                    })
                    .collect::<Result<_, _>>()?,
                shared: if e.num_shared > 0 {
                    Some(expert(
                        st,
                        &p("mlp.shared_experts"),
                        h,
                        e.shared_intermediate(),
                    )?)
                } else {
                    None
                },
            }),
            _ => Ffn::Dense(expert(st, &p("mlp"), h, s.intermediate_size)?),
        };
        layers.push(MlaLayerWeights {
            attn_norm: st.load(&p("input_layernorm.weight"), &[h])?,
            q,
            wkv_a: st.load(
                &p("self_attn.kv_a_proj_with_mqa.weight"),
                &[m.latent_dim(), h],
            )?,
            kv_a_norm: st.load(&p("self_attn.kv_a_layernorm.weight"), &[m.kv_lora_rank])?,
            wkv_b: st.load(
                &p("self_attn.kv_b_proj.weight"),
                &[nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
            )?,
            wo: st.load(&p("self_attn.o_proj.weight"), &[h, nh * m.v_head_dim])?,
            mlp_norm: st.load(&p("post_attention_layernorm.weight"), &[h])?,
            ffn,
        });
    }
    let w = MlaWeights {
        embed: st.load("model.embed_tokens.weight", &[s.vocab_size, h])?,
        layers,
        final_norm: st.load("model.norm.weight", &[h])?,
        lm_head: if s.tie_word_embeddings {
            None
        } else {
            Some(st.load("lm_head.weight", &[s.vocab_size, h])?)
        },
    };
    st.finish();
    Ok(w)
}

#[cfg(test)]
mod tests {
    use crate::loader::LoadError;
    use crate::loader::hf::spec_from_config;
    use crate::spec::{Arch, MoeScoring, RopeScaling, yarn_mscale};
    use serde_json::{Value, json};
    use std::path::Path;

    /// DeepSeek-V2-Lite's config.json as published (trust_remote_code era: `rope_scaling` with
    /// `type`, `moe_layer_freq`, `scoring_func`).
    fn v2_lite() -> Value {
        json!({
            "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 27,
            "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 102400,
            "kv_lora_rank": 512, "q_lora_rank": null, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
            "n_shared_experts": 2, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy",
            "n_group": 1, "topk_group": 1, "norm_topk_prob": false, "scoring_func": "softmax",
            "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6, "rope_theta": 10000,
            "max_position_embeddings": 163840, "bos_token_id": 100000, "eos_token_id": 100001,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                             "mscale_all_dim": 0.707}
        })
    }

    #[test]
    fn the_published_v2_lite_config_is_the_preset() {
        let s = spec_from_config(&v2_lite(), None, Path::new("config.json")).unwrap();
        assert_eq!(s, crate::loader::dummy::deepseek_v2_lite());
        let m = s.mla.unwrap();
        assert_eq!((m.latent_dim(), m.qk_head_dim()), (576, 192));
        assert!(matches!(
            s.rope_scaling,
            Some(RopeScaling::Yarn { attention_factor, mscale_all_dim: Some(a), .. })
                if attention_factor == 1.0 && a == 0.707
        ));
        // V3 by model_type alone, with its routing.
        let mut v3 = v2_lite();
        v3.as_object_mut().unwrap().remove("architectures");
        v3["model_type"] = json!("deepseek_v3");
        v3["topk_method"] = json!("noaux_tc");
        v3["scoring_func"] = json!("sigmoid");
        v3["n_group"] = json!(8);
        v3["topk_group"] = json!(4);
        v3["rope_scaling"]["mscale"] = json!(1.0);
        v3["rope_scaling"]["mscale_all_dim"] = json!(0.5);
        let s = spec_from_config(&v3, None, Path::new("config.json")).unwrap();
        assert_eq!(s.arch, Arch::DeepseekV3);
        let e = s.moe.unwrap();
        assert_eq!(
            (e.scoring, e.num_groups, e.topk_groups),
            (MoeScoring::SigmoidBiased, 8, 4)
        );
        let want = yarn_mscale(40.0, 1.0) / yarn_mscale(40.0, 0.5);
        assert!(matches!(
            s.rope_scaling,
            Some(RopeScaling::Yarn { attention_factor, .. }) if attention_factor == want
        ));
    }

    #[test]
    fn what_cannot_be_served_is_refused_not_approximated() {
        let p = Path::new("config.json");
        for (k, v) in [
            ("moe_layer_freq", json!(2)),
            ("topk_method", json!("noaux_tc")),
            ("scoring_func", json!("sigmoid")),
            ("attention_bias", json!(true)),
            ("num_experts_per_tok", json!(65)),
            ("n_group", json!(3)),
            ("qk_rope_head_dim", json!(63)),
            ("kv_lora_rank", json!(0)),
        ] {
            let mut c = v2_lite();
            c[k] = v.clone();
            if k == "n_group" {
                c["topk_method"] = json!("group_limited_greedy");
            }
            assert!(
                matches!(
                    spec_from_config(&c, None, p),
                    Err(LoadError::Unsupported { .. } | LoadError::Config { .. })
                ),
                "{k} = {v}"
            );
        }
        let mut c = v2_lite();
        c.as_object_mut().unwrap().remove("kv_lora_rank");
        assert!(matches!(
            spec_from_config(&c, None, p),
            Err(LoadError::Config { .. })
        ));
        // YaRN only where its attention factor is applied (DeepSeek).
        let mut llama = v2_lite();
        llama["architectures"] = json!(["LlamaForCausalLM"]);
        assert!(matches!(
            spec_from_config(&llama, None, p),
            Err(LoadError::Config { .. })
        ));
    }
}
