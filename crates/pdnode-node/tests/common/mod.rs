//! Shared setup of the node tests: the **mock** engine over the SmolLM2 dummy shapes, in-process
//! KV, the in-memory registry.

#![allow(dead_code)]

use pdnode_core::config::{Backend, Config, ModelFormat, RegistryKind, TransferKind};
use pdnode_core::{NodeId, RequestId, Role, SamplingParams};
use pdnode_engine::engine::EngineEvent;
use pdnode_engine::scheduler::Mode;
use pdnode_node::pd;
use pdnode_router::{DecodeCall, NodeClient, PrefillCall, ReserveKv};
use std::time::Duration;

/// A mock-engine node: 1 us a prompt token, `decode_us` a decode step, `output_len` tokens,
/// 64 blocks of 4 tokens, KV leases of `lease_ms`.
pub fn mock_config(decode_us: u64, output_len: u32, lease_ms: u64) -> Config {
    let mut c = Config::default();
    c.engine.backend = Backend::Mock;
    c.engine.mock.prefill_us_per_token = 1;
    c.engine.mock.decode_us_per_token = decode_us;
    c.engine.mock.output_len = output_len;
    c.engine.num_kv_blocks = 64;
    c.engine.block_size = 4;
    c.model.format = ModelFormat::Dummy;
    c.model.preset = "smollm2-135m".into();
    c.registry.kind = RegistryKind::Memory;
    c.transfer.kind = TransferKind::InProcess;
    c.transfer.lease_ms = lease_ms;
    c
}

/// A 23-token prompt (6 blocks of 4, the last partial).
pub fn prompt() -> Vec<u32> {
    (0..23).map(|i| (i * 7 + 3) % 200).collect()
}

/// The CPU backend over a tiny HF fixture, prefill and decode nodes over UCX on loopback: the
/// KV goes through the nodes' registered staging arenas (or host staging, when they are absent
/// or full).
pub fn cpu_ucx_config() -> Config {
    let mut c = Config::default();
    c.engine.backend = Backend::Cpu;
    c.engine.cpu_threads = 1;
    c.engine.num_kv_blocks = 64;
    c.engine.block_size = 4;
    c.model.format = ModelFormat::Hf;
    c.model.path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../pdnode-engine/tests/fixtures/llama_gqa"
    )
    .into();
    c.registry.kind = RegistryKind::Memory;
    c.transfer.kind = TransferKind::Ucx;
    // Loopback only (the config key, not the environment: the tests share one process).
    c.transfer.ucx_net_devices = "lo".into();
    c.transfer.lease_ms = 5_000;
    c
}

pub fn cpu_prompt(seed: u32) -> Vec<u32> {
    (0..23).map(|i| (i * 7 + 3 + seed * 11) % 120).collect()
}

/// Starts a prefill and a decode node; `None` when UCX is missing outside CI.
pub fn pd_pair(cfg: &Config) -> Option<(pd::ServingNode, pd::ServingNode)> {
    let mut pcfg = cfg.clone();
    pcfg.node.role = Role::Prefill;
    let mut dcfg = cfg.clone();
    dcfg.node.role = Role::Decode;
    let p = tokio::task::block_in_place(|| pd::pd_node(&pcfg, &NodeId::new("p"), Role::Prefill));
    let p = match p {
        Ok(p) => p,
        Err(e) if std::env::var("CI").is_err() && e.to_string().contains("libucp") => {
            eprintln!("skipped: UCX library not available here: {e}");
            return None;
        }
        Err(e) => panic!("{e}"),
    };
    let d = tokio::task::block_in_place(|| pd::pd_node(&dcfg, &NodeId::new("d"), Role::Decode))
        .unwrap();
    Some((p, d))
}

pub async fn colocated_tokens(cfg: &Config, ids: &[u32], max_tokens: u32) -> Vec<u32> {
    colocated_sampled(cfg, ids, SamplingParams::greedy(max_tokens)).await
}

pub async fn colocated_sampled(cfg: &Config, ids: &[u32], sampling: SamplingParams) -> Vec<u32> {
    let built = tokio::task::block_in_place(|| pd::build_engine(cfg, Mode::Colocated)).unwrap();
    let mut s = built
        .handle
        .add_request(pdnode_core::request::GenerateRequest {
            id: RequestId(1),
            prompt_token_ids: ids.to_vec(),
            sampling,
        })
        .unwrap();
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        match ev {
            EngineEvent::Token { token, .. } => out.push(token),
            EngineEvent::Finished { .. } => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    built.handle.shutdown(Duration::from_secs(5)).await;
    out
}

/// Waits (at most 10 s) until `engine` holds nothing: every KV block free or evictable cache, no
/// lease, nothing running or queued; then checks its accounting.
pub async fn assert_clean(engine: &pdnode_engine::engine::EngineHandle) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = engine.stats().await.unwrap().scheduler;
        if s.kv.free + s.kv.cached_unreferenced == s.kv.total
            && s.kv.leases == 0
            && s.running == 0
            && s.waiting == 0
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "engine still holds: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    engine.check_accounting().await.unwrap().unwrap();
}

/// Greedy tokens of one request through `router` (routing key `key`), to its end.
pub async fn greedy(
    router: &std::sync::Arc<pdnode_router::Router>,
    ids: Vec<u32>,
    max_tokens: u32,
    key: Option<&str>,
) -> Vec<u32> {
    use pdnode_router::{GenEvent, GenRequest};
    let mut g = router
        .generate(GenRequest {
            prompt_token_ids: ids,
            sampling: SamplingParams::greedy(max_tokens),
            endpoint: "test",
            routing_key: key.map(str::to_string),
            slo: Default::default(),
        })
        .unwrap();
    let mut got = Vec::new();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(120), g.events.recv())
            .await
            .expect("router stalled");
        match ev {
            Some(GenEvent::Tokens { token_ids, .. }) => got.extend(token_ids),
            Some(GenEvent::Done { .. }) => return got,
            Some(GenEvent::Error(e)) => panic!("request failed: {e}"),
            None => panic!("stream ended without Done"),
        }
    }
}

/// The CPU backend on the demo SmolLM2 GGUF (context 256, 64 blocks of 16, 4 running), or
/// `None` (printed SKIP) when the model is absent; absent with `CI` set is a failure
/// (scripts/fetch-model.sh fetches it).
pub fn smollm2_config() -> Option<Config> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let model = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !model.is_file() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{} is missing and CI is set (scripts/fetch-model.sh)",
            model.display()
        );
        eprintln!(
            "SKIP: {} is missing (scripts/fetch-model.sh)",
            model.display()
        );
        return None;
    }
    let mut c = mock_config(100, 12, 5_000);
    c.engine.backend = Backend::Cpu;
    c.engine.context_length = 256;
    c.engine.num_kv_blocks = 64;
    c.engine.block_size = 16;
    c.engine.max_running_requests = 4;
    c.model.format = ModelFormat::Gguf;
    c.model.path = model.to_string_lossy().into_owned();
    Some(c)
}

/// Waits (at most 10 s) until `node`'s pool holds nothing but evictable cache and no lease;
/// then checks its accounting.
pub async fn assert_node_clean(node: &pdnode_node::pd::PdNode) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let s = node.engine().stats().await.unwrap().scheduler;
        if s.kv.free + s.kv.cached_unreferenced == s.kv.total && s.kv.leases == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "blocks still held: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.engine().check_accounting().await.unwrap().unwrap();
}

/// One request through reserve -> prefill (push) -> decode; the tokens and the prefill outcome.
pub async fn pd_request(
    p: &pd::ServingNode,
    d: &pd::ServingNode,
    id: u64,
    ids: &[u32],
    max_tokens: u32,
) -> (Vec<u32>, pdnode_router::PrefillOutcome) {
    pd_request_sampled(p, d, id, ids, SamplingParams::greedy(max_tokens)).await
}

/// [`pd_request`] with any sampling; the decode call carries prefill's sampler, as the router's.
pub async fn pd_request_sampled(
    p: &pd::ServingNode,
    d: &pd::ServingNode,
    id: u64,
    ids: &[u32],
    sampling: SamplingParams,
) -> (Vec<u32>, pdnode_router::PrefillOutcome) {
    let (_, out, mut s) = pd_start(p, d, RequestId(id), ids, sampling).await;
    let mut got = vec![out.first_token_id];
    use futures::StreamExt;
    while let Some(c) = tokio::time::timeout(Duration::from_secs(20), s.next())
        .await
        .unwrap()
    {
        let c = c.unwrap();
        got.extend(c.token_ids);
        if c.finish.is_some() {
            break;
        }
    }
    (got, out)
}

/// A request's reservation on `d`, its prefill on `p` and its decode call on `d`: the target,
/// prefill's outcome and the decode stream (nothing read from it yet).
pub async fn pd_start(
    p: &pd::ServingNode,
    d: &pd::ServingNode,
    id: RequestId,
    ids: &[u32],
    sampling: SamplingParams,
) -> (
    pdnode_router::KvTarget,
    pdnode_router::PrefillOutcome,
    pdnode_router::DecodeStream,
) {
    let target = d
        .node
        .reserve_kv(ReserveKv {
            request_id: id,
            prompt_token_ids: ids.to_vec(),
            max_tokens: sampling.max_tokens,
            prefill_node: NodeId::new("p"),
        })
        .await
        .unwrap();
    let out = p
        .node
        .prefill(PrefillCall {
            request_id: id,
            prompt_token_ids: ids.to_vec(),
            sampling: sampling.clone(),
            target: target.clone(),
        })
        .await
        .unwrap();
    let s = d
        .node
        .decode(DecodeCall {
            request_id: id,
            secret: target.secret.clone(),
            first_token_id: out.first_token_id,
            first_logprob: None,
            sampling,
            prompt_token_ids: ids.to_vec(),
            sampler: out.sampler,
        })
        .await
        .unwrap();
    (target, out, s)
}

pub fn arena_free(n: &pd::ServingNode) -> bool {
    n.node.staging_arena().is_none_or(|a| a.all_free())
}
