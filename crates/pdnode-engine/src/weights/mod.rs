//! Host-side f32 weights in Hugging Face orientation: every projection is `[out_features, in_features]`
//! row-major, as in HF `nn.Linear.weight`. Loaders (safetensors, GGUF, dummy) produce this; the CPU
//! backend computes on it directly, the CUDA backend converts it to bf16 on upload.

use crate::spec::ModelSpec;

/// A dense row-major f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Self { shape, data }
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct LayerWeights {
    pub attn_norm: Tensor,      // [hidden]
    pub wq: Tensor,             // [num_heads*head_dim, hidden]
    pub wk: Tensor,             // [num_kv_heads*head_dim, hidden]
    pub wv: Tensor,             // [num_kv_heads*head_dim, hidden]
    pub bq: Option<Tensor>,     // [num_heads*head_dim]      (qkv_bias)
    pub bk: Option<Tensor>,     // [num_kv_heads*head_dim]   (qkv_bias)
    pub bv: Option<Tensor>,     // [num_kv_heads*head_dim]   (qkv_bias)
    pub q_norm: Option<Tensor>, // [head_dim]                (qk_norm)
    pub k_norm: Option<Tensor>, // [head_dim]                (qk_norm)
    pub wo: Tensor,             // [hidden, num_heads*head_dim]
    pub mlp_norm: Tensor,       // [hidden]
    pub w_gate: Tensor,         // [intermediate, hidden]
    pub w_up: Tensor,           // [intermediate, hidden]
    pub w_down: Tensor,         // [hidden, intermediate]
}

#[derive(Debug, Clone, PartialEq)]
pub struct Weights {
    pub embed: Tensor, // [vocab, hidden]
    pub layers: Vec<LayerWeights>,
    pub final_norm: Tensor,      // [hidden]
    pub lm_head: Option<Tensor>, // [vocab, hidden]; None when tied to `embed`
}

/// The first tensor of a [`Weights`] that does not fit its [`ModelSpec`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    #[error("tensor {name}: shape {got:?}, expected {expected:?}")]
    Shape {
        name: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tensor {name} is missing")]
    Missing { name: String },
    #[error("tensor {name} is present but the architecture does not use it")]
    Unused { name: String },
    #[error("{got} layers, expected {expected}")]
    Layers { got: usize, expected: usize },
}

/// `t` has `shape`, or the error names it.
fn want(name: &str, t: &Tensor, shape: &[usize]) -> Result<(), ShapeError> {
    if t.shape != shape || t.data.len() != shape.iter().product::<usize>() {
        return Err(ShapeError::Shape {
            name: name.to_string(),
            got: t.shape.clone(),
            expected: shape.to_vec(),
        });
    }
    Ok(())
}

/// As many layers as the spec says.
fn want_layers(got: usize, s: &ModelSpec) -> Result<(), ShapeError> {
    if got != s.num_layers {
        return Err(ShapeError::Layers {
            got,
            expected: s.num_layers,
        });
    }
    Ok(())
}

/// `t` is present with `shape` exactly when `on`.
fn want_opt(name: &str, t: &Option<Tensor>, on: bool, shape: &[usize]) -> Result<(), ShapeError> {
    let name = name.to_string();
    match (t, on) {
        (Some(t), true) => want(&name, t, shape),
        (None, false) => Ok(()),
        (None, true) => Err(ShapeError::Missing { name }),
        (Some(_), false) => Err(ShapeError::Unused { name }),
    }
}

impl Weights {
    /// Checks every tensor's shape against the spec; `Err` names the first tensor that is off.
    pub fn check_shapes(&self, s: &ModelSpec) -> Result<(), ShapeError> {
        let (h, q, kv, i) = (s.hidden_size, s.q_dim(), s.kv_dim(), s.intermediate_size);
        want("embed", &self.embed, &[s.vocab_size, h])?;
        want_layers(self.layers.len(), s)?;
        for (n, l) in self.layers.iter().enumerate() {
            let p = |x: &str| format!("layers.{n}.{x}");
            want(&p("attn_norm"), &l.attn_norm, &[h])?;
            want(&p("wq"), &l.wq, &[q, h])?;
            want(&p("wk"), &l.wk, &[kv, h])?;
            want(&p("wv"), &l.wv, &[kv, h])?;
            want_opt(&p("bq"), &l.bq, s.qkv_bias, &[q])?;
            want_opt(&p("bk"), &l.bk, s.qkv_bias, &[kv])?;
            want_opt(&p("bv"), &l.bv, s.qkv_bias, &[kv])?;
            want_opt(&p("q_norm"), &l.q_norm, s.qk_norm, &[s.head_dim])?;
            want_opt(&p("k_norm"), &l.k_norm, s.qk_norm, &[s.head_dim])?;
            want(&p("wo"), &l.wo, &[h, q])?;
            want(&p("mlp_norm"), &l.mlp_norm, &[h])?;
            want(&p("w_gate"), &l.w_gate, &[i, h])?;
            want(&p("w_up"), &l.w_up, &[i, h])?;
            want(&p("w_down"), &l.w_down, &[h, i])?;
        }
        want("final_norm", &self.final_norm, &[h])?;
        want_opt(
            "lm_head",
            &self.lm_head,
            !s.tie_word_embeddings,
            &[s.vocab_size, h],
        )
    }

    /// The output projection: `lm_head`, or the embedding when tied.
    pub fn output(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

mod mla;
pub use mla::{Expert, Ffn, MlaLayerWeights, MlaQuery, MlaWeights, MoeWeights};
