//! Every integration test of `pdnode-core`, one module per file, in one test binary: one build and
//! one link instead of one per file (the cold build on CI's two cores). Run one file's tests
//! with its module path: `cargo test -p pdnode-core --test all config::`.

mod common;

#[path = "config.rs"]
mod config;
#[path = "config_cuda.rs"]
mod config_cuda;
#[path = "config_limits.rs"]
mod config_limits;
#[path = "config_security.rs"]
mod config_security;
#[path = "dashboards.rs"]
mod dashboards;
#[path = "fuzz_config.rs"]
mod fuzz_config;
