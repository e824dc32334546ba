//! Conditional disaggregation on the node side: a decode node asked to prefill a request itself
//! (`ReserveKv` naming the decode node as its own prefill node; the router does that under
//! `router.local_prefill`). Its greedy output equals the PD path's (mock engine and the CPU
//! SmolLM2 engine) while the prefill engine runs nothing; the capability guards every call; every
//! way such a request ends leaves the decode engine's KV accounting clean.

use crate::common;

use futures::StreamExt;
use pdnode_core::config::Config;
use pdnode_core::{ErrorKind, NodeId, RequestId, SamplingParams, TargetTransport};
use pdnode_engine::engine::EngineHandle;
use pdnode_node::pd;
use pdnode_router::{DecodeCall, KvTarget, NodeClient, PrefillCall, ReserveKv, Router, RouterDeps};
use std::time::{Duration, Instant};

use common::{assert_clean, prompt};

async fn generate(deps: RouterDeps, ids: Vec<u32>, max_tokens: u32) -> Vec<u32> {
    common::greedy(&Router::new(deps), ids, max_tokens, None).await
}

/// Prefill steps the engine ran so far.
async fn prefill_steps(engine: &EngineHandle) -> u64 {
    engine.stats().await.unwrap().step_prefill.count
}

async fn here_equals_pd(cfg: &Config, ids: Vec<u32>, max_tokens: u32) {
    let aio = tokio::task::block_in_place(|| pd::all_in_one(cfg, &NodeId::new("pd"))).unwrap();
    let want = generate(aio.deps.clone(), ids.clone(), max_tokens).await;
    assert!(want.len() > 1, "{want:?}");
    let p_steps = prefill_steps(aio.prefill.engine()).await;
    assert!(p_steps > 0, "the PD run prefilled on the prefill node");
    let mut deps = aio.deps.clone();
    deps.config.local_prefill.max_prompt_tokens = ids.len() as u32;
    let got = generate(deps, ids, max_tokens).await;
    assert_eq!(
        got, want,
        "prefilled on the decode node: output differs from PD"
    );
    assert_eq!(
        prefill_steps(aio.prefill.engine()).await,
        p_steps,
        "the prefill engine ran a step for a request its decode node prefilled"
    );
    assert_eq!(aio.decode.pending_here(), 0);
    assert_eq!(aio.decode.pending_reservations(), 0);
    assert_clean(aio.decode.engine()).await;
    assert_clean(aio.prefill.engine()).await;
    aio.prefill.engine().shutdown(Duration::from_secs(5)).await;
    aio.decode.engine().shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_here_matches_pd_on_the_mock_engine() {
    here_equals_pd(&common::mock_config(100, 12, 5_000), prompt(), 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_here_matches_pd_on_the_cpu_smollm2_engine() {
    let Some(c) = common::smollm2_config() else {
        return;
    };
    here_equals_pd(&c, vec![1, 504, 3458, 282, 4649, 314, 2], 6).await;
}

fn reserve_here(d: &pd::PdNode, id: RequestId) -> ReserveKv {
    ReserveKv {
        request_id: id,
        prefill_node: d.id().clone(),
        prompt_token_ids: prompt(),
        max_tokens: 50,
    }
}

fn prefill(id: RequestId, t: &KvTarget) -> PrefillCall {
    PrefillCall {
        request_id: id,
        prompt_token_ids: prompt(),
        sampling: SamplingParams::greedy(50),
        target: t.clone(),
    }
}

fn decode(id: RequestId, secret: Vec<u8>, first: u32) -> DecodeCall {
    DecodeCall {
        request_id: id,
        secret,
        first_token_id: first,
        first_logprob: None,
        sampling: SamplingParams::greedy(50),
        prompt_token_ids: prompt(),
        sampler: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_drops_aborts_and_leases_of_a_prefill_here() {
    let mut cfg = common::mock_config(2_000, 200, 300);
    cfg.engine.mock.prefill_us_per_token = 1;
    let aio = tokio::task::block_in_place(|| pd::all_in_one(&cfg, &NodeId::new("h"))).unwrap();
    let d = aio.decode.clone();

    // The reservation holds no blocks and names nothing to write: the KV stays where the
    // decode node computes it.
    let id = RequestId(1);
    let t = d.reserve_kv(reserve_here(&d, id)).await.unwrap();
    assert_eq!(t.transport, TargetTransport::InProcess);
    assert!(t.blocks.is_empty() && t.ranks.is_empty(), "{t:?}");
    assert_eq!(d.pending_here(), 1);
    assert_eq!(d.pending_reservations(), 0);
    // The same id again, either way, is refused.
    let e = d.reserve_kv(reserve_here(&d, id)).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidRequest, "{e}");
    let mut pd_way = reserve_here(&d, id);
    pd_way.prefill_node = aio.prefill.id().clone();
    let e = d.reserve_kv(pd_way).await.unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidRequest, "{e}");
    // A wrong secret is refused; Decode before Prefill is refused and ends the request.
    let mut wrong = t.clone();
    wrong.secret = vec![0; 16];
    assert!(d.prefill(prefill(id, &wrong)).await.is_err());
    let id2 = RequestId(2);
    let t2 = d.reserve_kv(reserve_here(&d, id2)).await.unwrap();
    assert!(d.decode(decode(id2, t2.secret.clone(), 0)).await.is_err());
    assert_clean(d.engine()).await;

    // A decode stream dropped after two tokens aborts the request.
    let id = RequestId(3);
    let t = d.reserve_kv(reserve_here(&d, id)).await.unwrap();
    let first = d.prefill(prefill(id, &t)).await.unwrap();
    assert!(
        first.sampler.is_none(),
        "one engine samples the whole request"
    );
    assert_eq!(first.transfer_bytes, 0);
    let mut s = d
        .decode(decode(id, t.secret.clone(), first.first_token_id))
        .await
        .unwrap();
    for _ in 0..2 {
        let c = s.next().await.unwrap().unwrap();
        assert_eq!(c.token_ids.len(), 1);
    }
    drop(s);
    assert_clean(d.engine()).await;

    // An abort after the prefill needs the capability; with it, everything is freed.
    let id = RequestId(4);
    let t = d.reserve_kv(reserve_here(&d, id)).await.unwrap();
    d.prefill(prefill(id, &t)).await.unwrap();
    // (Request 1's reservation may still wait for its lease.)
    let before = d.pending_here();
    for wrong in [Vec::new(), vec![0; 16], t.secret[..15].to_vec()] {
        let e = d.abort(id, wrong, "test".into()).await.unwrap_err();
        assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
    }
    assert_eq!(
        d.pending_here(),
        before,
        "a refused abort leaves the request"
    );
    assert!(d.abort(id, t.secret.clone(), "test".into()).await.unwrap());
    assert!(!d.abort(id, t.secret.clone(), "again".into()).await.unwrap());
    assert_eq!(d.pending_here(), before - 1);
    assert_clean(d.engine()).await;

    // A prefilled request nobody decodes is aborted at its lease by the node's sweep.
    let id = RequestId(5);
    let t = d.reserve_kv(reserve_here(&d, id)).await.unwrap();
    d.prefill(prefill(id, &t)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.pending_here() > 0 {
        assert!(Instant::now() < deadline, "lease never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
        d.sweep();
    }
    assert_clean(d.engine()).await;

    // A prefill node never prefills "here": the reservation is a decode node's call.
    let p = aio.prefill.clone();
    let mut r = reserve_here(&d, RequestId(6));
    r.prefill_node = p.id().clone();
    assert!(p.reserve_kv(r).await.is_err());
    aio.prefill.engine().shutdown(Duration::from_secs(5)).await;
    aio.decode.engine().shutdown(Duration::from_secs(5)).await;
}
