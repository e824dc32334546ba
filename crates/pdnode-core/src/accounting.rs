//! [`Accounting`]: who holds a node's KV blocks and staging spans, as the node reports it (the
//! `Stats` RPC, `/metrics`). See docs/runtime-semantics.md, "Reading KV accounting".

/// A node's KV blocks and staging spans split by holder.
///
/// KV blocks: `kv_blocks_owned_request + kv_blocks_owned_transfer + kv_blocks_cached +
/// kv_blocks_free == kv_blocks_total` of the same report. *Owned* blocks are held by a request
/// the engine knows (running, queued or preempted) or by a transfer lease (a decode reservation
/// waiting for its KV, a prefill hand-off being pushed); a prefix-cache block some holder shares
/// is owned, not cached. *Cached* blocks are prefix-cache blocks nobody holds: kept for reuse and
/// evicted on demand. With nothing in flight, both owned counts are 0.
///
/// Staging (nodes with a data path): spans *owned* by a reservation, spans *quarantined* (released
/// but fenced until the writer's record lands or the fence deadline passes), the arena's free
/// bytes, and the fence outcomes since start (counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Accounting {
    pub kv_blocks_owned_request: u64,
    pub kv_blocks_owned_transfer: u64,
    pub kv_blocks_cached: u64,
    pub kv_blocks_free: u64,
    pub staging_spans_owned: u64,
    pub staging_spans_quarantined: u64,
    pub staging_arena_free_bytes: u64,
    pub staging_arena_bytes: u64,
    /// Per-request host staging held (owned and quarantined).
    pub staging_host_bytes: u64,
    pub fence_quarantines_total: u64,
    pub fence_released_by_record_total: u64,
    pub fence_released_at_deadline_total: u64,
    pub fence_checksum_failures_total: u64,
    pub fence_record_failures_total: u64,
    pub fence_sources_leaked_total: u64,
}

impl Accounting {
    /// KV blocks held by someone alive (requests and transfer leases).
    pub fn kv_blocks_owned(&self) -> u64 {
        self.kv_blocks_owned_request + self.kv_blocks_owned_transfer
    }
}
