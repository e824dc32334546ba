//! End to end with a DeepSeek-family model: `pdnode start` on the CPU with the tiny DeepSeek-V3
//! checkpoint of the engine's fixtures (latent attention, MoE; a word-level tokenizer, `w17` is
//! id 17), one all-in-one process and a router + prefill + decode split over etcd with the
//! latent KV over UCX on loopback. The OpenAI completions API gives transformers' greedy tokens
//! (the fixture's reference) on both, and the split's prefill node hands off every request's KV.

use crate::e2e_split::start_split;
use e2e_support::{Node, dump, free_addr, greedy_completion};
use pdnode_testkit::{EtcdServer, skip_etcd_tests};
use std::time::Duration;

use crate::e2e_support;

const READY: Duration = Duration::from_secs(120);
const MAX_TOKENS: u32 = 8;

fn fixture() -> std::path::PathBuf {
    e2e_support::repo_root().join("crates/pdnode-engine/tests/fixtures/deepseek_v3")
}

/// The `--set`s that serve the fixture (every node: the router reads its tokenizer).
fn model_sets() -> Vec<String> {
    vec![
        format!("model.path=\"{}\"", fixture().display()),
        "model.format=\"hf\"".to_string(),
        "model.served_name=\"tiny-deepseek-v3\"".to_string(),
        "engine.context_length=128".to_string(),
        "engine.cpu_threads=1".to_string(),
    ]
}

/// The reference prompt as text (ids 17, 42, ... as `w17 w42 ...`, BOS added by the
/// tokenizer) and transformers' first greedy tokens as the text they decode to.
fn reference() -> (String, String) {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap())
            .unwrap();
    let words = |k: &str, skip: usize, take: usize| {
        v[k].as_array().unwrap()[skip..skip + take]
            .iter()
            .map(|x| format!("w{}", x.as_u64().unwrap()))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let prompt_len = v["prompt_ids"].as_array().unwrap().len();
    // prompt_ids[0] is BOS (1), which the tokenizer adds.
    (
        words("prompt_ids", 1, prompt_len - 1),
        words("greedy_ids", 0, MAX_TOKENS as usize),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deepseek_model_serves_transformers_greedy_tokens_all_in_one_and_split() {
    let (prompt, want) = reference();
    let dir = tempfile::tempdir().unwrap();
    let local_http = free_addr();
    let mut sets = model_sets();
    sets.push(format!("router.http_listen=\"{local_http}\""));
    sets.push("router.grpc_listen=\"\"".to_string());
    let local = Node::start(dir.path(), "local", "configs/local.toml", &sets);
    e2e_support::wait_healthy(&local_http, READY, &[&local]).await;
    let (text, completion, prompt_tokens) =
        greedy_completion(&local_http, &prompt, MAX_TOKENS).await;
    assert_eq!(
        text.split_whitespace().collect::<Vec<_>>().join(" "),
        want,
        "all-in-one vs transformers{}",
        dump(&[&local])
    );
    assert_eq!((completion, prompt_tokens), (MAX_TOKENS as u64, 12));
    drop(local);

    if skip_etcd_tests() {
        return;
    }
    let etcd = EtcdServer::start().expect("etcd");
    let split = start_split(
        dir.path(),
        &etcd.endpoint(),
        "e2e-deepseek",
        &model_sets(),
        &[],
        &model_sets(),
    );
    e2e_support::wait_healthy(&split.http, READY, &split.nodes()).await;
    for _ in 0..2 {
        let (text, completion, _) = greedy_completion(&split.http, &prompt, MAX_TOKENS).await;
        assert_eq!(
            text.split_whitespace().collect::<Vec<_>>().join(" "),
            want,
            "split vs transformers{}",
            dump(&split.nodes())
        );
        assert_eq!(completion, MAX_TOKENS as u64);
    }
    let handoffs = "pdnode_transfer_handoffs_total{node=\"e2e-deepseek-prefill\",outcome=\"ok\"}";
    assert!(
        e2e_support::metric(&split.http, handoffs).await >= Some(2.0),
        "{handoffs}{}",
        dump(&split.nodes())
    );
}
