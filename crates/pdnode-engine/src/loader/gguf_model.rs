//! A GGUF file to a [`LoadedModel`]: `{arch}.*` metadata to a [`ModelSpec`], `blk.N.*` tensors
//! dequantized to HF-orientation [`Weights`], `tokenizer.ggml.*` to a [`GgufTokenizer`].
//!
//! llama.cpp's converter permutes the rows of `attn_q` / `attn_k` of `llama` models so that RoPE
//! rotates adjacent pairs (GPT-J style); we undo it ([`unpermute_rows`]) so the one HF
//! `rotate_half` RoPE serves every source. `qwen2` / `qwen3` files are not permuted.

use super::gguf::{GgufFile, GgufTensorInfo, GgufValue};
use super::progress::LoadProgress;
use super::quant::dequantize;
use super::{GgufTokenizer, LoadError, TokenizerSource};
use crate::spec::{Arch, ModelSpec, RopeScaling};
use crate::weights::{LayerWeights, Tensor, Weights};
use std::collections::HashMap;
use std::path::Path;

/// GGUF `general.architecture` values we load.
pub const SUPPORTED_GGUF_ARCHS: [&str; 3] = ["llama", "qwen2", "qwen3"];

/// What [`load`] produces (assembled into a [`super::LoadedModel`] by the caller).
pub struct GgufModel {
    pub spec: ModelSpec,
    pub weights: Weights,
    pub tokenizer: TokenizerSource,
    pub metadata: HashMap<String, String>,
}

fn cfg_err(path: &Path, reason: String) -> LoadError {
    LoadError::Config {
        path: path.to_path_buf(),
        reason,
    }
}

struct Meta<'a> {
    f: &'a GgufFile,
    arch: &'a str,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    fn opt_u(&self, k: &str) -> Result<Option<usize>, LoadError> {
        let key = self.key(k);
        match self.f.get(&key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .map(Some)
                .ok_or_else(|| {
                    cfg_err(
                        &self.f.path,
                        format!("`{key}` = {} is not a count", v.summary()),
                    )
                }),
        }
    }
    fn req_u(&self, k: &str) -> Result<usize, LoadError> {
        self.opt_u(k)?.ok_or_else(|| {
            cfg_err(
                &self.f.path,
                format!("metadata `{}` is missing", self.key(k)),
            )
        })
    }
    fn opt_f(&self, k: &str) -> Result<Option<f32>, LoadError> {
        let key = self.key(k);
        match self.f.get(&key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| {
                cfg_err(
                    &self.f.path,
                    format!("`{key}` = {} is not a number", v.summary()),
                )
            }),
        }
    }
}

fn token_id(f: &GgufFile, key: &str) -> Option<u32> {
    f.get(key)
        .and_then(|v| v.as_u64())
        .and_then(|v| u32::try_from(v).ok())
}

/// Builds the [`ModelSpec`] from the metadata and the tensor table.
pub fn spec_from_gguf(f: &GgufFile) -> Result<ModelSpec, LoadError> {
    let path = &f.path;
    let arch_name = f
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .ok_or_else(|| cfg_err(path, "metadata `general.architecture` is missing".into()))?;
    let arch = match arch_name {
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        other => {
            return Err(LoadError::UnsupportedArch {
                path: path.clone(),
                arch: other.to_string(),
                supported: SUPPORTED_GGUF_ARCHS.iter().map(|s| s.to_string()).collect(),
            });
        }
    };
    let m = Meta { f, arch: arch_name };
    let hidden_size = m.req_u("embedding_length")?;
    let num_heads = m.req_u("attention.head_count")?;
    if num_heads == 0 || hidden_size == 0 {
        return Err(cfg_err(path, "zero hidden size or head count".into()));
    }
    let num_kv_heads = m.opt_u("attention.head_count_kv")?.unwrap_or(num_heads);
    let head_dim = m
        .opt_u("attention.key_length")?
        .unwrap_or(hidden_size / num_heads);
    let embed = f
        .tensor("token_embd.weight")
        .ok_or_else(|| LoadError::MissingTensor {
            path: path.clone(),
            name: "token_embd.weight".into(),
        })?;
    let vocab_size = embed.shape()[0];
    let rope_theta = m.opt_f("rope.freq_base")?.unwrap_or(10_000.0);
    let max_position_embeddings = m.opt_u("context_length")?.unwrap_or(2048);
    let eos = token_id(f, "tokenizer.ggml.eos_token_id");
    let eot = token_id(f, "tokenizer.ggml.eot_token_id");
    let mut eos_token_ids: Vec<u32> = eos.into_iter().collect();
    if let Some(e) = eot.filter(|e| !eos_token_ids.contains(e)) {
        eos_token_ids.push(e);
    }
    let mut spec = ModelSpec {
        arch,
        hidden_size,
        intermediate_size: m.req_u("feed_forward_length")?,
        num_layers: m.req_u("block_count")?,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size,
        rms_norm_eps: m.opt_f("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
        rope_theta,
        // Read below, once the head dimension that sizes it is validated.
        rope_scaling: None,
        max_position_embeddings,
        tie_word_embeddings: f.tensor("output.weight").is_none(),
        qkv_bias: f.tensor("blk.0.attn_q.bias").is_some(),
        qk_norm: f.tensor("blk.0.attn_q_norm.weight").is_some(),
        sliding_window: None,
        bos_token_id: token_id(f, "tokenizer.ggml.bos_token_id"),
        eos_token_ids,
        mla: None,
        moe: None,
    };
    if spec.num_kv_heads == 0 || !spec.num_heads.is_multiple_of(spec.num_kv_heads) {
        return Err(cfg_err(
            path,
            format!(
                "{} heads is not a multiple of {} KV heads",
                spec.num_heads, spec.num_kv_heads
            ),
        ));
    }
    if head_dim % 2 != 0 {
        return Err(cfg_err(path, format!("head dim {head_dim} is odd")));
    }
    let validate = |s: &ModelSpec| {
        s.validate()
            .map_err(|e| LoadError::config_value(path, gguf_key(arch_name, e.field), e))
    };
    validate(&spec)?;
    spec.rope_scaling = rope_scaling(f, &m, head_dim, rope_theta)?;
    validate(&spec)?;
    Ok(spec)
}

/// The metadata key (or tensor) of a [`crate::spec::SpecError`] field.
fn gguf_key(arch: &str, field: &str) -> String {
    let key = match field {
        "hidden_size" => "embedding_length",
        "intermediate_size" => "feed_forward_length",
        "num_layers" => "block_count",
        "num_heads" => "attention.head_count",
        "num_kv_heads" => "attention.head_count_kv",
        "head_dim" => "attention.key_length",
        "rms_norm_eps" => "attention.layer_norm_rms_epsilon",
        "rope_theta" => "rope.freq_base",
        "rope_scaling.factor" => "rope.scaling.factor",
        "rope_scaling.original_max_position_embeddings" => "rope.scaling.original_context_length",
        "max_position_embeddings" => "context_length",
        "vocab_size" => return "token_embd.weight (rows)".into(),
        other => return other.to_string(),
    };
    format!("{arch}.{key}")
}

/// `{arch}.rope.scaling.*` metadata, or llama3 scaling recognized from a `rope_freqs.weight`
/// tensor (llama.cpp bakes llama3 scaling into per-dimension frequency factors). `head_dim` is
/// validated: the tables compared are sized from it.
fn rope_scaling(
    f: &GgufFile,
    m: &Meta<'_>,
    head_dim: usize,
    theta: f32,
) -> Result<Option<RopeScaling>, LoadError> {
    let ty = f.get(&m.key("rope.scaling.type")).and_then(|v| v.as_str());
    let factor = m.opt_f("rope.scaling.factor")?;
    match (ty, factor) {
        (Some("linear"), Some(factor)) if factor != 1.0 => {
            return Ok(Some(RopeScaling::Linear { factor }));
        }
        (Some("none") | None, _) | (Some("linear"), _) => {}
        (Some(other), _) => {
            return Err(LoadError::Unsupported {
                path: f.path.clone(),
                reason: format!("rope scaling type `{other}` (supported: linear, llama3)"),
            });
        }
    }
    let Some(info) = f.tensor("rope_freqs.weight") else {
        return Ok(None);
    };
    // One factor per rotated pair.
    if info.shape() != [head_dim / 2] {
        return Err(LoadError::TensorShape {
            path: f.path.clone(),
            name: info.name.clone(),
            got: info.shape(),
            expected: vec![head_dim / 2],
        });
    }
    let factors = dequantize(info.ggml_type, f.tensor_bytes(info), info.numel())
        .map_err(|e| malformed(&f.path, &info.name, e.to_string()))?;
    // Try llama3 with the parameters every Llama 3.1/3.2 release uses, at the original context
    // the file states (or 8192); accept only if it reproduces the stored factors.
    let orig_key = "rope.scaling.original_context_length";
    let orig = match m.opt_u(orig_key)? {
        None => 8192,
        Some(n) => {
            u32::try_from(n)
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| LoadError::ConfigValue {
                    path: f.path.clone(),
                    key: m.key(orig_key),
                    reason: format!("= {n} is not within 1..={}", u32::MAX),
                })?
        }
    };
    let want_factor = factor.unwrap_or(if orig == 8192 { 8.0 } else { 32.0 });
    for (factor, low, high) in [(want_factor, 1.0, 4.0), (8.0, 1.0, 4.0), (32.0, 1.0, 4.0)] {
        let s = RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: orig,
        };
        let inv = crate::spec::rope_inv_freqs(head_dim, theta, Some(&s));
        let plain = crate::spec::rope_inv_freqs(head_dim, theta, None);
        if factors.len() == inv.len()
            && factors
                .iter()
                .zip(inv.iter().zip(&plain))
                .all(|(ff, (i, p))| ((p / ff) - i).abs() <= 1e-3 * i.abs().max(1e-12))
        {
            return Ok(Some(s));
        }
    }
    Err(LoadError::Unsupported {
        path: f.path.clone(),
        reason: "rope_freqs.weight does not match llama3 rope scaling".into(),
    })
}

fn malformed(path: &Path, tensor: &str, reason: String) -> LoadError {
    LoadError::Malformed {
        path: path.to_path_buf(),
        format: "GGUF",
        reason: format!("tensor `{tensor}`: {reason}"),
    }
}

/// Undoes llama.cpp's `permute(w, n_head)` on the rows of a `[n_head * head_dim, in]` matrix:
/// GGUF row `h*hd + 2*i + half` holds HF row `h*hd + half*hd/2 + i`.
pub fn unpermute_rows(w: &Tensor, n_head: usize) -> Tensor {
    let (rows, cols) = (w.shape[0], w.shape.get(1).copied().unwrap_or(1));
    let hd = rows / n_head;
    let mut out = vec![0f32; w.data.len()];
    for h in 0..n_head {
        for i in 0..hd / 2 {
            for half in 0..2 {
                let src = h * hd + 2 * i + half;
                let dst = h * hd + half * hd / 2 + i;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&w.data[src * cols..(src + 1) * cols]);
            }
        }
    }
    Tensor::new(w.shape.clone(), out)
}

struct TensorLoader<'a> {
    f: &'a GgufFile,
    progress: LoadProgress,
}

impl TensorLoader<'_> {
    fn info(&self, name: &str) -> Result<&GgufTensorInfo, LoadError> {
        self.f.tensor(name).ok_or_else(|| LoadError::MissingTensor {
            path: self.f.path.clone(),
            name: name.to_string(),
        })
    }

    fn load(&self, name: &str, expected: &[usize]) -> Result<Tensor, LoadError> {
        let info = self.info(name)?;
        let shape = info.shape();
        if shape != expected {
            return Err(LoadError::TensorShape {
                path: self.f.path.clone(),
                name: name.to_string(),
                got: shape,
                expected: expected.to_vec(),
            });
        }
        let data =
            dequantize(info.ggml_type, self.f.tensor_bytes(info), info.numel()).map_err(|e| {
                LoadError::Unsupported {
                    path: self.f.path.clone(),
                    reason: format!("tensor `{name}`: {e}"),
                }
            })?;
        self.progress.inc(info.range.len() as u64);
        Ok(Tensor::new(shape, data))
    }

    fn opt(&self, name: &str, on: bool, expected: &[usize]) -> Result<Option<Tensor>, LoadError> {
        if on {
            self.load(name, expected).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Dequantizes every tensor of the model into host f32 weights.
pub fn weights_from_gguf(f: &GgufFile, s: &ModelSpec) -> Result<Weights, LoadError> {
    let name = f
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let total: u64 = f.tensors.iter().map(|t| t.range.len() as u64).sum();
    let tl = TensorLoader {
        f,
        progress: LoadProgress::new(&name, total),
    };
    let (h, q, kv, i) = (s.hidden_size, s.q_dim(), s.kv_dim(), s.intermediate_size);
    let permuted = s.arch == Arch::Llama || s.arch == Arch::Mistral;
    // `block_count` comes from the file: never reserve more layers than it has tensors (a
    // corrupt count aborted the process on a 552 GB allocation; found by tests/fuzz_loaders.rs).
    let mut layers = Vec::with_capacity(s.num_layers.min(f.tensors.len()));
    for n in 0..s.num_layers {
        let p = |x: &str| format!("blk.{n}.{x}");
        let mut wq = tl.load(&p("attn_q.weight"), &[q, h])?;
        let mut wk = tl.load(&p("attn_k.weight"), &[kv, h])?;
        if permuted {
            wq = unpermute_rows(&wq, s.num_heads);
            wk = unpermute_rows(&wk, s.num_kv_heads);
        }
        layers.push(LayerWeights {
            attn_norm: tl.load(&p("attn_norm.weight"), &[h])?,
            wq,
            wk,
            wv: tl.load(&p("attn_v.weight"), &[kv, h])?,
            bq: tl.opt(&p("attn_q.bias"), s.qkv_bias, &[q])?,
            bk: tl.opt(&p("attn_k.bias"), s.qkv_bias, &[kv])?,
            bv: tl.opt(&p("attn_v.bias"), s.qkv_bias, &[kv])?,
            q_norm: tl.opt(&p("attn_q_norm.weight"), s.qk_norm, &[s.head_dim])?,
            k_norm: tl.opt(&p("attn_k_norm.weight"), s.qk_norm, &[s.head_dim])?,
            wo: tl.load(&p("attn_output.weight"), &[h, q])?,
            mlp_norm: tl.load(&p("ffn_norm.weight"), &[h])?,
            w_gate: tl.load(&p("ffn_gate.weight"), &[i, h])?,
            w_up: tl.load(&p("ffn_up.weight"), &[i, h])?,
            w_down: tl.load(&p("ffn_down.weight"), &[h, i])?,
        });
    }
    let w = Weights {
        embed: tl.load("token_embd.weight", &[s.vocab_size, h])?,
        layers,
        final_norm: tl.load("output_norm.weight", &[h])?,
        lm_head: tl.opt("output.weight", !s.tie_word_embeddings, &[s.vocab_size, h])?,
    };
    tl.progress.finish();
    Ok(w)
}

fn string_array(f: &GgufFile, key: &str) -> Result<Vec<String>, LoadError> {
    match f.get(key) {
        None => Ok(Vec::new()),
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_str().map(str::to_string)).collect())
            .ok_or_else(|| cfg_err(&f.path, format!("`{key}` is not an array of strings"))),
    }
}

/// The `tokenizer.ggml.*` metadata as raw data; `None` when the file has no tokenizer.
pub fn tokenizer_from_gguf(f: &GgufFile) -> Result<TokenizerSource, LoadError> {
    let Some(model) = f.get("tokenizer.ggml.model").and_then(|v| v.as_str()) else {
        return Ok(TokenizerSource::None);
    };
    let tokens = string_array(f, "tokenizer.ggml.tokens")?;
    let token_types = match f.get("tokenizer.ggml.token_type") {
        None => Vec::new(),
        Some(v) => v
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|x| x.as_i64().and_then(|i| i32::try_from(i).ok()))
                    .collect()
            })
            .ok_or_else(|| {
                cfg_err(
                    &f.path,
                    "`tokenizer.ggml.token_type` is not integers".into(),
                )
            })?,
    };
    let scores = match f.get("tokenizer.ggml.scores") {
        None => Vec::new(),
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_f64().map(|x| x as f32)).collect())
            .ok_or_else(|| cfg_err(&f.path, "`tokenizer.ggml.scores` is not numbers".into()))?,
    };
    let check_id = |key: &str| -> Result<Option<u32>, LoadError> {
        match token_id(f, key) {
            Some(id) if id as usize >= tokens.len() => Err(cfg_err(
                &f.path,
                format!("`{key}` = {id} is outside the {} tokens", tokens.len()),
            )),
            x => Ok(x),
        }
    };
    let bool_key = |k: &str| f.get(k).and_then(GgufValue::as_bool);
    Ok(TokenizerSource::Gguf(Box::new(GgufTokenizer {
        model: model.to_string(),
        pre: f
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        merges: string_array(f, "tokenizer.ggml.merges")?,
        token_types,
        scores,
        bos_token_id: check_id("tokenizer.ggml.bos_token_id")?,
        eos_token_id: check_id("tokenizer.ggml.eos_token_id")?,
        unk_token_id: check_id("tokenizer.ggml.unknown_token_id")?,
        pad_token_id: check_id("tokenizer.ggml.padding_token_id")?,
        add_bos_token: bool_key("tokenizer.ggml.add_bos_token"),
        add_eos_token: bool_key("tokenizer.ggml.add_eos_token"),
        chat_template: f
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        tokens,
    })))
}

/// Opens, parses and dequantizes a GGUF model file.
pub fn load(path: &Path) -> Result<GgufModel, LoadError> {
    from_file(&GgufFile::open(path)?)
}

/// Builds the model from a parsed GGUF file.
pub fn from_file(f: &GgufFile) -> Result<GgufModel, LoadError> {
    let spec = spec_from_gguf(f)?;
    let weights = weights_from_gguf(f, &spec)?;
    weights
        .check_shapes(&spec)
        .map_err(|e| cfg_err(&f.path, e.to_string()))?;
    let tokenizer = tokenizer_from_gguf(f)?;
    let metadata = f
        .metadata_order
        .iter()
        .filter(|k| k.starts_with("general."))
        .filter_map(|k| f.get(k).map(|v| (k.clone(), v.summary())))
        .collect();
    Ok(GgufModel {
        spec,
        weights,
        tokenizer,
        metadata,
    })
}
