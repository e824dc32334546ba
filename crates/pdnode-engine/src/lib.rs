//! pdnode-engine: the model engine every role runs.
//!
//! - [`spec`]: the normalized architecture description ([`spec::ModelSpec`]).
//! - [`weights`]: host f32 weights in HF orientation.
//! - [`loader`]: HF directory / GGUF / dummy-preset loading into a [`loader::LoadedModel`].
//! - [`text`]: tokenizer, chat templates, incremental detokenization.
//! - [`sampling`]: per-request sampling, penalties, logprobs and stop conditions.
//! - [`backend`]: the narrow [`backend::Backend`] trait (forward over paged KV, KV copy in/out) and
//!   its implementations.

pub mod backend;
pub mod engine;
pub mod loader;
pub mod mock;
pub mod sampling;
pub mod scheduler;
pub mod spec;
pub mod text;
pub mod weights;
