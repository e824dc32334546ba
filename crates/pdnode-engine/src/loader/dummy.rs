//! `dummy` models: the exact shapes of a named preset with seeded random weights (vLLM's
//! `--load-format dummy`), for benchmarks.
//!
//! Weights are a pure function of `(seed, tensor id, element index)` ([`value`]): a counter-based
//! generator (splitmix64) any backend can evaluate element by element — the CPU backend via
//! [`materialize`], the CUDA backend in a kernel on the device — and get the same numbers.
//! Norm weights (attn/mlp/final norm, q/k norm) are 1.0 and qkv biases 0.0; every other tensor is
//! uniform on `[-std*sqrt(3), std*sqrt(3))` (standard deviation `std`).

use super::DummySpec;
use crate::spec::{Arch, MlaSpec, ModelSpec, MoeScoring, MoeSpec, RopeScaling, yarn_mscale};
use crate::weights::{
    Expert, Ffn, LayerWeights, MlaLayerWeights, MlaQuery, MlaWeights, MoeWeights, Tensor, Weights,
};
use rayon::prelude::*;

/// Preset names, for help texts and errors (the config's list, which validation checks).
pub use pdnode_core::config::MODEL_PRESETS as PRESETS;

/// Default weight standard deviation: small enough that activations stay sane through every
/// layer (RMSNorm re-normalizes the residual stream's input to each block).
pub const DEFAULT_STD: f32 = 0.02;

fn llama31(hidden: usize, inter: usize, layers: usize, heads: usize) -> ModelSpec {
    ModelSpec {
        arch: Arch::Llama,
        hidden_size: hidden,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: 8,
        head_dim: 128,
        vocab_size: 128_256,
        rms_norm_eps: 1e-5,
        rope_theta: 500_000.0,
        rope_scaling: Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
        max_position_embeddings: 131_072,
        tie_word_embeddings: false,
        qkv_bias: false,
        qk_norm: false,
        sliding_window: None,
        mla: None,
        moe: None,
        bos_token_id: Some(128_000),
        eos_token_ids: vec![128_001, 128_008, 128_009],
    }
}

/// Llama-3.1-8B's shapes (preset `llama-3.1-8b`; also what the CUDA benchmarks run).
pub fn llama31_8b() -> ModelSpec {
    llama31(4096, 14336, 32, 32)
}

/// DeepSeek's YaRN: 40x over 4096 positions.
fn deepseek_yarn(mscale: f32, mscale_all_dim: f32) -> RopeScaling {
    RopeScaling::Yarn {
        factor: 40.0,
        original_max_position_embeddings: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: yarn_mscale(40.0, mscale) / yarn_mscale(40.0, mscale_all_dim),
        mscale_all_dim: Some(mscale_all_dim),
        truncate: true,
    }
}

/// DeepSeek-V2-Lite's shapes (`deepseek-ai/DeepSeek-V2-Lite` config.json): 27 layers, the first
/// dense, then 64 routed experts (top-6) and 2 shared; q without a low rank.
pub fn deepseek_v2_lite() -> ModelSpec {
    ModelSpec {
        arch: Arch::DeepseekV2,
        hidden_size: 2048,
        intermediate_size: 10944,
        num_layers: 27,
        num_heads: 16,
        num_kv_heads: 16,
        head_dim: 192,
        vocab_size: 102_400,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        rope_scaling: Some(deepseek_yarn(0.707, 0.707)),
        max_position_embeddings: 163_840,
        tie_word_embeddings: false,
        qkv_bias: false,
        qk_norm: false,
        sliding_window: None,
        mla: Some(MlaSpec {
            q_lora_rank: None,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            rope_interleave: true,
        }),
        moe: Some(MoeSpec {
            num_experts: 64,
            top_k: 6,
            num_shared: 2,
            expert_intermediate: 1408,
            first_dense_layers: 1,
            num_groups: 1,
            topk_groups: 1,
            scoring: MoeScoring::Softmax {
                group_limited: false,
            },
            norm_topk_prob: false,
            routed_scaling_factor: 1.0,
        }),
        bos_token_id: Some(100_000),
        eos_token_ids: vec![100_001],
    }
}

/// DeepSeek-V3's shapes (`deepseek-ai/DeepSeek-V3` config.json, without the multi-token
/// prediction layer): 61 layers, 3 dense, then 256 routed experts (top-8 within 4 of 8 groups)
/// and 1 shared.
pub fn deepseek_v3() -> ModelSpec {
    ModelSpec {
        arch: Arch::DeepseekV3,
        hidden_size: 7168,
        intermediate_size: 18432,
        num_layers: 61,
        num_heads: 128,
        num_kv_heads: 128,
        head_dim: 192,
        vocab_size: 129_280,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        rope_scaling: Some(deepseek_yarn(1.0, 1.0)),
        max_position_embeddings: 163_840,
        tie_word_embeddings: false,
        qkv_bias: false,
        qk_norm: false,
        sliding_window: None,
        mla: Some(MlaSpec {
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            rope_interleave: true,
        }),
        moe: Some(MoeSpec {
            num_experts: 256,
            top_k: 8,
            num_shared: 1,
            expert_intermediate: 2048,
            first_dense_layers: 3,
            num_groups: 8,
            topk_groups: 4,
            scoring: MoeScoring::SigmoidBiased,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
        }),
        bos_token_id: Some(0),
        eos_token_ids: vec![1],
    }
}

/// The [`ModelSpec`] of a named preset (HF `config.json` of the instruct release), or `None`.
pub fn preset(name: &str) -> Option<ModelSpec> {
    Some(match name.to_ascii_lowercase().as_str() {
        "llama-3.1-8b" => llama31_8b(),
        "llama-3.1-70b" => llama31(8192, 28672, 80, 64),
        "deepseek-v2-lite" => deepseek_v2_lite(),
        "deepseek-v3" => deepseek_v3(),
        "qwen2.5-7b" => ModelSpec {
            arch: Arch::Qwen2,
            hidden_size: 3584,
            intermediate_size: 18944,
            num_layers: 28,
            num_heads: 28,
            num_kv_heads: 4,
            head_dim: 128,
            vocab_size: 152_064,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            max_position_embeddings: 32_768,
            tie_word_embeddings: false,
            qkv_bias: true,
            qk_norm: false,
            sliding_window: None,
            mla: None,
            moe: None,
            bos_token_id: Some(151_643),
            eos_token_ids: vec![151_645, 151_643],
        },
        "qwen3-8b" => ModelSpec {
            arch: Arch::Qwen3,
            hidden_size: 4096,
            intermediate_size: 12288,
            num_layers: 36,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            vocab_size: 151_936,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            max_position_embeddings: 40_960,
            tie_word_embeddings: false,
            qkv_bias: false,
            qk_norm: true,
            sliding_window: None,
            mla: None,
            moe: None,
            bos_token_id: Some(151_643),
            eos_token_ids: vec![151_645, 151_643],
        },
        "smollm2-135m" => ModelSpec {
            arch: Arch::Llama,
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            vocab_size: 49_152,
            rms_norm_eps: 1e-5,
            rope_theta: 100_000.0,
            rope_scaling: None,
            max_position_embeddings: 8192,
            tie_word_embeddings: true,
            qkv_bias: false,
            qk_norm: false,
            sliding_window: None,
            mla: None,
            moe: None,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
        },
        _ => return None,
    })
}

/// Which tensor of the model; [`TensorKind::id`] numbers them for [`value`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorKind {
    Embed,
    FinalNorm,
    LmHead,
    AttnNorm(usize),
    Wq(usize),
    Wk(usize),
    Wv(usize),
    Bq(usize),
    Bk(usize),
    Bv(usize),
    QNorm(usize),
    KNorm(usize),
    Wo(usize),
    MlpNorm(usize),
    WGate(usize),
    WUp(usize),
    WDown(usize),
}

/// What every element of a tensor is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fill {
    Const(f32),
    /// Uniform with this standard deviation, from [`value`].
    Random,
}

impl TensorKind {
    /// Stable id: 0 embed, 1 final norm, 2 lm_head, `16 + 16 * layer + k` for layer tensors
    /// (k: attn_norm 0, wq 1, wk 2, wv 3, bq 4, bk 5, bv 6, q_norm 7, k_norm 8, wo 9, mlp_norm 10,
    /// gate 11, up 12, down 13).
    pub fn id(self) -> u64 {
        use TensorKind::*;
        let (layer, k) = match self {
            Embed => return 0,
            FinalNorm => return 1,
            LmHead => return 2,
            AttnNorm(l) => (l, 0),
            Wq(l) => (l, 1),
            Wk(l) => (l, 2),
            Wv(l) => (l, 3),
            Bq(l) => (l, 4),
            Bk(l) => (l, 5),
            Bv(l) => (l, 6),
            QNorm(l) => (l, 7),
            KNorm(l) => (l, 8),
            Wo(l) => (l, 9),
            MlpNorm(l) => (l, 10),
            WGate(l) => (l, 11),
            WUp(l) => (l, 12),
            WDown(l) => (l, 13),
        };
        16 + 16 * layer as u64 + k
    }

    pub fn fill(self) -> Fill {
        use TensorKind::*;
        match self {
            FinalNorm | AttnNorm(_) | MlpNorm(_) | QNorm(_) | KNorm(_) => Fill::Const(1.0),
            Bq(_) | Bk(_) | Bv(_) => Fill::Const(0.0),
            _ => Fill::Random,
        }
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Element `index` of random tensor `tensor_id`:
/// `u = (splitmix64(splitmix64(seed ^ (tensor_id << 40)) ^ index) >> 40) as f32 / 2^24`
/// (uniform on [0, 1)), value `(2u - 1) * std * sqrt(3)`.
pub fn value(seed: u64, tensor_id: u64, index: u64, std: f32) -> f32 {
    let base = splitmix64(seed ^ (tensor_id << 40));
    let u = (splitmix64(base ^ index) >> 40) as f32 / (1u64 << 24) as f32;
    (2.0 * u - 1.0) * std * 3f32.sqrt()
}

/// Generates one tensor on the host.
pub fn tensor(d: DummySpec, kind: TensorKind, shape: Vec<usize>) -> Tensor {
    filled(d, kind.id(), kind.fill(), shape)
}

/// A tensor of `shape` filled as `fill` says, random values from tensor id `id`.
fn filled(d: DummySpec, id: u64, fill: Fill, shape: Vec<usize>) -> Tensor {
    let n: usize = shape.iter().product();
    let data = match fill {
        Fill::Const(c) => vec![c; n],
        Fill::Random => {
            let mut v = vec![0f32; n];
            v.par_chunks_mut(1 << 16)
                .enumerate()
                .for_each(|(c, chunk)| {
                    for (j, x) in chunk.iter_mut().enumerate() {
                        *x = value(d.seed, id, (c * (1 << 16) + j) as u64, d.std);
                    }
                });
            v
        }
    };
    Tensor::new(shape, data)
}

/// Materializes every weight of `spec` on the host (for the CPU backend; mind the size:
/// `spec.num_params() * 4` bytes).
pub fn materialize(spec: &ModelSpec, d: DummySpec) -> Weights {
    use TensorKind::*;
    let (h, q, kv, i) = (
        spec.hidden_size,
        spec.q_dim(),
        spec.kv_dim(),
        spec.intermediate_size,
    );
    let t = |k: TensorKind, shape: &[usize]| tensor(d, k, shape.to_vec());
    let opt = |on: bool, k: TensorKind, shape: &[usize]| on.then(|| t(k, shape));
    let layers = (0..spec.num_layers)
        .map(|l| LayerWeights {
            attn_norm: t(AttnNorm(l), &[h]),
            wq: t(Wq(l), &[q, h]),
            wk: t(Wk(l), &[kv, h]),
            wv: t(Wv(l), &[kv, h]),
            bq: opt(spec.qkv_bias, Bq(l), &[q]),
            bk: opt(spec.qkv_bias, Bk(l), &[kv]),
            bv: opt(spec.qkv_bias, Bv(l), &[kv]),
            q_norm: opt(spec.qk_norm, QNorm(l), &[spec.head_dim]),
            k_norm: opt(spec.qk_norm, KNorm(l), &[spec.head_dim]),
            wo: t(Wo(l), &[h, q]),
            mlp_norm: t(MlpNorm(l), &[h]),
            w_gate: t(WGate(l), &[i, h]),
            w_up: t(WUp(l), &[i, h]),
            w_down: t(WDown(l), &[h, i]),
        })
        .collect();
    Weights {
        embed: t(Embed, &[spec.vocab_size, h]),
        layers,
        final_norm: t(FinalNorm, &[h]),
        lm_head: opt(!spec.tie_word_embeddings, LmHead, &[spec.vocab_size, h]),
    }
}

/// Materializes every weight of a latent-attention `spec` on the host (`None` when it has no
/// `mla`). Norms are 1.0 and V3's routing bias 0.0; every other tensor is random, tensor `i`
/// (in [`MlaWeights::tensors`] order) with id `1 << 20 | i` in [`value`].
pub fn materialize_mla(spec: &ModelSpec, d: DummySpec) -> Option<MlaWeights> {
    let m = spec.mla.as_ref()?;
    let (h, nh) = (spec.hidden_size, spec.num_heads);
    let mut next = 0u64;
    let mut t = |shape: &[usize], fill: Fill| {
        let id = 1 << 20 | next;
        next += 1;
        filled(d, id, fill, shape.to_vec())
    };
    let r = Fill::Random;
    let one = Fill::Const(1.0);
    let embed = t(&[spec.vocab_size, h], r);
    let mut layers = Vec::with_capacity(spec.num_layers);
    for l in 0..spec.num_layers {
        let attn_norm = t(&[h], one);
        let rows = nh * m.qk_head_dim();
        let q = match m.q_lora_rank {
            None => MlaQuery::Direct {
                wq: t(&[rows, h], r),
            },
            Some(qr) => MlaQuery::LowRank {
                wq_a: t(&[qr, h], r),
                q_a_norm: t(&[qr], one),
                wq_b: t(&[rows, qr], r),
            },
        };
        let wkv_a = t(&[m.latent_dim(), h], r);
        let kv_a_norm = t(&[m.kv_lora_rank], one);
        let wkv_b = t(
            &[nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
            r,
        );
        let wo = t(&[h, nh * m.v_head_dim], r);
        let mlp_norm = t(&[h], one);
        let ffn = match &spec.moe {
            Some(e) if e.is_moe_layer(l) => {
                let router = t(&[e.num_experts, h], r);
                let score_bias = (e.scoring == MoeScoring::SigmoidBiased)
                    .then(|| t(&[e.num_experts], Fill::Const(0.0)));
                let experts = (0..e.num_experts)
                    .map(|_| dummy_expert(&mut t, e.expert_intermediate, h))
                    .collect();
                let shared =
                    (e.num_shared > 0).then(|| dummy_expert(&mut t, e.shared_intermediate(), h));
                Ffn::Moe(MoeWeights {
                    router,
                    score_bias,
                    experts,
                    shared,
                })
            }
            _ => Ffn::Dense(dummy_expert(&mut t, spec.intermediate_size, h)),
        };
        layers.push(MlaLayerWeights {
            attn_norm,
            q,
            wkv_a,
            kv_a_norm,
            wkv_b,
            wo,
            mlp_norm,
            ffn,
        });
    }
    let final_norm = t(&[h], one);
    let lm_head = (!spec.tie_word_embeddings).then(|| t(&[spec.vocab_size, h], r));
    Some(MlaWeights {
        embed,
        layers,
        final_norm,
        lm_head,
    })
}

fn dummy_expert(t: &mut impl FnMut(&[usize], Fill) -> Tensor, inter: usize, h: usize) -> Expert {
    Expert {
        w_gate: t(&[inter, h], Fill::Random),
        w_up: t(&[inter, h], Fill::Random),
        w_down: t(&[h, inter], Fill::Random),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_consistent_shapes() {
        for name in PRESETS {
            let s = preset(name).unwrap();
            assert_eq!(s.num_heads % s.num_kv_heads, 0, "{name}");
        }
        let params = |name: &str, want: f64, tol: f64| {
            let got = preset(name).unwrap().num_params() as f64;
            assert!((got - want).abs() < tol, "{name}: {got} parameters");
        };
        // Llama 3.1 8B: 8.03e9 parameters; SmolLM2: 134.5e6; DeepSeek-V2-Lite: 15.7e9;
        // DeepSeek-V3: 671e9 (without its MTP layer).
        params("llama-3.1-8b", 8.03e9, 0.02e9);
        params("smollm2-135m", 134.5e6, 1e6);
        params("deepseek-v2-lite", 15.7e9, 0.1e9);
        params("deepseek-v3", 671e9, 2e9);
        assert!(preset("gpt-5").is_none());
        let v2 = preset("deepseek-v2-lite").unwrap();
        assert_eq!(v2.kv_cache_shape(), (1, 1, 576));
    }

    #[test]
    fn dummy_deepseek_weights_fit_their_spec() {
        for name in ["deepseek-v2-lite", "deepseek-v3"] {
            let full = preset(name).unwrap();
            let mut tiny = full.clone();
            tiny.hidden_size = 32;
            tiny.intermediate_size = 48;
            tiny.vocab_size = 40;
            tiny.num_heads = 2;
            tiny.num_kv_heads = 2;
            tiny.num_layers = full.moe.as_ref().unwrap().first_dense_layers + 1;
            if let Some(e) = tiny.moe.as_mut() {
                e.expert_intermediate = 8;
            }
            let w = materialize_mla(&tiny, DummySpec { seed: 3, std: 0.02 }).unwrap();
            w.check_shapes(&tiny).unwrap();
            assert!(
                matches!(w.layers.last().unwrap().ffn, Ffn::Moe(_)),
                "{name}"
            );
            assert!(matches!(w.layers[0].ffn, Ffn::Dense(_)), "{name}");
        }
        assert!(materialize_mla(&llama31_8b(), DummySpec { seed: 3, std: 0.02 }).is_none());
    }

    #[test]
    fn values_are_deterministic_and_have_the_requested_spread() {
        let d = DummySpec { seed: 7, std: 0.02 };
        let a = tensor(d, TensorKind::Wq(3), vec![64, 64]);
        let b = tensor(d, TensorKind::Wq(3), vec![64, 64]);
        let c = tensor(d, TensorKind::Wk(3), vec![64, 64]);
        assert_eq!(a, b);
        assert_ne!(a, c);
        let n = a.data.len() as f32;
        let mean = a.data.iter().sum::<f32>() / n;
        let std = (a.data.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / n).sqrt();
        assert!(
            mean.abs() < 0.002 && (std - 0.02).abs() < 0.002,
            "{mean} {std}"
        );
        assert_eq!(a.data[100], value(7, TensorKind::Wq(3).id(), 100, 0.02));
        let s = preset("smollm2-135m").unwrap();
        let tiny = ModelSpec {
            num_layers: 1,
            vocab_size: 32,
            ..s
        };
        let w = materialize(&tiny, d);
        w.check_shapes(&tiny).unwrap();
        assert!(w.layers[0].attn_norm.data.iter().all(|&x| x == 1.0));
    }
}
