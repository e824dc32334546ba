//! The command line: one subcommand per file under `cmd/`.

use crate::cmd;
use clap::{Parser, Subcommand};

/// pdnode: a prefill/decode-disaggregated LLM serving runtime.
///
/// A node owns one GPU group and one role (prefill, decode, router, or all). Most settings live
/// in the TOML config file; see docs/configuration.md.
#[derive(Debug, Parser)]
#[command(name = "pdnode", version, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start a node with the role its config gives (prefill, decode, router or all).
    Start(cmd::start::Args),
    /// Load and validate a config; print the effective config (exit 0) or every error (exit 2).
    CheckConfig(cmd::check_config::Args),
    /// Print the version, the git commit and the enabled features.
    Version(cmd::version::Args),
    /// Generate text from a prompt with a local model (no server).
    Generate(cmd::generate::Args),
    /// Benchmark an OpenAI-compatible endpoint: TTFT, TPOT, throughput, goodput.
    Bench(Box<cmd::bench::Args>),
    /// Measure KV transfer bandwidth between two endpoints.
    BenchTransfer(cmd::bench_transfer::Args),
    /// List the nodes registered in a cluster.
    Nodes(cmd::nodes::Args),
    /// Drain one node of a cluster over its node API: a graceful shutdown, as SIGTERM
    /// (`--migrate`: a decode node moves its running decodes to other decode nodes first).
    Drain(cmd::drain::Args),
    /// Make a cluster CA and node certificates for the node plane's mutual TLS.
    Certs(cmd::certs::Args),
    /// A drop-in for sglang-router 0.3.2's PD mode: route to SGLang prefill/decode workers.
    SglangRouter(Box<cmd::sglang_router::Args>),
    /// Keep an SGLang worker's card in the registry while it is healthy (for routers with
    /// router.sglang.discover = true).
    SglangRegister(cmd::sglang_register::Args),
    /// CUDA backend step times at Llama-3.1-8B shapes vs measured ceilings (GPU hosts).
    #[command(hide = true)]
    #[cfg(feature = "bench-engine")]
    BenchEngine(cmd::bench_engine::Args),
}

/// Runs one subcommand. Commands with a config file initialise logging from it; the others use
/// the default log settings (`RUST_LOG` still overrides).
pub async fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Start(a) => cmd::start::run(a).await,
        Command::CheckConfig(a) => cmd::check_config::run(a).await,
        Command::Version(a) => cmd::version::run(a).await,
        Command::Generate(a) => cmd::generate::run(a).await,
        Command::Bench(a) => cmd::bench::run(*a).await,
        Command::BenchTransfer(a) => cmd::bench_transfer::run(a).await,
        Command::Nodes(a) => cmd::nodes::run(a).await,
        Command::Drain(a) => cmd::drain::run(a).await,
        Command::Certs(a) => cmd::certs::run(a).await,
        Command::SglangRouter(a) => cmd::sglang_router::run(*a).await,
        Command::SglangRegister(a) => cmd::sglang_register::run(a).await,
        #[cfg(feature = "bench-engine")]
        Command::BenchEngine(a) => cmd::bench_engine::run(a).await,
    }
}
