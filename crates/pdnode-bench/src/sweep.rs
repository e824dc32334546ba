//! A benchmark: a workload run at each concurrency level against one endpoint, or against two in
//! alternation (`--compare`), summarised into a [`BenchReport`].

use crate::client::{Api, Client, Endpoint};
use crate::error::BenchError;
use crate::metrics::{Slo, Summary};
use crate::runner::{self, Pacing};
use crate::workload::Workload;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// One endpoint, or two for a comparison (the second is compared against the first).
    pub endpoints: Vec<Endpoint>,
    pub workload: Workload,
    /// Requests per concurrency level (a trace: its first N lines; 0: all of them).
    pub num_requests: usize,
    /// Concurrency levels of the sweep.
    pub concurrency: Vec<usize>,
    pub request_rate: Option<f64>,
    pub seed: u64,
    pub slo: Slo,
    /// Requests sent one by one before each endpoint's first level, not measured.
    pub warmup: usize,
    pub show_progress: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointInfo {
    pub label: String,
    pub base_url: String,
    pub model: String,
    pub api: Api,
}

/// One endpoint at one concurrency level.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Run {
    /// Index into [`BenchReport::endpoints`].
    pub endpoint: usize,
    pub concurrency: usize,
    pub summary: Summary,
}

/// Ratios of the second endpoint over the first at one concurrency level (`< 1` for a latency
/// means the second is faster; `> 1` for a throughput means the second serves more).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    pub concurrency: usize,
    pub ttft_p50: Option<f64>,
    pub ttft_p99: Option<f64>,
    pub tpot_p50: Option<f64>,
    pub tpot_p99: Option<f64>,
    pub itl_p50: Option<f64>,
    pub e2e_p50: Option<f64>,
    pub output_token_throughput: Option<f64>,
    pub request_throughput: Option<f64>,
    pub goodput: Option<f64>,
}

fn ratio(b: f64, a: f64) -> Option<f64> {
    (a > 0.0 && b.is_finite()).then(|| b / a)
}

impl Comparison {
    pub fn of(concurrency: usize, a: &Summary, b: &Summary) -> Self {
        Comparison {
            concurrency,
            ttft_p50: ratio(b.ttft.p50_ms, a.ttft.p50_ms),
            ttft_p99: ratio(b.ttft.p99_ms, a.ttft.p99_ms),
            tpot_p50: ratio(b.tpot.p50_ms, a.tpot.p50_ms),
            tpot_p99: ratio(b.tpot.p99_ms, a.tpot.p99_ms),
            itl_p50: ratio(b.itl.p50_ms, a.itl.p50_ms),
            e2e_p50: ratio(b.e2e.p50_ms, a.e2e.p50_ms),
            output_token_throughput: ratio(b.output_token_throughput, a.output_token_throughput),
            request_throughput: ratio(b.request_throughput, a.request_throughput),
            goodput: ratio(b.goodput, a.goodput),
        }
    }
}

/// Everything a benchmark measured; what `--out` writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    pub pdnode_version: String,
    pub started_at_unix_s: u64,
    pub workload: Workload,
    pub num_requests: usize,
    pub request_rate: Option<f64>,
    pub seed: u64,
    pub ignore_eos: bool,
    pub endpoints: Vec<EndpointInfo>,
    pub runs: Vec<Run>,
    pub comparisons: Vec<Comparison>,
}

impl BenchReport {
    /// The runs of one endpoint, in sweep order.
    pub fn runs_of(&self, endpoint: usize) -> impl Iterator<Item = &Run> {
        self.runs.iter().filter(move |r| r.endpoint == endpoint)
    }
}

impl BenchConfig {
    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |option: &'static str, reason: &str| {
            Err(BenchError::InvalidOption {
                option,
                reason: reason.into(),
            })
        };
        if self.endpoints.is_empty() || self.endpoints.len() > 2 {
            return bad("--url", "one endpoint, or two with --compare");
        }
        if self.concurrency.is_empty() || self.concurrency.contains(&0) {
            return bad("--concurrency", "a list of levels >= 1, e.g. 1,8,32,64");
        }
        if let Some(r) = self.request_rate
            && !(r.is_finite() && r > 0.0)
        {
            return bad(
                "--request-rate",
                "must be a positive number of requests per second",
            );
        }
        if self.num_requests == 0 && !matches!(self.workload, Workload::Trace { .. }) {
            return bad("--num-requests", "must be at least 1");
        }
        self.workload.validate()
    }
}

/// Runs the sweep. Request failures are measured, not returned as errors; an error here is a
/// bad option or an unreadable trace.
pub async fn run(cfg: &BenchConfig) -> Result<BenchReport, BenchError> {
    cfg.validate()?;
    let started_at_unix_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let specs = cfg.workload.generate(cfg.num_requests, cfg.seed)?;
    let clients = cfg
        .endpoints
        .iter()
        .cloned()
        .map(Client::new)
        .collect::<Result<Vec<_>, _>>()?;
    let endpoints: Vec<EndpointInfo> = clients
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let e = c.endpoint();
            EndpointInfo {
                label: if clients.len() == 1 {
                    "A".to_string()
                } else {
                    ["A", "B"][i].to_string()
                },
                base_url: e.base_url.clone(),
                model: e.model.clone(),
                api: e.api,
            }
        })
        .collect();

    for c in &clients {
        for spec in specs.iter().take(cfg.warmup) {
            let _ = c.send(spec).await;
        }
    }

    let total = (specs.len() * cfg.concurrency.len() * clients.len()) as u64;
    let progress = if cfg.show_progress {
        let pb = ProgressBar::new(total);
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests {msg}",
        ) {
            pb.set_style(style);
        }
        pb
    } else {
        ProgressBar::hidden()
    };

    let mut runs = Vec::new();
    let mut comparisons = Vec::new();
    for (level, &concurrency) in cfg.concurrency.iter().enumerate() {
        let mut level_summaries = Vec::new();
        // Alternate endpoints level by level, so slow drift (thermal, other load) hits both.
        for (i, client) in clients.iter().enumerate() {
            progress.set_message(format!(
                "{} @ concurrency {concurrency}",
                endpoints[i].label
            ));
            let pacing = Pacing {
                concurrency,
                request_rate: cfg.request_rate,
                seed: cfg.seed.wrapping_add(level as u64),
            };
            let (results, duration) = runner::run(client, &specs, pacing, &progress).await;
            let summary = Summary::new(&results, duration, cfg.slo);
            level_summaries.push(summary.clone());
            runs.push(Run {
                endpoint: i,
                concurrency,
                summary,
            });
        }
        if let [a, b] = level_summaries.as_slice() {
            comparisons.push(Comparison::of(concurrency, a, b));
        }
    }
    progress.finish_and_clear();

    Ok(BenchReport {
        pdnode_version: env!("CARGO_PKG_VERSION").to_string(),
        started_at_unix_s,
        workload: cfg.workload.clone(),
        num_requests: specs.len(),
        request_rate: cfg.request_rate,
        seed: cfg.seed,
        ignore_eos: cfg.endpoints.iter().any(|e| e.ignore_eos),
        endpoints,
        runs,
        comparisons,
    })
}
