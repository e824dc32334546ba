//! Warm pairs (`router.warm_pairs`, docs/runtime-semantics.md "Warm pairs"). The first KV
//! hand-off between a prefill process and a decode process pays for what later ones reuse: the
//! prefill node's UCX endpoint to the decode node's worker (a connect and a round trip) and, on
//! a GPU host, the `cuda_ipc` mapping of the decode node's staging arena (docs/protocol.md
//! section 6). The router warms a new pair with a small request of its own (a few prompt
//! tokens, 2 output tokens, greedy) before the pair takes client traffic, and until then picks
//! warm pairs while one is there; with none warm the request goes to a cold pair (its hand-off
//! is the warm-up): warmth never refuses or delays a request.
//!
//! Which pairs are warmed ahead of traffic: each node's first [`WARM_FANOUT`] pairs (a node that
//! joins becomes pickable once one of them is warm), then the cold pairs the policies were kept
//! from (one per request that found a cold candidate), at most [`WARM_CONCURRENCY`] at once. A
//! pair is a pair of processes: a node that restarts under the same id (a new `started_at_ms`
//! on its card) is cold again. A pair's first successful hand-off, warm-up or client request,
//! makes it warm. Each router warms for itself (the nodes' endpoints outlive a router, so a
//! second router's warm-ups are plain small requests).

use super::attempt::Flow;
use super::booking::Booking;
use super::flow::{End, Exit, Pair, Progress, run_attempt};
use super::{GenRequest, Router};
use crate::error::RouterError;
use crate::membership::Worker;
use pdnode_core::metrics as m;
use pdnode_core::{NodeId, RequestId};
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::Instrument;

/// Warm-ups in flight at once, per router.
pub const WARM_CONCURRENCY: usize = 4;
/// Pairs warmed ahead of traffic per node; the rest warm as the policies ask for them.
pub const WARM_FANOUT: usize = 2;
/// How long a pair whose warm-up failed waits before the next one.
pub const WARM_RETRY: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Warmth {
    Warming,
    Warm,
    /// The last warm-up failed at this time.
    Failed(Instant),
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    p_started: u64,
    d_started: u64,
    warmth: Warmth,
}

impl Entry {
    /// Whether the entry is about these two processes (not an earlier run of either node).
    fn is_for(&self, p: &Worker, d: &Worker) -> bool {
        self.p_started == p.card.started_at_ms && self.d_started == d.card.started_at_ms
    }

    /// Warm or warming: counts toward its nodes' fan-out.
    fn engaged(&self) -> bool {
        matches!(self.warmth, Warmth::Warm | Warmth::Warming)
    }
}

/// The warmth of every prefill/decode pair the router has warmed or tried to.
#[derive(Debug, Default)]
pub struct WarmPairs {
    /// By decode node id, then prefill node id.
    pairs: HashMap<NodeId, HashMap<NodeId, Entry>>,
    /// Warm pairs per decode node.
    warm_d: HashMap<NodeId, u32>,
    /// Warm or warming pairs per node (prefill and decode ids are distinct nodes).
    engaged: HashMap<NodeId, u32>,
    /// Warm-ups in flight.
    warming: usize,
    /// The membership [`Self::retain`] last pruned against.
    seen: u64,
}

fn bump(map: &mut HashMap<NodeId, u32>, id: &NodeId, up: bool) {
    if up {
        *map.entry(id.clone()).or_default() += 1;
    } else if let Some(n) = map.get_mut(id) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            map.remove(id);
        }
    }
}

impl WarmPairs {
    fn entry(&self, p: &Worker, d: &Worker) -> Option<&Entry> {
        self.pairs
            .get(d.id())
            .and_then(|m| m.get(p.id()))
            .filter(|e| e.is_for(p, d))
    }

    /// Whether a hand-off from `p` to `d` has succeeded since both processes started.
    pub fn is_warm(&self, p: &Worker, d: &Worker) -> bool {
        self.entry(p, d).is_some_and(|e| e.warmth == Warmth::Warm)
    }

    /// Whether `d` has a warm pair with some prefill node.
    pub fn has_warm_decode(&self, d: &Worker) -> bool {
        self.warm_d.get(d.id()).is_some_and(|&n| n > 0)
    }

    /// Warm-ups in flight.
    #[cfg(test)]
    pub fn warming(&self) -> usize {
        self.warming
    }

    /// Sets the pair's state to `to` (`None`: forgets it), keeping the counts.
    fn set(&mut self, p: &Worker, d: &Worker, to: Option<Warmth>) {
        let old = self.pairs.get(d.id()).and_then(|m| m.get(p.id())).copied();
        if let Some(e) = old {
            self.count(p.id(), d.id(), &e, false);
        }
        match to {
            Some(warmth) => {
                let e = Entry {
                    p_started: p.card.started_at_ms,
                    d_started: d.card.started_at_ms,
                    warmth,
                };
                self.count(p.id(), d.id(), &e, true);
                self.pairs
                    .entry(d.id().clone())
                    .or_default()
                    .insert(p.id().clone(), e);
            }
            None => {
                if let Some(m) = self.pairs.get_mut(d.id()) {
                    m.remove(p.id());
                    if m.is_empty() {
                        self.pairs.remove(d.id());
                    }
                }
            }
        }
    }

    /// Adds (`up`) or removes an entry's share of the counts.
    fn count(&mut self, p: &NodeId, d: &NodeId, e: &Entry, up: bool) {
        if e.warmth == Warmth::Warm {
            bump(&mut self.warm_d, d, up);
        }
        if e.engaged() {
            bump(&mut self.engaged, p, up);
            bump(&mut self.engaged, d, up);
        }
        if e.warmth == Warmth::Warming {
            if up {
                self.warming += 1;
            } else {
                self.warming = self.warming.saturating_sub(1);
            }
        }
    }

    /// A hand-off from `p` to `d` succeeded: the pair is warm.
    pub fn set_warm(&mut self, p: &Worker, d: &Worker) {
        if !self.is_warm(p, d) {
            self.set(p, d, Some(Warmth::Warm));
        }
    }

    /// Starts a warm-up of the pair if it is cold, none is in flight for it, its last one did
    /// not fail within [`WARM_RETRY`] and fewer than [`WARM_CONCURRENCY`] run. True: the caller
    /// runs it and reports with [`Self::finish`].
    pub fn begin(&mut self, p: &Worker, d: &Worker, now: Instant) -> bool {
        if self.warming >= WARM_CONCURRENCY {
            return false;
        }
        match self.entry(p, d).map(|e| e.warmth) {
            Some(Warmth::Warm | Warmth::Warming) => return false,
            Some(Warmth::Failed(at)) if now < at + WARM_RETRY => return false,
            _ => {}
        }
        self.set(p, d, Some(Warmth::Warming));
        true
    }

    /// The warm-up [`Self::begin`] started ended. A pair forgotten meanwhile (a node left or
    /// restarted) stays forgotten.
    pub fn finish(&mut self, p: &Worker, d: &Worker, ok: bool, now: Instant) {
        if self.entry(p, d).map(|e| e.warmth) != Some(Warmth::Warming) {
            return;
        }
        let to = if ok {
            Warmth::Warm
        } else {
            Warmth::Failed(now)
        };
        self.set(p, d, Some(to));
    }

    /// Forgets pairs of nodes no longer present, or present as another process (restarted).
    /// Cheap when the membership did not change since the last call.
    pub fn retain(&mut self, prefills: &[Worker], decodes: &[Worker]) {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for w in prefills.iter().chain(decodes) {
            w.id().hash(&mut h);
            w.card.started_at_ms.hash(&mut h);
        }
        let sig = h.finish();
        if sig == self.seen {
            return;
        }
        self.seen = sig;
        let started = |ws: &[Worker]| -> HashMap<NodeId, u64> {
            ws.iter()
                .map(|w| (w.id().clone(), w.card.started_at_ms))
                .collect()
        };
        let (ps, ds) = (started(prefills), started(decodes));
        let old = std::mem::take(&mut self.pairs);
        let (mut warm_d, mut engaged, mut warming) = (HashMap::new(), HashMap::new(), 0);
        for (d, inner) in old {
            let kept: HashMap<NodeId, Entry> = inner
                .into_iter()
                .filter(|(p, e)| {
                    ds.get(&d) == Some(&e.d_started) && ps.get(p) == Some(&e.p_started)
                })
                .collect();
            for (p, e) in &kept {
                if e.warmth == Warmth::Warm {
                    *warm_d.entry(d.clone()).or_default() += 1;
                }
                if e.engaged() {
                    *engaged.entry(p.clone()).or_default() += 1;
                    *engaged.entry(d.clone()).or_default() += 1;
                }
                if e.warmth == Warmth::Warming {
                    warming += 1;
                }
            }
            if !kept.is_empty() {
                self.pairs.insert(d, kept);
            }
        }
        self.warm_d = warm_d;
        self.engaged = engaged;
        self.warming = warming;
    }

    /// The pairs to warm now ahead of traffic: for each node with fewer than [`WARM_FANOUT`]
    /// warm or warming pairs, cold pairs with nodes of the other role until it has them (or
    /// [`WARM_CONCURRENCY`] run). Each returned pair is begun ([`Self::begin`]). `usable` says
    /// which nodes may be warmed with now (not suspected unreachable).
    pub fn plan(
        &mut self,
        prefills: &[Worker],
        decodes: &[Worker],
        usable: impl Fn(&Worker) -> bool,
        now: Instant,
    ) -> Vec<(Worker, Worker)> {
        let mut out = Vec::new();
        let engaged = |s: &Self, w: &Worker| s.engaged.get(w.id()).copied().unwrap_or(0) as usize;
        for (side, others, is_decode) in [(decodes, prefills, true), (prefills, decodes, false)] {
            let want = WARM_FANOUT.min(others.iter().filter(|w| usable(w)).count());
            for n in side.iter().filter(|w| usable(w)) {
                for o in others.iter().filter(|w| usable(w)) {
                    if engaged(self, n) >= want || self.warming >= WARM_CONCURRENCY {
                        break;
                    }
                    let (p, d) = if is_decode { (o, n) } else { (n, o) };
                    if self.begin(p, d, now) {
                        out.push((p.clone(), d.clone()));
                    }
                }
            }
        }
        out
    }

    /// A cold pair of `d` with one of `prefills` (not excluded, not warming, not failed lately)
    /// to warm for later requests, begun ([`Self::begin`]); `None` when there is none or
    /// [`WARM_CONCURRENCY`] run.
    pub fn next_cold(
        &mut self,
        prefills: &[Worker],
        d: &Worker,
        excluded: &[NodeId],
        now: Instant,
    ) -> Option<Worker> {
        let engaged = self.engaged.get(d.id()).copied().unwrap_or(0) as usize;
        if self.warming >= WARM_CONCURRENCY || engaged >= prefills.len() {
            return None;
        }
        let p = prefills
            .iter()
            .filter(|p| !excluded.contains(p.id()))
            .find(|p| self.entry(p, d).is_none_or(|e| !e.engaged()))?;
        self.begin(p, d, now).then(|| p.clone())
    }
}

/// Runs the warm-up of `(p, d)` that [`WarmPairs::begin`] started, as a task of its own.
pub(crate) fn spawn(router: Arc<Router>, p: Worker, d: Worker) {
    tokio::spawn(async move {
        let t0 = Instant::now();
        let result = warm_pair(&router, &p, &d).await;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        router
            .state
            .lock()
            .warm
            .finish(&p, &d, result.is_ok(), Instant::now());
        let outcome = match &result {
            Ok(()) => {
                tracing::info!(prefill = %p.id(), decode = %d.id(), ms, "pair warmed");
                "ok"
            }
            Err(e) => {
                tracing::warn!(prefill = %p.id(), decode = %d.id(), ms, error = %e, "pair warm-up failed");
                use pdnode_core::error::Classify;
                e.kind().as_str()
            }
        };
        router
            .metrics
            .inc(m::ROUTER_PAIR_WARMUPS_TOTAL, &[("outcome", outcome)], 1.0);
    });
}

impl Router {
    /// Warms the pairs [`WarmPairs::plan`] picks (the stats loop calls it after each refresh):
    /// nothing with `router.warm_pairs` off or while draining.
    pub fn warm_ahead(self: &Arc<Self>) {
        if !self.deps.config.warm_pairs || self.is_draining() {
            return;
        }
        let (prefills, decodes) = crate::membership::candidates(self.deps.membership.as_ref());
        let decodes: Vec<Worker> = decodes
            .into_iter()
            .filter(|w| !crate::membership::is_colocated(w))
            .collect();
        let now = Instant::now();
        let plan = {
            let mut st = self.state.lock();
            st.warm.retain(&prefills, &decodes);
            let suspect: std::collections::HashSet<NodeId> = prefills
                .iter()
                .chain(&decodes)
                .filter(|w| st.is_suspect(w.id(), now))
                .map(|w| w.id().clone())
                .collect();
            st.warm
                .plan(&prefills, &decodes, |w| !suspect.contains(w.id()), now)
        };
        for (p, d) in plan {
            spawn(self.clone(), p, d);
        }
    }

    /// Whether the pair `(prefill, decode)` is warm for this router (tests, diagnostics).
    pub fn is_pair_warm(&self, prefill: &NodeId, decode: &NodeId) -> bool {
        let (prefills, decodes) = crate::membership::candidates(self.deps.membership.as_ref());
        let (Some(p), Some(d)) = (
            prefills.iter().find(|w| w.id() == prefill),
            decodes.iter().find(|w| w.id() == decode),
        ) else {
            return false;
        };
        self.state.lock().warm.is_warm(p, d)
    }
}

/// The `endpoint` of the router's own warm-up requests (kept out of the client metrics).
pub(crate) const WARM_UP_ENDPOINT: &str = "warm_up";

/// The prompt of a warm-up request: a few tokens any model has.
const WARM_UP_PROMPT: &str = "pdnode warm-up";

/// Runs one small request of the router's own through the pair `(p, d)`: a reservation on D,
/// P's prefill and KV hand-off, one decode step on D (2 tokens, greedy, EOS ignored). Bounded
/// as a client request is (`prefill_timeout_s`, `token_timeout_s`, `request_timeout_s`); a
/// failure aborts on both nodes as it would for a client's.
pub(crate) async fn warm_pair(router: &Router, p: &Worker, d: &Worker) -> Result<(), RouterError> {
    let mut prompt = router
        .deps
        .tokenizer
        .encode(WARM_UP_PROMPT, true)
        .unwrap_or_default();
    let vocab = router.deps.tokenizer.vocab_size();
    prompt.retain(|&t| t < vocab);
    if prompt.is_empty() {
        prompt.push(0);
    }
    let req = GenRequest {
        prompt_token_ids: prompt,
        sampling: pdnode_core::SamplingParams {
            temperature: 0.0,
            max_tokens: 2,
            ignore_eos: true,
            ..Default::default()
        },
        endpoint: WARM_UP_ENDPOINT,
        routing_key: None,
        slo: Default::default(),
    };
    // Nobody reads the events: room for all of them (the first token, one more, the end).
    let (tx, _rx) = mpsc::channel(8);
    let mut flow = Flow::new(1);
    flow.begin(false);
    let _d_booking = Booking::new(router, d.id());
    let pair = Pair {
        router,
        p,
        d,
        id: RequestId::random(),
        here: false,
        d_booking: None,
        capability: OnceLock::new(),
    };
    let mut progress = Progress {
        first_at: None,
        tokens: 0,
        cached: 0,
    };
    let span = tracing::info_span!("pair_warm_up", request_id = %pair.id, prefill = %p.id(), decode = %d.id());
    let end = run_attempt(&pair, &mut flow, &req, &tx, Instant::now(), &mut progress)
        .instrument(span)
        .await;
    match end {
        End::Exit(Exit::Done(_)) => Ok(()),
        End::Exit(Exit::ClientGone) => Err(RouterError::Internal {
            message: "the warm-up's event channel closed".into(),
        }),
        End::Fail(e) | End::Retry { err: e, .. } => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeNode;
    use pdnode_core::Role;

    fn w(id: &str, role: Role, started: u64) -> Worker {
        let mut w = FakeNode::new(id).worker(role);
        w.card.started_at_ms = started;
        w
    }

    #[test]
    fn a_pair_is_warm_after_a_hand_off_and_cold_again_when_a_node_restarts() {
        let (p, d) = (w("p0", Role::Prefill, 1), w("d0", Role::Decode, 1));
        let mut s = WarmPairs::default();
        assert!(!s.is_warm(&p, &d) && !s.has_warm_decode(&d));
        s.set_warm(&p, &d);
        assert!(s.is_warm(&p, &d) && s.has_warm_decode(&d));
        // The decode node restarted: same id, a new process.
        let d2 = w("d0", Role::Decode, 2);
        assert!(!s.is_warm(&p, &d2));
        s.retain(std::slice::from_ref(&p), std::slice::from_ref(&d2));
        assert!(!s.has_warm_decode(&d2));
        assert!(s.pairs.is_empty() && s.engaged.is_empty());
    }

    #[test]
    fn warm_ups_are_bounded_retried_after_a_failure_and_forgotten_with_their_node() {
        let ps: Vec<Worker> = (0..3)
            .map(|i| w(&format!("p{i}"), Role::Prefill, 1))
            .collect();
        let ds: Vec<Worker> = (0..3)
            .map(|i| w(&format!("d{i}"), Role::Decode, 1))
            .collect();
        let t0 = Instant::now();
        let mut s = WarmPairs::default();
        let plan = s.plan(&ps, &ds, |_| true, t0);
        assert_eq!(plan.len(), WARM_CONCURRENCY);
        assert_eq!(s.warming(), WARM_CONCURRENCY);
        assert!(s.plan(&ps, &ds, |_| true, t0).is_empty());
        for (p, d) in &plan {
            s.finish(p, d, true, t0);
        }
        assert_eq!(s.warming(), 0);
        // Until every node has WARM_FANOUT warm pairs.
        for _ in 0..10 {
            let plan = s.plan(&ps, &ds, |_| true, t0);
            for (p, d) in &plan {
                s.finish(p, d, true, t0);
            }
        }
        for n in ps.iter().chain(&ds) {
            assert!(s.engaged[n.id()] as usize >= WARM_FANOUT, "{}", n.id());
        }
        assert!(ds.iter().all(|d| s.has_warm_decode(d)));
        // A failed warm-up is not retried before WARM_RETRY.
        let (p, d) = (&ps[2], &ds[2]);
        if s.is_warm(p, d) {
            s.set(p, d, None);
        }
        assert!(s.begin(p, d, t0));
        s.finish(p, d, false, t0);
        assert!(!s.begin(p, d, t0 + WARM_RETRY / 2));
        assert!(s.begin(p, d, t0 + WARM_RETRY));
        s.finish(p, d, true, t0);
        // d2 leaves: its pairs are forgotten, and a suspect node is not planned for.
        s.retain(&ps, &ds[..2]);
        assert!(!s.pairs.contains_key(ds[2].id()));
        let p3 = w("p3", Role::Prefill, 1);
        let ps4: Vec<Worker> = ps.iter().cloned().chain([p3.clone()]).collect();
        s.retain(&ps4, &ds[..2]);
        assert!(s.plan(&ps4, &ds[..2], |w| w.id() != p3.id(), t0).is_empty());
        let plan = s.plan(&ps4, &ds[..2], |_| true, t0);
        assert_eq!(plan.len(), WARM_FANOUT);
        assert!(plan.iter().all(|(p, _)| p.id() == p3.id()));
    }

    #[test]
    fn next_cold_finds_a_pair_not_warm_nor_warming() {
        let ps: Vec<Worker> = (0..2)
            .map(|i| w(&format!("p{i}"), Role::Prefill, 1))
            .collect();
        let d = w("d0", Role::Decode, 1);
        let t0 = Instant::now();
        let mut s = WarmPairs::default();
        s.set_warm(&ps[0], &d);
        assert_eq!(
            s.next_cold(&ps, &d, &[], t0).map(|p| p.id().clone()),
            Some(ps[1].id().clone())
        );
        assert!(s.next_cold(&ps, &d, &[], t0).is_none());
        s.finish(&ps[1], &d, true, t0);
        assert!(s.is_warm(&ps[1], &d));
        assert_eq!(s.warming(), 0);
    }
}
