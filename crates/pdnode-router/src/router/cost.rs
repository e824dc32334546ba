//! What the `cost` prefill policy predicts from (docs/runtime-semantics.md, "Pairing by cost"):
//! per prefill node, the seconds a prompt token costs it, and per (prefill, decode) pair, the
//! seconds per KV byte its hand-off adds after the prefill, both learned from this router's real
//! requests (an exponentially weighted mean of each `Prefill` answer: its duration as the router
//! saw it, and the bytes and hand-off time the prefill node reported). A request of `L` prompt
//! tokens on `(P, D)` is predicted to reach its first token in
//!
//! `(tokens in flight on P from this router + L) x s_per_token(P) + L x bytes_per_token x
//! s_per_byte(P, D)`.
//!
//! A pair without a sample younger than [`STALE`] is predicted to hand off for free, so a new
//! pair, or a slow link that recovered, is tried again by one request rather than avoided
//! forever; a prefill node without one is predicted as fast as the fastest measured (so the
//! tokens in flight on it still count).

use crate::membership::Worker;
use pdnode_core::NodeId;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A sample older than this no longer speaks for its node or pair.
pub const STALE: Duration = Duration::from_secs(30);
/// Weight of a new sample in the running means.
const ALPHA: f64 = 0.3;

#[derive(Debug, Clone, Copy)]
struct Mean {
    value: f64,
    at: Instant,
}

impl Mean {
    fn update(slot: &mut Option<Mean>, sample: f64, now: Instant) {
        let value = match *slot {
            Some(m) if now.duration_since(m.at) < STALE => m.value + ALPHA * (sample - m.value),
            _ => sample,
        };
        *slot = Some(Mean { value, at: now });
    }

    fn fresh(slot: Option<&Mean>, now: Instant) -> Option<f64> {
        slot.filter(|m| now.duration_since(m.at) < STALE)
            .map(|m| m.value)
    }
}

#[derive(Debug, Default)]
pub struct CostModel {
    /// Seconds per prompt token, per prefill node.
    per_token: HashMap<NodeId, Option<Mean>>,
    /// Exposed hand-off seconds per KV byte, by decode node then prefill node.
    per_byte: HashMap<NodeId, HashMap<NodeId, Option<Mean>>>,
    /// KV bytes per prompt token (the same model everywhere).
    bytes_per_token: Option<Mean>,
    /// Prompt tokens of this router's prefill calls in flight, per prefill node.
    inflight: HashMap<NodeId, u64>,
    /// Seconds per output token after the first of the streams that ended lately, per decode
    /// node.
    per_output_token: HashMap<NodeId, Option<Mean>>,
}

/// One prefill call in flight (from [`CostModel::begin`]); hand it back to
/// [`CostModel::end`] however the call ended.
#[derive(Debug)]
pub struct Ticket {
    node: NodeId,
    tokens: u64,
    /// Tokens of this router's calls on the node when this one began.
    ahead: u64,
    /// When the prefill call went out (its duration is measured from here).
    pub(crate) started: Instant,
}

impl CostModel {
    /// A prefill call of `tokens` prompt tokens starts on `p`.
    pub fn begin(&mut self, p: &Worker, tokens: usize, now: Instant) -> Ticket {
        let n = self.inflight.entry(p.id().clone()).or_default();
        let ahead = *n;
        *n += tokens as u64;
        Ticket {
            node: p.id().clone(),
            tokens: tokens as u64,
            ahead,
            started: now,
        }
    }

    /// The call of `t` ended; `done`: it answered with `transfer_bytes` handed off to `d` in
    /// `transfer_us` after its prefill (a sample); else (failed, dropped) only its tokens leave.
    pub fn end(&mut self, t: Ticket, done: Option<(&Worker, u64, u64)>, now: Instant) {
        if let Some(n) = self.inflight.get_mut(&t.node) {
            *n = n.saturating_sub(t.tokens);
            if *n == 0 {
                self.inflight.remove(&t.node);
            }
        }
        let Some((d, bytes, us)) = done else {
            return;
        };
        if t.tokens == 0 {
            return;
        }
        let took = now.duration_since(t.started).as_secs_f64();
        let handoff = us as f64 / 1e6;
        let compute = (took - handoff).max(0.0);
        Mean::update(
            self.per_token.entry(t.node.clone()).or_default(),
            compute / (t.ahead + t.tokens) as f64,
            now,
        );
        if bytes > 0 {
            Mean::update(
                &mut self.bytes_per_token,
                bytes as f64 / t.tokens as f64,
                now,
            );
            Mean::update(
                self.per_byte
                    .entry(d.id().clone())
                    .or_default()
                    .entry(t.node)
                    .or_default(),
                handoff / bytes as f64,
                now,
            );
        }
    }

    /// Predicted time to first token of `tokens` prompt tokens on `(p, d)`, microseconds.
    pub fn predict_us(&self, p: &Worker, d: &Worker, tokens: usize, now: Instant) -> u64 {
        let best = |it: &mut dyn Iterator<Item = &Option<Mean>>| {
            it.filter_map(|m| Mean::fresh(m.as_ref(), now))
                .fold(None, |a: Option<f64>, v| Some(a.map_or(v, |a| a.min(v))))
                .unwrap_or(0.0)
        };
        let per_token = Mean::fresh(self.per_token.get(p.id()).and_then(Option::as_ref), now)
            .unwrap_or_else(|| best(&mut self.per_token.values()));
        let per_byte = Mean::fresh(
            self.per_byte
                .get(d.id())
                .and_then(|m| m.get(p.id()))
                .and_then(Option::as_ref),
            now,
        )
        .unwrap_or(0.0);
        let bpt = Mean::fresh(self.bytes_per_token.as_ref(), now).unwrap_or(0.0);
        let ahead = self.inflight.get(p.id()).copied().unwrap_or(0);
        let l = tokens as f64;
        let s = (ahead as f64 + l) * per_token + l * bpt * per_byte;
        (s * 1e6) as u64
    }

    /// Predicted time to first token of `tokens` prompt tokens on prefill node `p`, the hand-off
    /// left out, microseconds; `None` when nothing fresh was measured on any prefill node.
    pub fn predict_prefill_us(&self, p: &Worker, tokens: usize, now: Instant) -> Option<u64> {
        let per_token = Mean::fresh(self.per_token.get(p.id()).and_then(Option::as_ref), now)
            .or_else(|| {
                self.per_token
                    .values()
                    .filter_map(|m| Mean::fresh(m.as_ref(), now))
                    .reduce(f64::min)
            })?;
        let ahead = self.inflight.get(p.id()).copied().unwrap_or(0);
        Some(((ahead as f64 + tokens as f64) * per_token * 1e6) as u64)
    }

    /// A stream on `d` ended after `tokens` output tokens, `after_first` past its first.
    pub fn observe_stream(&mut self, d: &Worker, tokens: u32, after_first: Duration, now: Instant) {
        if tokens > 1 {
            Mean::update(
                self.per_output_token.entry(d.id().clone()).or_default(),
                after_first.as_secs_f64() / f64::from(tokens - 1),
                now,
            );
        }
    }

    /// The time per output token `d`'s streams ran at lately, seconds; `None`: none ended
    /// within [`STALE`].
    pub fn tpot(&self, d: &Worker, now: Instant) -> Option<f64> {
        Mean::fresh(
            self.per_output_token.get(d.id()).and_then(Option::as_ref),
            now,
        )
    }

    /// Forgets nodes no longer present.
    pub fn retain(&mut self, present: &[NodeId]) {
        self.per_token.retain(|id, _| present.contains(id));
        self.per_byte.retain(|id, _| present.contains(id));
        self.per_output_token.retain(|id, _| present.contains(id));
        for m in self.per_byte.values_mut() {
            m.retain(|id, _| present.contains(id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeNode;
    use pdnode_core::Role;

    #[test]
    fn a_slow_pair_is_predicted_slow_until_its_sample_goes_stale() {
        let p0 = FakeNode::new("p0").worker(Role::Prefill);
        let p1 = FakeNode::new("p1").worker(Role::Prefill);
        let d0 = FakeNode::new("d0").worker(Role::Decode);
        let t0 = Instant::now();
        let mut m = CostModel::default();
        // Nothing measured: every pair predicts 0.
        assert_eq!(m.predict_us(&p0, &d0, 100, t0), 0);
        // p0 -> d0: 100 tokens in 10 ms of which 8 ms hand-off of 1 MB; p1 -> d0: 2 ms, 0.1 ms.
        let t = m.begin(&p0, 100, t0);
        m.end(
            t,
            Some((&d0, 1 << 20, 8_000)),
            t0 + Duration::from_millis(10),
        );
        let t = m.begin(&p1, 100, t0);
        m.end(t, Some((&d0, 1 << 20, 100)), t0 + Duration::from_millis(2));
        let now = t0 + Duration::from_millis(20);
        let slow = m.predict_us(&p0, &d0, 100, now);
        let fast = m.predict_us(&p1, &d0, 100, now);
        assert!((9_000..=11_000).contains(&slow), "{slow}");
        assert!((1_500..=2_500).contains(&fast), "{fast}");
        // Tokens in flight on p1 count against it.
        let busy = m.begin(&p1, 1000, now);
        assert!(m.predict_us(&p1, &d0, 100, now) > 10 * fast);
        m.end(busy, None, now);
        assert_eq!(m.predict_us(&p1, &d0, 100, now), fast);
        // Past STALE, p0's own samples no longer count: its prefill is predicted as fast as
        // the fastest measured (p1's) and its hand-off free, so one request tries it again.
        let later = t0 + STALE + Duration::from_millis(20);
        let t = m.begin(&p1, 100, later);
        m.end(
            t,
            Some((&d0, 1 << 20, 100)),
            later + Duration::from_millis(2),
        );
        let after = later + Duration::from_millis(3);
        assert!(m.predict_us(&p0, &d0, 100, after) <= m.predict_us(&p1, &d0, 100, after));
        m.retain(&[p1.id().clone(), d0.id().clone()]);
        assert!(!m.per_token.contains_key(p0.id()));
    }
}
