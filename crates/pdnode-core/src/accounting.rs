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
    /// Requests the engine preempted (to recompute) since start.
    pub engine_preemptions_total: u64,
    /// Forward-pass times of the engine's steps that ran a prompt chunk, and of the others.
    pub engine_step_prefill: StepTimes,
    pub engine_step_decode: StepTimes,
}

/// A histogram of step times over [`crate::metrics::LATENCY_BUCKETS`], kept by the engine:
/// `le[i]` steps took at most `LATENCY_BUCKETS[i]` seconds (cumulative, as Prometheus counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepTimes {
    pub le: [u64; crate::metrics::LATENCY_BUCKETS.len()],
    pub count: u64,
    /// Their sum, microseconds.
    pub sum_us: u64,
}

impl StepTimes {
    pub fn observe(&mut self, d: std::time::Duration) {
        let s = d.as_secs_f64();
        for (n, b) in self.le.iter_mut().zip(crate::metrics::LATENCY_BUCKETS) {
            if s <= b {
                *n += 1;
            }
        }
        self.count += 1;
        self.sum_us = self
            .sum_us
            .saturating_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    }

    /// From the wire: `le` must have one count per bucket, never decreasing, none above
    /// `count`; anything else is refused as a whole (`None`), not guessed at.
    pub fn from_parts(le: &[u64], count: u64, sum_us: u64) -> Option<Self> {
        let le: [u64; crate::metrics::LATENCY_BUCKETS.len()] = le.try_into().ok()?;
        let ordered = le.windows(2).all(|w| w[0] <= w[1]) && le.last().is_none_or(|l| *l <= count);
        ordered.then_some(Self { le, count, sum_us })
    }
}

impl Accounting {
    /// KV blocks held by someone alive (requests and transfer leases).
    pub fn kv_blocks_owned(&self) -> u64 {
        self.kv_blocks_owned_request + self.kv_blocks_owned_transfer
    }
}

#[cfg(test)]
mod tests {
    use super::StepTimes;
    use std::time::Duration;

    #[test]
    fn step_times_count_cumulatively_and_refuse_a_malformed_histogram() {
        let mut t = StepTimes::default();
        t.observe(Duration::from_micros(800));
        t.observe(Duration::from_millis(7));
        t.observe(Duration::from_secs(500));
        assert_eq!(t.count, 3);
        assert_eq!(t.sum_us, 800 + 7_000 + 500_000_000);
        // 1 ms, 2.5 ms, 5 ms, 10 ms, ...: the first two hold one step, from 10 ms on two.
        assert_eq!(&t.le[..5], &[1, 1, 1, 2, 2]);
        assert_eq!(
            *t.le.last().unwrap(),
            2,
            "500 s is past the last bound (only +Inf)"
        );
        assert_eq!(StepTimes::from_parts(&t.le, t.count, t.sum_us), Some(t));
        assert_eq!(StepTimes::from_parts(&t.le[1..], t.count, t.sum_us), None);
        let mut down = t.le;
        down[3] = 0;
        assert_eq!(StepTimes::from_parts(&down, t.count, t.sum_us), None);
        assert_eq!(StepTimes::from_parts(&t.le, 1, t.sum_us), None);
    }
}
