//! Building the engine a node's config asks for: load the model, pick the backend (cpu, cuda,
//! auto, mock), size the KV pool, start the engine loop thread, and build the tokenizer.

use pdnode_core::KvLayout;
use pdnode_core::config::{Backend as BackendKind, Config, ModelFormat};
use pdnode_core::error::{Classify, ErrorKind};
use pdnode_cuda::build::{BuildOptions, build_backend};
use pdnode_cuda::{BackendChoice, select_backend};
use pdnode_engine::backend::STAGING_ALIGN;
use pdnode_engine::engine::{
    EngineHandle, EngineLoopConfig, spawn_with_memory, spawn_with_regions,
};
use pdnode_engine::loader::{TokenizerSource, load_model};
use pdnode_engine::mock::MockBackend;
use pdnode_engine::scheduler::Mode;
use pdnode_engine::text::Tokenizer;
use std::sync::Arc;
use std::time::Duration;

pub use pdnode_cuda::build::HostArenaSource;

/// An engine loop ready to serve, with what the frontends need about its model.
pub struct BuiltEngine {
    pub handle: EngineHandle,
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// The served model name.
    pub model_id: String,
    pub context_length: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("loading model {path:?}: {message}")]
    Model { path: String, message: String },
    #[error("tokenizer of {path:?}: {message}")]
    Tokenizer { path: String, message: String },
    #[error("backend {backend}: {message}")]
    Backend { backend: String, message: String },
    #[error("engine: {0}")]
    Engine(String),
}

impl Classify for BuildError {
    fn kind(&self) -> ErrorKind {
        ErrorKind::Internal
    }
}

/// The name clients pass as `model`.
pub fn served_name(cfg: &Config) -> String {
    if !cfg.model.served_name.is_empty() {
        return cfg.model.served_name.clone();
    }
    if cfg.engine.backend == BackendKind::Mock {
        return "mock".into();
    }
    if cfg.model.format == ModelFormat::Dummy {
        return format!("dummy-{}", cfg.model.preset);
    }
    let p = std::path::Path::new(&cfg.model.path);
    p.file_stem()
        .or_else(|| p.file_name())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

fn tokenizer_from(src: &TokenizerSource, path: &str) -> Result<Option<Arc<Tokenizer>>, BuildError> {
    if matches!(src, TokenizerSource::None) {
        return Ok(None);
    }
    Tokenizer::from_source(src)
        .map(|t| Some(Arc::new(t)))
        .map_err(|e| BuildError::Tokenizer {
            path: path.to_string(),
            message: e.to_string(),
        })
}

/// Builds and starts the engine of `cfg` in `mode`. Blocking (loads weights): call it from a
/// blocking context.
pub fn build_engine(cfg: &Config, mode: Mode) -> Result<BuiltEngine, BuildError> {
    build_engine_with(cfg, mode, None)
}

/// Bytes of one TP rank's KV staging arena for `layout` under `cfg` (`engine.kv_staging_tokens`
/// in whole blocks); 0: none.
pub fn staging_bytes(cfg: &Config, layout: &KvLayout) -> usize {
    pdnode_cuda::build::staging_bytes(&cfg.engine, layout)
}

/// As [`build_engine`], and with a KV staging arena per TP rank when `staging` is given (a
/// prefill or decode node over UCX): the CUDA backend allocates its own (`cuMemAlloc`), the CPU
/// backend takes the memory `staging` lends. An arena that cannot be had is logged and left out
/// (the hand-off then copies through per-request host staging); it never fails the build.
pub fn build_engine_with(
    cfg: &Config,
    mode: Mode,
    staging: Option<HostArenaSource<'_>>,
) -> Result<BuiltEngine, BuildError> {
    let lease = Duration::from_millis(cfg.transfer.lease_ms);
    let model_id = served_name(cfg);
    let e = &cfg.engine;
    let choice = resolve_backend(cfg)?;
    match choice {
        Choice::Mock => {
            let backend = MockBackend::new(e).map_err(|err| BuildError::Backend {
                backend: "mock".into(),
                message: err.to_string(),
            })?;
            tracing::warn!(
                "engine.backend = \"mock\": a SIMULATED engine (timed steps, pseudo-random tokens); not a model"
            );
            let loop_cfg = EngineLoopConfig::from_config(
                e,
                mode,
                lease,
                e.mock.vocab_size as usize,
                Vec::new(),
            );
            let handle = spawn_with_memory(backend, loop_cfg, None)
                .map_err(|err| BuildError::Engine(err.to_string()))?;
            Ok(BuiltEngine {
                handle,
                tokenizer: None,
                model_id,
                context_length: e.context_length,
            })
        }
        Choice::Cpu | Choice::Cuda => {
            let t0 = std::time::Instant::now();
            let loaded = load_model(&cfg.model).map_err(|err| BuildError::Model {
                path: cfg.model.path.clone(),
                message: err.to_string(),
            })?;
            tracing::info!(model = %loaded.name, arch = ?loaded.spec.arch, ms = t0.elapsed().as_millis() as u64, "model loaded");
            let tokenizer = tokenizer_from(&loaded.tokenizer, &cfg.model.path)?;
            let spec = loaded.spec.clone();
            let mut eos = spec.eos_token_ids.clone();
            if let Some(t) = &tokenizer {
                for id in t.eos_token_ids() {
                    if !eos.contains(id) {
                        eos.push(*id);
                    }
                }
            }
            let context = (e.context_length as usize).min(spec.max_position_embeddings.max(16));
            let mut engine_cfg = e.clone();
            engine_cfg.context_length = context as u32;
            let loop_cfg =
                EngineLoopConfig::from_config(&engine_cfg, mode, lease, spec.vocab_size, eos);
            let built = build_backend(
                e,
                loaded,
                BuildOptions {
                    context,
                    kv_blocks: None,
                    staging,
                    host_slot_bytes: STAGING_ALIGN,
                },
            )
            .map_err(|err| BuildError::Backend {
                backend: if choice == Choice::Cpu { "cpu" } else { "cuda" }.into(),
                message: err.to_string(),
            })?;
            // The engine gets no tokenizer: the router detokenizes and applies stop strings,
            // once (`super::engine_sampling`); the tokenizer serves the router's model.
            let handle = spawn_with_regions(built.backend, built.kv_regions, loop_cfg, None)
                .map_err(|err| BuildError::Engine(err.to_string()))?;
            Ok(BuiltEngine {
                handle,
                tokenizer,
                model_id,
                context_length: context as u32,
            })
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Choice {
    Cpu,
    Cuda,
    Mock,
}

pub(super) fn resolve_backend(cfg: &Config) -> Result<Choice, BuildError> {
    match select_backend(cfg.engine.backend, &cfg.engine.gpus) {
        Ok(BackendChoice::Cpu) => Ok(Choice::Cpu),
        Ok(BackendChoice::Cuda) => Ok(Choice::Cuda),
        Ok(BackendChoice::Mock) => Ok(Choice::Mock),
        Err(e) => Err(BuildError::Backend {
            backend: "cuda".into(),
            message: e.to_string(),
        }),
    }
}
