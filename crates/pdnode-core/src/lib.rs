//! pdnode-core: the plain types every pdnode crate shares.
//!
//! Nothing here knows about tonic, etcd, UCX or CUDA. Ids are newtypes, the node card is what a
//! node publishes in the registry, [`layout::KvLayout`] is what prefill and decode compare before a
//! KV hand-off, [`request`] holds request and sampling parameters, [`error::ErrorKind`] is the one
//! classification every error maps to (HTTP status, gRPC code, metric label), [`metrics`] holds
//! every metric name, and [`config`] is the single configuration tree for every role.

pub mod accounting;
pub mod card;
pub mod config;
pub mod error;
pub mod ids;
pub mod kv_target;
pub mod kvh64;
pub mod layout;
pub mod metrics;
pub mod request;

pub use accounting::{Accounting, StepTimes};
pub use card::{NodeCard, Role, SglangWorker};
pub use error::ErrorKind;
pub use ids::{BlockId, NodeId, RequestId, TransferId};
pub use kv_target::{KvTarget, Placement, RankTarget, TargetError, TargetTransport};
pub use layout::{DType, KvKind, KvLayout};
pub use request::{FinishReason, SamplingParams};
