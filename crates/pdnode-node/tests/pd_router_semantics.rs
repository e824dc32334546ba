//! What a client sees through the router over the PD data path (role = "all": a prefill-only
//! and a decode-only engine, KV moved in process; the simulated engine) compared with the
//! colocated node:
//! - seeded sampling gives the same tokens (the decode node continues the sampler prefill
//!   handed over, `PrefillOutcome::sampler`, instead of starting its random stream again);
//! - `usage.cached_tokens` reports the prefill node's prefix-cache hits;
//! - stop strings are applied once, by the router (the nodes' engines never detokenize).

use crate::common;

use pdnode_core::config::Config;
use pdnode_core::{FinishReason, NodeId, SamplingParams};
use pdnode_node::pd;
use pdnode_router::{GenEvent, GenRequest, Router, RouterDeps, Usage};
use std::sync::Arc;
use std::time::Duration;

fn mock_config() -> Config {
    common::mock_config(100, 16, 5_000)
}

use common::prompt;

/// Everything one request produced through `router`.
#[derive(Debug)]
struct Outcome {
    tokens: Vec<u32>,
    text: String,
    finish: FinishReason,
    usage: Usage,
}

async fn run(router: &Arc<Router>, ids: Vec<u32>, sampling: SamplingParams) -> Outcome {
    let mut g = router
        .generate(GenRequest {
            prompt_token_ids: ids,
            sampling,
            endpoint: "test",
            routing_key: None,
            slo: Default::default(),
        })
        .unwrap();
    let mut tokens = Vec::new();
    let mut text = String::new();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(30), g.events.recv())
            .await
            .expect("router stalled");
        match ev {
            Some(GenEvent::Tokens {
                token_ids, text: t, ..
            }) => {
                tokens.extend(token_ids);
                text.push_str(&t);
            }
            Some(GenEvent::Done { finish, usage }) => {
                return Outcome {
                    tokens,
                    text,
                    finish,
                    usage,
                };
            }
            Some(GenEvent::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended without Done"),
        }
    }
}

fn pd_router(cfg: &Config, id: &str) -> (Arc<Router>, pd::AllInOne) {
    let aio = tokio::task::block_in_place(|| pd::all_in_one(cfg, &NodeId::new(id))).unwrap();
    (Router::new(aio.deps.clone()), aio)
}

fn colocated_router(cfg: &Config, id: &str) -> (Arc<Router>, RouterDeps) {
    let c = tokio::task::block_in_place(|| pd::colocated(cfg, &NodeId::new(id))).unwrap();
    (Router::new(c.deps.clone()), c.deps)
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 8,
        seed: Some(seed),
        max_tokens: 12,
        ..SamplingParams::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_through_pd_equals_colocated() {
    let cfg = mock_config();
    let (colo, _keep) = colocated_router(&cfg, "c");
    let (pd, _aio) = pd_router(&cfg, "p");
    let mut differ = 0;
    for seed in [1, 7, 1234] {
        let want = run(&colo, prompt(), seeded(seed)).await;
        let got = run(&pd, prompt(), seeded(seed)).await;
        assert_eq!(want.tokens.len(), 12, "{want:?}");
        assert_eq!(
            got.tokens, want.tokens,
            "seed {seed}: PD sampled otherwise than colocated"
        );
        // Same seed twice on PD: the same tokens (the seed, not chance, decides).
        assert_eq!(run(&pd, prompt(), seeded(seed)).await.tokens, got.tokens);
        if got.tokens != run(&colo, prompt(), seeded(seed + 100)).await.tokens {
            differ += 1;
        }
    }
    assert!(
        differ > 0,
        "the seed changes nothing: the test samples nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_reports_the_prefill_prefix_cache_hits() {
    let cfg = mock_config();
    let (pd, _aio) = pd_router(&cfg, "u");
    let first = run(&pd, prompt(), SamplingParams::greedy(4)).await;
    assert_eq!(first.usage.prompt_tokens, 23);
    assert_eq!(first.usage.cached_tokens, 0, "{:?}", first.usage);
    // The same prompt again: its 5 full blocks of 4 tokens are in the prefill node's cache.
    let second = run(&pd, prompt(), SamplingParams::greedy(4)).await;
    assert_eq!(second.tokens, first.tokens);
    assert_eq!(second.usage.cached_tokens, 20, "{:?}", second.usage);
    // A prompt sharing only its first 8 tokens: two blocks hit.
    let mut other = prompt();
    other[9] = 199;
    let third = run(&pd, other, SamplingParams::greedy(4)).await;
    assert_eq!(third.usage.cached_tokens, 8, "{:?}", third.usage);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_are_applied_once_by_the_router() {
    let cfg = mock_config();
    let (pd, aio) = pd_router(&cfg, "s");
    let plain = run(&pd, prompt(), SamplingParams::greedy(10)).await;
    assert_eq!(plain.tokens.len(), 10);
    assert_eq!(plain.finish, FinishReason::Length);
    // The mock tokenizer decodes id t (>= 256) as " t<id>": stop at the fourth token's text.
    let stop = format!(" t{}", plain.tokens[3]);
    let cut = plain.text.find(&stop).expect("the fourth token's text");
    let mut sampling = SamplingParams::greedy(10);
    sampling.stop = vec![stop.clone()];
    let stopped = run(&pd, prompt(), sampling.clone()).await;
    assert_eq!(stopped.finish, FinishReason::Stop, "{stopped:?}");
    assert_eq!(stopped.text, plain.text[..cut], "{stopped:?}");
    assert_eq!(stopped.tokens[..4], plain.tokens[..4]);
    // The nodes' engines hold nothing once the router ended the request on the stop string.
    for n in [&aio.prefill, &aio.decode] {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let s = n.engine().stats().await.unwrap();
            if s.in_flight() == 0 {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{s:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
