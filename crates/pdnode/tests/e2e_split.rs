//! End to end, separate processes: etcd (testkit) + `pdnode start` router, prefill and decode,
//! built from configs/cpu-{router,prefill,decode}.toml with `--set` overrides (etcd endpoint,
//! free loopback ports, a cluster name per test), KV over UCX on loopback.
//!
//! - SmolLM2 on the CPU: greedy outputs token-identical to the all-in-one node, then the official
//!   `openai` Python client (examples/openai_client.py --check) against the router.
//! - Simulated engine: the decode node is SIGKILLed mid-stream; the client gets an error event
//!   and the end of the stream within seconds, the prefill node holds no KV blocks afterwards,
//!   and the router answers 503 once the decode node is gone.

use crate::e2e_support;

use e2e_support::{Node, dump, free_addr, greedy_completion, model_present, read_sse};
use pdnode_proto::v1::{StatsRequest, node_client::NodeClient};
use pdnode_testkit::{ChildGuard, EtcdServer, skip_etcd_tests, wait_for_async};
use serde_json::json;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const READY: Duration = Duration::from_secs(120);

/// The three processes of a disaggregated run, and their addresses.
pub(crate) struct Split {
    pub(crate) router: Node,
    pub(crate) prefill: Node,
    pub(crate) decode: Node,
    pub(crate) http: String,
    prefill_grpc: String,
}

impl Split {
    pub(crate) fn nodes(&self) -> [&Node; 3] {
        [&self.router, &self.prefill, &self.decode]
    }
}

/// Starts router, prefill and decode from configs/cpu-*.toml against `etcd` in cluster
/// `cluster`; `engine` are extra `--set`s for the prefill and decode nodes, `router_extra` for
/// the router.
pub(crate) fn start_split(
    dir: &Path,
    etcd: &str,
    cluster: &str,
    engine: &[String],
    decode_extra: &[String],
    router_extra: &[String],
) -> Split {
    let common = |role: &str, listen: &str| {
        vec![
            format!("registry.endpoints=[\"{etcd}\"]"),
            format!("node.cluster=\"{cluster}\""),
            format!("node.id=\"{cluster}-{role}\""),
            format!("node.listen=\"{listen}\""),
            "registry.lease_ttl_s=3".to_string(),
        ]
    };
    let http = free_addr();
    let mut r = common("router", &free_addr());
    r.push(format!("router.http_listen=\"{http}\""));
    r.push(format!("router.grpc_listen=\"{}\"", free_addr()));
    r.extend(router_extra.iter().cloned());
    let prefill_grpc = free_addr();
    let mut p = common("prefill", &prefill_grpc);
    p.push(format!("node.http_listen=\"{}\"", free_addr()));
    p.extend(engine.iter().cloned());
    let mut d = common("decode", &free_addr());
    d.push(format!("node.http_listen=\"{}\"", free_addr()));
    d.extend(engine.iter().cloned());
    d.extend(decode_extra.iter().cloned());
    Split {
        prefill: Node::start(dir, "prefill", "configs/cpu-prefill.toml", &p),
        decode: Node::start(dir, "decode", "configs/cpu-decode.toml", &d),
        router: Node::start(dir, "router", "configs/cpu-router.toml", &r),
        http,
        prefill_grpc,
    }
}

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
];
const MAX_TOKENS: u32 = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_processes_match_all_in_one_and_serve_the_openai_client() {
    if skip_etcd_tests() || !model_present("split_processes_match_all_in_one") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start().expect("etcd");
    // Two engines share two cores with the all-in-one node: one thread each.
    let cpu = vec!["engine.cpu_threads=1".to_string()];
    let split = start_split(dir.path(), &etcd.endpoint(), "e2e-split", &cpu, &[], &[]);
    let local_http = free_addr();
    let local = Node::start(
        dir.path(),
        "local",
        "configs/local.toml",
        &[
            format!("router.http_listen=\"{local_http}\""),
            "router.grpc_listen=\"\"".to_string(),
            "engine.cpu_threads=1".to_string(),
        ],
    );
    e2e_support::wait_healthy(&split.http, READY, &split.nodes()).await;
    e2e_support::wait_healthy(&local_http, READY, &[&local]).await;

    let mut wants = Vec::new();
    for prompt in PROMPTS {
        let (lt, lc, lp) = greedy_completion(&local_http, prompt, MAX_TOKENS).await;
        let (st, sc, sp) = greedy_completion(&split.http, prompt, MAX_TOKENS).await;
        assert_eq!(
            (&st, sc, sp),
            (&lt, lc, lp),
            "split vs all-in-one for {prompt:?}{}",
            dump(&split.nodes())
        );
        assert!(lc >= 1, "{prompt:?}: no tokens");
        eprintln!("{prompt:?} -> {st:?} ({sc} tokens) on both");
        wants.push((lt, lc, lp));
    }
    drop(local);

    // Conditional disaggregation (router.local_prefill): a second router of the cluster has
    // every one of these prompts prefilled on the decode node itself, over node gRPC; the
    // tokens are the same and no KV is handed off.
    let here_http = free_addr();
    let here = Node::start(
        dir.path(),
        "router-here",
        "configs/cpu-router.toml",
        &[
            format!("registry.endpoints=[\"{}\"]", etcd.endpoint()),
            "node.cluster=\"e2e-split\"".to_string(),
            "node.id=\"e2e-split-router-here\"".to_string(),
            format!("node.listen=\"{}\"", free_addr()),
            "registry.lease_ttl_s=3".to_string(),
            format!("router.http_listen=\"{here_http}\""),
            "router.grpc_listen=\"\"".to_string(),
            "router.warm_pairs=false".to_string(),
            "router.local_prefill.max_prompt_tokens=4096".to_string(),
        ],
    );
    e2e_support::wait_healthy(&here_http, READY, &[&here]).await;
    for (prompt, want) in PROMPTS.iter().zip(&wants) {
        let got = greedy_completion(&here_http, prompt, MAX_TOKENS).await;
        assert_eq!(
            &got,
            want,
            "prefilled on the decode node vs all-in-one for {prompt:?}{}",
            dump(&[&here, &split.prefill, &split.decode])
        );
    }
    let series = "pdnode_router_local_prefills_total{reason=\"short\"}";
    assert_eq!(
        e2e_support::metric(&here_http, series).await,
        Some(PROMPTS.len() as f64),
        "{series}"
    );
    let handoffs = "pdnode_transfer_handoffs_total{node=\"e2e-split-prefill\",outcome=\"ok\"}";
    // The first router's hand-offs show under that series; the second router's, none.
    assert!(
        e2e_support::metric(&split.http, handoffs).await >= Some(PROMPTS.len() as f64),
        "{handoffs} on the first router"
    );
    assert_eq!(
        e2e_support::metric(&here_http, handoffs).await,
        None,
        "no hand-off through the second router"
    );
    drop(here);

    // The official openai Python client, through the router.
    if !openai_python_available() {
        return;
    }
    let script = e2e_support::repo_root().join("examples/openai_client.py");
    let log = dir.path().join("openai_client.log");
    let f = std::fs::File::create(&log).unwrap();
    let child = Command::new("python3")
        .arg(&script)
        .arg("--base-url")
        .arg(format!("http://{}/v1", split.http))
        .args(["--max-tokens", "6", "--check"])
        .stdin(Stdio::null())
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .spawn()
        .expect("python3");
    let mut py = ChildGuard::new("openai_client.py", child);
    let status = tokio::task::spawn_blocking(move || {
        let s = py.wait_timeout(Duration::from_secs(120));
        (s, py)
    })
    .await
    .unwrap();
    let out = std::fs::read_to_string(&log).unwrap_or_default();
    let st = status.0.unwrap().unwrap_or_else(|| {
        panic!(
            "openai_client.py ran past 120 s:\n{out}{}",
            dump(&split.nodes())
        )
    });
    assert!(
        st.success(),
        "openai_client.py --check failed ({st}):\n{out}"
    );
    for want in [
        "completion:",
        "completion stream:",
        "chat:",
        "chat stream:",
        "n=2 refused",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
}

/// Whether `import openai` works, installing it with pip once if not. Unavailable: SKIPPED, or
/// a failure when `CI` is set.
fn openai_python_available() -> bool {
    let import = || {
        Command::new("python3")
            .args(["-c", "import openai"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if import() {
        return true;
    }
    let pip = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "openai"])
        .status();
    if pip.is_ok_and(|s| s.success()) && import() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "the openai Python package is missing and `pip install openai` failed (CI is set)"
    );
    eprintln!("SKIPPED openai client check: `pip install openai` failed");
    false
}

async fn prefill_stats(addr: &str) -> Option<pdnode_proto::v1::StatsResponse> {
    let mut c = NodeClient::connect(format!("http://{addr}")).await.ok()?;
    let r = tokio::time::timeout(Duration::from_secs(2), c.stats(StatsRequest {}))
        .await
        .ok()?
        .ok()?;
    Some(r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_killed_mid_stream_gives_a_clean_error_and_no_leaked_prefill_blocks() {
    if skip_etcd_tests() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start().expect("etcd");
    let mock: Vec<String> = [
        "engine.backend=\"mock\"",
        "model.format=\"dummy\"",
        "model.preset=\"smollm2-135m\"",
        "model.path=\"\"",
        // Every block the prefill node holds must come back: no prefix cache keeps any.
        "engine.prefix_cache=false",
    ]
    .map(String::from)
    .to_vec();
    // 50 ms per output token, 200 tokens: a 10 s stream.
    let decode_extra = [
        "engine.mock.decode_us_per_token=50000",
        "engine.mock.output_len=200",
    ]
    .map(String::from);
    let router_extra = mock[..4].to_vec();
    let split = start_split(
        dir.path(),
        &etcd.endpoint(),
        "e2e-kill",
        &mock,
        &decode_extra,
        &router_extra,
    );
    e2e_support::wait_healthy(&split.http, READY, &split.nodes()).await;

    let before = prefill_stats(&split.prefill_grpc)
        .await
        .expect("prefill Stats");
    assert!(before.kv_blocks_total > 0, "{before:?}");
    assert_eq!(before.kv_blocks_free, before.kv_blocks_total, "{before:?}");

    let resp = e2e_support::client()
        .post(format!("http://{}/v1/completions", split.http))
        .json(
            &json!({"prompt": "a prompt that spans more than one KV block of sixteen tokens, \
                       so the prefill node holds several blocks for this request",
                      "max_tokens": 200, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut resp = resp;
    // Read until a few tokens have arrived (the stream is live and decoding).
    let mut head = String::new();
    let t0 = Instant::now();
    while head.matches("data:").count() < 3 {
        assert!(t0.elapsed() < Duration::from_secs(30), "no tokens: {head}");
        match tokio::time::timeout(Duration::from_secs(30), resp.chunk()).await {
            Ok(Ok(Some(b))) => head.push_str(&String::from_utf8_lossy(&b)),
            other => panic!(
                "stream ended early ({other:?}): {head}{}",
                dump(&split.nodes())
            ),
        }
    }
    assert!(!head.contains("[DONE]"), "finished before the kill: {head}");

    let killed = Instant::now();
    split
        .decode
        .guard
        .signal("KILL")
        .expect("kill -KILL decode");
    let (events, ended) = read_sse(resp, Duration::from_secs(10)).await;
    let took = killed.elapsed();
    assert!(
        ended,
        "the stream hung after the decode node died: {events:?}"
    );
    assert!(took < Duration::from_secs(5), "error took {took:?}");
    eprintln!("after the kill ({took:?}): {events:?}");
    let err = events
        .iter()
        .find_map(|e| {
            serde_json::from_str::<serde_json::Value>(e)
                .ok()
                .filter(|v| v["error"].is_object())
        })
        .unwrap_or_else(|| {
            panic!(
                "no error event after the kill: {events:?}{}",
                dump(&split.nodes())
            )
        });
    assert!(
        err["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{err}"
    );
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert!(
        !events
            .iter()
            .any(|e| e.contains("\"finish_reason\":\"length\"")),
        "the stream claims it finished normally: {events:?}"
    );

    // The prefill node ends with every block free and nothing running.
    eprintln!("prefill before: {before:?}");
    assert_prefill_drained(&split, before.kv_blocks_total).await;

    // With the decode node gone (lease 3 s), the router says so: 503, OpenAI-style.
    let http = split.http.clone();
    let c = e2e_support::client();
    let r = wait_for_async(
        "router reports no decode node",
        Duration::from_secs(20),
        || {
            let (c, http) = (c.clone(), http.clone());
            async move {
                matches!(c.get(format!("http://{http}/health")).send().await,
                     Ok(r) if r.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE)
            }
        },
    )
    .await;
    if let Err(e) = r {
        panic!("{e}{}", dump(&split.nodes()));
    }
    let (st, v) = e2e_support::post_json(
        &split.http,
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 4}),
    )
    .await;
    assert_eq!(st, 503, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    drop(etcd);
}

/// Waits until the prefill node holds no KV block and runs nothing (its block count unchanged).
async fn assert_prefill_drained(split: &Split, total: u64) {
    let addr = split.prefill_grpc.clone();
    let r = wait_for_async("prefill blocks all free", Duration::from_secs(20), || {
        let addr = addr.clone();
        async move {
            prefill_stats(&addr).await.is_some_and(|s| {
                s.kv_blocks_free == s.kv_blocks_total
                    && s.kv_blocks_total == total
                    && s.running_requests == 0
                    && s.queued_requests == 0
            })
        }
    })
    .await;
    if let Err(e) = r {
        let now = prefill_stats(&split.prefill_grpc).await;
        panic!("{e}: {now:?}{}", dump(&split.nodes()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_killed_while_prefill_holds_blocks_frees_them_and_fails_the_request() {
    if skip_etcd_tests() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start().expect("etcd");
    let mock: Vec<String> = [
        "engine.backend=\"mock\"",
        "model.format=\"dummy\"",
        "model.preset=\"smollm2-135m\"",
        "model.path=\"\"",
        "engine.prefix_cache=false",
    ]
    .map(String::from)
    .to_vec();
    // The mock tokenizer is one token per byte: a 512-token prompt prefilled 32 tokens per step at
    // 10 ms per token is 16 steps of 320 ms (about 5 s) with KV blocks held between steps.
    let mut engine = mock.clone();
    engine.extend(
        [
            "engine.mock.prefill_us_per_token=10000",
            "engine.max_batch_tokens=32",
        ]
        .map(String::from),
    );
    let split = start_split(
        dir.path(),
        &etcd.endpoint(),
        "e2e-kill-prefill",
        &engine,
        &[],
        &mock[..4],
    );
    e2e_support::wait_healthy(&split.http, READY, &split.nodes()).await;
    let before = prefill_stats(&split.prefill_grpc)
        .await
        .expect("prefill Stats");
    assert_eq!(before.kv_blocks_free, before.kv_blocks_total, "{before:?}");

    let http = split.http.clone();
    let request = tokio::spawn(async move {
        let prompt = "0123456789abcdef".repeat(32);
        e2e_support::post_json(
            &http,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 4}),
        )
        .await
    });
    // The prefill node is part-way through the prompt: it holds blocks.
    let addr = split.prefill_grpc.clone();
    let r = wait_for_async("prefill holds KV blocks", Duration::from_secs(10), || {
        let addr = addr.clone();
        async move {
            prefill_stats(&addr)
                .await
                .is_some_and(|s| s.kv_blocks_free < s.kv_blocks_total)
        }
    })
    .await;
    if let Err(e) = r {
        panic!("{e}{}", dump(&split.nodes()));
    }
    let killed = Instant::now();
    split
        .decode
        .guard
        .signal("KILL")
        .expect("kill -KILL decode");
    let (st, v) = tokio::time::timeout(Duration::from_secs(15), request)
        .await
        .unwrap_or_else(|_| panic!("the request hung after the kill{}", dump(&split.nodes())))
        .unwrap();
    let took = killed.elapsed();
    eprintln!("after the kill ({took:?}): {st} {v}");
    assert!(st >= 500, "status {st}: {v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    assert!(v["error"]["type"].is_string(), "{v}");
    assert_prefill_drained(&split, before.kv_blocks_total).await;
    drop(etcd);
}
