//! The card a role-"all" node registers says what its node API serves: a colocated one registers
//! as `all` with `NodeCard::colocated` (both phases on its node API), and a separate router in
//! the same cluster pairs it with itself; the in-process kind keeps its engines behind its own
//! router and registers as a `router` (its node API serves no data path), so no registry view
//! ever lists it as a prefill or decode node.

use pdnode_core::config::{Backend, Config, ModelFormat, RegistryKind, TransferKind};
use pdnode_core::{Role, SamplingParams};
use pdnode_node::{Node, assemble::assemble, pd};
use pdnode_registry::{LiveMembership, MemoryRegistry, Registry, RegistryOptions};
use pdnode_router::grpc_client::CardMembership;
use pdnode_router::{GenEvent, GenRequest, Router, RouterDeps, RouterError};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn all_config(id: &str, colocated: bool) -> Config {
    let mut c = Config::default();
    c.engine.backend = Backend::Mock;
    c.engine.mock.prefill_us_per_token = 1;
    c.engine.mock.decode_us_per_token = 100;
    c.engine.mock.output_len = 6;
    c.engine.num_kv_blocks = 64;
    c.engine.block_size = 4;
    c.model.format = ModelFormat::Dummy;
    c.model.preset = "smollm2-135m".into();
    c.registry.kind = RegistryKind::Memory;
    c.transfer.kind = TransferKind::InProcess;
    c.transfer.lease_ms = 5_000;
    c.node.role = Role::All;
    c.node.cluster = "mixed".into();
    c.node.id = id.into();
    c.node.listen = "127.0.0.1:0".into();
    c.router.http_listen = "127.0.0.1:0".into();
    c.router.grpc_listen = "127.0.0.1:0".into();
    c.engine.colocated = colocated;
    c
}

fn request() -> GenRequest {
    GenRequest {
        prompt_token_ids: (0..17).map(|i| (i * 5 + 1) % 200).collect(),
        sampling: SamplingParams {
            max_tokens: 4,
            ..SamplingParams::default()
        },
        endpoint: "completions",
        routing_key: None,
        slo: Default::default(),
    }
}

/// A router over the registry's view of the cluster, as role "router" builds it.
async fn separate_router(reg: &Arc<dyn Registry>, want: usize) -> Arc<Router> {
    let live = Arc::new(LiveMembership::start(&**reg, "mixed").await.unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while live.snapshot().cards().count() < want {
        assert!(Instant::now() < deadline, "the nodes never showed up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let cfg = all_config("r", false);
    let rm = pd::router_tokenizer(&cfg).unwrap();
    Router::new(RouterDeps {
        config: cfg.router.clone(),
        api_keys: Vec::new(),
        insecure_node_plane: false,
        membership: Arc::new(CardMembership::new(move |r| live.serving(r))),
        tokenizer: rm.tokenizer,
        chat: rm.chat,
        model: rm.model,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_colocated_all_nodes_are_paired_by_another_router() {
    let reg: Arc<dyn Registry> = Arc::new(MemoryRegistry::new(RegistryOptions::default()));

    // An all-in-one node: separate prefill and decode engines, KV moved in process.
    let c = all_config("aio-0", false);
    let aio = Node::start(&c, assemble(&c, reg.clone()).await.unwrap())
        .await
        .unwrap();
    // Its node API answers UNIMPLEMENTED to ReserveKv/Prefill/Decode: it registers as what it
    // serves (a router), so a registry view never offers it as a prefill or decode node.
    assert_eq!(aio.card().role, Role::Router, "{:?}", aio.card());
    assert!(!aio.card().colocated, "{:?}", aio.card());
    let live = LiveMembership::start(&*reg, "mixed").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while live.snapshot().cards().count() < 1 {
        assert!(Instant::now() < deadline, "the node never showed up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for role in [Role::Prefill, Role::Decode, Role::All] {
        assert!(
            live.serving(role).is_empty(),
            "an in-process all node is listed as serving {role}: {:?}",
            live.serving(role)
        );
    }
    assert_eq!(live.snapshot().by_role(Role::Router).count(), 1);

    // Alone in the cluster, another router has no node to use, and says so at once.
    let router = separate_router(&reg, 1).await;
    match router.generate(request()) {
        Err(e @ RouterError::NoNode { .. }) => println!("all-in-one node alone: {e}"),
        Err(e) => panic!("expected NoNode, got {e}"),
        Ok(_) => panic!("a non-colocated all node was admitted as a worker"),
    }

    // A colocated node joins: the router pairs it with itself and serves every request.
    let c = all_config("colo-0", true);
    let colo = Node::start(&c, assemble(&c, reg.clone()).await.unwrap())
        .await
        .unwrap();
    assert!(colo.card().colocated, "{:?}", colo.card());
    let router = separate_router(&reg, 2).await;
    for _ in 0..4 {
        let mut g = router.generate(request()).unwrap();
        let mut n = 0;
        loop {
            let ev = tokio::time::timeout(Duration::from_secs(10), g.events.recv())
                .await
                .expect("an event within 10 s")
                .expect("Done or Error");
            match ev {
                GenEvent::Tokens { token_ids, .. } => n += token_ids.len(),
                GenEvent::Done { .. } => break,
                GenEvent::Error(e) => panic!("request failed: {e}"),
            }
        }
        assert_eq!(n, 4);
    }
    aio.shutdown().await;
    colo.shutdown().await;
}
