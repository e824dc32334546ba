//! pdnode-bench: a serving benchmark against any OpenAI-compatible endpoint (`pdnode bench`).
//!
//! - [`Workload`]: fixed, random, mixed (long prompts beside short chats), shared-prefix, and
//!   Mooncake-trace replay; synthetic word prompts, deterministic per seed.
//! - [`Client`]: one streaming `/v1/completions` (or chat) request, timed from the SSE stream:
//!   TTFT, inter-token gaps, end-to-end; errors by kind.
//! - [`sweep::run`]: a concurrency sweep (optionally Poisson-paced), against one endpoint or two
//!   in alternation with ratios ([`BenchReport`]).
//! - [`Summary`]: p50/p90/p99 of TTFT, TPOT, ITL, E2E; throughput; goodput under [`Slo`]s.
//! - [`report::table`] for the terminal, serde JSON for `--out`, [`plot::write_svg`] for `--plot`.

pub mod client;
pub mod error;
pub mod metrics;
pub mod plot;
pub mod report;
pub mod runner;
pub mod sse;
pub mod sweep;
pub mod text;
pub mod workload;

pub use client::{Api, Client, Endpoint, RequestResult};
pub use error::BenchError;
pub use metrics::{Slo, Stats, Summary};
pub use sweep::{BenchConfig, BenchReport, Comparison, run};
pub use workload::{RequestSpec, Workload};
