//! The normalized description of a model's architecture, built from an HF `config.json`, GGUF
//! metadata or a named preset. Both backends build from a [`ModelSpec`] plus [`crate::weights::Weights`].

use serde::{Deserialize, Serialize};

mod validate;
pub use validate::{
    MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_PARAMS, MAX_VOCAB, MAX_WIDTH, SpecError,
};

/// Supported architectures (HF `architectures[0]` names in [`Arch::hf_name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// Multi-head latent attention, MoE with softmax routing (`deepseek_v2`).
    DeepseekV2,
    /// Multi-head latent attention, MoE with sigmoid routing and a score-correction bias
    /// (`deepseek_v3`).
    DeepseekV3,
}

impl Arch {
    pub const ALL: [Arch; 6] = [
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::DeepseekV2,
        Arch::DeepseekV3,
    ];

    pub fn hf_name(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::DeepseekV2 => "DeepseekV2ForCausalLM",
            Arch::DeepseekV3 => "DeepseekV3ForCausalLM",
        }
    }

    pub fn from_hf_name(s: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.hf_name() == s)
    }
}

/// RoPE frequency scaling (`rope_scaling` in HF configs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    Linear {
        factor: f32,
    },
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: u32,
    },
    /// YaRN (DeepSeek): frequencies blended between interpolated and extrapolated by a ramp over
    /// `beta_fast ..= beta_slow` rotations, and cos/sin multiplied by `attention_factor`.
    Yarn {
        factor: f32,
        original_max_position_embeddings: u32,
        beta_fast: f32,
        beta_slow: f32,
        /// The cos/sin scale: `attention_factor` when the config sets it, else
        /// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are set, else
        /// `mscale(factor, 1)` (Hugging Face's rule).
        attention_factor: f32,
        /// DeepSeek's softmax scale is multiplied by `mscale(factor, mscale_all_dim)^2` when
        /// `mscale_all_dim` is set and non-zero (`None` otherwise).
        mscale_all_dim: Option<f32>,
        /// `truncate` (default true): the ramp's ends rounded to whole dimensions.
        truncate: bool,
    },
}

/// YaRN's magnitude scale for a context extended `scale` times.
pub fn yarn_mscale(scale: f32, mscale: f32) -> f32 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// The softmax scale of latent attention (both backends): `qk_head_dim^-0.5`, times YaRN's `mscale(factor, mscale_all_dim)^2`
/// when the config sets `mscale_all_dim` (DeepSeek's `yarn_apply_mscale`).
pub fn mla_softmax_scale(m: &MlaSpec, scaling: Option<&RopeScaling>) -> f32 {
    let base = (m.qk_head_dim() as f64).powf(-0.5) as f32;
    match scaling {
        Some(RopeScaling::Yarn {
            factor,
            mscale_all_dim: Some(all),
            ..
        }) => {
            let ms = yarn_mscale(*factor, *all);
            base * ms * ms
        }
        _ => base,
    }
}

/// The eps of the q and kv low-rank norms of latent attention: transformers builds them with its
/// RMSNorm default, not the config's `rms_norm_eps`.
pub const MLA_LORA_NORM_EPS: f32 = 1e-6;

/// Multi-head latent attention (DeepSeek-V2/V3). Each token caches one latent per layer: the
/// normalized `kv_lora_rank` compression of its keys and values followed by its
/// `qk_rope_head_dim` RoPE key, shared by every head.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MlaSpec {
    /// `None`: q is one projection of the hidden state (V2-Lite); else through this rank.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// RoPE pairs `(x[2i], x[2i+1])` (DeepSeek's layout; `rope_interleave`), else
    /// `(x[i], x[i + d/2])`.
    pub rope_interleave: bool,
}

impl MlaSpec {
    /// Values cached per token per layer: the latent plus the RoPE key.
    pub fn latent_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// The q and k head dimension (the softmax scale's base).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// How a MoE layer scores its experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MoeScoring {
    /// Softmax over the experts; the top-k by score (`greedy`), or only among the `topk_group`
    /// groups with the best single expert (`group_limited_greedy`) (DeepSeek-V2).
    Softmax { group_limited: bool },
    /// Sigmoid scores; experts chosen by score plus the layer's correction bias among the
    /// `topk_group` groups with the best sum of their top two, weighted by the plain score
    /// (DeepSeek-V3, `noaux_tc`).
    SigmoidBiased,
}

/// Mixture-of-experts feed-forward layers (DeepSeek): layers from `first_dense_layers` on route
/// each token to `top_k` of `num_experts` experts and add the shared experts' output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeSpec {
    pub num_experts: usize,
    pub top_k: usize,
    /// Shared experts, run as one MLP of `num_shared * expert_intermediate` (0: none).
    pub num_shared: usize,
    pub expert_intermediate: usize,
    /// Layers before this one use the dense MLP (`intermediate_size`).
    pub first_dense_layers: usize,
    pub num_groups: usize,
    pub topk_groups: usize,
    pub scoring: MoeScoring,
    /// Top-k weights divided by their sum (plus 1e-20) before the scaling factor.
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
}

impl MoeSpec {
    /// Whether layer `layer` is a MoE layer.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer >= self.first_dense_layers
    }

    /// Rows of the shared experts' MLP.
    pub fn shared_intermediate(&self) -> usize {
        self.num_shared * self.expert_intermediate
    }
}

/// Sliding-window attention (Mistral; Qwen2 and Qwen3 with `use_sliding_window`): a windowed
/// layer attends to the last `size` positions only, its query's own included (position `p`
/// sees `p + 1 - size ..= p`). The KV of older positions stays in the cache (prefix caching
/// and the hand-off are unchanged); it is not read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlidingWindow {
    pub size: usize,
    /// Per layer: windowed (`true`) or full attention.
    pub layers: Vec<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on the q, k and v projections (Qwen2).
    pub qkv_bias: bool,
    /// RMSNorm over each head of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// `None`: every layer attends to the whole context.
    #[serde(default)]
    pub sliding_window: Option<SlidingWindow>,
    /// Multi-head latent attention instead of q/k/v projections (DeepSeek).
    #[serde(default)]
    pub mla: Option<MlaSpec>,
    /// Mixture-of-experts feed-forward layers (DeepSeek).
    #[serde(default)]
    pub moe: Option<MoeSpec>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelSpec {
    /// The attention window of `layer`: `Some(size)` when it attends to its last `size`
    /// positions only, `None` for the whole context.
    pub fn attention_window(&self, layer: usize) -> Option<usize> {
        self.sliding_window
            .as_ref()
            .filter(|w| w.layers.get(layer).copied().unwrap_or(false))
            .map(|w| w.size)
    }

    /// Rows of the q projection (`num_heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Rows of each of the k and v projections (`num_kv_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Parameter count (for FLOP and byte estimates); `usize::MAX` when it does not fit (a spec
    /// that [`ModelSpec::validate`] refuses).
    pub fn num_params(&self) -> usize {
        self.checked_num_params().unwrap_or(usize::MAX)
    }

    /// The parameter count, `None` on overflow.
    fn checked_num_params(&self) -> Option<usize> {
        let mul = |a: usize, b: usize| a.checked_mul(b);
        let sum = |xs: &[Option<usize>]| {
            xs.iter()
                .try_fold(0usize, |acc, x| x.and_then(|x| acc.checked_add(x)))
        };
        let h = self.hidden_size;
        let emb = mul(self.vocab_size, h)?;
        let head = sum(&[
            mul(emb, if self.tie_word_embeddings { 1 } else { 2 }),
            Some(h),
        ])?;
        let attn = match &self.mla {
            None => sum(&[
                mul(mul(h, self.num_heads.checked_mul(self.head_dim)?)?, 2),
                mul(mul(h, self.num_kv_heads.checked_mul(self.head_dim)?)?, 2),
            ])?,
            Some(m) => {
                let nh = self.num_heads;
                let qk = m.qk_nope_head_dim.checked_add(m.qk_rope_head_dim)?;
                let q = match m.q_lora_rank {
                    None => mul(mul(h, nh)?, qk)?,
                    Some(r) => sum(&[mul(h, r), Some(r), mul(mul(r, nh)?, qk)])?,
                };
                sum(&[
                    Some(q),
                    mul(h, m.kv_lora_rank.checked_add(m.qk_rope_head_dim)?),
                    Some(m.kv_lora_rank),
                    mul(
                        mul(m.kv_lora_rank, nh)?,
                        m.qk_nope_head_dim.checked_add(m.v_head_dim)?,
                    ),
                    mul(mul(nh, m.v_head_dim)?, h),
                ])?
            }
        };
        let dense_mlp = mul(mul(3, h)?, self.intermediate_size)?;
        let moe_mlp = match &self.moe {
            None => 0,
            Some(e) => sum(&[
                mul(e.num_experts, h),
                mul(mul(mul(3, h)?, e.expert_intermediate)?, e.num_experts),
                mul(mul(3, h)?, mul(e.num_shared, e.expert_intermediate)?),
            ])?,
        };
        let moe_layers = match &self.moe {
            None => 0,
            Some(e) => self.num_layers.saturating_sub(e.first_dense_layers),
        };
        let dense_layers = self.num_layers - moe_layers;
        let per_layer = |mlp: usize| sum(&[Some(attn), Some(mlp), mul(2, h)]);
        sum(&[
            mul(per_layer(dense_mlp)?, dense_layers),
            mul(per_layer(moe_mlp)?, moe_layers),
            Some(head),
        ])
    }

    /// The KV cache's shape per token per layer: `(planes, heads, dim)`. Llama family: K and V
    /// (2 planes) of `num_kv_heads` heads of `head_dim`; MLA: one plane, one "head" holding the
    /// latent ([`MlaSpec::latent_dim`]), the same on every tensor-parallel rank.
    pub fn kv_cache_shape(&self) -> (usize, usize, usize) {
        match &self.mla {
            None => (2, self.num_kv_heads, self.head_dim),
            Some(m) => (1, 1, m.latent_dim()),
        }
    }
}

/// RoPE inverse frequencies for `head_dim` (`head_dim / 2` values), with `scaling` applied exactly
/// as Hugging Face's `ROPE_INIT_FUNCTIONS` do ("default", "linear", "llama3"). Every backend uses
/// this so they agree bit for bit on the table; the angle of position `p`, pair `i` is
/// `p as f32 * inv_freq[i]` and pairs are `(x[i], x[i + head_dim/2])` (HF `rotate_half`).
pub fn rope_inv_freqs(head_dim: usize, theta: f32, scaling: Option<&RopeScaling>) -> Vec<f32> {
    let half = head_dim / 2;
    let base: Vec<f32> = (0..half)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    match scaling {
        None => base,
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
        Some(RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            truncate,
            ..
        }) => {
            // transformers' `_compute_yarn_parameters`, in f32 as it computes them.
            let dim = head_dim as f32;
            let orig = *original_max_position_embeddings as f32;
            let correction_dim = |rotations: f32| {
                dim * (orig / (rotations * 2.0 * std::f32::consts::PI)).ln() / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
            if *truncate {
                low = low.floor();
                high = high.ceil();
            }
            let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
            if low == high {
                high += 0.001;
            }
            (0..half)
                .map(|i| {
                    let pos_freq = theta.powf((2 * i) as f32 / dim);
                    let extrapolation = 1.0 / pos_freq;
                    let interpolation = 1.0 / (factor * pos_freq);
                    let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                    let extra_factor = 1.0 - ramp;
                    interpolation * (1.0 - extra_factor) + extrapolation * extra_factor
                })
                .collect()
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let old = *original_max_position_embeddings as f32;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// The factor RoPE's cos and sin are multiplied by (YaRN's `attention_factor`; 1 otherwise).
pub fn rope_attention_factor(scaling: Option<&RopeScaling>) -> f32 {
    match scaling {
        Some(RopeScaling::Yarn {
            attention_factor, ..
        }) => *attention_factor,
        _ => 1.0,
    }
}
