//! A router on 127.0.0.1:0 over fake prefill and decode nodes.

#![allow(dead_code)]

use pdnode_core::config::{PolicyName, RouterConfig};
use pdnode_core::{Role, SamplingParams};
use pdnode_router::testing::{FakeNode, FakeTokenizer};
use pdnode_router::{GenRequest, ModelInfo, Router, RouterDeps, StaticMembership};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub struct Harness {
    pub http: SocketAddr,
    pub grpc: SocketAddr,
    pub router: Arc<Router>,
    pub prefill: Vec<Arc<FakeNode>>,
    pub decode: Vec<Arc<FakeNode>>,
    pub membership: Arc<StaticMembership>,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

pub fn config() -> RouterConfig {
    let mut c = RouterConfig {
        prefill_policy: PolicyName::RoundRobin,
        decode_policy: PolicyName::RoundRobin,
        seed: 1,
        request_timeout_s: 30,
        prefill_timeout_s: 5,
        token_timeout_s: 2,
        max_inflight_requests: 64,
        // The pair warm-ups' own calls would show in every test's call counts; the
        // `warm_pairs` tests turn it on.
        warm_pairs: false,
        ..RouterConfig::default()
    };
    c.power_of_two.load_refresh_ms = 100;
    c
}

/// Fake nodes in a static membership and router deps over them.
pub struct Fakes {
    pub prefill: Vec<Arc<FakeNode>>,
    pub decode: Vec<Arc<FakeNode>>,
    pub membership: Arc<StaticMembership>,
    pub deps: RouterDeps,
}

/// `n_prefill` + `n_decode` fake nodes (`p0..`, `d0..`) in a static membership, and router
/// deps over them with [`config`].
pub fn fakes(n_prefill: usize, n_decode: usize) -> Fakes {
    let prefill: Vec<_> = (0..n_prefill)
        .map(|i| FakeNode::new(&format!("p{i}")))
        .collect();
    let decode: Vec<_> = (0..n_decode)
        .map(|i| FakeNode::new(&format!("d{i}")))
        .collect();
    let mut workers: Vec<_> = prefill.iter().map(|n| n.worker(Role::Prefill)).collect();
    workers.extend(decode.iter().map(|n| n.worker(Role::Decode)));
    let membership = Arc::new(StaticMembership::new(workers));
    let deps = RouterDeps {
        config: config(),
        api_keys: Vec::new(),
        insecure_node_plane: false,
        membership: membership.clone(),
        tokenizer: Arc::new(FakeTokenizer),
        chat: Arc::new(FakeTokenizer),
        model: ModelInfo {
            served_name: "fake-model".into(),
            context_length: 256,
            simulated: None,
        },
    };
    Fakes {
        prefill,
        decode,
        membership,
        deps,
    }
}

/// A 40-token prompt (3 blocks of 16) asking for 20 tokens.
pub fn request_40_tokens() -> GenRequest {
    GenRequest {
        prompt_token_ids: vec![b'x'.into(); 40],
        sampling: SamplingParams {
            max_tokens: 20,
            ..SamplingParams::default()
        },
        endpoint: "completions",
        routing_key: None,
        slo: Default::default(),
    }
}

impl Harness {
    pub async fn start(n_prefill: usize, n_decode: usize) -> Self {
        Self::start_with(n_prefill, n_decode, |_| {}).await
    }

    pub async fn start_with(
        n_prefill: usize,
        n_decode: usize,
        tweak: impl FnOnce(&mut RouterDeps),
    ) -> Self {
        let Fakes {
            prefill,
            decode,
            membership,
            mut deps,
        } = fakes(n_prefill, n_decode);
        tweak(&mut deps);
        let router = Router::new(deps);
        let http_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = http_l.local_addr().unwrap();
        let grpc = grpc_l.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = {
            let router = router.clone();
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                pdnode_router::server::serve(router, http_l, Some(grpc_l), shutdown)
                    .await
                    .unwrap();
            })
        };
        Harness {
            http,
            grpc,
            router,
            prefill,
            decode,
            membership,
            shutdown,
            task,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.http, path)
    }

    /// Cancels the shutdown token without waiting.
    pub fn begin_shutdown(&self) {
        self.shutdown.cancel();
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("router stops within 10 s")
            .unwrap();
    }
}

/// Splits an SSE body into its `data:` payloads.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|ev| {
            ev.lines()
                .find_map(|l| l.strip_prefix("data:").map(|d| d.trim_start().to_string()))
        })
        .collect()
}

/// POSTs `body` as JSON; the status and the JSON answer (`Null` if none).
pub async fn post(h: &Harness, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    let r = reqwest::Client::new()
        .post(h.url(path))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

/// POSTs `body` as JSON; the status and the SSE `data:` payloads.
pub async fn post_sse(h: &Harness, path: &str, body: serde_json::Value) -> (u16, Vec<String>) {
    let r = reqwest::Client::new()
        .post(h.url(path))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, sse_data(&r.text().await.unwrap()))
}
