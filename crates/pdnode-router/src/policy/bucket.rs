//! `bucket`: each prefill worker serves one range of prompt lengths (sglang's PD-router bucket
//! policy), so short prompts do not queue behind long ones.
//!
//! Workers are ordered by id; worker `i` serves lengths in `[b[i-1], b[i])`. With configured
//! `boundaries` (exactly one fewer than workers) those are used as they are. Otherwise the
//! boundaries are recomputed every `rebalance_interval_secs` (and whenever the worker set
//! changes) from a window of observed prompt lengths so that each bucket receives an equal share
//! of prompt tokens; before any observation they split [0, `INITIAL_SPAN`) evenly.

use super::{Policy, PolicyContext};
use pdnode_core::config::BucketParams;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Prompt lengths remembered for rebalancing.
const WINDOW: usize = 4096;
/// Length range split evenly before any prompt was observed.
const INITIAL_SPAN: u64 = 4096;

pub struct BucketPolicy {
    params: BucketParams,
    observed: VecDeque<u32>,
    /// Current boundaries (ascending, `workers - 1` of them) and the worker ids they were
    /// computed for (sorted).
    boundaries: Vec<u64>,
    computed_for: Vec<String>,
    last_rebalance: Option<Instant>,
    /// The ids in the order the last call listed its workers, and that list's positions
    /// ordered by id: a call that lists the same workers in the same order (the router's
    /// steady state) reuses the ordering with one comparison per worker, no sort and no
    /// copies (1000 workers: the sort and the copies took ~160 µs a call).
    seen: Vec<String>,
    order: Vec<usize>,
}

impl BucketPolicy {
    pub fn new(params: BucketParams) -> Self {
        Self {
            params,
            observed: VecDeque::new(),
            boundaries: Vec::new(),
            computed_for: Vec::new(),
            last_rebalance: None,
            seen: Vec::new(),
            order: Vec::new(),
        }
    }

    /// Current boundaries (for tests and introspection).
    pub fn boundaries(&self) -> &[u64] {
        &self.boundaries
    }

    fn rebalance(&mut self, n: usize) {
        if n <= 1 {
            self.boundaries.clear();
            return;
        }
        if self.params.boundaries.len() == n - 1 {
            self.boundaries = self
                .params
                .boundaries
                .iter()
                .map(|&b| u64::from(b))
                .collect();
            return;
        }
        if self.observed.is_empty() {
            self.boundaries = (1..n as u64).map(|k| k * INITIAL_SPAN / n as u64).collect();
            return;
        }
        let mut lens: Vec<u64> = self.observed.iter().map(|&l| u64::from(l)).collect();
        lens.sort_unstable();
        let total: u64 = lens.iter().sum::<u64>().max(1);
        let mut out = Vec::with_capacity(n - 1);
        let mut acc = 0u64;
        let mut k = 1u64;
        for &l in &lens {
            acc += l;
            while k < n as u64 && acc * n as u64 >= k * total {
                // Lengths up to and including `l` fill bucket k-1.
                out.push(l + 1);
                k += 1;
            }
        }
        while out.len() < n - 1 {
            out.push(out.last().copied().unwrap_or(0) + 1);
        }
        // Strictly ascending so each worker owns a non-empty range.
        for i in 1..out.len() {
            if out[i] <= out[i - 1] {
                out[i] = out[i - 1] + 1;
            }
        }
        self.boundaries = out;
    }
}

impl Policy for BucketPolicy {
    fn name(&self) -> &'static str {
        "bucket"
    }

    fn select(&mut self, ctx: &PolicyContext<'_>) -> Option<usize> {
        let n = ctx.workers.len();
        if n == 0 {
            return None;
        }
        let same_list = self.seen.len() == n
            && self
                .seen
                .iter()
                .zip(ctx.workers)
                .all(|(s, w)| s.as_str() == w.id.as_str());
        let mut set_changed = false;
        if !same_list {
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| ctx.workers[a].id.cmp(&ctx.workers[b].id));
            let ids: Vec<String> = order
                .iter()
                .map(|&i| ctx.workers[i].id.to_string())
                .collect();
            if ids != self.computed_for {
                set_changed = true;
                self.computed_for = ids;
            }
            self.seen = ctx.workers.iter().map(|w| w.id.to_string()).collect();
            self.order = order;
        }
        let interval = Duration::from_secs(self.params.rebalance_interval_secs);
        let due = self
            .last_rebalance
            .is_none_or(|t| ctx.now.saturating_duration_since(t) >= interval);
        if due || set_changed {
            self.rebalance(n);
            self.last_rebalance = Some(ctx.now);
        }
        let len = ctx.token_ids.len() as u64;
        let bucket = self.boundaries.iter().take_while(|&&b| len >= b).count();
        if self.observed.len() == WINDOW {
            self.observed.pop_front();
        }
        self.observed
            .push_back(u32::try_from(ctx.token_ids.len()).unwrap_or(u32::MAX));
        Some(self.order[bucket.min(n - 1)])
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::*;

    fn pick(
        p: &mut BucketPolicy,
        ws: &[crate::policy::WorkerLoad],
        len: usize,
        now: Instant,
    ) -> usize {
        let toks = vec![1u32; len];
        p.select(&PolicyContext {
            workers: ws,
            token_ids: &toks,
            routing_key: None,
            now,
        })
        .unwrap()
    }

    #[test]
    fn fixed_boundaries_route_by_length() {
        let mut p = BucketPolicy::new(BucketParams {
            boundaries: vec![100, 1000],
            rebalance_interval_secs: 60,
        });
        // Given out of id order: w2, w0, w1 -> the policy orders by id.
        let mut ws = workers(&[0, 0, 0]);
        ws.rotate_left(2);
        let now = Instant::now();
        let id = |i: usize| ws[i].id.to_string();
        assert_eq!(id(pick(&mut p, &ws, 10, now)), "w0");
        assert_eq!(id(pick(&mut p, &ws, 100, now)), "w1");
        assert_eq!(id(pick(&mut p, &ws, 999, now)), "w1");
        assert_eq!(id(pick(&mut p, &ws, 5000, now)), "w2");
    }

    #[test]
    fn a_reordered_or_changed_worker_list_is_ordered_again() {
        let mut p = BucketPolicy::new(BucketParams {
            boundaries: vec![100],
            rebalance_interval_secs: 60,
        });
        let now = Instant::now();
        let ws = workers(&[0, 0]);
        let id = |ws: &[crate::policy::WorkerLoad], i: usize| ws[i].id.to_string();
        assert_eq!(id(&ws, pick(&mut p, &ws, 10, now)), "w0");
        assert_eq!(id(&ws, pick(&mut p, &ws, 10, now)), "w0");
        // The same workers listed the other way round: still by id.
        let mut rev = ws.clone();
        rev.reverse();
        assert_eq!(id(&rev, pick(&mut p, &rev, 10, now)), "w0");
        assert_eq!(id(&rev, pick(&mut p, &rev, 500, now)), "w1");
        // A third worker: the two-worker boundaries no longer fit; recomputed for three.
        let three = workers(&[0, 0, 0]);
        pick(&mut p, &three, 10, now);
        assert_eq!(p.boundaries().len(), 2);
        assert_eq!(id(&three, pick(&mut p, &three, 4000, now)), "w2");
    }

    #[test]
    fn rebalances_to_equal_token_shares() {
        let mut p = BucketPolicy::new(BucketParams {
            boundaries: vec![],
            rebalance_interval_secs: 10,
        });
        let ws = workers(&[0, 0]);
        let t0 = Instant::now();
        // Before observations: [0, 4096) split evenly.
        pick(&mut p, &ws, 10, t0);
        assert_eq!(p.boundaries(), &[2048]);
        // Observe many short prompts and a few long ones.
        for _ in 0..90 {
            pick(&mut p, &ws, 10, t0);
        }
        for _ in 0..10 {
            pick(&mut p, &ws, 90, t0);
        }
        // Rebalance: tokens 91*10 + 10*90 = 1810, half = 905 reached inside the short ones.
        let after = t0 + Duration::from_secs(11);
        assert_eq!(pick(&mut p, &ws, 90, after), 1);
        assert_eq!(p.boundaries(), &[11]);
        assert_eq!(pick(&mut p, &ws, 10, after), 0);
    }
}
