//! Model loading: an HF directory (`config.json` + safetensors), a GGUF file, or a `dummy` preset,
//! each producing a [`LoadedModel`]: the [`ModelSpec`], the weights ([`ModelWeights`]), the raw
//! tokenizer data ([`TokenizerSource`], turned into a `tokenizers::Tokenizer` by `crate::text`) and
//! the model fingerprint for `KvLayout::model_fingerprint`.
//!
//! Entry points: [`load_model`] (from the `[model]` config section) and [`load_path`] (a path,
//! format detected from it).

pub mod dummy;
pub mod fingerprint;
pub mod gguf;
pub mod gguf_model;
pub mod hf;
mod hf_mla;
mod progress;
pub mod quant;
pub mod safetensors_io;

use crate::spec::ModelSpec;
use crate::weights::{MlaWeights, Weights};
use pdnode_core::config::{ModelConfig, ModelFormat};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The tokenizer of a model, as raw data. `crate::text` builds the `tokenizers::Tokenizer` and the
/// chat template from it.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenizerSource {
    /// A Hugging Face `tokenizer.json` plus what `tokenizer_config.json` says about it.
    HfFile {
        /// Path of `tokenizer.json`.
        path: PathBuf,
        config: HfTokenizerConfig,
    },
    /// The tokenizer stored in a GGUF file's metadata (`tokenizer.ggml.*`).
    Gguf(Box<GgufTokenizer>),
    /// No tokenizer available (a dummy preset without a tokenizer path, or an HF directory without
    /// `tokenizer.json`): callers must work on token ids.
    None,
}

/// The parts of HF `tokenizer_config.json` (and `generation_config.json`) the text layer needs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HfTokenizerConfig {
    /// The Jinja chat template (`chat_template`, or the one named "default" when it is a list;
    /// also read from a separate `chat_template.jinja` / `chat_template.json` when present).
    pub chat_template: Option<String>,
    /// `bos_token` / `eos_token` / `pad_token` / `unk_token` as strings (the `content` of an
    /// AddedToken object is taken when they are objects).
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    pub unk_token: Option<String>,
    /// `add_bos_token` / `add_eos_token` when the file states them.
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    /// The whole `tokenizer_config.json` (Null when the file is absent), for anything else.
    pub raw: serde_json::Value,
}

/// A tokenizer read from GGUF metadata (`tokenizer.ggml.*`), unprocessed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GgufTokenizer {
    /// `tokenizer.ggml.model`: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer type ("smollm", "llama-bpe", "qwen2", ...), if given.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`, indexed by token id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.merges` ("a b" strings), empty for SentencePiece models.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
    /// 6 byte), empty when absent.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.scores`, empty when absent.
    pub scores: Vec<f32>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub unk_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token` / `add_eos_token` when present.
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    /// `tokenizer.chat_template`, if present.
    pub chat_template: Option<String>,
}

/// How the weights of a loaded model are held.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelWeights {
    /// Real (or materialized dummy) f32 weights in host memory.
    Host(Weights),
    /// The same for a latent-attention (DeepSeek) model.
    HostMla(MlaWeights),
    /// Random weights not materialized yet: a backend generates them itself from the spec and this
    /// description (the CUDA backend does so on the device; the CPU backend via
    /// `loader::dummy::materialize`).
    Dummy(DummySpec),
}

/// Seeded random weights: every tensor drawn from N(0, std) (norm weights are 1.0, biases 0.0),
/// tensor by tensor in a fixed order with a per-tensor seed so backends can generate any tensor
/// independently (see `loader::dummy`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DummySpec {
    pub seed: u64,
    pub std: f32,
}

/// A model ready to hand to a backend.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedModel {
    pub spec: ModelSpec,
    pub weights: ModelWeights,
    pub tokenizer: TokenizerSource,
    /// Stable hash of the spec, tensor names and shapes and a sample of the weight bytes
    /// (hex, 32 chars) for `KvLayout::model_fingerprint`.
    pub fingerprint: String,
    /// A display name: the file or directory name, or the preset name.
    pub name: String,
    /// Extra metadata worth logging (GGUF `general.*` strings, HF `torch_dtype`, ...).
    pub metadata: HashMap<String, String>,
}

/// Errors while loading a model. Every variant names the file (or preset) involved.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file's bytes do not make a valid file of its format (truncated, corrupted, bad offset).
    #[error("{path}: malformed {format} file: {reason}")]
    Malformed {
        path: PathBuf,
        format: &'static str,
        reason: String,
    },
    /// A valid file describing something we do not support.
    #[error("{path}: {reason}")]
    Unsupported { path: PathBuf, reason: String },
    #[error(
        "{path}: unsupported architecture `{arch}`; supported: {}",
        supported.join(", ")
    )]
    UnsupportedArch {
        path: PathBuf,
        arch: String,
        supported: Vec<String>,
    },
    #[error("{path}: tensor `{name}` is missing")]
    MissingTensor { path: PathBuf, name: String },
    #[error("{path}: tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape {
        path: PathBuf,
        name: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("{path}: invalid config: {reason}")]
    Config { path: PathBuf, reason: String },
    /// A value no servable model has (zero, past a bound, not finite, a product that overflows):
    /// `key` is the file's name for it (`num_attention_heads`, `llama.attention.head_count`).
    /// See [`ModelSpec::validate`].
    #[error("{path}: invalid config: `{key}` {reason}")]
    ConfigValue {
        path: PathBuf,
        key: String,
        reason: String,
    },
    #[error("unknown model preset `{name}`; known presets: {}", known.join(", "))]
    UnknownPreset { name: String, known: Vec<String> },
    #[error("{path}: cannot tell the model format (expected an HF directory or a .gguf file)")]
    UnknownFormat { path: PathBuf },
}

impl pdnode_core::error::Classify for LoadError {
    fn kind(&self) -> pdnode_core::ErrorKind {
        // Loading happens at start-up from operator-supplied paths: a bad path or file is the
        // caller's input, not a bug.
        match self {
            LoadError::Io { .. }
            | LoadError::Malformed { .. }
            | LoadError::Unsupported { .. }
            | LoadError::UnsupportedArch { .. }
            | LoadError::MissingTensor { .. }
            | LoadError::TensorShape { .. }
            | LoadError::Config { .. }
            | LoadError::ConfigValue { .. }
            | LoadError::UnknownPreset { .. }
            | LoadError::UnknownFormat { .. } => pdnode_core::ErrorKind::InvalidRequest,
        }
    }
}

impl LoadError {
    /// A [`crate::spec::SpecError`] as the loader of `path` names the value (`key`).
    pub(crate) fn config_value(path: &Path, key: String, e: crate::spec::SpecError) -> Self {
        LoadError::ConfigValue {
            path: path.to_path_buf(),
            key,
            reason: e.reason,
        }
    }

    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        LoadError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Which loader a path goes to.
pub fn detect_format(path: &Path) -> Result<ModelFormat, LoadError> {
    if path.is_dir() {
        return Ok(ModelFormat::Hf);
    }
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return Ok(ModelFormat::Gguf);
    }
    // A file without the extension: sniff the magic.
    if path.is_file() {
        let mut magic = [0u8; 4];
        let ok = std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .is_ok();
        if ok && &magic == b"GGUF" {
            return Ok(ModelFormat::Gguf);
        }
    }
    if !path.exists() {
        return Err(LoadError::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
        ));
    }
    Err(LoadError::UnknownFormat {
        path: path.to_path_buf(),
    })
}

/// Loads the model the `[model]` config section names: `format = "hf" | "gguf" | "dummy"`.
/// For `dummy`, `preset` names the shapes and a non-empty `path` supplies the tokenizer (an HF
/// directory or a GGUF file whose tokenizer is used; its weights are not read).
pub fn load_model(cfg: &ModelConfig) -> Result<LoadedModel, LoadError> {
    match cfg.format {
        ModelFormat::Dummy => {
            let tok = if cfg.path.is_empty() {
                None
            } else {
                Some(Path::new(&cfg.path))
            };
            load_dummy(
                &cfg.preset,
                DummySpec {
                    seed: 0,
                    std: dummy::DEFAULT_STD,
                },
                tok,
            )
        }
        ModelFormat::Hf | ModelFormat::Gguf => load_as(Path::new(&cfg.path), cfg.format),
    }
}

/// Loads an HF directory or a GGUF file, detecting which from the path.
pub fn load_path(path: &Path) -> Result<LoadedModel, LoadError> {
    load_as(path, detect_format(path)?)
}

fn display_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

fn load_as(path: &Path, format: ModelFormat) -> Result<LoadedModel, LoadError> {
    let t0 = std::time::Instant::now();
    let (spec, weights, tokenizer, metadata) = match format {
        ModelFormat::Hf => {
            let m = hf::load(path)?;
            (m.spec, m.weights, m.tokenizer, m.metadata)
        }
        ModelFormat::Gguf => {
            let m = gguf_model::load(path)?;
            (
                m.spec,
                ModelWeights::Host(m.weights),
                m.tokenizer,
                m.metadata,
            )
        }
        ModelFormat::Dummy => {
            return Err(LoadError::UnknownFormat {
                path: path.to_path_buf(),
            });
        }
    };
    let fingerprint = match &weights {
        ModelWeights::Host(w) => fingerprint::of_weights(&spec, w),
        ModelWeights::HostMla(w) => fingerprint::of_mla_weights(&spec, w),
        ModelWeights::Dummy(d) => fingerprint::of_dummy(&spec, *d),
    };
    tracing::info!(
        path = %path.display(),
        arch = ?spec.arch,
        layers = spec.num_layers,
        params = spec.num_params(),
        fingerprint = %fingerprint,
        load_ms = t0.elapsed().as_millis() as u64,
        "model loaded"
    );
    Ok(LoadedModel {
        spec,
        weights,
        tokenizer,
        fingerprint,
        name: display_name(path),
        metadata,
    })
}

/// A `dummy` model: preset shapes, weights left to the backend ([`ModelWeights::Dummy`]), and the
/// tokenizer of `tokenizer_from` when given (an HF directory or a GGUF file; only its tokenizer is
/// read).
pub fn load_dummy(
    preset: &str,
    d: DummySpec,
    tokenizer_from: Option<&Path>,
) -> Result<LoadedModel, LoadError> {
    let spec = dummy::preset(preset).ok_or_else(|| LoadError::UnknownPreset {
        name: preset.to_string(),
        known: dummy::PRESETS.iter().map(|s| s.to_string()).collect(),
    })?;
    spec.validate()
        .map_err(|e| LoadError::config_value(Path::new(preset), e.field.to_string(), e))?;
    let tokenizer = match tokenizer_from {
        None => TokenizerSource::None,
        Some(p) => match detect_format(p)? {
            ModelFormat::Gguf => gguf_model::tokenizer_from_gguf(&gguf::GgufFile::open(p)?)?,
            _ => {
                let tok = p.join("tokenizer.json");
                if !tok.is_file() {
                    return Err(LoadError::io(
                        &tok,
                        std::io::Error::new(std::io::ErrorKind::NotFound, "no tokenizer.json"),
                    ));
                }
                TokenizerSource::HfFile {
                    path: tok,
                    config: hf::tokenizer_config(p)?,
                }
            }
        },
    };
    let fingerprint = fingerprint::of_dummy(&spec, d);
    tracing::info!(
        preset,
        seed = d.seed,
        params = spec.num_params(),
        "dummy model (random weights)"
    );
    Ok(LoadedModel {
        spec,
        weights: ModelWeights::Dummy(d),
        tokenizer,
        fingerprint,
        name: preset.to_string(),
        metadata: HashMap::new(),
    })
}
