//! `pdnode`: start a node, check a config, generate, benchmark.
//!
//! Exit codes: 0 ok, 2 configuration or usage errors, 1 runtime errors.

mod cli;
mod cmd;
mod logging;

use clap::Parser;
use std::process::ExitCode;

/// Stack of the thread that runs the command: the 8 MiB a main thread gets on Linux.
const COMMAND_STACK: usize = 8 << 20;

fn main() -> ExitCode {
    // The main thread only waits: UCX moves the program break (glibc's main arena, the main
    // thread's heap) while it starts, so the command runs elsewhere (docs/runtime-semantics.md,
    // "Threads").
    let command = std::thread::Builder::new()
        .name("pdnode-main".into())
        .stack_size(COMMAND_STACK)
        .spawn(run);
    match command.map(|t| t.join()) {
        Ok(Ok(code)) => code,
        // The panic hook has printed the message already.
        Ok(Err(_)) => ExitCode::from(101),
        Err(e) => {
            eprintln!("error: cannot start the command's thread: {e}");
            ExitCode::from(1)
        }
    }
}

fn run() -> ExitCode {
    let cli = match cli::Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // `--help` and `--version` come back as "errors" that print to stdout and exit 0.
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(cli::dispatch(cli.command));
    // Do not wait forever for tasks a failed command left behind.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = cmd::report_error(&e);
            ExitCode::from(code)
        }
    }
}
