//! A node in-process on the memory registry with a test engine: an actor that panics is
//! restarted and the node keeps serving health; past the restart limit the node fails; a
//! graceful shutdown deregisters at once and drains.

use futures::FutureExt;
use futures::future::BoxFuture;
use pdnode_core::Role;
use pdnode_core::card::NodeCapacity;
use pdnode_core::config::{Config, RegistryConfig};
use pdnode_engine::engine::EngineError;
use pdnode_node::{
    EngineDescription, EngineLoad, EngineService, Node, NodeDeps, NodeOptions, RestartLimits,
};
use pdnode_registry::{MemoryRegistry, Registry, RegistryOptions};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

/// A test engine: reports a load, can be told to panic on its next load read, counts
/// in-flight requests the test sets.
#[derive(Default)]
struct TestEngine {
    panics_left: AtomicU32,
    in_flight: AtomicUsize,
    admitting: AtomicBool,
    loads: AtomicU32,
    /// While set, load reads do not come back: a wedged engine thread.
    wedged: AtomicBool,
}

impl EngineService for TestEngine {
    fn describe(&self) -> EngineDescription {
        EngineDescription {
            backend: "test".into(),
            model_id: "test-model".into(),
            model_fingerprint: "fp".into(),
            kv_layout: None,
            tp_size: 1,
        }
    }
    fn load(&self) -> BoxFuture<'_, Result<EngineLoad, EngineError>> {
        async move {
            if self
                .panics_left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                panic!("test engine: injected panic in load()");
            }
            while self.wedged.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let n = self.loads.fetch_add(1, Ordering::SeqCst);
            Ok(EngineLoad {
                capacity: NodeCapacity {
                    max_running_requests: 8,
                    running_requests: self.in_flight.load(Ordering::SeqCst) as u32,
                    kv_blocks_total: 100,
                    kv_blocks_free: 100 - (n % 2) as u64,
                    queued_requests: 0,
                },
                accounting: None,
            })
        }
        .boxed()
    }
    fn stop_admitting(&self) {
        self.admitting.store(false, Ordering::SeqCst);
    }
    fn in_flight(&self) -> BoxFuture<'_, Result<usize, EngineError>> {
        let n = self.in_flight.load(Ordering::SeqCst);
        async move { Ok(n) }.boxed()
    }
    fn shutdown(&self, _timeout: Duration) -> BoxFuture<'_, bool> {
        async { true }.boxed()
    }
}

fn config() -> Config {
    let mut c = Config::default();
    c.node.role = Role::All;
    c.node.cluster = "sup".into();
    c.node.id = "all-0".into();
    c.node.listen = "127.0.0.1:0".into();
    c.node.http_listen = "127.0.0.1:0".into();
    c.node.drain_timeout_s = 2;
    c.registry = RegistryConfig {
        lease_ttl_s: 2,
        ..Default::default()
    };
    c
}

fn options(max_restarts: usize) -> NodeOptions {
    NodeOptions {
        limits: RestartLimits {
            max_restarts,
            window: Duration::from_secs(60),
        },
        load_refresh: Duration::from_millis(50),
        card_refresh: Duration::from_millis(50),
        call_timeout: Duration::from_secs(1),
        engine_stall: Duration::from_secs(5),
    }
}

async fn wait_until<F, Fut>(what: &str, deadline: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    pdnode_testkit::wait_for_async(what, deadline, &mut f)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

/// The body of `GET /metrics` on the node's HTTP listener (HTTP/1.0: the server closes).
async fn get_metrics(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let read = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: node\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("/metrics answered")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_actor_is_restarted_and_health_keeps_serving() {
    let reg = Arc::new(MemoryRegistry::new(RegistryOptions::default()));
    let engine = Arc::new(TestEngine::default());
    let node = Node::start(
        &config(),
        NodeDeps {
            pd: None,
            ucx_worker: None,
            router: None,
            registry: reg.clone(),
            engine: Some(engine.clone()),
            options: options(5),
        },
    )
    .await
    .unwrap();
    let sup = node.supervisor().clone();
    wait_until("serving", Duration::from_secs(5), || async {
        sup.health().await.serving
    })
    .await;
    let before = sup.engine().await.unwrap().unwrap();

    engine.panics_left.store(1, Ordering::SeqCst);
    wait_until("engine actor restarted", Duration::from_secs(5), || async {
        let h = sup.health().await;
        h.serving && h.restarts == vec![("engine".to_string(), 1)]
    })
    .await;
    let after = sup.engine().await.unwrap().unwrap();
    assert_ne!(
        format!("{before:?}"),
        format!("{after:?}"),
        "a new actor took over"
    );
    // The node's /metrics counts it (what the dashboard's panel and the restart alert read).
    let metrics = get_metrics(node.http_addr().expect("node.http_listen set")).await;
    for line in [
        "pdnode_node_actor_restarts_total{node=\"all-0\",actor=\"engine\"} 1",
        "pdnode_registry_keepalive_failures_total{node=\"all-0\"} 0",
    ] {
        assert!(metrics.contains(line), "{line} missing from:\n{metrics}");
    }
    // The load still flows into the registry after the restart.
    let published = engine.loads.load(Ordering::SeqCst);
    wait_until("load read again", Duration::from_secs(5), || async {
        engine.loads.load(Ordering::SeqCst) > published + 2
    })
    .await;
    let cards = reg.list("sup").await.unwrap().cards;
    assert_eq!(cards.len(), 1);
    assert_eq!(cards[0].capacity.max_running_requests, 8);

    // Graceful shutdown: the key goes at once, the drain waits for in-flight work.
    engine.in_flight.store(1, Ordering::SeqCst);
    let e2 = engine.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        e2.in_flight.store(0, Ordering::SeqCst);
    });
    let report = node.shutdown().await;
    assert!(report.deregistered);
    assert_eq!(report.in_flight_left, 0);
    assert!(report.elapsed_ms >= 250, "{report:?}");
    assert!(!engine.admitting.load(Ordering::SeqCst));
    assert!(reg.list("sup").await.unwrap().cards.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_restart_limit_the_node_fails_with_a_clear_reason() {
    let reg = Arc::new(MemoryRegistry::new(RegistryOptions::default()));
    let engine = Arc::new(TestEngine::default());
    engine.panics_left.store(100, Ordering::SeqCst);
    let node = Node::start(
        &config(),
        NodeDeps {
            pd: None,
            ucx_worker: None,
            router: None,
            registry: reg.clone(),
            engine: Some(engine.clone()),
            options: options(3),
        },
    )
    .await
    .unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(10), node.wait_failed())
        .await
        .expect("the node gives up");
    assert!(
        reason.contains("engine") && reason.contains("3 times"),
        "{reason}"
    );
    let h = node.supervisor().health().await;
    assert!(!h.serving);
    let report = node.shutdown().await;
    assert!(report.deregistered);
    assert!(reg.list("sup").await.unwrap().cards.is_empty());
}

/// A wedged engine thread (its load reads stop coming back) is not hidden behind the last
/// published load: `Stats` answers UNAVAILABLE and `Health` NOT_SERVING within
/// `engine_stall` (plus a refresh), and both recover when the engine does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_engine_makes_stats_unavailable_and_health_not_serving() {
    use pdnode_proto::v1;
    let reg = Arc::new(MemoryRegistry::new(RegistryOptions::default()));
    let engine = Arc::new(TestEngine::default());
    let mut opts = options(5);
    opts.engine_stall = Duration::from_millis(300);
    let node = Node::start(
        &config(),
        NodeDeps {
            pd: None,
            ucx_worker: None,
            router: None,
            registry: reg.clone(),
            engine: Some(engine.clone()),
            options: opts,
        },
    )
    .await
    .unwrap();
    let url = format!("http://{}", node.grpc_addr());
    let client = v1::node_client::NodeClient::connect(url).await.unwrap();
    let stats_code = || {
        let mut c = client.clone();
        async move {
            match tokio::time::timeout(Duration::from_secs(2), c.stats(v1::StatsRequest {})).await {
                Ok(Ok(_)) => Some(tonic::Code::Ok),
                Ok(Err(s)) => Some(s.code()),
                Err(_) => None,
            }
        }
    };
    let serving = || {
        let mut c = client.clone();
        async move {
            match tokio::time::timeout(Duration::from_secs(3), c.health(v1::HealthRequest {})).await
            {
                Ok(Ok(h)) => h.into_inner().status == v1::ServingStatus::Serving as i32,
                _ => false,
            }
        }
    };
    wait_until(
        "engine reported, Stats answers",
        Duration::from_secs(5),
        || async { stats_code().await == Some(tonic::Code::Ok) && node_reported(&engine) },
    )
    .await;
    assert!(serving().await);

    engine.wedged.store(true, Ordering::SeqCst);
    wait_until("Stats UNAVAILABLE", Duration::from_secs(5), || async {
        stats_code().await == Some(tonic::Code::Unavailable)
    })
    .await;
    assert!(
        !serving().await,
        "health still SERVING with a wedged engine"
    );

    engine.wedged.store(false, Ordering::SeqCst);
    wait_until("Stats answers again", Duration::from_secs(5), || async {
        stats_code().await == Some(tonic::Code::Ok)
    })
    .await;
    wait_until("health SERVING again", Duration::from_secs(5), || async {
        serving().await
    })
    .await;
    node.shutdown().await;
}

fn node_reported(e: &TestEngine) -> bool {
    e.loads.load(Ordering::SeqCst) > 0
}
