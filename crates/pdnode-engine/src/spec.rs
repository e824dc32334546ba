//! The normalized description of a model's architecture, built from an HF `config.json`, GGUF
//! metadata or a named preset. Both backends build from a [`ModelSpec`] plus [`crate::weights::Weights`].

use serde::{Deserialize, Serialize};

/// Supported architectures (HF `architectures[0]` names in [`Arch::hf_name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub const ALL: [Arch; 4] = [Arch::Llama, Arch::Mistral, Arch::Qwen2, Arch::Qwen3];

    pub fn hf_name(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
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

    /// Parameter count (for FLOP and byte estimates).
    pub fn num_params(&self) -> usize {
        let h = self.hidden_size;
        let per_layer =
            h * self.q_dim() * 2 + h * self.kv_dim() * 2 + 3 * h * self.intermediate_size + 2 * h;
        let emb = self.vocab_size * h;
        per_layer * self.num_layers + emb * if self.tie_word_embeddings { 1 } else { 2 } + h
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
