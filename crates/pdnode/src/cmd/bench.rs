//! `pdnode bench`: a serving benchmark against any OpenAI-compatible endpoint (pdnode's router or
//! another server). See docs/benchmarks.md.

use super::UsageError;
use pdnode_bench::{Api, BenchConfig, Client, Endpoint, Slo, Workload};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    /// Every request: --input-len prompt tokens, --output-len output tokens.
    Fixed,
    /// Lengths uniform in [len * --random-range-ratio, len].
    Random,
    /// Long prompts (--long-input-len, --long-output-len) beside short chats (--input-len,
    /// --output-len); --long-fraction of requests are long.
    Mixed,
    /// --num-prefixes groups sharing a --prefix-len prefix, plus --input-len own words each.
    SharedPrefix,
    /// Replay of a Mooncake-format JSONL trace (--trace FILE).
    Trace,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ApiKind {
    Completions,
    Chat,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Base URL of the endpoint, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted).
    #[arg(long)]
    pub url: String,
    /// Model name to send; default: the first one the endpoint lists at /v1/models.
    #[arg(long)]
    pub model: Option<String>,
    /// Which OpenAI API to call.
    #[arg(long, value_enum, default_value_t = ApiKind::Completions)]
    pub api: ApiKind,
    /// Bearer key, if the endpoint needs one.
    #[arg(long, env = "PDNODE_BENCH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Concurrency levels to sweep, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub concurrency: Vec<usize>,
    /// Requests per concurrency level (a trace: its first N lines; 0 = all of it).
    #[arg(long, default_value_t = 64)]
    pub num_requests: usize,
    /// Poisson arrivals at this many requests per second (concurrency still caps in-flight).
    #[arg(long)]
    pub request_rate: Option<f64>,
    #[arg(long, value_enum, default_value_t = WorkloadKind::Fixed)]
    pub workload: WorkloadKind,
    /// Prompt length in tokens (approximately: synthetic words).
    #[arg(long, default_value_t = 256)]
    pub input_len: u32,
    #[arg(long, default_value_t = 128)]
    pub output_len: u32,
    #[arg(long, default_value_t = 0.5)]
    pub random_range_ratio: f64,
    #[arg(long, default_value_t = 2048)]
    pub long_input_len: u32,
    #[arg(long, default_value_t = 32)]
    pub long_output_len: u32,
    #[arg(long, default_value_t = 0.25)]
    pub long_fraction: f64,
    #[arg(long, default_value_t = 8)]
    pub num_prefixes: u32,
    #[arg(long, default_value_t = 1024)]
    pub prefix_len: u32,
    /// Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Tokens per trace hash id block (Mooncake: 512).
    #[arg(long, default_value_t = 512)]
    pub trace_block_tokens: u32,
    /// Multiply trace timestamps (0.5 = twice as fast).
    #[arg(long, default_value_t = 1.0)]
    pub trace_time_scale: f64,
    /// Send "ignore_eos": true so every answer reaches its output length.
    #[arg(long)]
    pub ignore_eos: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Goodput SLO: time to first token, ms.
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,
    /// Goodput SLO: time per output token, ms.
    #[arg(long)]
    pub slo_tpot_ms: Option<f64>,
    /// Deadline of one request, seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
    /// Unmeasured requests sent one by one to each endpoint first.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// Write the results as JSON.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write an SVG plot (latency percentiles and throughput against concurrency).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// A second endpoint: run the same workload against both in alternation, with ratios.
    #[arg(long)]
    pub compare: Option<String>,
    /// Model name at the --compare endpoint; default: discovered, else --model.
    #[arg(long)]
    pub compare_model: Option<String>,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

impl Args {
    fn workload(&self) -> anyhow::Result<Workload> {
        Ok(match self.workload {
            WorkloadKind::Fixed => Workload::Fixed {
                input_len: self.input_len,
                output_len: self.output_len,
            },
            WorkloadKind::Random => Workload::Random {
                input_len: self.input_len,
                output_len: self.output_len,
                range_ratio: self.random_range_ratio,
            },
            WorkloadKind::Mixed => Workload::Mixed {
                long_input_len: self.long_input_len,
                long_output_len: self.long_output_len,
                short_input_len: self.input_len,
                short_output_len: self.output_len,
                long_fraction: self.long_fraction,
            },
            WorkloadKind::SharedPrefix => Workload::SharedPrefix {
                num_prefixes: self.num_prefixes,
                prefix_len: self.prefix_len,
                suffix_len: self.input_len,
                output_len: self.output_len,
            },
            WorkloadKind::Trace => Workload::Trace {
                path: self
                    .trace
                    .clone()
                    .ok_or_else(|| usage("--workload trace needs --trace FILE"))?,
                block_tokens: self.trace_block_tokens,
                time_scale: self.trace_time_scale,
            },
        })
    }
}

async fn model_for(
    url: &str,
    given: Option<&String>,
    api_key: Option<&str>,
) -> anyhow::Result<String> {
    if let Some(m) = given {
        return Ok(m.clone());
    }
    Ok(Client::discover_model(url, api_key, Duration::from_secs(30)).await?)
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    crate::logging::init_default()?;
    if args.trace.is_some() && args.workload != WorkloadKind::Trace {
        return Err(usage("--trace is only used with --workload trace"));
    }
    let workload = args.workload()?;
    let api = match args.api {
        ApiKind::Completions => Api::Completions,
        ApiKind::Chat => Api::Chat,
    };
    let timeout = Duration::from_secs(args.timeout_s.max(1));
    let key = args.api_key.as_deref();
    let mut endpoints = vec![Endpoint {
        base_url: args.url.clone(),
        model: model_for(&args.url, args.model.as_ref(), key).await?,
        api,
        api_key: args.api_key.clone(),
        ignore_eos: args.ignore_eos,
        timeout,
    }];
    if let Some(url2) = &args.compare {
        let given = args.compare_model.as_ref();
        let model = match model_for(url2, given, key).await {
            Ok(m) => m,
            Err(_) if given.is_none() => endpoints[0].model.clone(),
            Err(e) => return Err(e),
        };
        endpoints.push(Endpoint {
            base_url: url2.clone(),
            model,
            ..endpoints[0].clone()
        });
    }
    let cfg = BenchConfig {
        endpoints,
        workload,
        num_requests: args.num_requests,
        concurrency: args.concurrency.clone(),
        request_rate: args.request_rate,
        seed: args.seed,
        slo: Slo {
            ttft_ms: args.slo_ttft_ms,
            tpot_ms: args.slo_tpot_ms,
        },
        warmup: args.warmup,
        show_progress: !args.no_progress,
    };
    cfg.validate().map_err(|e| usage(e.to_string()))?;

    let report = pdnode_bench::run(&cfg).await?;
    print!("{}", pdnode_bench::report::table(&report));
    if let Some(path) = &args.out {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n")
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        pdnode_bench::plot::write_svg(&report, path)?;
        eprintln!("wrote {}", path.display());
    }
    let failed: usize = report.runs.iter().map(|r| r.summary.failed).sum();
    let total: usize = report.runs.iter().map(|r| r.summary.requests).sum();
    if total > 0 && failed == total {
        anyhow::bail!("every request failed; see the errors above");
    }
    Ok(())
}
