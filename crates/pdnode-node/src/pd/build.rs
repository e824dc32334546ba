//! Building the engine a node's config asks for: load the model, pick the backend (cpu, cuda,
//! auto, mock), size the KV pool, start the engine loop thread, and build the tokenizer.

use pdnode_core::KvLayout;
use pdnode_core::config::{Backend as BackendKind, Config, ModelFormat};
use pdnode_core::error::{Classify, ErrorKind};
use pdnode_engine::backend::STAGING_ALIGN;
use pdnode_engine::backend::cpu::{CpuBackend, CpuBackendConfig, HostArena};
use pdnode_engine::engine::{EngineHandle, EngineLoopConfig, spawn_with_memory};
use pdnode_engine::loader::{TokenizerSource, load_model};
use pdnode_engine::mock::MockBackend;
use pdnode_engine::scheduler::Mode;
use pdnode_engine::text::Tokenizer;
use std::sync::Arc;
use std::time::Duration;

/// Host memory the CPU backend's KV pool may take when `engine.num_kv_blocks = 0`.
pub const CPU_KV_POOL_BUDGET_BYTES: usize = 1 << 30;

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

/// Lends the CPU backend host memory for its KV staging arena: called with the arena's length,
/// answers the memory (e.g. a UCX-allocated registered region) or `None` (no arena).
pub type HostArenaSource<'a> = &'a dyn Fn(usize) -> Option<HostArena>;

/// Bytes of one TP rank's KV staging arena for `layout` under `cfg` (`engine.kv_staging_tokens`
/// in whole blocks); 0: none.
pub fn staging_bytes(cfg: &Config, layout: &KvLayout) -> usize {
    let tokens = cfg.engine.kv_staging_tokens as usize;
    let blocks = tokens.div_ceil(layout.block_size.max(1) as usize);
    (blocks * layout.num_layers as usize * layout.block_layer_bytes())
        .next_multiple_of(STAGING_ALIGN)
}

/// Bytes of a host staging arena (the CPU backend's): [`staging_bytes`], plus room for the
/// fence record behind each span (`pd::fence`): one aligned slot per block, as many as there can
/// be spans.
pub fn host_staging_bytes(cfg: &Config, layout: &KvLayout) -> usize {
    let bytes = staging_bytes(cfg, layout);
    if bytes == 0 {
        return 0;
    }
    let blocks =
        (cfg.engine.kv_staging_tokens as usize).div_ceil(layout.block_size.max(1) as usize);
    bytes + blocks * STAGING_ALIGN
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
            let handle = if choice == Choice::Cpu {
                let layer_block = 2 * e.block_size as usize * spec.num_kv_heads * spec.head_dim * 4;
                let block_bytes = layer_block * spec.num_layers;
                let num_blocks = if e.num_kv_blocks > 0 {
                    e.num_kv_blocks
                } else {
                    let want =
                        e.max_running_requests as usize * (context.div_ceil(e.block_size as usize));
                    let cap = (CPU_KV_POOL_BUDGET_BYTES / block_bytes.max(1)).max(1);
                    want.min(cap).max(1) as u32
                };
                let mut backend = CpuBackend::from_loaded(
                    loaded,
                    CpuBackendConfig {
                        block_size: e.block_size,
                        num_blocks,
                        threads: e.cpu_threads,
                    },
                )
                .map_err(|err| BuildError::Backend {
                    backend: "cpu".into(),
                    message: err.to_string(),
                })?;
                use pdnode_engine::backend::Backend;
                let bytes = host_staging_bytes(cfg, backend.kv_layout());
                if let Some(lend) = staging.filter(|_| bytes > 0)
                    && let Some(arena) = lend(bytes)
                {
                    tracing::info!(bytes, "KV staging arena (host) attached");
                    backend.attach_staging(arena);
                }
                spawn_with_memory(backend, loop_cfg, tokenizer.clone())
            } else {
                spawn_cuda(cfg, &loaded, loop_cfg, tokenizer.clone(), staging.is_some())?
            }
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

#[cfg(feature = "cuda")]
pub(super) fn resolve_backend(cfg: &Config) -> Result<Choice, BuildError> {
    use pdnode_engine::backend::cuda::probe::{BackendChoice, select_backend};
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

#[cfg(not(feature = "cuda"))]
pub(super) fn resolve_backend(cfg: &Config) -> Result<Choice, BuildError> {
    match cfg.engine.backend {
        BackendKind::Cpu | BackendKind::Auto => Ok(Choice::Cpu),
        BackendKind::Mock => Ok(Choice::Mock),
        BackendKind::Cuda => Err(BuildError::Backend {
            backend: "cuda".into(),
            message: "this binary was built without the `cuda` feature".into(),
        }),
    }
}

#[cfg(feature = "cuda")]
fn spawn_cuda(
    cfg: &Config,
    loaded: &pdnode_engine::loader::LoadedModel,
    loop_cfg: EngineLoopConfig,
    tokenizer: Option<Arc<Tokenizer>>,
    with_staging: bool,
) -> Result<Result<EngineHandle, pdnode_engine::engine::EngineError>, BuildError> {
    use pdnode_engine::backend::Backend;
    use pdnode_engine::backend::cuda::{CudaBackend, CudaOptions, CudaTpBackend};
    let opts = CudaOptions::from_config(&cfg.engine);
    let err = |err: pdnode_engine::backend::cuda::CudaError| BuildError::Backend {
        backend: "cuda".into(),
        message: err.to_string(),
    };
    // The hand-off arena, when this engine hands KV off (a failure leaves host staging).
    let with_arena = |layout: &KvLayout, enable: &mut dyn FnMut(usize) -> Result<(), String>| {
        let bytes = if with_staging {
            staging_bytes(cfg, layout)
        } else {
            0
        };
        if bytes > 0
            && let Err(e) = enable(bytes)
        {
            tracing::warn!(error = %e, "no KV staging arena: the hand-off copies through host staging");
        }
    };
    if opts.tensor_parallel > 1 {
        let mut backend = CudaTpBackend::from_loaded(loaded, &opts).map_err(err)?;
        let layout = backend.kv_layout().clone();
        with_arena(&layout, &mut |b| {
            backend
                .enable_kv_staging(b)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        Ok(spawn_with_memory(backend, loop_cfg, tokenizer))
    } else {
        let mut backend = CudaBackend::from_loaded(loaded, &opts).map_err(err)?;
        let layout = backend.kv_layout().clone();
        with_arena(&layout, &mut |b| {
            backend
                .enable_kv_staging(b)
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        Ok(spawn_with_memory(backend, loop_cfg, tokenizer))
    }
}

#[cfg(not(feature = "cuda"))]
fn spawn_cuda(
    _cfg: &Config,
    _loaded: &pdnode_engine::loader::LoadedModel,
    _loop_cfg: EngineLoopConfig,
    _tokenizer: Option<Arc<Tokenizer>>,
    _with_staging: bool,
) -> Result<Result<EngineHandle, pdnode_engine::engine::EngineError>, BuildError> {
    Err(BuildError::Backend {
        backend: "cuda".into(),
        message: "this binary was built without the `cuda` feature".into(),
    })
}
