//! role = "all" with `engine.colocated`: one colocated engine behind the router ([`ColocatedNode`],
//! paired with itself). Its greedy output equals the PD path's (mock engine and the CPU SmolLM2
//! engine), and every way a request ends (finish, a dropped stream, an abort, an unclaimed
//! reservation) leaves the engine's KV accounting clean.

use crate::common;

use pdnode_core::config::{Backend, Config, ModelFormat};
use pdnode_core::{NodeId, RequestId, SamplingParams};
use pdnode_node::pd;
use pdnode_router::{DecodeCall, NodeClient, PrefillCall, ReserveKv, Router, RouterDeps};
use std::time::{Duration, Instant};

fn mock_config() -> Config {
    common::mock_config(100, 12, 5_000)
}

use common::{assert_clean, prompt};

/// Greedy tokens of one request through a router over `deps`.
async fn through_router(deps: RouterDeps, ids: Vec<u32>, max_tokens: u32) -> Vec<u32> {
    on_router(&Router::new(deps), ids, max_tokens).await
}

async fn on_router(router: &std::sync::Arc<Router>, ids: Vec<u32>, max_tokens: u32) -> Vec<u32> {
    common::greedy(router, ids, max_tokens, None).await
}

async fn colocated_equals_pd(cfg: &Config, ids: Vec<u32>, max_tokens: u32) {
    let aio = tokio::task::block_in_place(|| pd::all_in_one(cfg, &NodeId::new("pd"))).unwrap();
    let want = through_router(aio.deps.clone(), ids.clone(), max_tokens).await;
    assert!(!want.is_empty());
    let col = tokio::task::block_in_place(|| pd::colocated(cfg, &NodeId::new("co"))).unwrap();
    let got = through_router(col.deps.clone(), ids, max_tokens).await;
    assert_eq!(got, want, "colocated output differs from PD");
    assert_eq!(col.node.pending(), 0);
    assert_clean(col.node.engine()).await;
    aio.prefill.engine().shutdown(Duration::from_secs(5)).await;
    aio.decode.engine().shutdown(Duration::from_secs(5)).await;
    col.node.engine().shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocated_matches_pd_on_the_mock_engine() {
    colocated_equals_pd(&mock_config(), prompt(), 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn colocated_matches_pd_on_the_cpu_smollm2_engine() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let model = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !model.is_file() {
        eprintln!(
            "SKIP: {} is missing (scripts/fetch-model.sh)",
            model.display()
        );
        return;
    }
    let mut c = mock_config();
    c.engine.backend = Backend::Cpu;
    c.engine.context_length = 256;
    c.engine.num_kv_blocks = 64;
    c.engine.block_size = 16;
    c.engine.max_running_requests = 4;
    c.model.format = ModelFormat::Gguf;
    c.model.path = model.to_string_lossy().into_owned();
    let ids: Vec<u32> = vec![1, 504, 3458, 282, 4649, 314, 2];
    colocated_equals_pd(&c, ids, 6).await;
}

async fn reserve(node: &pd::ColocatedNode, id: RequestId) -> pdnode_router::KvTarget {
    node.reserve_kv(ReserveKv {
        request_id: id,
        prompt_token_ids: prompt(),
        max_tokens: 50,
        prefill_node: node.id().clone(),
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drops_aborts_refusals_and_leases_free_everything() {
    let mut cfg = mock_config();
    cfg.engine.mock.output_len = 200;
    cfg.engine.mock.decode_us_per_token = 2_000;
    cfg.transfer.lease_ms = 300;
    let col = tokio::task::block_in_place(|| pd::colocated(&cfg, &NodeId::new("c"))).unwrap();
    let node = col.node.clone();
    let call = |id: RequestId, t: &pdnode_router::KvTarget| PrefillCall {
        request_id: id,
        prompt_token_ids: prompt(),
        sampling: SamplingParams::greedy(50),
        target: t.clone(),
    };
    let dcall = |id: RequestId, secret: Vec<u8>, first: u32| DecodeCall {
        request_id: id,
        secret,
        first_token_id: first,
        first_logprob: None,
        sampling: SamplingParams::greedy(50),
        prompt_token_ids: prompt(),
        sampler: None,
    };

    // A wrong secret is refused; decode before prefill is refused.
    let id = RequestId(1);
    let t = reserve(&node, id).await;
    let mut wrong = t.clone();
    wrong.secret = vec![0; 16];
    assert!(node.prefill(call(id, &wrong)).await.is_err());
    let t = reserve(&node, RequestId(2)).await;
    assert!(
        node.decode(dcall(RequestId(2), t.secret.clone(), 0))
            .await
            .is_err()
    );

    // A decode stream dropped after two tokens aborts the request.
    let id = RequestId(3);
    let t = reserve(&node, id).await;
    let first = node.prefill(call(id, &t)).await.unwrap();
    let mut s = node
        .decode(dcall(id, t.secret.clone(), first.first_token_id))
        .await
        .unwrap();
    use futures::StreamExt;
    for _ in 0..2 {
        let c = s.next().await.unwrap().unwrap();
        assert_eq!(c.token_ids.len(), 1);
    }
    drop(s);
    assert_clean(node.engine()).await;

    // An abort after prefill frees the kept stream and the request.
    let id = RequestId(4);
    let t = reserve(&node, id).await;
    node.prefill(call(id, &t)).await.unwrap();
    let before = node.pending();
    // Without the request's KV capability an abort is refused, and the request stays.
    for wrong in [Vec::new(), vec![0; 16], t.secret[..15].to_vec()] {
        let e = node.abort(id, wrong, "test".into()).await.unwrap_err();
        assert_eq!(e.kind, pdnode_core::ErrorKind::PermissionDenied, "{e}");
    }
    assert_eq!(node.pending(), before);
    assert!(
        node.abort(id, t.secret.clone(), "test".into())
            .await
            .unwrap()
    );
    assert!(
        !node
            .abort(id, t.secret.clone(), "again".into())
            .await
            .unwrap(),
        "aborted already: nothing found"
    );
    assert_eq!(node.pending(), before - 1);
    assert_clean(node.engine()).await;

    // A prefilled request nobody decodes is aborted at its lease (by the next reservation's sweep).
    let id = RequestId(5);
    let t = reserve(&node, id).await;
    node.prefill(call(id, &t)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while node.pending() > 0 {
        assert!(Instant::now() < deadline, "lease never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
        node.sweep();
    }
    assert_clean(node.engine()).await;
    node.engine().shutdown(Duration::from_secs(5)).await;
}

/// Two role-"all" colocated nodes registered in one registry, served over node gRPC, behind a
/// separate router whose membership is the registry's view (as `role = "router"` builds it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_colocated_replicas_behind_a_separate_router_over_grpc() {
    use pdnode_core::Role;
    use pdnode_node::{Node, assemble::assemble};
    use pdnode_registry::{LiveMembership, MemoryRegistry, Registry, RegistryOptions};
    use pdnode_router::grpc_client::CardMembership;
    use std::sync::Arc;

    let reg: Arc<dyn Registry> = Arc::new(MemoryRegistry::new(RegistryOptions::default()));
    let mut nodes = Vec::new();
    for i in 0..2 {
        let mut c = mock_config();
        c.node.role = Role::All;
        c.node.cluster = "colo".into();
        c.node.id = format!("colo-{i}");
        c.node.listen = "127.0.0.1:0".into();
        c.router.http_listen = "127.0.0.1:0".into();
        c.router.grpc_listen = "127.0.0.1:0".into();
        c.engine.colocated = true;
        let deps = assemble(&c, reg.clone()).await.unwrap();
        assert!(deps.pd.is_some(), "a colocated node serves pdnode.v1.Node");
        nodes.push(Node::start(&c, deps).await.unwrap());
    }
    let live = Arc::new(LiveMembership::start(&*reg, "colo").await.unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while live.serving(Role::All).len() < 2 {
        assert!(Instant::now() < deadline, "the replicas never showed up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cfg = mock_config();
    let rm = pd::router_tokenizer(&cfg).unwrap();
    let deps = RouterDeps {
        config: cfg.router.clone(),
        api_keys: Vec::new(),
        insecure_node_plane: false,
        membership: Arc::new(CardMembership::new(move |r| live.serving(r))),
        tokenizer: rm.tokenizer,
        chat: rm.chat,
        model: rm.model,
    };
    let router = Router::new(deps);
    assert_eq!(router.deps().membership.workers(Role::All).len(), 2);
    // One router, round robin over the two replicas; every request is served whole by one of
    // them (D == P), and greedy mock output does not depend on which.
    let first = on_router(&router, prompt(), 8).await;
    assert_eq!(first.len(), 8);
    for _ in 0..3 {
        assert_eq!(on_router(&router, prompt(), 8).await, first);
    }
    for n in nodes {
        n.shutdown().await;
    }
}
