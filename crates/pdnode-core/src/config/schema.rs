//! The configuration schema. Key names are public interface: keep them stable.

use super::schema_router::RouterConfig;
use crate::card::Role;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub node: NodeConfig,
    pub registry: RegistryConfig,
    pub model: ModelConfig,
    pub engine: EngineConfig,
    pub transfer: TransferConfig,
    pub router: RouterConfig,
    pub security: SecurityConfig,
    pub log: LogConfig,
    pub telemetry: TelemetryConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// prefill | decode | router | all
    pub role: Role,
    /// Nodes of one cluster see each other; the registry key's second segment.
    pub cluster: String,
    /// Unique within the cluster. Empty: `{role}-{hostname}-{pid}`.
    pub id: String,
    /// Node-to-node gRPC listen address (`host:port`; port 0 picks a free one).
    pub listen: String,
    /// Address other nodes use to reach this one; empty: the listen address.
    pub advertise: String,
    /// HTTP listen address for `/health` and `/metrics` on prefill/decode nodes; empty: none.
    pub http_listen: String,
    /// Longest time a graceful shutdown waits for in-flight requests, seconds.
    pub drain_timeout_s: u64,
    /// What a decode node does with its running decodes on a graceful shutdown: `wait` for
    /// them to finish, or `migrate` them to other decode nodes (docs/runtime-semantics.md,
    /// "Live decode migration").
    pub drain: DrainMode,
    /// An engine that has not reported its load for this long (its thread is between steps
    /// only after a step ends) is taken for wedged: `Stats` answers UNAVAILABLE and the router
    /// fails over. Must exceed the longest engine step. 0: 5000, or 60000 for an engine on the
    /// CPU (a step of `engine.max_batch_tokens` prompt tokens there takes seconds).
    pub engine_stall_ms: u64,
}

/// `node.drain`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DrainMode {
    /// Wait for running requests to finish (up to `node.drain_timeout_s`).
    #[default]
    Wait,
    /// Ask the routers to move every running decode to another decode node, then wait for
    /// what is left.
    Migrate,
}

impl NodeConfig {
    /// Whether `node.listen` is reachable only from this host (127.0.0.0/8, `::1`,
    /// `localhost`).
    pub fn listens_on_loopback(&self) -> bool {
        is_loopback_listen(&self.listen)
    }
}

/// Whether a `host:port` listen address is loopback only.
pub fn is_loopback_listen(listen: &str) -> bool {
    let host = listen.rsplit_once(':').map_or(listen, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            role: Role::All,
            cluster: "default".into(),
            id: String::new(),
            listen: "127.0.0.1:0".into(),
            advertise: String::new(),
            http_listen: String::new(),
            drain_timeout_s: 30,
            drain: DrainMode::Wait,
            engine_stall_ms: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RegistryKind {
    /// In-process; only for `role = "all"`.
    Memory,
    Etcd,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryConfig {
    pub kind: RegistryKind,
    /// etcd endpoints, e.g. `["http://127.0.0.1:2379"]`.
    pub endpoints: Vec<String>,
    /// The node card's lease; a dead node disappears within this time.
    pub lease_ttl_s: u64,
    /// Timeout of each etcd call, milliseconds.
    pub timeout_ms: u64,
    /// How long `pdnode start` keeps trying a registry it cannot reach (once a second) before it
    /// exits 1; the node loads its engine meanwhile, so one started during an outage registers
    /// as soon as the registry answers. 0: one attempt.
    pub start_wait_s: u64,
    /// The CA (PEM) etcd's server certificate must chain to; needed by `https://` endpoints
    /// (etcd TLS). Bare `host:port` endpoints then use TLS too.
    pub etcd_tls_ca: String,
    /// Client certificate (PEM) presented to etcd (for its `--client-cert-auth`); with
    /// `etcd_tls_key`, both or neither.
    pub etcd_tls_cert: String,
    /// The private key of `etcd_tls_cert` (PEM).
    pub etcd_tls_key: String,
    /// etcd user (etcd `auth enable`); needs `etcd_password_file`.
    pub etcd_user: String,
    /// File holding `etcd_user`'s password (its first line). There is no inline password key:
    /// the effective configuration is logged at start and printed by `check-config`.
    pub etcd_password_file: String,
}

impl RegistryConfig {
    /// Whether the etcd client uses TLS: an `https://` endpoint or `etcd_tls_ca` set.
    pub fn etcd_tls(&self) -> bool {
        !self.etcd_tls_ca.is_empty() || self.endpoints.iter().any(|e| e.starts_with("https://"))
    }
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            kind: RegistryKind::Memory,
            endpoints: Vec::new(),
            lease_ttl_s: 10,
            timeout_ms: 3000,
            start_wait_s: 60,
            etcd_tls_ca: String::new(),
            etcd_tls_cert: String::new(),
            etcd_tls_key: String::new(),
            etcd_user: String::new(),
            etcd_password_file: String::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelFormat {
    /// A Hugging Face directory (config.json, *.safetensors, tokenizer.json).
    Hf,
    /// A GGUF file.
    Gguf,
    /// Random weights at the shapes of `model.preset` (benchmarks only).
    Dummy,
}

/// The shape presets `model.preset` may name (with `model.format = "dummy"`); the engine holds
/// each one's shapes (`pdnode_engine::loader::dummy::preset`, whose test checks it knows every
/// name here). Matched without regard to case.
pub const MODEL_PRESETS: [&str; 7] = [
    "llama-3.1-8b",
    "llama-3.1-70b",
    "qwen2.5-7b",
    "qwen3-8b",
    "smollm2-135m",
    "deepseek-v2-lite",
    "deepseek-v3",
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// HF directory or `.gguf` file; for `dummy`, an optional tokenizer source.
    pub path: String,
    pub format: ModelFormat,
    /// Shape preset for `dummy`: one of [`MODEL_PRESETS`].
    pub preset: String,
    /// The name clients pass as `model`; empty: derived from the path or preset.
    pub served_name: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            path: "models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            format: ModelFormat::Gguf,
            preset: String::new(),
            served_name: String::new(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Cpu,
    Cuda,
    /// CUDA when a driver and a device are present, else CPU.
    Auto,
    /// A simulated engine for router benchmarks and fault tests; never the default.
    Mock,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    pub backend: Backend,
    /// GPU ordinals this node binds (CUDA); one GPU group per node.
    pub gpus: Vec<u32>,
    /// Tensor-parallel degree inside the group; must divide `gpus.len()`.
    pub tensor_parallel: u32,
    /// Fraction of free GPU memory for weights + KV pool.
    pub mem_fraction: f32,
    /// Longest sequence (prompt + output) in tokens.
    pub context_length: u32,
    /// Token positions per KV block.
    pub block_size: u32,
    /// KV blocks in the pool; 0 = sized from memory (GPU) or to fit `max_running_requests`
    /// full contexts (CPU).
    pub num_kv_blocks: u32,
    /// Token budget of one forward step (chunked prefill splits longer prompts).
    pub max_batch_tokens: u32,
    pub max_running_requests: u32,
    /// Requests waiting beyond this are refused with 429.
    pub max_queued_requests: u32,
    /// CPU backend worker threads; 0 = all cores.
    pub cpu_threads: u32,
    /// Pin the engine's threads to these CPU cores, or `"auto"`: the cores of the NUMA node(s)
    /// of this node's GPUs, read from sysfs. Empty: no pinning.
    pub cpu_affinity: CpuAffinity,
    /// Keep finished prompts' KV blocks in the prefix cache.
    pub prefix_cache: bool,
    /// role = "all" only: one colocated engine (prefill and decode in one continuous batch)
    /// instead of a prefill-only plus a decode-only engine; the baseline PD is compared with.
    pub colocated: bool,
    /// CUDA backend: replay decode steps as CUDA graphs captured per batch-size bucket;
    /// false: launch every kernel eagerly.
    pub cuda_graphs: bool,
    /// Tokens of KV each TP rank's hand-off staging arena holds, summed over the hand-offs in
    /// flight (allocated once at start: device memory on CUDA, UCX-registered host memory on
    /// CPU); 0: no arena (every hand-off goes through per-request host staging).
    pub kv_staging_tokens: u32,
    /// Prefill nodes with an arena: during the step that ends a prompt, its KV goes to the
    /// decode node this many layers at a time while the later layers compute (one put per group);
    /// 0: all of it after the step. Single-GPU CUDA and CPU backends (a TP group pushes after
    /// the step).
    pub kv_push_layer_group: u32,
    /// Switches of the `cuda` backend (`engine.cuda.*`).
    pub cuda: CudaEngineConfig,
    pub mock: MockEngineConfig,
}

/// Switches of the `cuda` backend; ignored by the other backends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CudaEngineConfig {
    /// Rows sampled with temperature > 0 (no penalties or logprobs) are drawn on the GPU
    /// (`sample_rows`, one id per row over PCIe); false: their full logits rows go to the host.
    pub gpu_sampling: bool,
    /// Programmatic dependent launch of the backend's own kernels (Hopper: a kernel is scheduled
    /// while the previous one drains); needs sm_90+ and a 12.3+ driver, else it stays off with a
    /// warning. cuBLAS and NCCL launches are unaffected.
    pub pdl: bool,
    /// Most tokens at which SwiGLU is fused into the gate_up GEMV, [0, 8]; 0: off.
    pub fuse_swiglu_max_tokens: u32,
    /// Most tokens at which the next RMSNorm is fused into the o/down GEMV, [0, 8]; 0: off.
    pub fuse_norm_max_tokens: u32,
    /// Paged-attention kernel of decode steps and short chunks.
    pub attention: AttentionKernel,
    /// Waves of resident blocks the v4 attention kernel's partitions aim for, [1, 64].
    pub attention_v4_waves: u32,
    /// Longest partition (keys) of the v4 attention kernel, [128, 1048576].
    pub attention_v4_max_part: u32,
    /// Attention of the sequences with many new tokens in a step (prefill chunks).
    pub prefill_attention: PrefillAttention,
    /// Implementation of the linear layers.
    pub linear: LinearKernel,
    /// Longest context, tokens, a warm-up at start captures decode graphs for (every batch
    /// bucket at contexts 256, 512, ... up to it) after prefill steps of 256, 512, ... tokens
    /// up to it (and `max_batch_tokens`), before the node
    /// registers; [0, 1048576]; 0: no warm-up (the first requests pay for it).
    pub warm_up_context: u32,
}

/// `engine.cuda.attention`: the paged-attention kernel (decode and short chunks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKernel {
    /// v4 (tensor cores) at head_dim 64 / 128, v2 where it runs, else v1.
    Auto,
    /// A warp per key, any even head_dim up to 256.
    V1,
    /// Lane groups per key with 16-byte loads; 16 dims per lane from head_dim 128 up.
    V2,
    /// v2 with 8 dims per lane at every head_dim.
    V2narrow,
    /// Tensor cores for QK^T and PV, head_dim 64 or 128 (other head dims run `auto`'s kernel).
    V4,
}

/// `engine.cuda.prefill_attention`: the prefill attention implementation. Head dims other than
/// 64 and 128 always take `gemm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefillAttention {
    /// The fused flash kernel with a 4-stage K/V ring and overlapped softmax; needs a
    /// power-of-two block size (otherwise `flash8` runs).
    Flashv3,
    /// The fused flash kernel on Hopper's warpgroup MMA (wgmma), the default: compute capability
    /// 9.0, head_dim 128 and a power-of-two block size; elsewhere `flashv3` runs.
    Wgmma,
    /// The fused flash kernel, 8 warps of 16 query rows, any block size.
    Flash8,
    /// cuBLAS GEMMs around a causal softmax kernel.
    Gemm,
}

/// `engine.cuda.linear`: the linear layers' implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinearKernel {
    /// The measured per-shape table: tensor-core GEMV (L2 prefetch) or cuBLAS up to 8 tokens,
    /// cuBLAS beyond; the only choice that fuses (`fuse_*_max_tokens`).
    Table,
    /// The tensor-core GEMV wherever it can take the call (no prefetch), else cuBLAS.
    Mma,
    /// The CUDA-core GEMV wherever it can take the call, else cuBLAS.
    Gemv,
    /// cuBLAS everywhere.
    Cublas,
}

impl Default for CudaEngineConfig {
    fn default() -> Self {
        Self {
            gpu_sampling: true,
            pdl: false,
            fuse_swiglu_max_tokens: 8,
            fuse_norm_max_tokens: 0,
            attention: AttentionKernel::Auto,
            attention_v4_waves: 1,
            attention_v4_max_part: 4096,
            prefill_attention: PrefillAttention::Wgmma,
            linear: LinearKernel::Table,
            warm_up_context: 4096,
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            backend: Backend::Cpu,
            gpus: Vec::new(),
            tensor_parallel: 1,
            mem_fraction: 0.85,
            context_length: 4096,
            block_size: 16,
            num_kv_blocks: 0,
            max_batch_tokens: 2048,
            max_running_requests: 64,
            max_queued_requests: 1024,
            cpu_threads: 0,
            cpu_affinity: CpuAffinity::default(),
            prefix_cache: true,
            colocated: false,
            cuda_graphs: true,
            kv_staging_tokens: 8192,
            kv_push_layer_group: 4,
            cuda: CudaEngineConfig::default(),
            mock: MockEngineConfig::default(),
        }
    }
}

/// Timing of the simulated engine (`backend = "mock"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MockEngineConfig {
    pub prefill_us_per_token: u64,
    pub decode_us_per_token: u64,
    /// Output length when the request's max_tokens is larger.
    pub output_len: u32,
    pub vocab_size: u32,
}

impl Default for MockEngineConfig {
    fn default() -> Self {
        Self {
            prefill_us_per_token: 50,
            decode_us_per_token: 10_000,
            output_len: 64,
            vocab_size: 32_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransferKind {
    #[serde(rename = "ucx")]
    Ucx,
    #[serde(rename = "in-process")]
    InProcess,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransferConfig {
    /// ucx (between processes and hosts) | in-process (role = "all")
    pub kind: TransferKind,
    /// Path of `libucp.so.0`; empty: the system's.
    pub ucx_lib: String,
    /// `UCX_NET_DEVICES` for this node's worker (loopback by default).
    pub ucx_net_devices: String,
    /// `UCX_TLS`; empty: UCX's choice.
    pub ucx_tls: String,
    /// How long a decode node holds reserved blocks for a hand-off that does not complete.
    pub lease_ms: u64,
    /// Decode side: ask the prefill node for a CRC32C of each rank's KV bytes (in the fence
    /// record behind them) and check it before the scatter (host staging only).
    pub verify: bool,
    /// Decode side: the most bytes of per-request host staging (the fall-back when the staging
    /// arena has no room) held at once; past it a reservation is refused (Unavailable).
    pub host_staging_bytes: u64,
    /// Prefill side: a hand-off whose puts and flushes are not over this long past the time
    /// their bytes need at `stall_min_rate_mibps` counts as stalled and fails (the router retries on
    /// another pair), well before `lease_ms`, ms.
    pub stall_ms: u64,
    /// Prefill side: the slowest KV bandwidth to a decode node that is not a stall, MiB/s.
    pub stall_min_rate_mibps: u64,
}

impl TransferConfig {
    /// Whether UCX may use only the loopback device: `ucx_net_devices` lists `lo` and nothing
    /// else (empty or `all` means every device).
    pub fn ucx_loopback_only(&self) -> bool {
        let mut devices = self.ucx_net_devices.split(',').map(str::trim);
        devices.clone().next().is_some_and(|d| !d.is_empty()) && devices.all(|d| d == "lo")
    }
}

impl Default for TransferConfig {
    fn default() -> Self {
        Self {
            kind: TransferKind::InProcess,
            ucx_lib: String::new(),
            ucx_net_devices: "lo".into(),
            ucx_tls: String::new(),
            lease_ms: 30_000,
            verify: true,
            host_staging_bytes: 1 << 30,
            stall_ms: 1000,
            stall_min_rate_mibps: 100,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecurityConfig {
    /// Without the TLS keys the node API (`node.listen`) is plaintext and unauthenticated: a
    /// `node.listen` beyond loopback is then refused unless this says the operator accepts that.
    pub allow_insecure: bool,
    /// The KV plane (UCX) authenticates no one: whoever reaches a node's UCX interfaces can write
    /// and read any address of that node's process (docs/runtime-semantics.md, "Trust"). A
    /// prefill or decode node whose `transfer.ucx_net_devices` is not loopback refuses to start
    /// unless this says those interfaces sit on a network only the cluster's nodes reach.
    pub trusted_kv_network: bool,
    /// The cluster CA (PEM): node certificates are checked against it, both ways. With
    /// `tls_cert` and `tls_key` (all three or none) the node plane is mutual TLS.
    pub tls_ca: String,
    /// This node's certificate (PEM, signed by `tls_ca`; `pdnode certs init` makes one). Its URI
    /// SAN `spiffe://pdnode/{cluster}/{role}/{node.id}` is the node's identity.
    pub tls_cert: String,
    /// The private key of `tls_cert` (PEM).
    pub tls_key: String,
    /// Bearer keys accepted by the frontends; empty: no authentication.
    pub api_keys: Vec<String>,
    /// A file with one API key per line, added to `api_keys`.
    pub api_keys_file: String,
}

impl SecurityConfig {
    /// Whether the node plane runs over mutual TLS (the three TLS keys are set).
    pub fn node_tls(&self) -> bool {
        !self.tls_ca.is_empty() && !self.tls_cert.is_empty() && !self.tls_key.is_empty()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Human,
    Json,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    pub format: LogFormat,
    /// tracing env-filter directives; `RUST_LOG` overrides.
    pub filter: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Human,
            filter: "info".into(),
        }
    }
}

/// OpenTelemetry traces (docs/runtime-semantics.md, "Traces"). Off unless `endpoint` is set:
/// then no exporter runs and no span is sampled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// OTLP/gRPC collector, `http://host:port` (plaintext); empty: traces off.
    pub endpoint: String,
    /// Fraction of new traces (no sampled parent) recorded, [0, 1]; a request that comes with a
    /// W3C `traceparent` follows its caller's sampled flag.
    pub sampling_ratio: f64,
    /// `service.name` of this node's spans; empty: the node id.
    pub service_name: String,
    /// Longest a finished span waits in the batch before it is exported, ms.
    pub batch_delay_ms: u64,
}

impl TelemetryConfig {
    /// Whether traces are exported.
    pub fn enabled(&self) -> bool {
        !self.endpoint.is_empty()
    }
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            endpoint: String::new(),
            sampling_ratio: 1.0,
            service_name: String::new(),
            batch_delay_ms: 5_000,
        }
    }
}

/// `engine.cpu_affinity`: a list of CPU cores (`[]`: no pinning) or `"auto"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpuAffinity {
    /// These cores; empty: no pinning.
    Cores(Vec<u32>),
    /// The cores of the NUMA node(s) of the GPUs in `engine.gpus` (sysfs), resolved at start.
    Auto,
}

impl Default for CpuAffinity {
    fn default() -> Self {
        CpuAffinity::Cores(Vec::new())
    }
}

impl Serialize for CpuAffinity {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            CpuAffinity::Cores(c) => c.serialize(s),
            CpuAffinity::Auto => s.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for CpuAffinity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = CpuAffinity;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of CPU core numbers or \"auto\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<CpuAffinity, E> {
                if v == "auto" {
                    Ok(CpuAffinity::Auto)
                } else {
                    Err(E::invalid_value(serde::de::Unexpected::Str(v), &self))
                }
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<CpuAffinity, A::Error> {
                let mut cores = Vec::new();
                while let Some(c) = seq.next_element::<u32>()? {
                    cores.push(c);
                }
                Ok(CpuAffinity::Cores(cores))
            }
        }
        d.deserialize_any(V)
    }
}
