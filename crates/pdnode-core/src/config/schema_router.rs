//! The `[router]` section of the configuration schema (`router.*`: listeners, policies and
//! their parameters, timeouts, SLO admission, local prefill, rebalancing). Key names are public
//! interface: keep them stable.

use serde::{Deserialize, Serialize};

/// Router policy names, as sglang-router spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyName {
    Random,
    RoundRobin,
    PowerOfTwo,
    CacheAware,
    Bucket,
    /// Sticky: a request's routing key (the `X-SMG-Routing-Key` header, or in SGLang mode the
    /// body's `rid`) goes to the worker the key was first assigned to.
    Manual,
    /// Prefill only: the prefill node with the lowest predicted time to first token for the
    /// picked decode node (its queue, its prefill time, the hand-off to that decode node), from
    /// what the router measured of real requests (docs/runtime-semantics.md, "Pairing by cost").
    Cost,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// OpenAI-compatible HTTP API.
    pub http_listen: String,
    /// `pdnode.v1.Inference` gRPC API; empty: off.
    pub grpc_listen: String,
    pub prefill_policy: PolicyName,
    pub decode_policy: PolicyName,
    /// Seed of the randomized policies; 0 = random.
    pub seed: u64,
    pub cache_aware: CacheAwareParams,
    pub power_of_two: PowerOfTwoParams,
    pub bucket: BucketParams,
    pub manual: ManualParams,
    /// Deadline of a whole request, seconds.
    pub request_timeout_s: u64,
    /// Deadline of the prefill step (dispatch to first token and KV handed off), seconds.
    pub prefill_timeout_s: u64,
    /// Longest gap between two streamed tokens before the request fails, seconds.
    pub token_timeout_s: u64,
    /// Requests in flight beyond this are refused with 429.
    pub max_inflight_requests: u32,
    /// Longest wait to hand one event (tokens, the end) to a client that does not read; past it
    /// the client counts as gone and the request is aborted on its nodes, seconds.
    pub client_send_timeout_s: u64,
    /// HTTP/2 PING on every router-to-node connection after this long without a frame from the
    /// node, milliseconds.
    pub node_keepalive_interval_ms: u64,
    /// A PING not answered within this closes the connection and fails every call on it
    /// (a frozen or unreachable node), milliseconds.
    pub node_keepalive_timeout_ms: u64,
    /// Warm each new prefill/decode pair with a small request of the router's own (its UCX
    /// endpoint opened, the decode node's memory mapped) before it takes client traffic, while
    /// a warm pair is there to take it instead.
    pub warm_pairs: bool,
    /// Latency targets a request gets when its client names none (`[router.slo]`).
    pub slo: SloConfig,
    /// When a request is prefilled on its decode node, with no hand-off (`[router.local_prefill]`).
    pub local_prefill: LocalPrefillConfig,
    /// Moving streams between decode nodes to even their load (`[router.rebalance]`).
    pub rebalance: RebalanceConfig,
    /// SGLang PD workers to route to instead of pdnode nodes (`[router.sglang]`).
    pub sglang: super::sglang::SglangConfig,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            http_listen: "127.0.0.1:8000".into(),
            grpc_listen: "127.0.0.1:50051".into(),
            prefill_policy: PolicyName::CacheAware,
            decode_policy: PolicyName::PowerOfTwo,
            seed: 0,
            cache_aware: CacheAwareParams::default(),
            power_of_two: PowerOfTwoParams::default(),
            bucket: BucketParams::default(),
            manual: ManualParams::default(),
            request_timeout_s: 600,
            prefill_timeout_s: 120,
            token_timeout_s: 60,
            max_inflight_requests: 4096,
            client_send_timeout_s: 30,
            node_keepalive_interval_ms: 250,
            node_keepalive_timeout_ms: 750,
            warm_pairs: true,
            slo: SloConfig::default(),
            local_prefill: LocalPrefillConfig::default(),
            rebalance: RebalanceConfig::default(),
            sglang: super::sglang::SglangConfig::default(),
        }
    }
}

/// Default latency targets (docs/runtime-semantics.md, "SLO admission"): a request whose
/// predicted time to first token, or the time per output token its decode nodes run at now,
/// exceeds its target is refused at once (429 with `Retry-After`) rather than served late.
/// Clients override them per request (`X-SLO-TTFT-Ms`, `X-SLO-TPOT-Ms`). 0: no target.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SloConfig {
    /// Time to first token, ms.
    pub ttft_ms: u64,
    /// Time per output token after the first, ms.
    pub tpot_ms: u64,
    /// Longest a request that would miss a target waits at admission for the load ahead of it
    /// to go, ms (its TTFT target shrinks by the wait); 0: refused at once.
    pub queue_ms: u64,
}

/// Conditional disaggregation (docs/runtime-semantics.md, "Prefill on the decode node"): a request
/// is prefilled by its decode node itself, with no prefill node and no KV hand-off, when its
/// prompt is short, or when every prefill node is busy and the decode node has room. 0: off.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LocalPrefillConfig {
    /// Prompts of at most this many tokens are prefilled on their decode node.
    pub max_prompt_tokens: u32,
    /// Any prompt is prefilled on its decode node while every prefill node has at least this
    /// many requests in flight (running and queued, with the router's own bookings) and the
    /// decode node has none queued.
    pub prefill_busy_requests: u32,
}

/// Rebalancing by live decode migration (docs/runtime-semantics.md, "Live decode migration"):
/// when the decode node running the most requests runs at least `min_gap` more than the one
/// running the fewest, one of this router's streams on the first moves to the second, at most
/// one every `interval_ms`. `min_gap` 0: off.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RebalanceConfig {
    pub min_gap: u32,
    pub interval_ms: u64,
}

impl Default for RebalanceConfig {
    fn default() -> Self {
        Self {
            min_gap: 0,
            interval_ms: 1000,
        }
    }
}

/// sglang-router's cache-aware parameters, same names and meaning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheAwareParams {
    /// Minimum prefix match ratio to route by cache; below it, the worker with the smallest tree.
    pub cache_threshold: f32,
    /// Load is unbalanced when max - min exceeds this (requests) ...
    pub balance_abs_threshold: u32,
    /// ... and max exceeds min times this; then route to the least loaded.
    pub balance_rel_threshold: f32,
    /// Tokens kept per worker's tree before LRU eviction.
    pub max_tree_size: u64,
    pub eviction_interval_secs: u64,
}

impl Default for CacheAwareParams {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            max_tree_size: 1 << 24,
            eviction_interval_secs: 120,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PowerOfTwoParams {
    /// Refresh of node loads from their cards/stats, milliseconds.
    pub load_refresh_ms: u64,
}

impl Default for PowerOfTwoParams {
    fn default() -> Self {
        Self {
            load_refresh_ms: 1000,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BucketParams {
    /// Prompt-length boundaries (tokens); empty: rebalanced from observed lengths.
    pub boundaries: Vec<u32>,
    /// How often boundaries are recomputed from observed prompt lengths, seconds.
    pub rebalance_interval_secs: u64,
}

/// How the `manual` policy places a routing key it has not seen (sglang-router's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AssignmentMode {
    /// A random candidate.
    Random,
    /// The candidate with the fewest running + queued requests.
    MinLoad,
    /// The candidate holding the fewest routing keys.
    MinGroup,
}

/// sglang-router's `manual` policy parameters, same names and meaning.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ManualParams {
    /// A routing key unused this long is forgotten (its next request is assigned anew), seconds.
    pub max_idle_secs: u64,
    pub assignment_mode: AssignmentMode,
}

impl Default for ManualParams {
    fn default() -> Self {
        Self {
            max_idle_secs: 4 * 3600,
            assignment_mode: AssignmentMode::Random,
        }
    }
}

impl Default for BucketParams {
    fn default() -> Self {
        Self {
            boundaries: Vec::new(),
            rebalance_interval_secs: 60,
        }
    }
}
