//! Every integration test of `pdnode`, one module per file, in one test binary: one build and
//! one link instead of one per file (the cold build on CI's two cores). Run one file's tests
//! with its module path: `cargo test -p pdnode --test all cli::`.

mod e2e_support;

#[path = "cli.rs"]
mod cli;
#[path = "e2e_deepseek.rs"]
mod e2e_deepseek;
#[path = "e2e_fault.rs"]
mod e2e_fault;
#[path = "e2e_faults.rs"]
mod e2e_faults;
#[path = "e2e_local.rs"]
mod e2e_local;
#[path = "e2e_migrate.rs"]
mod e2e_migrate;
#[path = "e2e_split.rs"]
mod e2e_split;
#[path = "e2e_tls.rs"]
mod e2e_tls;
#[path = "e2e_trace.rs"]
mod e2e_trace;
#[path = "etcd_tls.rs"]
mod etcd_tls;
#[path = "generate.rs"]
mod generate;
#[path = "node_lifecycle.rs"]
mod node_lifecycle;
#[path = "sglang_router.rs"]
mod sglang_router;
#[path = "transfer.rs"]
mod transfer;
