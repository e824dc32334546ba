//! pdnode as the router in front of SGLang prefill/decode HTTP workers: a drop-in for
//! sglang-router's PD mode (`python -m sglang_router.launch_router --pd-disaggregation ...`).
//!
//! A client's `POST /generate`, `/v1/completions` or `/v1/chat/completions` goes to the same
//! path on one prefill and one decode worker at once, with the same body plus
//! `bootstrap_host`, `bootstrap_port` and `bootstrap_room` (arrays for a batch); the prefill
//! worker pushes the KV to the decode worker waiting in that room. The prefill answer is read
//! to its end; the decode answer is the client's. See docs/sglang.md for the contract and
//! where this router differs from sglang-router 0.3.2.
//!
//! [`SglangRouter`] holds the workers (health from probes, one breaker per worker and cause,
//! requests in flight) and pdnode's policies; [`server::serve`] serves it over HTTP and
//! [`server::serve_grpc`] as `pdnode.v1.Inference` ([`grpc`]).

pub mod discovery;
pub mod grpc;
pub mod metrics;
pub mod request;
pub mod router;
pub mod server;
pub mod sse;
pub mod worker;

pub use request::Route;
pub use router::{BuildError, SglangRouter};
pub use server::{serve, serve_grpc, serve_metrics};
