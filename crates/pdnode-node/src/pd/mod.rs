//! The prefill/decode data path of a node, and the assembly of each role's serving pieces.
//!
//! - [`PdNode`]: one engine (prefill-only or decode-only) behind the router's `NodeClient` seam.
//! - [`KvMover`]: how KV reaches the decode node (in process, or UCX staging + put + flush).
//! - [`wire`]: the `pdnode.v1.Node` data-path methods over a `NodeClient` (the gRPC edge).
//! - [`build_engine`]: the engine a config asks for (cpu, cuda, auto, mock).
//! - [`all_in_one`]: role = "all": a prefill engine, a decode engine and the router's
//!   dependencies in one process, KV moved in process.
//! - [`pd_node`]: role = "prefill" | "decode": one engine and a UCX transport.
//! - [`router_tokenizer`]: the tokenizer a router (any role) serves with.
//! - [`ColocatedNode`], [`colocated`]: role = "all" with `engine.colocated`: one colocated engine
//!   (the baseline PD is measured against), paired with itself by the router.

pub mod arena;
mod build;
mod colocated;
pub mod fence;
pub mod handoff;
mod held;
mod kv;
mod local;
mod mock_tok;
mod overlap;
mod peers;
mod tokenize;
pub mod wire;

pub use build::{
    BuildError, BuiltEngine, HostArenaSource, build_engine, build_engine_with, served_name,
    staging_bytes,
};
pub use colocated::{Colocated, ColocatedNode, colocated};
pub use kv::{InProcessDirectory, KvMover};
pub use local::{HandoffSettings, MAX_ARENA_WAIT, PdNode, StagingStats};
pub use mock_tok::MockTokenizer;
pub use peers::{PeerError, RegisteredPeers};
pub use tokenize::EngineTokenizer;

use pdnode_core::card::{NodeAddresses, NodeCapacity, NodeCard};
use pdnode_core::config::{Backend as BackendKind, Config, ModelFormat};
use pdnode_core::{NodeId, Role};
use pdnode_engine::scheduler::Mode;
use pdnode_engine::text::Tokenizer;
use pdnode_router::{
    ChatRender, Membership, ModelInfo, RouterDeps, StaticMembership, Tokenize, Worker,
};
use pdnode_transfer::{KvTransport, UcxConfig, UcxTransport};
use std::sync::Arc;
use std::time::Duration;

/// Sampling parameters as a node's engine runs them: without stop strings. The router is the one
/// place that turns output tokens into text: it detokenizes once, cuts the text at a stop string
/// and ends the request on both nodes (docs/runtime-semantics.md, "Output text and stop
/// strings"), so the nodes' engines are built without a tokenizer and never see stop strings.
pub(crate) fn engine_sampling(mut p: pdnode_core::SamplingParams) -> pdnode_core::SamplingParams {
    p.stop.clear();
    p
}

/// The KV part of a node's [`pdnode_core::Accounting`], from the engine's pool counts: owned by
/// requests, by transfer leases, evictable cached, free (they add up to the pool).
pub fn kv_accounting(kv: &pdnode_kvcache::KvStats) -> pdnode_core::Accounting {
    pdnode_core::Accounting {
        kv_blocks_owned_request: kv.owned_by_requests() as u64,
        kv_blocks_owned_transfer: kv.owned_by_leases() as u64,
        kv_blocks_cached: kv.cached_evictable() as u64,
        kv_blocks_free: kv.free as u64,
        ..pdnode_core::Accounting::default()
    }
}

/// The engine's part of a node's report: [`kv_accounting`], preemptions and step times.
pub fn engine_accounting(s: &pdnode_engine::engine::EngineStats) -> pdnode_core::Accounting {
    pdnode_core::Accounting {
        engine_preemptions_total: s.scheduler.preemptions_total,
        engine_step_prefill: s.step_prefill,
        engine_step_decode: s.step_decode,
        ..kv_accounting(&s.scheduler.kv)
    }
}

/// The router's view of the model: tokenizer, chat renderer and model facts.
pub struct RouterModel {
    pub tokenizer: Arc<dyn Tokenize>,
    pub chat: Arc<dyn ChatRender>,
    pub model: ModelInfo,
}

impl RouterModel {
    /// The router's dependencies: this model, `membership`, and the config's router section and
    /// API keys.
    pub fn into_deps(
        self,
        cfg: &Config,
        membership: Arc<dyn Membership>,
    ) -> Result<RouterDeps, BuildError> {
        Ok(RouterDeps {
            config: cfg.router.clone(),
            api_keys: api_keys(cfg)?,
            insecure_node_plane: !cfg.node.listens_on_loopback() && !cfg.security.node_tls(),
            membership,
            tokenizer: self.tokenizer,
            chat: self.chat,
            model: self.model,
        })
    }
}

/// Frontend-side model pieces from an engine's tokenizer (or the mock's).
pub fn router_model(
    cfg: &Config,
    tok: Option<Arc<Tokenizer>>,
    context_length: u32,
) -> Result<RouterModel, BuildError> {
    let model = ModelInfo {
        served_name: served_name(cfg),
        context_length,
        simulated: (cfg.engine.backend == BackendKind::Mock).then(|| "mock".to_string()),
    };
    match tok {
        Some(t) => {
            let et = Arc::new(EngineTokenizer::new(t));
            Ok(RouterModel {
                tokenizer: et.clone(),
                chat: et,
                model,
            })
        }
        None if cfg.engine.backend == BackendKind::Mock => {
            let mt = Arc::new(MockTokenizer {
                vocab_size: cfg.engine.mock.vocab_size,
            });
            Ok(RouterModel {
                tokenizer: mt.clone(),
                chat: mt,
                model,
            })
        }
        None => Err(BuildError::Tokenizer {
            path: cfg.model.path.clone(),
            message:
                "the model has no tokenizer; the frontends need one (use an HF directory with \
                      tokenizer.json or a GGUF file with tokenizer metadata)"
                    .into(),
        }),
    }
}

/// The tokenizer a router process serves with, loaded without the weights where the format
/// allows (GGUF metadata, HF tokenizer.json).
pub fn router_tokenizer(cfg: &Config) -> Result<RouterModel, BuildError> {
    use pdnode_engine::loader::{TokenizerSource, gguf::GgufFile, gguf_model, hf};
    let context = cfg.engine.context_length;
    if cfg.engine.backend == BackendKind::Mock {
        return router_model(cfg, None, context);
    }
    let path = std::path::Path::new(&cfg.model.path);
    let err = |m: String| BuildError::Tokenizer {
        path: cfg.model.path.clone(),
        message: m,
    };
    let src = match cfg.model.format {
        ModelFormat::Gguf => {
            let f = GgufFile::open(path).map_err(|e| err(e.to_string()))?;
            gguf_model::tokenizer_from_gguf(&f).map_err(|e| err(e.to_string()))?
        }
        ModelFormat::Hf | ModelFormat::Dummy if path.join("tokenizer.json").is_file() => {
            TokenizerSource::HfFile {
                path: path.join("tokenizer.json"),
                config: hf::tokenizer_config(path).map_err(|e| err(e.to_string()))?,
            }
        }
        _ => TokenizerSource::None,
    };
    let tok = match src {
        TokenizerSource::None => None,
        s => Some(Arc::new(
            Tokenizer::from_source(&s).map_err(|e| err(e.to_string()))?,
        )),
    };
    router_model(cfg, tok, context)
}

/// A node card for an in-process worker or a serving node.
pub fn card(cfg: &Config, id: &NodeId, role: Role, built: &BuiltEngine, grpc: &str) -> NodeCard {
    let info = built.handle.info();
    NodeCard {
        id: id.clone(),
        role,
        cluster: cfg.node.cluster.clone(),
        model_id: built.model_id.clone(),
        model_fingerprint: info.kv_layout.model_fingerprint.clone(),
        kv_layout: Some(info.kv_layout.clone()),
        tp_size: info.kv_layout.tp_size,
        addresses: NodeAddresses {
            grpc: grpc.to_string(),
            ..Default::default()
        },
        capacity: NodeCapacity {
            kv_blocks_total: info.num_kv_blocks as u64,
            kv_blocks_free: info.num_kv_blocks as u64,
            max_running_requests: info.max_running_requests as u32,
            ..Default::default()
        },
        version: env!("CARGO_PKG_VERSION").to_string(),
        started_at_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        // In process, only `pd::colocated` builds an `all` card: one engine serving both phases.
        colocated: role == Role::All,
        sglang: None,
        draining: false,
    }
}

/// API keys from `security.api_keys` plus `security.api_keys_file`.
pub fn api_keys(cfg: &Config) -> Result<Vec<String>, BuildError> {
    let mut keys = cfg.security.api_keys.clone();
    if !cfg.security.api_keys_file.is_empty() {
        let text = std::fs::read_to_string(&cfg.security.api_keys_file).map_err(|e| {
            BuildError::Engine(format!(
                "security.api_keys_file {:?}: {e}",
                cfg.security.api_keys_file
            ))
        })?;
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(str::to_string),
        );
    }
    Ok(keys)
}

/// role = "all": everything one process needs to serve.
pub struct AllInOne {
    pub deps: RouterDeps,
    pub prefill: Arc<PdNode>,
    pub decode: Arc<PdNode>,
}

/// Builds a prefill engine, a decode engine (KV moved in process) and the router's deps.
/// Blocking (loads the model twice): call from a blocking context.
pub fn all_in_one(cfg: &Config, node_id: &NodeId) -> Result<AllInOne, BuildError> {
    let lease = Duration::from_millis(cfg.transfer.lease_ms);
    let p = build_engine(cfg, Mode::PrefillOnly)?;
    let d = build_engine(cfg, Mode::DecodeOnly)?;
    let pid = NodeId::new(format!("{node_id}.prefill"));
    let did = NodeId::new(format!("{node_id}.decode"));
    let dir = InProcessDirectory::new();
    dir.insert(did.clone(), d.handle.clone());
    let prefill = PdNode::new(
        pid.clone(),
        Role::Prefill,
        p.handle.clone(),
        KvMover::InProcess(dir.clone()),
        lease,
    );
    let decode = PdNode::new(
        did.clone(),
        Role::Decode,
        d.handle.clone(),
        KvMover::InProcess(dir),
        lease,
    );
    let membership = StaticMembership::new(vec![
        Worker {
            card: card(cfg, &pid, Role::Prefill, &p, "in-process"),
            client: prefill.clone(),
        },
        Worker {
            card: card(cfg, &did, Role::Decode, &d, "in-process"),
            client: decode.clone(),
        },
    ]);
    let deps = router_model(cfg, p.tokenizer.clone(), p.context_length)?
        .into_deps(cfg, Arc::new(membership))?;
    Ok(AllInOne {
        deps,
        prefill,
        decode,
    })
}

/// role = "prefill" | "decode": one engine, a UCX transport, and the node client over them.
pub struct ServingNode {
    pub node: Arc<PdNode>,
    pub built: BuiltEngine,
    pub transport: Arc<UcxTransport>,
}

pub fn pd_node(cfg: &Config, id: &NodeId, role: Role) -> Result<ServingNode, BuildError> {
    let mode = match role {
        Role::Prefill => Mode::PrefillOnly,
        Role::Decode => Mode::DecodeOnly,
        other => {
            return Err(BuildError::Engine(format!(
                "pd_node serves prefill or decode, not {other}"
            )));
        }
    };
    // A CUDA engine's staging arena is device memory: UCX's CUDA transports need the engine
    // GPU's primary context current on the worker thread.
    let cuda_device = (build::resolve_backend(cfg)? == build::Choice::Cuda)
        .then(|| cfg.engine.gpus.first().copied().unwrap_or(0));
    let ucx = UcxTransport::start(UcxConfig {
        library: (!cfg.transfer.ucx_lib.is_empty()).then(|| cfg.transfer.ucx_lib.clone()),
        name: id.to_string(),
        net_devices: (!cfg.transfer.ucx_net_devices.is_empty())
            .then(|| cfg.transfer.ucx_net_devices.clone()),
        tls: (!cfg.transfer.ucx_tls.is_empty()).then(|| cfg.transfer.ucx_tls.clone()),
        cuda_device,
        ..UcxConfig::default()
    })
    .map_err(|e| BuildError::Backend {
        backend: "ucx".into(),
        message: e.to_string(),
    })?;
    let transport = Arc::new(ucx);
    let (built, host) = build_with_host_arena(cfg, mode, &transport)?;
    let arena = arena::register(&transport, &built.handle.info().staging_regions, host);
    let node = PdNode::with_staging(
        id.clone(),
        role,
        built.handle.clone(),
        KvMover::Ucx(transport.clone()),
        Duration::from_millis(cfg.transfer.lease_ms),
        arena,
    );
    node.set_push_layer_group(cfg.engine.kv_push_layer_group);
    node.set_verify(cfg.transfer.verify);
    node.set_host_staging_bytes(cfg.transfer.host_staging_bytes);
    node.set_stall(cfg.transfer.stall_ms, cfg.transfer.stall_min_rate_mibps);
    Ok(ServingNode {
        node,
        built,
        transport,
    })
}

/// Builds the engine with a KV staging arena: the CPU backend's is host memory UCX allocates
/// and registers (`allocate_registered`: shared-memory transports map it, unlike a user buffer);
/// returned beside the engine so that it is registered once, not twice.
fn build_with_host_arena(
    cfg: &Config,
    mode: Mode,
    transport: &Arc<UcxTransport>,
) -> Result<(BuiltEngine, Option<Arc<pdnode_transfer::Registration>>), BuildError> {
    let host = std::sync::Mutex::new(None);
    let lend = |len: usize| {
        let reg = match transport.allocate_registered(len) {
            Ok(r) => Arc::new(r),
            Err(e) => {
                tracing::warn!(len, error = %e, "no host KV staging arena");
                return None;
            }
        };
        let r = reg.region();
        *host.lock().unwrap_or_else(|p| p.into_inner()) = Some(reg.clone());
        // SAFETY: the registration owns `r.len` bytes of host memory at `r.addr`, kept alive
        // by the arena's owner handle (and by `host` for the node); only the engine (gather,
        // scatter) and UCX (puts of the span a request owns) touch it, per span.
        Some(unsafe { pdnode_engine::backend::cpu::HostArena::new(r.addr as *mut u8, r.len, reg) })
    };
    let built = build_engine_with(cfg, mode, Some(&lend))?;
    let host = host.into_inner().unwrap_or_else(|p| p.into_inner());
    Ok((built, host))
}

/// Hex of the UCX worker address, for the node card.
pub fn ucx_address_hex(t: &UcxTransport) -> String {
    t.local_address()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
