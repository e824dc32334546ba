//! Every integration test of `pdnode-engine`, one module per file, in one test binary: one build and
//! one link instead of one per file (the cold build on CI's two cores). Run one file's tests
//! with its module path: `cargo test -p pdnode-engine --test all engine::`.

mod text_support;

#[path = "engine.rs"]
mod engine;
#[path = "engine_argmax.rs"]
mod engine_argmax;
#[path = "engine_cpu.rs"]
mod engine_cpu;
#[path = "engine_queue.rs"]
mod engine_queue;
#[path = "engine_release.rs"]
mod engine_release;
#[path = "engine_staged.rs"]
mod engine_staged;
#[path = "fuzz_loaders.rs"]
mod fuzz_loaders;
#[path = "fuzz_text.rs"]
mod fuzz_text;
#[path = "loader.rs"]
mod loader;
#[path = "loader_limits.rs"]
mod loader_limits;
#[path = "parity.rs"]
mod parity;
#[path = "parity_smollm2.rs"]
mod parity_smollm2;
#[path = "sampling.rs"]
mod sampling;
#[path = "sampling_stop.rs"]
mod sampling_stop;
#[path = "scheduler.rs"]
mod scheduler;
#[path = "text_chat.rs"]
mod text_chat;
#[path = "text_detok.rs"]
mod text_detok;
#[path = "text_tokenizer.rs"]
mod text_tokenizer;
