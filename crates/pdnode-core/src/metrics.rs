//! Every metric name, in one place: `pdnode_<subsystem>_<what>_<unit>`; counters end in `_total`.

/// Upper bounds (seconds) of every histogram's buckets (latencies and step times).
pub const LATENCY_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Requests finished, label `outcome` (ok, or an [`crate::ErrorKind`] string), `endpoint`.
pub const ROUTER_REQUESTS_TOTAL: &str = "pdnode_router_requests_total";
/// Time to first token, seconds (histogram).
pub const ROUTER_TTFT_SECONDS: &str = "pdnode_router_ttft_seconds";
/// Time per output token after the first, seconds (histogram).
pub const ROUTER_TPOT_SECONDS: &str = "pdnode_router_tpot_seconds";
/// End-to-end request latency, seconds (histogram).
pub const ROUTER_E2E_SECONDS: &str = "pdnode_router_e2e_seconds";
/// Requests admitted by the router and not yet finished (gauge).
pub const ROUTER_INFLIGHT_REQUESTS: &str = "pdnode_router_inflight_requests";
/// Requests waiting at admission for their latency target to hold (`router.slo.queue_ms`;
/// gauge, at most `router.max_inflight_requests`).
pub const ROUTER_SLO_WAITING_REQUESTS: &str = "pdnode_router_slo_waiting_requests";
/// Prompt tokens processed (counter).
pub const ROUTER_PROMPT_TOKENS_TOTAL: &str = "pdnode_router_prompt_tokens_total";
/// Output tokens generated (counter).
pub const ROUTER_OUTPUT_TOKENS_TOTAL: &str = "pdnode_router_output_tokens_total";
/// Nodes in the membership view, label `role` (gauge).
pub const ROUTER_NODES: &str = "pdnode_router_nodes";
/// Prompt tokens the `cache_aware` policy's prefix tree holds, summed over workers, label `role`
/// (gauge; bounded by `router.cache_aware.max_tree_size` per worker at each eviction).
pub const ROUTER_PREFIX_TREE_TOKENS: &str = "pdnode_router_prefix_tree_tokens";
/// Nodes of that tree, label `role` (gauge).
pub const ROUTER_PREFIX_TREE_NODES: &str = "pdnode_router_prefix_tree_nodes";
/// Pair warm-ups the router ran (`router.warm_pairs`), label `outcome` (`ok`, or the failure's
/// error class) (counter).
pub const ROUTER_PAIR_WARMUPS_TOTAL: &str = "pdnode_router_pair_warmups_total";
/// Requests the router had prefilled on their decode node, no hand-off
/// (`router.local_prefill`), label `reason` (`short`, `busy`) (counter).
pub const ROUTER_LOCAL_PREFILLS_TOTAL: &str = "pdnode_router_local_prefills_total";
/// Streams a decode node asked to move (draining with `node.drain = "migrate"`), label
/// `outcome` (`ok`, `failed`, `refused`, `nowhere`) (counter).
pub const ROUTER_MIGRATIONS_TOTAL: &str = "pdnode_router_migrations_total";

/// Requests waiting in the engine's queue, label `node` (gauge).
pub const ENGINE_QUEUE_DEPTH: &str = "pdnode_engine_queue_depth";
/// Requests running in the engine's batch, label `node` (gauge).
pub const ENGINE_RUNNING_REQUESTS: &str = "pdnode_engine_running_requests";
/// KV blocks not free, label `node` (gauge): owned + cached, i.e. including the evictable
/// prefix cache. Kept for dashboards; read [`KV_OWNED_BLOCKS`] and [`KV_CACHED_BLOCKS`] instead.
pub const KV_BLOCKS_IN_USE: &str = "pdnode_kv_blocks_in_use";
/// KV blocks held by a live holder, labels `node`, `owner` (`request`, `transfer_lease`) (gauge).
/// 0 on an idle node.
pub const KV_OWNED_BLOCKS: &str = "pdnode_kv_owned_blocks";
/// KV blocks in the prefix cache that nobody holds (evictable), label `node` (gauge).
pub const KV_CACHED_BLOCKS: &str = "pdnode_kv_cached_blocks";
/// KV blocks on the free list, label `node` (gauge).
pub const KV_FREE_BLOCKS: &str = "pdnode_kv_free_blocks";
/// KV blocks in the pool, label `node` (gauge).
pub const KV_BLOCKS_TOTAL: &str = "pdnode_kv_blocks_total";
/// Requests preempted (recompute), label `node` (counter, kept by the node).
pub const ENGINE_PREEMPTIONS_TOTAL: &str = "pdnode_engine_preemptions_total";
/// The backend's forward pass of one engine step, seconds (histogram, kept by the node over
/// [`LATENCY_BUCKETS`]), labels `node`, `phase` (`prefill`: the step runs a prompt chunk,
/// possibly beside decodes; `decode`: decodes only).
pub const ENGINE_STEP_SECONDS: &str = "pdnode_engine_step_seconds";

/// KV bytes handed off, label `direction` (sent, received) (counter).
pub const TRANSFER_BYTES_TOTAL: &str = "pdnode_transfer_bytes_total";
/// KV hand-off latency from target received to done, seconds (histogram).
pub const TRANSFER_SECONDS: &str = "pdnode_transfer_seconds";
/// Prefill calls (the prompt's forward pass and its KV hand-off) ended, as the router saw them,
/// labels `node` (the prefill node), `outcome` (`ok`, or the failure's error class: the
/// prefill or its hand-off failed, or the prefill or decode node was lost) (counter).
pub const TRANSFER_HANDOFFS_TOTAL: &str = "pdnode_transfer_handoffs_total";

/// Staging spans held by a decode reservation, label `node` (gauge). 0 on an idle node.
pub const STAGING_OWNED_SPANS: &str = "pdnode_staging_owned_spans";
/// Staging spans released but fenced until the writer's record or the fence deadline, label
/// `node` (gauge).
pub const STAGING_QUARANTINED_SPANS: &str = "pdnode_staging_quarantined_spans";
/// Free bytes of the staging arena, label `node` (gauge).
pub const STAGING_ARENA_FREE_BYTES: &str = "pdnode_staging_arena_free_bytes";
/// Size of the staging arena, label `node` (gauge).
pub const STAGING_ARENA_BYTES: &str = "pdnode_staging_arena_bytes";
/// Per-request host staging held (owned and quarantined), label `node` (gauge).
pub const STAGING_HOST_BYTES: &str = "pdnode_staging_host_bytes";
/// Staging spans put in quarantine, label `node` (counter).
pub const FENCE_QUARANTINES_TOTAL: &str = "pdnode_fence_quarantines_total";
/// Quarantines ended, labels `node`, `by` (`record`, `deadline`) (counter).
pub const FENCE_RELEASES_TOTAL: &str = "pdnode_fence_releases_total";
/// Hand-offs refused at `Decode`, labels `node`, `check` (`checksum`, `record`) (counter).
pub const FENCE_FAILURES_TOTAL: &str = "pdnode_fence_failures_total";
/// Prefill staging sources never freed because a put never finished, label `node` (counter).
pub const FENCE_SOURCES_LEAKED_TOTAL: &str = "pdnode_fence_sources_leaked_total";

/// Registry lease keepalive failures (counter).
pub const REGISTRY_KEEPALIVE_FAILURES_TOTAL: &str = "pdnode_registry_keepalive_failures_total";
/// Actor restarts by the supervisor, label `actor` (counter).
pub const NODE_ACTOR_RESTARTS_TOTAL: &str = "pdnode_node_actor_restarts_total";

/// All names, for tests that check the naming rule.
pub const ALL: &[&str] = &[
    ROUTER_REQUESTS_TOTAL,
    ROUTER_TTFT_SECONDS,
    ROUTER_TPOT_SECONDS,
    ROUTER_E2E_SECONDS,
    ROUTER_INFLIGHT_REQUESTS,
    ROUTER_SLO_WAITING_REQUESTS,
    ROUTER_PROMPT_TOKENS_TOTAL,
    ROUTER_OUTPUT_TOKENS_TOTAL,
    ROUTER_NODES,
    ROUTER_PREFIX_TREE_TOKENS,
    ROUTER_PREFIX_TREE_NODES,
    ROUTER_PAIR_WARMUPS_TOTAL,
    ROUTER_LOCAL_PREFILLS_TOTAL,
    ROUTER_MIGRATIONS_TOTAL,
    ENGINE_QUEUE_DEPTH,
    ENGINE_RUNNING_REQUESTS,
    KV_BLOCKS_IN_USE,
    KV_BLOCKS_TOTAL,
    KV_OWNED_BLOCKS,
    KV_CACHED_BLOCKS,
    KV_FREE_BLOCKS,
    STAGING_OWNED_SPANS,
    STAGING_QUARANTINED_SPANS,
    STAGING_ARENA_FREE_BYTES,
    STAGING_ARENA_BYTES,
    STAGING_HOST_BYTES,
    FENCE_QUARANTINES_TOTAL,
    FENCE_RELEASES_TOTAL,
    FENCE_FAILURES_TOTAL,
    FENCE_SOURCES_LEAKED_TOTAL,
    ENGINE_PREEMPTIONS_TOTAL,
    ENGINE_STEP_SECONDS,
    TRANSFER_BYTES_TOTAL,
    TRANSFER_SECONDS,
    TRANSFER_HANDOFFS_TOTAL,
    REGISTRY_KEEPALIVE_FAILURES_TOTAL,
    NODE_ACTOR_RESTARTS_TOTAL,
];

#[cfg(test)]
mod tests {
    #[test]
    fn names_follow_the_rule() {
        let mut seen = std::collections::HashSet::new();
        for n in super::ALL {
            assert!(n.starts_with("pdnode_"), "{n}");
            assert!(
                n.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{n}"
            );
            assert!(seen.insert(*n), "duplicate {n}");
        }
    }
}
