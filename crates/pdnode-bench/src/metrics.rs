//! Summaries of one run: latency percentiles, throughput, goodput, errors by kind.

use crate::client::RequestResult;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Latency statistics in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Stats {
    pub count: usize,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Stats {
    /// From samples in seconds. Percentiles interpolate linearly between order statistics
    /// (numpy's default). No samples: all zero.
    pub fn from_seconds(samples: &[f64]) -> Stats {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Stats::default();
        }
        v.sort_by(f64::total_cmp);
        let ms = |x: f64| x * 1000.0;
        Stats {
            count: v.len(),
            mean_ms: ms(v.iter().sum::<f64>() / v.len() as f64),
            p50_ms: ms(percentile(&v, 50.0)),
            p90_ms: ms(percentile(&v, 90.0)),
            p99_ms: ms(percentile(&v, 99.0)),
            max_ms: ms(v[v.len() - 1]),
        }
    }
}

/// `p`-th percentile of sorted, non-empty `v`.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    let rank = (p / 100.0) * (v.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let frac = rank - lo as f64;
    v[lo] + (v[hi] - v[lo]) * frac
}

/// Service-level objectives for goodput.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

impl Slo {
    /// Whether a successful request met every objective (a one-token answer has no TPOT and
    /// meets the TPOT objective).
    pub fn met_by(&self, r: &RequestResult) -> bool {
        if !r.is_ok() {
            return false;
        }
        let ttft_ok = match (self.ttft_ms, r.ttft_s) {
            (Some(limit), Some(t)) => t * 1000.0 <= limit,
            (Some(_), None) => false,
            (None, _) => true,
        };
        let tpot_ok = match (self.tpot_ms, r.tpot_s()) {
            (Some(limit), Some(t)) => t * 1000.0 <= limit,
            _ => true,
        };
        ttft_ok && tpot_ok
    }
}

/// Everything one run (one endpoint, one concurrency level) measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    /// Errors by kind (see [`RequestResult::error`]).
    pub errors: BTreeMap<String, usize>,
    /// First send to last answer, seconds.
    pub duration_s: f64,
    pub request_throughput: f64,
    pub input_token_throughput: f64,
    pub output_token_throughput: f64,
    pub total_input_tokens: u64,
    pub total_output_tokens: u64,
    pub ttft: Stats,
    pub tpot: Stats,
    pub itl: Stats,
    pub e2e: Stats,
    pub slo: Slo,
    /// Completed requests that met the SLOs, per second (= request_throughput without SLOs).
    pub goodput: f64,
    /// Fraction of all requests that met the SLOs.
    pub slo_attainment: f64,
}

impl Summary {
    pub fn new(results: &[RequestResult], duration_s: f64, slo: Slo) -> Summary {
        let ok: Vec<&RequestResult> = results.iter().filter(|r| r.is_ok()).collect();
        let mut errors = BTreeMap::new();
        for r in results {
            if let Some(k) = &r.error {
                *errors.entry(k.clone()).or_insert(0) += 1;
            }
        }
        let per_s = |x: f64| {
            if duration_s > 0.0 {
                x / duration_s
            } else {
                0.0
            }
        };
        let total_in: u64 = ok.iter().map(|r| u64::from(r.input_tokens)).sum();
        let total_out: u64 = ok.iter().map(|r| u64::from(r.output_tokens)).sum();
        let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_s).collect();
        let tpot: Vec<f64> = ok.iter().filter_map(|r| r.tpot_s()).collect();
        let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_s.iter().copied()).collect();
        let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_s).collect();
        let good = results.iter().filter(|r| slo.met_by(r)).count();
        Summary {
            requests: results.len(),
            completed: ok.len(),
            failed: results.len() - ok.len(),
            errors,
            duration_s,
            request_throughput: per_s(ok.len() as f64),
            input_token_throughput: per_s(total_in as f64),
            output_token_throughput: per_s(total_out as f64),
            total_input_tokens: total_in,
            total_output_tokens: total_out,
            ttft: Stats::from_seconds(&ttft),
            tpot: Stats::from_seconds(&tpot),
            itl: Stats::from_seconds(&itl),
            e2e: Stats::from_seconds(&e2e),
            slo,
            goodput: per_s(good as f64),
            slo_attainment: if results.is_empty() {
                0.0
            } else {
                good as f64 / results.len() as f64
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(ttft: f64, e2e: f64, out: u32) -> RequestResult {
        RequestResult {
            error: None,
            error_detail: None,
            ttft_s: Some(ttft),
            itl_s: vec![(e2e - ttft) / f64::from(out.max(2) - 1); out.saturating_sub(1) as usize],
            e2e_s: e2e,
            input_tokens: 10,
            output_tokens: out,
        }
    }

    #[test]
    fn percentiles_interpolate() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.5);
        assert!((percentile(&v, 99.0) - 99.01).abs() < 1e-9);
        assert_eq!(percentile(&[3.0], 90.0), 3.0);
        let s = Stats::from_seconds(&[0.1, 0.2, 0.3]);
        assert!((s.p50_ms - 200.0).abs() < 1e-9 && (s.mean_ms - 200.0).abs() < 1e-9);
        assert_eq!(Stats::from_seconds(&[]).count, 0);
    }

    #[test]
    fn summary_counts_throughput_goodput_and_errors() {
        let mut results = vec![ok(0.1, 1.1, 11), ok(0.5, 1.5, 11)];
        results.push(RequestResult {
            error: Some("http_503".into()),
            ..ok(0.0, 0.2, 0)
        });
        let slo = Slo {
            ttft_ms: Some(200.0),
            tpot_ms: Some(150.0),
        };
        let s = Summary::new(&results, 2.0, slo);
        assert_eq!((s.requests, s.completed, s.failed), (3, 2, 1));
        assert_eq!(s.errors.get("http_503"), Some(&1));
        assert_eq!(s.total_output_tokens, 22);
        assert!((s.output_token_throughput - 11.0).abs() < 1e-9);
        assert!((s.tpot.p50_ms - 100.0).abs() < 1e-6);
        // Only the first request meets TTFT <= 200 ms.
        assert!((s.goodput - 0.5).abs() < 1e-9);
        assert!((s.slo_attainment - 1.0 / 3.0).abs() < 1e-9);
        let no_slo = Summary::new(&results, 2.0, Slo::default());
        assert!((no_slo.goodput - no_slo.request_throughput).abs() < 1e-9);
    }
}
