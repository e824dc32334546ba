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
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelSpec {
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
