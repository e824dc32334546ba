//! Every integration test of `pdnode-router`, one module per file, in one test binary: one build and
//! one link instead of one per file (the cold build on CI's two cores). Run one file's tests
//! with its module path: `cargo test -p pdnode-router --test all abort_capability::`.

mod common;

#[path = "abort_capability.rs"]
mod abort_capability;
#[path = "colocated.rs"]
mod colocated;
#[path = "cost_policy.rs"]
mod cost_policy;
#[path = "decode_lost.rs"]
mod decode_lost;
#[path = "decode_watch.rs"]
mod decode_watch;
#[path = "fuzz_openai.rs"]
mod fuzz_openai;
#[path = "grpc.rs"]
mod grpc;
#[path = "grpc_nodes.rs"]
mod grpc_nodes;
#[path = "http.rs"]
mod http;
#[path = "http_requests.rs"]
mod http_requests;
#[path = "local_prefill.rs"]
mod local_prefill;
#[path = "node_lost.rs"]
mod node_lost;
#[path = "openai_python.rs"]
mod openai_python;
#[path = "slo_admission.rs"]
mod slo_admission;
#[path = "slow_client.rs"]
mod slow_client;
#[path = "stats_refresh.rs"]
mod stats_refresh;
#[path = "throughput.rs"]
mod throughput;
#[path = "warm_pairs.rs"]
mod warm_pairs;
