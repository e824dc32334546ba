//! `manual`: sticky routing. A request that carries a routing key goes to the worker the key
//! was assigned to the first time it was seen, as long as that worker is a candidate; a new key
//! (or one whose worker is gone or excluded) is assigned by the configured
//! [`AssignmentMode`]. A request without a key is placed at random, like sglang-router's
//! fallback. Keys unused for `max_idle_secs` are forgotten.
//!
//! The table is bounded: clients choose keys, so at [`MAX_KEYS`] the idle sweep runs at once
//! (at most once a second: a sweep walks the whole table under the router's lock), and when
//! every key is still live a new key is routed without being remembered. Every step of a
//! request's pick costs time in the number of workers, not of keys (`min_group` keeps a count
//! of keys per worker).

use super::{Policy, PolicyContext};
use pdnode_core::NodeId;
use pdnode_core::config::{AssignmentMode, ManualParams};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Most routing keys remembered at once (~100 bytes each).
pub const MAX_KEYS: usize = 1 << 20;

struct Assignment {
    worker: NodeId,
    last_used: Instant,
}

/// The shortest time between two sweeps forced by a full table.
const FULL_SWEEP_EVERY: Duration = Duration::from_secs(1);

pub struct ManualPolicy {
    keys: HashMap<String, Assignment>,
    /// Keys assigned to each worker (what `min_group` balances), kept with `keys`.
    per_worker: HashMap<NodeId, usize>,
    max_keys: usize,
    max_idle: Duration,
    mode: AssignmentMode,
    rng: ChaCha8Rng,
    next_sweep: Option<Instant>,
    /// When a full table last forced a sweep.
    full_sweep: Option<Instant>,
    /// Sweeps so far.
    sweeps: u64,
}

impl ManualPolicy {
    pub fn new(params: &ManualParams, rng: ChaCha8Rng) -> Self {
        Self::with_capacity(params, rng, MAX_KEYS)
    }

    /// As [`ManualPolicy::new`], remembering at most `max_keys` keys.
    pub fn with_capacity(params: &ManualParams, rng: ChaCha8Rng, max_keys: usize) -> Self {
        Self {
            keys: HashMap::new(),
            per_worker: HashMap::new(),
            max_keys,
            max_idle: Duration::from_secs(params.max_idle_secs.max(1)),
            mode: params.assignment_mode,
            rng,
            next_sweep: None,
            full_sweep: None,
            sweeps: 0,
        }
    }

    fn forget(per_worker: &mut HashMap<NodeId, usize>, worker: &NodeId) {
        if let Some(n) = per_worker.get_mut(worker) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                per_worker.remove(worker);
            }
        }
    }

    /// Routing keys remembered now.
    pub fn keys(&self) -> usize {
        self.keys.len()
    }

    fn sweep(&mut self, now: Instant) {
        self.sweeps += 1;
        let max_idle = self.max_idle;
        let per_worker = &mut self.per_worker;
        self.keys.retain(|_, a| {
            let live = now.saturating_duration_since(a.last_used) < max_idle;
            if !live {
                Self::forget(per_worker, &a.worker);
            }
            live
        });
        // Sweep again after a tenth of the idle limit (at least a second).
        self.next_sweep = now.checked_add((max_idle / 10).max(Duration::from_secs(1)));
    }

    fn assign(&mut self, ctx: &PolicyContext<'_>) -> usize {
        let n = ctx.workers.len();
        match self.mode {
            AssignmentMode::Random => self.rng.random_range(0..n),
            AssignmentMode::MinLoad => ctx.least_loaded(),
            AssignmentMode::MinGroup => {
                let group = |i: usize| self.per_worker.get(&ctx.workers[i].id).copied();
                // Fewest keys; ties: the less loaded, then the first.
                (0..n)
                    .min_by_key(|&i| (group(i).unwrap_or(0), ctx.workers[i].load()))
                    .unwrap_or(0)
            }
        }
    }
}

impl Policy for ManualPolicy {
    fn name(&self) -> &'static str {
        "manual"
    }

    fn select(&mut self, ctx: &PolicyContext<'_>) -> Option<usize> {
        if ctx.workers.is_empty() {
            return None;
        }
        if self.next_sweep.is_none_or(|t| ctx.now >= t) {
            self.sweep(ctx.now);
        }
        let Some(key) = ctx.routing_key else {
            return Some(self.rng.random_range(0..ctx.workers.len()));
        };
        if let Some(a) = self.keys.get_mut(key)
            && ctx.now.saturating_duration_since(a.last_used) < self.max_idle
            && let Some(i) = ctx.workers.iter().position(|w| w.id == a.worker)
        {
            a.last_used = ctx.now;
            return Some(i);
        }
        let i = self.assign(ctx);
        if !self.keys.contains_key(key)
            && self.keys.len() >= self.max_keys
            && self
                .full_sweep
                .is_none_or(|t| ctx.now.saturating_duration_since(t) >= FULL_SWEEP_EVERY)
        {
            self.full_sweep = Some(ctx.now);
            self.sweep(ctx.now);
        }
        if self.keys.contains_key(key) || self.keys.len() < self.max_keys {
            let worker = ctx.workers[i].id.clone();
            *self.per_worker.entry(worker.clone()).or_default() += 1;
            let old = self.keys.insert(
                key.to_owned(),
                Assignment {
                    worker,
                    last_used: ctx.now,
                },
            );
            if let Some(old) = old {
                Self::forget(&mut self.per_worker, &old.worker);
            }
        }
        Some(i)
    }
}

#[cfg(test)]
mod tests {
    use super::super::WorkerLoad;
    use super::super::test_util::*;
    use super::*;
    use rand::SeedableRng;

    fn policy(mode: AssignmentMode, idle: u64) -> ManualPolicy {
        ManualPolicy::new(
            &ManualParams {
                max_idle_secs: idle,
                assignment_mode: mode,
            },
            ChaCha8Rng::seed_from_u64(3),
        )
    }

    fn keyed<'a>(ws: &'a [WorkerLoad], key: &'a str, now: Instant) -> PolicyContext<'a> {
        PolicyContext {
            routing_key: Some(key),
            now,
            ..ctx(ws, &[])
        }
    }

    #[test]
    fn a_key_sticks_to_its_worker_whatever_the_load() {
        let mut p = policy(AssignmentMode::Random, 60);
        let mut ws = workers(&[0, 0, 0, 0]);
        let now = Instant::now();
        let first: Vec<usize> = (0..16)
            .map(|k| p.select(&keyed(&ws, &format!("user-{k}"), now)).unwrap())
            .collect();
        // Random assignment spreads 16 keys over more than one worker.
        assert!(first.iter().any(|&i| i != first[0]), "{first:?}");
        // Load changes do not move a key.
        ws[first[0]].running = 100;
        for (k, &i) in first.iter().enumerate() {
            assert_eq!(p.select(&keyed(&ws, &format!("user-{k}"), now)), Some(i));
        }
        assert_eq!(p.keys(), 16);
    }

    #[test]
    fn a_key_whose_worker_left_is_reassigned_and_then_sticks_there() {
        let mut p = policy(AssignmentMode::MinLoad, 60);
        let now = Instant::now();
        let ws = workers(&[5, 0, 9]);
        assert_eq!(p.select(&keyed(&ws, "k", now)), Some(1));
        // w1 is excluded (gone, suspect): the key moves to the least loaded of the rest.
        let rest = vec![ws[0].clone(), ws[2].clone()];
        assert_eq!(p.select(&keyed(&rest, "k", now)), Some(0));
        // And stays with w0 even when w1 returns.
        assert_eq!(p.select(&keyed(&ws, "k", now)), Some(0));
    }

    #[test]
    fn min_group_balances_keys_not_requests() {
        let mut p = policy(AssignmentMode::MinGroup, 60);
        let now = Instant::now();
        let ws = workers(&[50, 0, 0]);
        let mut per = [0usize; 3];
        for k in 0..30 {
            per[p.select(&keyed(&ws, &format!("{k}"), now)).unwrap()] += 1;
        }
        assert_eq!(per, [10, 10, 10]);
    }

    #[test]
    fn an_idle_key_is_forgotten_and_assigned_anew() {
        let mut p = policy(AssignmentMode::MinLoad, 10);
        let t0 = Instant::now();
        let mut ws = workers(&[0, 5]);
        assert_eq!(p.select(&keyed(&ws, "k", t0)), Some(0));
        ws[0].running = 9;
        // Still within the idle limit: sticky.
        let t1 = t0 + Duration::from_secs(9);
        assert_eq!(p.select(&keyed(&ws, "k", t1)), Some(0));
        // Idle past the limit after its last use: reassigned to the least loaded.
        let t2 = t1 + Duration::from_secs(11);
        assert_eq!(p.select(&keyed(&ws, "k", t2)), Some(1));
        // A sweep a while later drops keys that went idle.
        assert_eq!(p.select(&keyed(&ws, "other", t2)), Some(1));
        let t3 = t2 + Duration::from_secs(30);
        p.select(&keyed(&ws, "third", t3));
        assert_eq!(p.keys(), 1, "only the key used at t3 is left");
    }

    /// The per-worker counts `min_group` balances follow reassignments and sweeps: after
    /// keys move off a worker and idle ones are swept, new keys go to the worker that holds
    /// the fewest live keys.
    #[test]
    fn min_group_counts_follow_reassignments_and_sweeps() {
        let mut p = policy(AssignmentMode::MinGroup, 10);
        let t0 = Instant::now();
        let ws = workers(&[0, 0]);
        for k in 0..4 {
            p.select(&keyed(&ws, &format!("a{k}"), t0));
        }
        assert_eq!(p.per_worker.values().sum::<usize>(), 4);
        // w0 excluded: its two keys move to w1 (w1 holds all four)
        let only_w1 = vec![ws[1].clone()];
        for k in 0..4 {
            assert_eq!(p.select(&keyed(&only_w1, &format!("a{k}"), t0)), Some(0));
        }
        assert_eq!(p.per_worker.get(&ws[1].id), Some(&4));
        assert_eq!(p.per_worker.get(&ws[0].id), None);
        // the next new keys go to w0 until the counts meet
        for k in 0..4 {
            assert_eq!(p.select(&keyed(&ws, &format!("b{k}"), t0)), Some(0), "b{k}");
        }
        // everything idles out: a sweep empties the counts with the table
        let t1 = t0 + Duration::from_secs(30);
        p.select(&keyed(&ws, "c", t1));
        assert_eq!(p.keys(), 1);
        assert_eq!(p.per_worker.values().sum::<usize>(), 1);
    }

    /// A full table of live keys: a new key is routed, not remembered, and the forced sweep
    /// runs at most once a second however many new keys come.
    #[test]
    fn a_full_table_routes_new_keys_without_remembering_or_sweeping_each_time() {
        let params = ManualParams {
            max_idle_secs: 60,
            assignment_mode: AssignmentMode::MinGroup,
        };
        let mut p = ManualPolicy::with_capacity(&params, ChaCha8Rng::seed_from_u64(3), 4);
        let ws = workers(&[0, 0]);
        let t0 = Instant::now();
        for k in 0..4 {
            p.select(&keyed(&ws, &format!("k{k}"), t0));
        }
        assert_eq!(p.keys(), 4);
        let sweeps = p.sweeps;
        let t1 = t0 + Duration::from_millis(10);
        for k in 0..100 {
            assert!(p.select(&keyed(&ws, &format!("new{k}"), t1)).is_some());
        }
        assert_eq!(p.keys(), 4, "live keys kept, new ones not remembered");
        assert_eq!(p.sweeps, sweeps + 1, "one forced sweep for the 100 keys");
        let t2 = t1 + FULL_SWEEP_EVERY;
        p.select(&keyed(&ws, "later", t2));
        assert_eq!(p.sweeps, sweeps + 2, "and another a second later");
        // the remembered keys still stick
        let at = p.select(&keyed(&ws, "k0", t1));
        assert_eq!(p.select(&keyed(&ws, "k0", t1)), at);
    }

    #[test]
    fn requests_without_a_key_are_spread_and_not_remembered() {
        let mut p = policy(AssignmentMode::MinLoad, 60);
        let ws = workers(&[0, 0, 0]);
        let mut seen = [false; 3];
        for _ in 0..60 {
            seen[p.select(&ctx(&ws, &[1, 2])).unwrap()] = true;
        }
        assert_eq!(seen, [true; 3]);
        assert_eq!(p.keys(), 0);
        assert_eq!(p.select(&ctx(&[], &[])), None);
    }
}
