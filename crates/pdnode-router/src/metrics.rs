//! A small Prometheus registry: labelled counters, gauges and histograms rendered in the text
//! exposition format (version 0.0.4). Names come from `pdnode_core::metrics`.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Latency buckets, seconds.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

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
}
