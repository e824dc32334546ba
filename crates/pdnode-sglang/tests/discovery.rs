//! SGLang workers discovered through a **real etcd** (started by the testkit on a free port):
//! `keep_registered` (what `pdnode sglang-register` runs) keeps each **mock** worker's card while
//! the worker is healthy; a router with `router.sglang.discover` and no static list follows the
//! cards: workers join, serve, and leave when their registration stops or their health fails.

use pdnode_core::config::{PolicyName, RouterConfig, SglangConfig};
use pdnode_core::{NodeCard, Role};
use pdnode_registry::{EtcdRegistry, LiveMembership, Registry, RegistryOptions};
use pdnode_sglang::SglangRouter;
use pdnode_sglang::discovery::{WorkerSpec, follow, keep_registered};
use pdnode_testkit::EtcdServer;
use pdnode_testkit::sglang_mock::{MockRole, MockWorker, Rendezvous};
use pdnode_testkit::skip_etcd_tests;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const CLUSTER: &str = "sg";

fn probe_rules() -> SglangConfig {
    SglangConfig {
        discover: true,
        health_check_interval_s: 1,
        health_check_timeout_s: 1,
        health_failure_threshold: 1,
        health_success_threshold: 1,
        ..SglangConfig::default()
    }
}

fn spec(w: &MockWorker, id: &str) -> WorkerSpec {
    WorkerSpec {
        id: id.into(),
        cluster: CLUSTER.into(),
        role: match w.role {
            MockRole::Prefill => Role::Prefill,
            MockRole::Decode => Role::Decode,
        },
        url: w.url.clone(),
        bootstrap_port: w.bootstrap_port,
    }
}

async fn health(http: &reqwest::Client, url: &str) -> (u64, u64) {
    let Ok(r) = http.get(format!("{url}/health")).send().await else {
        return (0, 0);
    };
    let v: Value = r.json().await.unwrap_or_default();
    (
        v["usable_prefill_workers"].as_u64().unwrap_or(0),
        v["usable_decode_workers"].as_u64().unwrap_or(0),
    )
}

async fn until_usable(http: &reqwest::Client, url: &str, want: (u64, u64), what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = health(http, url).await;
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: usable (prefill, decode) is {got:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn generate(http: &reqwest::Client, url: &str) -> u16 {
    http.post(format!("{url}/generate"))
        .json(&json!({"text": "hi", "sampling_params": {"max_new_tokens": 3}}))
        .timeout(Duration::from_secs(20))
        .send()
        .await
        .map_or(0, |r| r.status().as_u16())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_join_and_leave_with_their_registry_cards() {
    if skip_etcd_tests() {
        return;
    }
    let etcd = EtcdServer::start().expect("etcd");
    let opts = RegistryOptions {
        lease_ttl: Duration::from_secs(2),
        call_timeout: Duration::from_secs(2),
        max_backoff: Duration::from_millis(500),
    };
    let registry: Arc<dyn Registry> = Arc::new(
        EtcdRegistry::connect(&[etcd.endpoint()], opts)
            .await
            .unwrap(),
    );
    let rv = Arc::new(Rendezvous::default());
    let p0 = MockWorker::start(MockRole::Prefill, Some(9300), rv.clone(), Duration::ZERO).await;
    let d0 = MockWorker::start(MockRole::Decode, None, rv.clone(), Duration::ZERO).await;
    let d1 = MockWorker::start(MockRole::Decode, None, rv.clone(), Duration::ZERO).await;

    // The router: no static workers, discovery only.
    let cfg = RouterConfig {
        prefill_policy: PolicyName::RoundRobin,
        decode_policy: PolicyName::RoundRobin,
        sglang: probe_rules(),
        ..RouterConfig::default()
    };
    let router = SglangRouter::new(&cfg, Vec::new()).unwrap();
    let stop = CancellationToken::new();
    let live = LiveMembership::start(registry.as_ref(), CLUSTER)
        .await
        .unwrap();
    tokio::spawn(follow(router.clone(), live, stop.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(pdnode_sglang::serve(listener, router, stop.clone()));
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    assert_eq!(health(&http, &url).await, (0, 0));
    assert_eq!(generate(&http, &url).await, 503, "no worker registered yet");

    // Each worker registers while healthy.
    let regs: Vec<CancellationToken> = (0..3).map(|_| CancellationToken::new()).collect();
    let mut tasks = Vec::new();
    for (w, id, stop_w) in [
        (&p0, "p0", &regs[0]),
        (&d0, "d0", &regs[1]),
        (&d1, "d1", &regs[2]),
    ] {
        tasks.push(tokio::spawn(keep_registered(
            registry.clone(),
            spec(w, id),
            probe_rules(),
            stop_w.clone(),
        )));
    }
    until_usable(&http, &url, (1, 2), "all three registered").await;
    // The cards say what they are: SGLang workers, which pdnode routers do not take as nodes.
    let snap = registry.list(CLUSTER).await.unwrap();
    let p_card: &NodeCard = snap.cards.iter().find(|c| c.id.as_str() == "p0").unwrap();
    let sg = p_card.sglang.as_ref().unwrap();
    assert_eq!(
        (sg.url.as_str(), sg.bootstrap_port),
        (p0.url.as_str(), Some(9300))
    );
    assert_eq!(p_card.model_id, "mock-model");
    for _ in 0..4 {
        assert_eq!(generate(&http, &url).await, 200);
    }
    use std::sync::atomic::Ordering::SeqCst;
    assert_eq!(
        (d0.requests.load(SeqCst), d1.requests.load(SeqCst)),
        (2, 2),
        "round robin over both discovered decode workers"
    );

    // d1's registration stops (its sidecar exits): the card goes, and so does the worker.
    regs[2].cancel();
    until_usable(&http, &url, (1, 1), "d1 deregistered").await;
    let before = d1.requests.load(SeqCst);
    for _ in 0..3 {
        assert_eq!(generate(&http, &url).await, 200);
    }
    assert_eq!(
        d1.requests.load(SeqCst),
        before,
        "no request to a departed worker"
    );

    // The prefill worker dies: its sidecar sees the failed probe and removes the card.
    p0.kill();
    until_usable(&http, &url, (0, 1), "p0 died").await;
    let snap = registry.list(CLUSTER).await.unwrap();
    assert!(snap.cards.iter().all(|c| c.id.as_str() != "p0"));
    assert_eq!(generate(&http, &url).await, 503);

    for t in &regs {
        t.cancel();
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert!(registry.list(CLUSTER).await.unwrap().cards.is_empty());
    stop.cancel();
    d0.kill();
    d1.kill();
}
