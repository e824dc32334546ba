//! Every integration test of `pdnode-sglang`, one module per file, in one test binary: one build and
//! one link instead of one per file (the cold build on CI's two cores). Run one file's tests
//! with its module path: `cargo test -p pdnode-sglang --test all discovery::`.

#[path = "discovery.rs"]
mod discovery;
#[path = "grpc.rs"]
mod grpc;
#[path = "sglang_router.rs"]
mod sglang_router;
#[path = "trace.rs"]
mod trace;
