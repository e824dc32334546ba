//! `pdnode-control-bench`: the control plane at scale (issue 18; docs/benchmarks.md, "Control
//! plane at scale").
//!
//! `run` starts a real etcd on loopback, `--registrars` child processes of this
//! binary that register `--nodes` node cards between them through `pdnode-registry` (each card
//! under its own lease with the registry's own keepalives, one etcd connection per
//! `--nodes-per-conn` cards), and `--routers` routers' membership views (`LiveMembership`, each on
//! its own connection). It then measures: the time until every router sees every node, a new
//! router's convergence, a burst of nodes joining and leaving at once, etcd's load in a steady
//! window (requests and keepalives per second, per node; etcd's CPU), a registrar process
//! killed (its leases expire), and the placement latency of each router policy over
//! `--candidates` candidates. Prints one table; `--json FILE` writes the figures too. Exits 1
//! when a view did not converge within its deadline.
//!
//! `registrar` is the child process (driven over stdin/stdout; not for use by hand).

mod driver;
mod etcd_load;
mod placement;
mod registrar;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "pdnode-control-bench",
    about = "The control plane at scale: registry and routers with many nodes"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The benchmark.
    Run(driver::RunArgs),
    /// A child process holding registrations (driven by `run` over stdin/stdout).
    #[command(hide = true)]
    Registrar(registrar::RegistrarArgs),
    /// Only the placement latency of each policy (no etcd).
    Placement(placement::PlacementArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pdnode-control-bench: runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let r = match cli.cmd {
        Cmd::Run(a) => rt.block_on(driver::run(a)),
        Cmd::Registrar(a) => rt.block_on(registrar::run(a)),
        Cmd::Placement(a) => {
            // The membership's gRPC clients are made (lazily) inside a runtime.
            let rows = rt.block_on(async { placement::measure(&a) });
            println!("{}", placement::table(&rows, a.candidates));
            Ok(true)
        }
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("pdnode-control-bench: {e:#}");
            ExitCode::from(2)
        }
    }
}
