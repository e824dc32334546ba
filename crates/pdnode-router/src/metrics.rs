//! A small Prometheus registry: labelled counters, gauges and histograms rendered in the text
//! exposition format (version 0.0.4). Names come from `pdnode_core::metrics`.

use parking_lot::Mutex;
use pdnode_core::Accounting;
use pdnode_core::metrics as m;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Latency buckets, seconds (every histogram's).
pub use pdnode_core::metrics::LATENCY_BUCKETS;

type Labels = Vec<(&'static str, String)>;
type Key = (&'static str, Labels);

#[derive(Debug, Clone)]
struct Hist {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

#[derive(Default)]
struct Inner {
    counters: BTreeMap<Key, f64>,
    gauges: BTreeMap<Key, f64>,
    hists: BTreeMap<Key, Hist>,
    help: BTreeMap<&'static str, &'static str>,
}

#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

fn labels(l: &[(&'static str, &str)]) -> Labels {
    l.iter().map(|(k, v)| (*k, (*v).to_string())).collect()
}

impl Metrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// A one-line description shown as `# HELP`.
    pub fn describe(&self, name: &'static str, help: &'static str) {
        self.inner.lock().help.insert(name, help);
    }

    pub fn inc(&self, name: &'static str, l: &[(&'static str, &str)], by: f64) {
        *self
            .inner
            .lock()
            .counters
            .entry((name, labels(l)))
            .or_default() += by;
    }

    pub fn set(&self, name: &'static str, l: &[(&'static str, &str)], v: f64) {
        self.inner.lock().gauges.insert((name, labels(l)), v);
    }

    /// Sets gauge `name` to `v()`, evaluated under the metrics lock. Updaters that change a
    /// shared count and then set its gauge this way (reading the count inside `v`) leave the
    /// gauge at the count's last value whatever their interleaving; with [`Metrics::set`] a
    /// value read before another thread's update could be written after it, and stay.
    pub fn set_from(
        &self,
        name: &'static str,
        l: &[(&'static str, &str)],
        v: impl FnOnce() -> f64,
    ) {
        let mut g = self.inner.lock();
        let value = v();
        g.gauges.insert((name, labels(l)), value);
    }

    /// Sets counter `name` to `v`: a counter another process keeps (a node's, read by its stats).
    pub fn set_counter(&self, name: &'static str, l: &[(&'static str, &str)], v: f64) {
        self.inner.lock().counters.insert((name, labels(l)), v);
    }

    /// Removes every series of counter `name` (a node that left).
    pub fn clear_counter(&self, name: &'static str) {
        self.inner.lock().counters.retain(|(n, _), _| *n != name);
    }

    /// Removes every series of gauge `name` (before re-setting the current ones).
    pub fn clear_gauge(&self, name: &'static str) {
        self.inner.lock().gauges.retain(|(n, _), _| *n != name);
    }

    pub fn observe(&self, name: &'static str, l: &[(&'static str, &str)], v: f64) {
        let mut g = self.inner.lock();
        let h = g.hists.entry((name, labels(l))).or_insert_with(|| Hist {
            counts: vec![0; LATENCY_BUCKETS.len()],
            sum: 0.0,
            count: 0,
        });
        for (i, b) in LATENCY_BUCKETS.iter().enumerate() {
            if v <= *b {
                h.counts[i] += 1;
            }
        }
        h.sum += v;
        h.count += 1;
    }

    /// Sets histogram `name` to `t`: one another process keeps (a node's step times, read by
    /// its stats), over the same [`LATENCY_BUCKETS`].
    pub fn set_histogram(
        &self,
        name: &'static str,
        l: &[(&'static str, &str)],
        t: &pdnode_core::StepTimes,
    ) {
        let h = Hist {
            counts: t.le.to_vec(),
            sum: t.sum_us as f64 / 1e6,
            count: t.count,
        };
        self.inner.lock().hists.insert((name, labels(l)), h);
    }

    /// Removes every series of histogram `name` (a node that left).
    pub fn clear_histogram(&self, name: &'static str) {
        self.inner.lock().hists.retain(|(n, _), _| *n != name);
    }

    /// Current value of a counter or gauge series (tests).
    pub fn value(&self, name: &'static str, l: &[(&'static str, &str)]) -> Option<f64> {
        let g = self.inner.lock();
        let k = (name, labels(l));
        g.counters.get(&k).or_else(|| g.gauges.get(&k)).copied()
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let g = self.inner.lock();
        let mut out = String::new();
        let header = |out: &mut String, name: &str, kind: &str| {
            if let Some(h) = g.help.get(name) {
                let _ = writeln!(out, "# HELP {name} {h}");
            }
            let _ = writeln!(out, "# TYPE {name} {kind}");
        };
        let mut last = "";
        for ((name, l), v) in &g.counters {
            if *name != last {
                header(&mut out, name, "counter");
                last = name;
            }
            let _ = writeln!(out, "{name}{} {v}", fmt_labels(l, None));
        }
        last = "";
        for ((name, l), v) in &g.gauges {
            if *name != last {
                header(&mut out, name, "gauge");
                last = name;
            }
            let _ = writeln!(out, "{name}{} {v}", fmt_labels(l, None));
        }
        last = "";
        for ((name, l), h) in &g.hists {
            if *name != last {
                header(&mut out, name, "histogram");
                last = name;
            }
            for (i, b) in LATENCY_BUCKETS.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{name}_bucket{} {}",
                    fmt_labels(l, Some(&b.to_string())),
                    h.counts[i]
                );
            }
            let _ = writeln!(
                out,
                "{name}_bucket{} {}",
                fmt_labels(l, Some("+Inf")),
                h.count
            );
            let _ = writeln!(out, "{name}_sum{} {}", fmt_labels(l, None), h.sum);
            let _ = writeln!(out, "{name}_count{} {}", fmt_labels(l, None), h.count);
        }
        out
    }
}

/// The gauges and node-kept counters [`export_accounting`] writes.
const ACCOUNTING_GAUGES: &[&str] = &[
    m::KV_OWNED_BLOCKS,
    m::KV_CACHED_BLOCKS,
    m::KV_FREE_BLOCKS,
    m::STAGING_OWNED_SPANS,
    m::STAGING_QUARANTINED_SPANS,
    m::STAGING_ARENA_FREE_BYTES,
    m::STAGING_ARENA_BYTES,
    m::STAGING_HOST_BYTES,
];
const ACCOUNTING_COUNTERS: &[&str] = &[
    m::FENCE_QUARANTINES_TOTAL,
    m::FENCE_RELEASES_TOTAL,
    m::FENCE_FAILURES_TOTAL,
    m::FENCE_SOURCES_LEAKED_TOTAL,
    m::ENGINE_PREEMPTIONS_TOTAL,
];

/// `# HELP` lines of the accounting metrics.
pub fn describe_accounting(mx: &Metrics) {
    for (n, h) in [
        (
            m::KV_OWNED_BLOCKS,
            "KV blocks held by live requests or transfer leases, by owner (0 when idle).",
        ),
        (
            m::KV_CACHED_BLOCKS,
            "KV blocks in the prefix cache that nobody holds (evictable).",
        ),
        (m::KV_FREE_BLOCKS, "KV blocks on the free list."),
        (
            m::STAGING_OWNED_SPANS,
            "Staging spans held by a decode reservation (0 when idle).",
        ),
        (
            m::STAGING_QUARANTINED_SPANS,
            "Staging spans released but fenced until the writer's record or the fence deadline.",
        ),
        (
            m::STAGING_ARENA_FREE_BYTES,
            "Free bytes of the staging arena.",
        ),
        (m::STAGING_ARENA_BYTES, "Size of the staging arena."),
        (
            m::STAGING_HOST_BYTES,
            "Per-request host staging held (owned and quarantined).",
        ),
        (
            m::FENCE_QUARANTINES_TOTAL,
            "Staging spans put in quarantine.",
        ),
        (
            m::FENCE_RELEASES_TOTAL,
            "Quarantines ended, by the writer's record or at the fence deadline.",
        ),
        (
            m::FENCE_FAILURES_TOTAL,
            "Hand-offs refused at Decode, by failed check (checksum, record).",
        ),
        (
            m::FENCE_SOURCES_LEAKED_TOTAL,
            "Prefill staging sources never freed because a put never finished.",
        ),
        (
            m::ENGINE_PREEMPTIONS_TOTAL,
            "Requests the engine preempted (to recompute).",
        ),
        (
            m::ENGINE_STEP_SECONDS,
            "The backend's forward pass of an engine step, by phase (prefill: a prompt chunk ran).",
        ),
    ] {
        mx.describe(n, h);
    }
}

/// Drops every accounting series (before writing the nodes present now).
pub fn clear_accounting(mx: &Metrics) {
    for n in ACCOUNTING_GAUGES {
        mx.clear_gauge(n);
    }
    for n in ACCOUNTING_COUNTERS {
        mx.clear_counter(n);
    }
    mx.clear_histogram(m::ENGINE_STEP_SECONDS);
}

/// Writes node `node`'s accounting (docs/runtime-semantics.md, "Reading KV accounting").
pub fn export_accounting(mx: &Metrics, node: &str, a: &Accounting) {
    let l = [("node", node)];
    let f = |v: u64| v as f64;
    for (owner, v) in [
        ("request", a.kv_blocks_owned_request),
        ("transfer_lease", a.kv_blocks_owned_transfer),
    ] {
        mx.set(
            m::KV_OWNED_BLOCKS,
            &[("node", node), ("owner", owner)],
            f(v),
        );
    }
    mx.set(m::KV_CACHED_BLOCKS, &l, f(a.kv_blocks_cached));
    mx.set(m::KV_FREE_BLOCKS, &l, f(a.kv_blocks_free));
    mx.set(m::STAGING_OWNED_SPANS, &l, f(a.staging_spans_owned));
    mx.set(
        m::STAGING_QUARANTINED_SPANS,
        &l,
        f(a.staging_spans_quarantined),
    );
    mx.set(
        m::STAGING_ARENA_FREE_BYTES,
        &l,
        f(a.staging_arena_free_bytes),
    );
    mx.set(m::STAGING_ARENA_BYTES, &l, f(a.staging_arena_bytes));
    mx.set(m::STAGING_HOST_BYTES, &l, f(a.staging_host_bytes));
    mx.set_counter(m::FENCE_QUARANTINES_TOTAL, &l, f(a.fence_quarantines_total));
    for (by, v) in [
        ("record", a.fence_released_by_record_total),
        ("deadline", a.fence_released_at_deadline_total),
    ] {
        mx.set_counter(m::FENCE_RELEASES_TOTAL, &[("node", node), ("by", by)], f(v));
    }
    for (check, v) in [
        ("checksum", a.fence_checksum_failures_total),
        ("record", a.fence_record_failures_total),
    ] {
        mx.set_counter(
            m::FENCE_FAILURES_TOTAL,
            &[("node", node), ("check", check)],
            f(v),
        );
    }
    mx.set_counter(
        m::FENCE_SOURCES_LEAKED_TOTAL,
        &l,
        f(a.fence_sources_leaked_total),
    );
    mx.set_counter(
        m::ENGINE_PREEMPTIONS_TOTAL,
        &l,
        f(a.engine_preemptions_total),
    );
    for (phase, t) in [
        ("prefill", &a.engine_step_prefill),
        ("decode", &a.engine_step_decode),
    ] {
        mx.set_histogram(
            m::ENGINE_STEP_SECONDS,
            &[("node", node), ("phase", phase)],
            t,
        );
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn fmt_labels(l: &Labels, le: Option<&str>) -> String {
    let mut parts: Vec<String> = l
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    if let Some(le) = le {
        parts.push(format!("le=\"{le}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Many threads changing one count and setting its gauge with `set_from`: the gauge ends
    /// at the count (with a value read outside the lock it could end at a stale one, which the
    /// cluster harness once saw as "the router still has requests in flight").
    #[test]
    fn a_gauge_set_from_a_shared_count_ends_at_the_count() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU32, Ordering};
        let m = Arc::new(Metrics::new());
        let count = Arc::new(AtomicU32::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (m, count) = (m.clone(), count.clone());
                std::thread::spawn(move || {
                    for _ in 0..2000 {
                        count.fetch_add(1, Ordering::AcqRel);
                        m.set_from("g", &[], || f64::from(count.load(Ordering::Acquire)));
                        count.fetch_sub(1, Ordering::AcqRel);
                        m.set_from("g", &[], || f64::from(count.load(Ordering::Acquire)));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(count.load(Ordering::Acquire), 0);
        assert_eq!(m.value("g", &[]), Some(0.0));
    }

    #[test]
    fn renders_counters_gauges_and_cumulative_histograms() {
        let m = Metrics::new();
        m.describe("pdnode_x_total", "things");
        m.inc("pdnode_x_total", &[("outcome", "ok")], 1.0);
        m.inc("pdnode_x_total", &[("outcome", "ok")], 2.0);
        m.set("pdnode_g", &[("node", "a\"b")], 5.0);
        m.observe("pdnode_h_seconds", &[], 0.003);
        m.observe("pdnode_h_seconds", &[], 7.0);
        let t = m.render();
        assert!(t.contains("# HELP pdnode_x_total things"));
        assert!(t.contains("# TYPE pdnode_x_total counter"));
        assert!(t.contains("pdnode_x_total{outcome=\"ok\"} 3"));
        assert!(t.contains("pdnode_g{node=\"a\\\"b\"} 5"));
        assert!(t.contains("pdnode_h_seconds_bucket{le=\"0.0025\"} 0"));
        assert!(t.contains("pdnode_h_seconds_bucket{le=\"0.005\"} 1"));
        assert!(t.contains("pdnode_h_seconds_bucket{le=\"10\"} 2"));
        assert!(t.contains("pdnode_h_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(t.contains("pdnode_h_seconds_count 2"));
        m.clear_gauge("pdnode_g");
        assert!(!m.render().contains("pdnode_g{"));
    }

    #[test]
    fn accounting_renders_owned_by_owner_and_node_counters() {
        let mx = Metrics::new();
        describe_accounting(&mx);
        let a = Accounting {
            kv_blocks_owned_request: 3,
            kv_blocks_owned_transfer: 4,
            kv_blocks_cached: 5,
            kv_blocks_free: 6,
            staging_spans_quarantined: 2,
            fence_released_at_deadline_total: 7,
            ..Accounting::default()
        };
        export_accounting(&mx, "d0", &a);
        let t = mx.render();
        for line in [
            "pdnode_kv_owned_blocks{node=\"d0\",owner=\"request\"} 3",
            "pdnode_kv_owned_blocks{node=\"d0\",owner=\"transfer_lease\"} 4",
            "pdnode_kv_cached_blocks{node=\"d0\"} 5",
            "pdnode_kv_free_blocks{node=\"d0\"} 6",
            "pdnode_staging_quarantined_spans{node=\"d0\"} 2",
            "# TYPE pdnode_fence_releases_total counter",
            "pdnode_fence_releases_total{node=\"d0\",by=\"deadline\"} 7",
        ] {
            assert!(t.contains(line), "{line} missing from:\n{t}");
        }
        clear_accounting(&mx);
        assert!(!mx.render().contains("node=\"d0\""));
    }
}
