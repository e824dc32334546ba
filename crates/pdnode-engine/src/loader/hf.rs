//! A Hugging Face model directory: `config.json` to a [`ModelSpec`], safetensors to [`Weights`],
//! `tokenizer.json` + `tokenizer_config.json` (+ `generation_config.json` for EOS ids) to a
//! [`TokenizerSource`].

use super::safetensors_io::SafetensorsSet;
use super::{HfTokenizerConfig, LoadError, ModelWeights, TokenizerSource, hf_mla};
use crate::spec::{Arch, ModelSpec, RopeScaling, SlidingWindow};
use crate::weights::{LayerWeights, Weights};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

pub struct HfModel {
    pub spec: ModelSpec,
    /// [`ModelWeights::Host`] or, for a latent-attention model, [`ModelWeights::HostMla`].
    pub weights: ModelWeights,
    pub tokenizer: TokenizerSource,
    pub metadata: HashMap<String, String>,
}

fn read_json(path: &Path) -> Result<Value, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| LoadError::Malformed {
        path: path.to_path_buf(),
        format: "JSON",
        reason: e.to_string(),
    })
}

fn read_json_opt(path: &Path) -> Result<Option<Value>, LoadError> {
    if path.is_file() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

/// Token ids from an int or a list of ints.
fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .into_iter()
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

pub(super) struct Cfg<'a> {
    pub(super) v: &'a Value,
    path: &'a Path,
}

impl Cfg<'_> {
    pub(super) fn err(&self, reason: String) -> LoadError {
        LoadError::Config {
            path: self.path.to_path_buf(),
            reason,
        }
    }
    /// A value no model can have, by its key.
    pub(super) fn value(&self, key: String, reason: String) -> LoadError {
        LoadError::ConfigValue {
            path: self.path.to_path_buf(),
            key,
            reason,
        }
    }
    pub(super) fn unsupported(&self, reason: String) -> LoadError {
        LoadError::Unsupported {
            path: self.path.to_path_buf(),
            reason,
        }
    }
    pub(super) fn opt_u(&self, k: &str) -> Result<Option<usize>, LoadError> {
        match self.v.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| self.err(format!("`{k}` = {x} is not a non-negative integer"))),
        }
    }
    pub(super) fn req_u(&self, k: &str) -> Result<usize, LoadError> {
        self.opt_u(k)?
            .ok_or_else(|| self.err(format!("`{k}` is missing")))
    }
    pub(super) fn opt_f(&self, k: &str) -> Result<Option<f32>, LoadError> {
        match self.v.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| self.err(format!("`{k}` = {x} is not a number"))),
        }
    }
    pub(super) fn bool(&self, k: &str) -> bool {
        self.v.get(k).and_then(Value::as_bool).unwrap_or(false)
    }
}

/// Which of the `n` layers (validated) attend through the window: `layer_types` when the config
/// lists them (transformers >= 4.53 writes it), else every layer (Mistral) or the layers from
/// `max_window_layers` on (Qwen2, Qwen3: transformers' rule).
fn window_layers(c: &Cfg<'_>, arch: Arch, n: usize) -> Result<Vec<bool>, LoadError> {
    if let Some(types) = c.v.get("layer_types").filter(|v| !v.is_null()) {
        let types = types
            .as_array()
            .ok_or_else(|| c.err("`layer_types` is not a list".into()))?;
        if types.len() != n {
            return Err(c.err(format!(
                "`layer_types` lists {} layers, `num_hidden_layers` is {n}",
                types.len()
            )));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(c.err(format!(
                    "`layer_types` entry {t} is not supported (supported: full_attention, sliding_attention)"
                ))),
            })
            .collect();
    }
    Ok(match arch {
        Arch::Qwen2 | Arch::Qwen3 => {
            let from = c.opt_u("max_window_layers")?.unwrap_or(n);
            (0..n).map(|i| i >= from).collect()
        }
        _ => vec![true; n],
    })
}

fn rope_scaling(
    c: &Cfg<'_>,
    arch: Arch,
    max_position_embeddings: usize,
) -> Result<Option<RopeScaling>, LoadError> {
    // transformers < 5 writes `rope_scaling` (null when unscaled); transformers >= 5 writes
    // `rope_parameters` with `rope_type` ("default" when unscaled) and `rope_theta` inside.
    let Some(rs) =
        c.v.get("rope_scaling")
            .filter(|v| !v.is_null())
            .or_else(|| c.v.get("rope_parameters").filter(|v| !v.is_null()))
    else {
        return Ok(None);
    };
    let ty = rs
        .get("rope_type")
        .or_else(|| rs.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |k: &str| -> Result<f32, LoadError> {
        rs.get(k)
            .and_then(Value::as_f64)
            .map(|x| x as f32)
            .ok_or_else(|| c.err(format!("`rope_scaling.{k}` is missing or not a number")))
    };
    match ty {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: num("factor")?,
        })),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: positions(c, rs, "original_max_position_embeddings")?,
        })),
        "yarn" if matches!(arch, Arch::DeepseekV2 | Arch::DeepseekV3) => {
            hf_mla::yarn(c, rs, max_position_embeddings).map(Some)
        }
        other => Err(c.err(format!(
            "rope_scaling type `{other}` is not supported (supported: default, linear, llama3; \
             yarn on DeepSeek models)"
        ))),
    }
}

/// The object the config keeps RoPE scaling in: `rope_scaling` (transformers < 5) or
/// `rope_parameters`.
fn rope_object(c: &Cfg<'_>) -> &'static str {
    if c.v.get("rope_scaling").is_some_and(|v| !v.is_null()) {
        "rope_scaling"
    } else {
        "rope_parameters"
    }
}

/// `{rope object}.{k}`: a whole number of positions in `1..=u32::MAX`.
pub(super) fn positions(c: &Cfg<'_>, rs: &Value, k: &str) -> Result<u32, LoadError> {
    let key = format!("{}.{k}", rope_object(c));
    let v = rs
        .get(k)
        .filter(|v| !v.is_null())
        .ok_or_else(|| c.err(format!("`{key}` is missing")))?;
    v.as_f64()
        .filter(|x| x.fract() == 0.0 && (1.0..=f64::from(u32::MAX)).contains(x))
        .map(|x| x as u32)
        .ok_or_else(|| {
            c.value(
                key.clone(),
                format!(
                    "= {v} is not a whole number of positions in 1..={}",
                    u32::MAX
                ),
            )
        })
}

/// The `config.json` key of a [`crate::spec::SpecError`] field (`mla`: a latent-attention
/// model, whose head dimension is the sum of two keys).
fn hf_key(c: &Cfg<'_>, field: &str, mla: bool) -> String {
    if let Some(k) = field.strip_prefix("rope_scaling.") {
        return format!("{}.{k}", rope_object(c));
    }
    if field == "rope_theta" && c.v.get("rope_theta").is_none_or(Value::is_null) {
        return "rope_parameters.rope_theta".into();
    }
    let key = match field {
        "num_layers" => "num_hidden_layers",
        "num_heads" => "num_attention_heads",
        "num_kv_heads" => "num_key_value_heads",
        "head_dim" if mla => "qk_nope_head_dim + qk_rope_head_dim",
        "sliding_window.size" => "sliding_window",
        "sliding_window.layers" => "layer_types",
        "moe.num_experts" => "n_routed_experts",
        "moe.top_k" => "num_experts_per_tok",
        "moe.num_shared" => "n_shared_experts",
        "moe.expert_intermediate" => "moe_intermediate_size",
        "moe.first_dense_layers" => "first_k_dense_replace",
        "moe.num_groups" => "n_group",
        "moe.topk_groups" => "topk_group",
        "moe.routed_scaling_factor" => "routed_scaling_factor",
        f => f.strip_prefix("mla.").unwrap_or(f),
    };
    key.to_string()
}

/// `config.json` (+ `generation_config.json`) to a [`ModelSpec`], validated
/// ([`ModelSpec::validate`]) before anything is sized from it.
pub fn spec_from_config(
    config: &Value,
    gen_cfg: Option<&Value>,
    path: &Path,
) -> Result<ModelSpec, LoadError> {
    let c = Cfg { v: config, path };
    let supported = || Arch::ALL.iter().map(|a| a.hf_name().to_string()).collect();
    // `architectures[0]`, or the class named by `model_type` when a config lacks it.
    let by_model_type = |t: &str| match t {
        "llama" => Some(Arch::Llama.hf_name()),
        "mistral" => Some(Arch::Mistral.hf_name()),
        "qwen2" => Some(Arch::Qwen2.hf_name()),
        "qwen3" => Some(Arch::Qwen3.hf_name()),
        "deepseek_v2" => Some(Arch::DeepseekV2.hf_name()),
        "deepseek_v3" => Some(Arch::DeepseekV3.hf_name()),
        _ => None,
    };
    let arch_name = config
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .or_else(|| {
            config
                .get("model_type")
                .and_then(Value::as_str)
                .and_then(by_model_type)
        })
        .ok_or_else(|| LoadError::UnsupportedArch {
            path: path.to_path_buf(),
            arch: "(no `architectures` in config.json)".into(),
            supported: supported(),
        })?;
    let arch = Arch::from_hf_name(arch_name).ok_or_else(|| LoadError::UnsupportedArch {
        path: path.to_path_buf(),
        arch: arch_name.to_string(),
        supported: supported(),
    })?;
    if let Some(act) = config
        .get("hidden_act")
        .and_then(Value::as_str)
        .filter(|a| *a != "silu")
    {
        return Err(LoadError::Unsupported {
            path: path.to_path_buf(),
            reason: format!("hidden_act `{act}` (only silu is supported)"),
        });
    }
    let deepseek = matches!(arch, Arch::DeepseekV2 | Arch::DeepseekV3);
    let attention_bias = c.bool("attention_bias");
    if attention_bias && arch != Arch::Qwen2 && !deepseek {
        return Err(LoadError::Unsupported {
            path: path.to_path_buf(),
            reason: "attention_bias = true (o_proj bias) is not supported".into(),
        });
    }
    if c.bool("mlp_bias") {
        return Err(LoadError::Unsupported {
            path: path.to_path_buf(),
            reason: "mlp_bias = true is not supported".into(),
        });
    }
    let hidden_size = c.req_u("hidden_size")?;
    let num_heads = c.req_u("num_attention_heads")?;
    if num_heads == 0 {
        return Err(c.err("`num_attention_heads` is 0".into()));
    }
    let num_kv_heads = c.opt_u("num_key_value_heads")?.unwrap_or(num_heads);
    if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(c.err(format!(
            "{num_heads} heads is not a multiple of {num_kv_heads} KV heads"
        )));
    }
    let (mla, moe) = if deepseek {
        (
            Some(hf_mla::mla_spec(&c, arch)?),
            hf_mla::moe_spec(&c, arch)?,
        )
    } else {
        (None, None)
    };
    // A latent-attention model's q/k head: its nope and RoPE parts (its config's `head_dim`
    // is the RoPE part's).
    let head_dim = match &mla {
        // Saturating: validation refuses a sum that does not fit.
        Some(m) => m.qk_nope_head_dim.saturating_add(m.qk_rope_head_dim),
        None => c.opt_u("head_dim")?.unwrap_or(hidden_size / num_heads),
    };
    let mut eos_token_ids = ids(config.get("eos_token_id"));
    if let Some(g) = gen_cfg {
        for id in ids(g.get("eos_token_id")) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
    }
    let bos_token_id = ids(config.get("bos_token_id"))
        .first()
        .copied()
        .or_else(|| gen_cfg.and_then(|g| ids(g.get("bos_token_id")).first().copied()));
    let sliding = match arch {
        Arch::Mistral => c.opt_u("sliding_window")?,
        Arch::Qwen2 | Arch::Qwen3 if c.bool("use_sliding_window") => c.opt_u("sliding_window")?,
        _ => None,
    };
    let max_position_embeddings = c.opt_u("max_position_embeddings")?.unwrap_or(4096);
    let mut spec = ModelSpec {
        arch,
        hidden_size,
        intermediate_size: c.req_u("intermediate_size")?,
        num_layers: c.req_u("num_hidden_layers")?,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size: c.req_u("vocab_size")?,
        rms_norm_eps: c.opt_f("rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta: match c.opt_f("rope_theta")? {
            Some(t) => t,
            None => config
                .get("rope_parameters")
                .and_then(|p| p.get("rope_theta"))
                .and_then(Value::as_f64)
                .map_or(10_000.0, |t| t as f32),
        },
        rope_scaling: rope_scaling(&c, arch, max_position_embeddings)?,
        max_position_embeddings,
        tie_word_embeddings: c.bool("tie_word_embeddings"),
        qkv_bias: arch == Arch::Qwen2 || attention_bias,
        qk_norm: arch == Arch::Qwen3,
        // Set below, once the layer count that sizes it is validated.
        sliding_window: None,
        bos_token_id,
        eos_token_ids,
        mla,
        moe,
    };
    let is_mla = spec.mla.is_some();
    let validate = |s: &ModelSpec| {
        s.validate()
            .map_err(|e| LoadError::config_value(path, hf_key(&c, e.field, is_mla), e))
    };
    validate(&spec)?;
    if !head_dim.is_multiple_of(2) {
        return Err(c.err(format!("head_dim {head_dim} must be even")));
    }
    // A window at least as long as any context changes nothing.
    spec.sliding_window = match sliding.filter(|&w| w < max_position_embeddings) {
        None => None,
        Some(0) => {
            return Err(c.err("`sliding_window` = 0: a layer must see its own position".into()));
        }
        Some(size) => {
            let layers = window_layers(&c, arch, spec.num_layers)?;
            layers
                .iter()
                .any(|&w| w)
                .then_some(SlidingWindow { size, layers })
        }
    };
    validate(&spec)?;
    Ok(spec)
}

/// Reads every weight of `spec` from the safetensors set.
pub fn weights_from_safetensors(st: &SafetensorsSet, s: &ModelSpec) -> Result<Weights, LoadError> {
    let (h, q, kv, i) = (s.hidden_size, s.q_dim(), s.kv_dim(), s.intermediate_size);
    let opt = |name: String, on: bool, shape: &[usize]| {
        if on {
            st.load(&name, shape).map(Some)
        } else {
            Ok(None)
        }
    };
    // Never more than the file has tensors, whatever spec the caller passes.
    let mut layers = Vec::with_capacity(s.num_layers.min(st.len()));
    for n in 0..s.num_layers {
        let p = |x: &str| format!("model.layers.{n}.{x}");
        layers.push(LayerWeights {
            attn_norm: st.load(&p("input_layernorm.weight"), &[h])?,
            wq: st.load(&p("self_attn.q_proj.weight"), &[q, h])?,
            wk: st.load(&p("self_attn.k_proj.weight"), &[kv, h])?,
            wv: st.load(&p("self_attn.v_proj.weight"), &[kv, h])?,
            bq: opt(p("self_attn.q_proj.bias"), s.qkv_bias, &[q])?,
            bk: opt(p("self_attn.k_proj.bias"), s.qkv_bias, &[kv])?,
            bv: opt(p("self_attn.v_proj.bias"), s.qkv_bias, &[kv])?,
            q_norm: opt(p("self_attn.q_norm.weight"), s.qk_norm, &[s.head_dim])?,
            k_norm: opt(p("self_attn.k_norm.weight"), s.qk_norm, &[s.head_dim])?,
            wo: st.load(&p("self_attn.o_proj.weight"), &[h, q])?,
            mlp_norm: st.load(&p("post_attention_layernorm.weight"), &[h])?,
            w_gate: st.load(&p("mlp.gate_proj.weight"), &[i, h])?,
            w_up: st.load(&p("mlp.up_proj.weight"), &[i, h])?,
            w_down: st.load(&p("mlp.down_proj.weight"), &[h, i])?,
        });
    }
    let w = Weights {
        embed: st.load("model.embed_tokens.weight", &[s.vocab_size, h])?,
        layers,
        final_norm: st.load("model.norm.weight", &[h])?,
        lm_head: opt(
            "lm_head.weight".into(),
            !s.tie_word_embeddings,
            &[s.vocab_size, h],
        )?,
    };
    st.finish();
    Ok(w)
}

/// A special-token entry: a string, or an AddedToken object with `content`.
fn token_str(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// `tokenizer_config.json` (and `chat_template.jinja` / `chat_template.json`) of `dir`.
pub fn tokenizer_config(dir: &Path) -> Result<HfTokenizerConfig, LoadError> {
    let raw = read_json_opt(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    let mut chat_template = match raw.get("chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    };
    if chat_template.is_none() {
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            chat_template =
                Some(std::fs::read_to_string(&jinja).map_err(|e| LoadError::io(&jinja, e))?);
        } else if let Some(v) = read_json_opt(&dir.join("chat_template.json"))? {
            chat_template = v
                .get("chat_template")
                .and_then(Value::as_str)
                .map(str::to_string);
        }
    }
    Ok(HfTokenizerConfig {
        chat_template,
        bos_token: token_str(raw.get("bos_token")),
        eos_token: token_str(raw.get("eos_token")),
        pad_token: token_str(raw.get("pad_token")),
        unk_token: token_str(raw.get("unk_token")),
        add_bos_token: raw.get("add_bos_token").and_then(Value::as_bool),
        add_eos_token: raw.get("add_eos_token").and_then(Value::as_bool),
        raw,
    })
}

/// Loads an HF model directory.
pub fn load(dir: &Path) -> Result<HfModel, LoadError> {
    let config_path = dir.join("config.json");
    let config = read_json(&config_path)?;
    let gen_cfg = read_json_opt(&dir.join("generation_config.json"))?;
    let spec = spec_from_config(&config, gen_cfg.as_ref(), &config_path)?;
    let mut st = SafetensorsSet::open_dir(dir)?;
    if let Some(block) = hf_mla::fp8_block(&config, &config_path)? {
        st.set_fp8_block(block);
    }
    let bad_shape = |reason: crate::weights::ShapeError| LoadError::Config {
        path: dir.to_path_buf(),
        reason: reason.to_string(),
    };
    let weights = match &spec.mla {
        Some(m) => {
            let w = hf_mla::weights(&st, &spec, m)?;
            w.check_shapes(&spec).map_err(bad_shape)?;
            ModelWeights::HostMla(w)
        }
        None => {
            let w = weights_from_safetensors(&st, &spec)?;
            w.check_shapes(&spec).map_err(bad_shape)?;
            ModelWeights::Host(w)
        }
    };
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = if tok_path.is_file() {
        TokenizerSource::HfFile {
            path: tok_path,
            config: tokenizer_config(dir)?,
        }
    } else {
        TokenizerSource::None
    };
    let mut metadata = HashMap::new();
    for k in [
        "torch_dtype",
        "model_type",
        "_name_or_path",
        "transformers_version",
    ] {
        if let Some(v) = config.get(k).and_then(Value::as_str) {
            metadata.insert(k.to_string(), v.to_string());
        }
    }
    Ok(HfModel {
        spec,
        weights,
        tokenizer,
        metadata,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "rope_theta": 500000.0, "max_position_embeddings": 1024,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "bos_token_id": 7, "eos_token_id": [8, 9]
        })
    }

    #[test]
    fn sliding_windows_are_read_per_layer() {
        let p = Path::new("config.json");
        // Mistral: every layer, unless layer_types says otherwise.
        let mut m = base();
        m["architectures"] = json!(["MistralForCausalLM"]);
        m["sliding_window"] = json!(8);
        let s = spec_from_config(&m, None, p).unwrap();
        assert_eq!(s.attention_window(0), Some(8));
        assert_eq!(s.attention_window(1), Some(8));
        m["layer_types"] = json!(["full_attention", "sliding_attention"]);
        let s = spec_from_config(&m, None, p).unwrap();
        assert_eq!(
            (s.attention_window(0), s.attention_window(1)),
            (None, Some(8))
        );
        // A window as long as any context is no window.
        m["sliding_window"] = json!(1024);
        assert!(
            spec_from_config(&m, None, p)
                .unwrap()
                .sliding_window
                .is_none()
        );
        // Qwen2: only with use_sliding_window, from max_window_layers on.
        let mut q = base();
        q["architectures"] = json!(["Qwen2ForCausalLM"]);
        q["sliding_window"] = json!(8);
        q["max_window_layers"] = json!(1);
        assert!(
            spec_from_config(&q, None, p)
                .unwrap()
                .sliding_window
                .is_none()
        );
        q["use_sliding_window"] = json!(true);
        let s = spec_from_config(&q, None, p).unwrap();
        assert_eq!(
            (s.attention_window(0), s.attention_window(1)),
            (None, Some(8))
        );
        q["max_window_layers"] = json!(2);
        assert!(
            spec_from_config(&q, None, p)
                .unwrap()
                .sliding_window
                .is_none()
        );
        // What cannot be served is refused, not approximated.
        for (k, v) in [
            ("sliding_window", json!(0)),
            ("layer_types", json!(["full_attention"])),
            (
                "layer_types",
                json!(["full_attention", "chunked_attention"]),
            ),
        ] {
            let mut bad = m.clone();
            bad["sliding_window"] = json!(8);
            bad[k] = v;
            assert!(
                matches!(
                    spec_from_config(&bad, None, p),
                    Err(LoadError::Config { .. })
                ),
                "{k}"
            );
        }
    }

    #[test]
    fn config_fields_map_to_the_spec() {
        let p = Path::new("config.json");
        let gen_cfg = json!({"eos_token_id": [9, 10]});
        let s = spec_from_config(&base(), Some(&gen_cfg), p).unwrap();
        assert_eq!(s.head_dim, 16);
        assert_eq!(s.eos_token_ids, vec![8, 9, 10]);
        assert_eq!(s.bos_token_id, Some(7));
        assert_eq!(s.rope_theta, 500000.0);
        assert!(
            matches!(s.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0)
        );
        assert!(!s.qkv_bias && !s.qk_norm && !s.tie_word_embeddings);
        let mut q = base();
        q["architectures"] = json!(["Qwen3ForCausalLM"]);
        q["head_dim"] = json!(32);
        q["eos_token_id"] = json!(8);
        q["rope_scaling"] = Value::Null;
        let s = spec_from_config(&q, None, p).unwrap();
        assert!(s.qk_norm && s.head_dim == 32 && s.eos_token_ids == vec![8]);
        assert!(s.rope_scaling.is_none());
        let mut bad = base();
        bad["hidden_act"] = json!("gelu");
        assert!(matches!(
            spec_from_config(&bad, None, p),
            Err(LoadError::Unsupported { .. })
        ));
        let mut bad = base();
        bad["num_key_value_heads"] = json!(3);
        assert!(matches!(
            spec_from_config(&bad, None, p),
            Err(LoadError::Config { .. })
        ));
    }

    #[test]
    fn tokenizer_config_reads_template_and_special_tokens() {
        let dir = std::env::temp_dir().join(format!("pdnode-hf-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            json!({
                "bos_token": {"content": "<s>", "special": true},
                "eos_token": "</s>",
                "add_bos_token": true,
                "chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}]
            })
            .to_string(),
        )
        .unwrap();
        let c = tokenizer_config(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(c.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.eos_token.as_deref(), Some("</s>"));
        assert_eq!(c.add_bos_token, Some(true));
        assert_eq!(c.chat_template.as_deref(), Some("D"));
    }
}
