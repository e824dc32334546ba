//! The SGLang router end to end over **mock** SGLang workers (`pdnode_testkit::sglang_mock`) on
//! loopback: every request kind, the bootstrap fields as the decode mock checks them, and the
//! faults (a killed decode, a hung prefill, malformed answers, HTTP 500) with the breaker
//! blaming only the worker that failed.

use pdnode_core::config::{RouterConfig, SglangDecodeWorker, SglangPrefillWorker};
use pdnode_sglang::SglangRouter;
use pdnode_testkit::sglang_mock::{Fault, MockRole, MockWorker, Rendezvous};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

struct Cluster {
    prefill: Vec<Arc<MockWorker>>,
    decode: Vec<Arc<MockWorker>>,
    url: String,
    stop: CancellationToken,
    http: reqwest::Client,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop.cancel();
        for w in self.prefill.iter().chain(&self.decode) {
            w.kill();
        }
    }
}

async fn cluster(np: usize, nd: usize, tweak: impl FnOnce(&mut RouterConfig)) -> Cluster {
    let rv = Arc::new(Rendezvous::default());
    let mut prefill = Vec::new();
    for i in 0..np {
        let port = Some(9100 + i as u16);
        prefill.push(MockWorker::start(MockRole::Prefill, port, rv.clone(), Duration::ZERO).await);
    }
    let mut decode = Vec::new();
    for _ in 0..nd {
        decode.push(
            MockWorker::start(MockRole::Decode, None, rv.clone(), Duration::from_millis(2)).await,
        );
    }
    let mut cfg = RouterConfig {
        prefill_policy: pdnode_core::config::PolicyName::RoundRobin,
        decode_policy: pdnode_core::config::PolicyName::RoundRobin,
        ..RouterConfig::default()
    };
    cfg.sglang.prefill = prefill
        .iter()
        .map(|w| SglangPrefillWorker {
            url: w.url.clone(),
            bootstrap_port: w.bootstrap_port,
        })
        .collect();
    cfg.sglang.decode = decode
        .iter()
        .map(|w| SglangDecodeWorker { url: w.url.clone() })
        .collect();
    tweak(&mut cfg);
    let router = SglangRouter::new(&cfg, Vec::new()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(pdnode_sglang::serve(listener, router, stop.clone()));
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    // Ready once every worker passed its first probe.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(r) = http.get(format!("{url}/health")).send().await {
            let v: Value = r.json().await.unwrap();
            if v["usable_prefill_workers"] == np && v["usable_decode_workers"] == nd {
                break;
            }
        }
        assert!(Instant::now() < deadline, "workers never became usable");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Cluster {
        prefill,
        decode,
        url,
        stop,
        http,
    }
}

impl Cluster {
    async fn post(&self, path: &str, body: Value) -> (u16, String) {
        let r = self
            .http
            .post(format!("{}{path}", self.url))
            .header("x-request-id", "req-7")
            .header(
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )
            .header("authorization", "Bearer client-key")
            .json(&body)
            .timeout(Duration::from_secs(20))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.text().await.unwrap_or_default())
    }

    async fn metrics(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

/// The JSON events of an SSE body, and whether it ended with `[DONE]`.
fn events(body: &str) -> (Vec<Value>, bool) {
    let mut out = Vec::new();
    let mut done = false;
    for line in body.lines() {
        if let Some(p) = line.strip_prefix("data: ") {
            if p == "[DONE]" {
                done = true;
            } else {
                out.push(serde_json::from_str(p).unwrap_or_else(|e| panic!("{p}: {e}")));
            }
        }
    }
    (out, done)
}

#[tokio::test]
async fn every_request_kind_reaches_a_pair_with_the_right_bootstrap() {
    let c = cluster(2, 2, |_| {}).await;
    let cases = [
        (
            "/generate",
            json!({"text": "Hello", "sampling_params": {"max_new_tokens": 4}}),
        ),
        (
            "/v1/completions",
            json!({"model": "m", "prompt": "Hello", "max_tokens": 4}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi"}]}),
        ),
    ];
    for (path, body) in cases {
        for stream in [false, true] {
            let mut b = body.clone();
            b["stream"] = json!(stream);
            let (status, text) = c.post(path, b).await;
            assert_eq!(status, 200, "{path} stream={stream}: {text}");
            let seen = if stream {
                let (evs, done) = events(&text);
                assert!(done, "{path}: no [DONE]");
                assert_eq!(evs.len(), 4, "{path}: {text}");
                evs[0]["mock_seen"].clone()
            } else {
                let v: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(v["text"], "t0 t1 t2 t3 ");
                v["meta_info"]["mock_seen"].clone()
            };
            assert_eq!(seen["bootstrap_host"], "127.0.0.1");
            let port = seen["bootstrap_port"].as_u64().unwrap();
            assert!(port == 9100 || port == 9101, "{seen}");
            assert!(seen["bootstrap_room"].as_u64().unwrap() < 1 << 63);
            assert_eq!(seen["headers"]["x_request_id"], "req-7");
            assert_eq!(seen["headers"]["authorization"], "Bearer client-key");
            assert!(
                seen["headers"]["traceparent"]
                    .as_str()
                    .unwrap()
                    .starts_with("00-")
            );
        }
    }
    // Round robin spread the twelve requests over both prefill and both decode workers.
    for w in c.prefill.iter().chain(&c.decode) {
        assert!(
            w.requests.load(Ordering::Relaxed) >= 1,
            "{} got nothing",
            w.url
        );
    }
}

#[tokio::test]
async fn batches_carry_one_bootstrap_entry_per_sequence() {
    let c = cluster(1, 1, |_| {}).await;
    let (status, text) = c
        .post(
            "/generate",
            json!({"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 2}}),
        )
        .await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    let rooms = v["meta_info"]["mock_seen"]["bootstrap_room"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(rooms.len(), 3);
    assert_eq!(
        v["meta_info"]["mock_seen"]["bootstrap_host"],
        json!(["127.0.0.1", "127.0.0.1", "127.0.0.1"])
    );
    let (status, text) = c
        .post(
            "/v1/completions",
            json!({"prompt": "a", "n": 2, "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, 200, "{text}");
}

#[tokio::test]
async fn generate_merges_the_prefill_input_logprobs_first() {
    let c = cluster(1, 1, |_| {}).await;
    let (status, text) = c
        .post("/generate", json!({"text": "a", "return_logprob": true}))
        .await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        v["meta_info"]["input_token_logprobs"],
        json!([[null, 1, null], [-0.5, 2, null], [-0.25, 3, null]])
    );
}

#[tokio::test]
async fn a_decode_killed_mid_stream_ends_with_an_error_event_and_done() {
    let c = cluster(1, 1, |_| {}).await;
    let decode = c.decode[0].clone();
    let killer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(30)).await;
        decode.kill();
    });
    let t0 = Instant::now();
    let (status, text) = c
        .post(
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 1000, "stream": true}),
        )
        .await;
    killer.await.unwrap();
    assert_eq!(status, 200);
    let (evs, done) = events(&text);
    assert!(done, "the client got [DONE]: {text}");
    let last = evs.last().unwrap();
    assert_eq!(last["error"]["code"], 502, "{last}");
    assert!(evs.len() > 1, "tokens came before the break");
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn a_stream_dropped_without_done_or_with_a_bad_line_is_terminated_cleanly() {
    let c = cluster(1, 1, |_| {}).await;
    c.decode[0].set_fault(Fault::DropMidStream(2));
    let (status, text) = c
        .post(
            "/v1/chat/completions",
            json!({"messages": [], "max_tokens": 8, "stream": true}),
        )
        .await;
    assert_eq!(status, 200);
    let (evs, done) = events(&text);
    assert!(done);
    // Tokens the mock wrote before it dropped the connection may be lost with it.
    assert!(
        (2..=3).contains(&evs.len()),
        "tokens, then the error: {text}"
    );
    assert!(evs[0]["error"].is_null());
    let last = evs.last().unwrap();
    assert!(
        last["error"]["message"].as_str().unwrap().contains("broke"),
        "{text}"
    );

    c.decode[0].set_fault(Fault::Malformed);
    let (status, text) = c
        .post("/generate", json!({"text": "a", "stream": true}))
        .await;
    assert_eq!(status, 200);
    let (evs, done) = events(&text); // panics on a line that is not JSON
    assert!(done);
    assert!(
        evs.last().unwrap()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not JSON")
    );
}

#[tokio::test]
async fn malformed_answers_are_502_and_count_against_that_worker_only() {
    let c = cluster(1, 1, |_| {}).await;
    c.decode[0].set_fault(Fault::Malformed);
    let (status, text) = c.post("/generate", json!({"text": "a"})).await;
    assert_eq!(status, 502, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("not JSON"));
    let m = c.metrics().await;
    let decode_url = &c.decode[0].url;
    let line = format!(
        "pdnode_sglang_worker_failures_total{{worker=\"{decode_url}\",cause=\"malformed\"}} 1"
    );
    assert!(m.contains(&line), "{m}");
    assert!(
        !m.contains(&format!("worker=\"{}\",cause", c.prefill[0].url)),
        "{m}"
    );
}

#[tokio::test]
async fn decode_failures_open_the_decode_breaker_not_the_prefill_one() {
    let c = cluster(1, 2, |cfg| {
        cfg.sglang.breaker_failure_threshold = 1;
        cfg.sglang.max_retries = 1;
    })
    .await;
    c.decode[0].set_fault(Fault::Http500);
    // Round robin sends the first to decode 0 (500), the retry to decode 1: 200.
    for _ in 0..3 {
        let (status, text) = c.post("/generate", json!({"text": "a"})).await;
        assert_eq!(status, 200, "{text}");
    }
    let h: Value = c
        .http
        .get(format!("{}/health", c.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for w in h["workers"].as_array().unwrap() {
        let open = w["open_breakers"].as_array().unwrap();
        if w["url"] == c.decode[0].url.as_str() {
            assert_eq!(open, &vec![json!("server_error")], "{h}");
        } else {
            assert!(open.is_empty(), "{w} blamed: {h}");
        }
    }
    assert_eq!(h["status"], "ok", "the prefill worker stays usable: {h}");
    assert!(c.metrics().await.contains("pdnode_sglang_retries_total 1"));
}

#[tokio::test]
async fn a_hung_prefill_times_out_and_the_retry_uses_the_other_prefill() {
    let c = cluster(2, 1, |cfg| {
        cfg.prefill_timeout_s = 1;
        cfg.sglang.max_retries = 1;
    })
    .await;
    c.prefill[0].set_fault(Fault::Hang);
    let t0 = Instant::now();
    let (status, text) = c.post("/generate", json!({"text": "a"})).await;
    assert_eq!(status, 200, "{text}");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    // With no retry left, a hung prefill is a clean 504 after its deadline.
    let c = cluster(1, 1, |cfg| {
        cfg.prefill_timeout_s = 1;
        cfg.sglang.max_retries = 0;
    })
    .await;
    c.prefill[0].set_fault(Fault::Hang);
    let t0 = Instant::now();
    let (status, text) = c
        .post("/v1/completions", json!({"prompt": "a", "stream": true}))
        .await;
    assert_eq!(status, 504, "{text}");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("prefill"),
        "{v}"
    );
}

#[tokio::test]
async fn worker_client_errors_pass_through_and_bad_bodies_are_400() {
    let c = cluster(1, 1, |_| {}).await;
    let r = c
        .http
        .post(format!("{}/generate", c.url))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not valid JSON")
    );
    assert_eq!(
        c.prefill[0].requests.load(Ordering::Relaxed),
        0,
        "nothing forwarded"
    );
    // A batch of three with n's arrays missing is the worker's 400 (the mock checks shapes);
    // here: a body the prefill mock refuses is passed on as it is.
    let (status, text) = c
        .post("/generate", json!({"text": "a", "bootstrap_room": "x"}))
        .await;
    assert_eq!(
        status, 200,
        "the router's own bootstrap fields replace the client's: {text}"
    );
}

#[tokio::test]
async fn no_usable_worker_is_503_and_health_says_so() {
    let c = cluster(1, 1, |cfg| {
        cfg.sglang.health_check_interval_s = 1;
        cfg.sglang.health_check_timeout_s = 1;
        cfg.sglang.health_failure_threshold = 1;
    })
    .await;
    c.decode[0].kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = c
            .http
            .get(format!("{}/health", c.url))
            .send()
            .await
            .unwrap();
        if r.status().as_u16() == 503 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "health never noticed the dead decode worker"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, text) = c.post("/generate", json!({"text": "a"})).await;
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("decode"), "{text}");
}

#[tokio::test]
async fn models_and_info_come_from_the_workers() {
    let c = cluster(1, 1, |_| {}).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let v: Value = c
            .http
            .get(format!("{}/v1/models", c.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if v["data"][0]["id"] == "mock-model" {
            break;
        }
        assert!(Instant::now() < deadline, "{v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for path in [
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
    ] {
        let r = c.http.get(format!("{}{path}", c.url)).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "{path}");
    }
}

#[tokio::test]
async fn requests_past_max_inflight_are_429_while_a_stream_runs() {
    let c = cluster(1, 1, |cfg| cfg.max_inflight_requests = 1).await;
    c.decode[0].set_fault(Fault::None);
    let r = c
        .http
        .post(format!("{}/v1/completions", c.url))
        .json(&json!({"prompt": "a", "max_tokens": 400, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // The stream is still running (400 tokens at 2 ms): a second request is refused.
    let (status, text) = c.post("/generate", json!({"text": "a"})).await;
    assert_eq!(status, 429, "{text}");
    let body = r.text().await.unwrap();
    assert!(events(&body).1);
    let (status, _) = c.post("/generate", json!({"text": "a"})).await;
    assert_eq!(status, 200, "the slot came back when the stream ended");
}
