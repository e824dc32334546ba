//! The engine loop over the CPU backend on a tiny fixture model: greedy generation of several
//! sequences batched together (continuous batching, chunked prefill, prefix-cache hits) equals
//! each sequence generated alone, and the reference prompt gives transformers' greedy tokens;
//! for the Llama family and for DeepSeek (latent attention: the prefix cache shares latents).

use pdnode_core::request::GenerateRequest;
use pdnode_core::{RequestId, SamplingParams};
use pdnode_engine::backend::cpu::{CpuBackend, CpuBackendConfig};
use pdnode_engine::engine::{EngineEvent, EngineHandle, EngineLoopConfig, RequestStream, spawn};
use pdnode_engine::loader::load_path;
use pdnode_engine::scheduler::Mode;
use std::path::PathBuf;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(120);

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn engine(name: &str, max_batch_tokens: usize) -> (EngineHandle, usize) {
    let model = load_path(&fixture(name)).unwrap();
    let vocab = model.spec.vocab_size;
    let cfg = CpuBackendConfig {
        block_size: 4,
        num_blocks: 128,
        threads: 1,
    };
    let b = CpuBackend::from_loaded(model, cfg).unwrap();
    let lc = EngineLoopConfig {
        mode: Mode::Colocated,
        max_batch_tokens,
        max_running_requests: 8,
        max_queued_requests: 100,
        context_length: 256,
        prefix_cache: true,
        lease: Duration::from_secs(5),
        vocab_size: vocab,
        eos_token_ids: vec![],
        max_output_tokens: None,
        idle_wait: Duration::from_millis(5),
        call_timeout: Duration::from_secs(30),
    };
    (spawn(Box::new(b), lc, None).unwrap(), vocab)
}

async fn collect(mut s: RequestStream) -> Vec<u32> {
    let fut = async {
        let mut out = Vec::new();
        while let Some(ev) = s.next().await {
            match ev {
                EngineEvent::Token { token, .. } => out.push(token),
                EngineEvent::Finished { .. } => return out,
                other => panic!("unexpected {other:?}"),
            }
        }
        panic!("stream ended without Finished");
    };
    tokio::time::timeout(DEADLINE, fut).await.expect("deadline")
}

fn reference(name: &str) -> (Vec<u32>, Vec<u32>) {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    (ids("prompt_ids"), ids("greedy_ids"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_greedy_generation_equals_each_sequence_alone() {
    for name in ["llama_gqa", "deepseek_v2", "deepseek_v3"] {
        batched_equals_alone(name).await;
    }
}

async fn batched_equals_alone(name: &str) {
    let (prompt, greedy) = reference(name);
    // A small step budget forces chunked prefill and mixed prefill/decode steps.
    let (batched, vocab) = engine(name, 12);
    let v = vocab as u32;
    let mut reqs = vec![GenerateRequest {
        id: RequestId(1),
        prompt_token_ids: prompt.clone(),
        sampling: SamplingParams::greedy(greedy.len() as u32),
    }];
    for i in 2..=5u64 {
        // Some share the reference prompt's prefix (prefix-cache hits), some do not.
        let mut p: Vec<u32> = if i % 2 == 0 {
            prompt[..prompt.len().min(9)].to_vec()
        } else {
            Vec::new()
        };
        p.extend((0..(5 + i as u32 * 3)).map(|k| (k * 37 + i as u32 * 11) % v));
        reqs.push(GenerateRequest {
            id: RequestId(i),
            prompt_token_ids: p,
            sampling: SamplingParams::greedy(6 + i as u32),
        });
    }
    let streams: Vec<_> = reqs
        .iter()
        .map(|r| batched.add_request(r.clone()).unwrap())
        .collect();
    let mut together = Vec::new();
    for s in streams {
        together.push(collect(s).await);
    }
    assert_eq!(
        together[0], greedy,
        "{name}: the reference prompt's greedy tokens"
    );
    let (solo, _) = engine(name, 512);
    for (r, got) in reqs.iter().zip(&together) {
        let alone = collect(solo.add_request(r.clone()).unwrap()).await;
        assert_eq!(&alone, got, "{name}: {}", r.id);
    }
    // Again on the batched engine, from its prefix cache: the same tokens.
    let again = collect(batched.add_request(reqs[0].clone()).unwrap()).await;
    assert_eq!(again, greedy, "{name}: from the prefix cache");
    for e in [&batched, &solo] {
        e.check_accounting().await.unwrap().unwrap();
        let s = e.stats().await.unwrap().scheduler;
        assert_eq!(s.kv.available(), s.kv.total);
        assert!(s.kv.cached > 0, "{name}: finished prompts stay cached");
        assert!(e.shutdown(DEADLINE).await);
    }
}
