//! pdnode-router: membership view, prefill/decode policies, request orchestration, and the
//! OpenAI-compatible HTTP and `pdnode.v1.Inference` gRPC frontends.
//!
//! To host a router, a process provides [`RouterDeps`]: a [`Membership`] (nodes by role, each
//! with a [`NodeClient`]), a [`Tokenize`] + [`ChatRender`] for the model, and [`ModelInfo`]; then
//! calls [`run`] with its listeners. [`grpc_client`] has the `NodeClient` over the node gRPC API
//! and a card-driven `Membership`; [`testing`] has in-memory twins.

pub mod error;
pub mod grpc;
pub mod grpc_client;
pub mod http;
pub mod membership;
pub mod metrics;
pub mod net;
pub mod node;
pub mod policy;
pub mod router;
pub mod server;
pub mod testing;
pub mod tokenize;

pub use error::{NodeError, RouterError};
pub use membership::{Membership, StaticMembership, Worker};
pub use node::{
    DecodeCall, DecodeChunk, DecodeStream, KvTarget, MigrateCall, MigrateOutcome, NodeClient,
    NodeStats, PrefillCall, PrefillOutcome, ReserveKv,
};
pub use router::{
    GenEvent, GenRequest, Generation, ModelInfo, ROUTING_KEY_HEADER, ROUTING_KEY_MAX, Router,
    RouterDeps, SLO_TPOT_HEADER, SLO_TTFT_HEADER, Slo, Usage, routing_key,
};
pub use server::run;
pub use tokenize::{ChatMessage, ChatRender, Tokenize, TokenizeError};
