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
    cluster_paced(np, nd, Duration::from_millis(2), tweak).await
}

/// [`cluster`] with decode workers streaming a token every `token_delay`.
async fn cluster_paced(
    np: usize,
    nd: usize,
    token_delay: Duration,
    tweak: impl FnOnce(&mut RouterConfig),
) -> Cluster {
    let rv = Arc::new(Rendezvous::default());
    let mut prefill = Vec::new();
    for i in 0..np {
        let port = Some(9100 + i as u16);
        prefill.push(MockWorker::start(MockRole::Prefill, port, rv.clone(), Duration::ZERO).await);
    }
    let mut decode = Vec::new();
    for _ in 0..nd {
        decode.push(MockWorker::start(MockRole::Decode, None, rv.clone(), token_delay).await);
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

/// A body over `--max-payload-size` is 413, one that stops arriving is 408 at
/// `router.client_send_timeout_s` (its connection closed); neither reaches a worker.
#[tokio::test]
async fn oversized_and_stalled_bodies_are_413_and_408() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c = cluster(1, 1, |cfg| {
        cfg.sglang.max_payload_bytes = 1024;
        cfg.client_send_timeout_s = 1;
    })
    .await;
    let r = c
        .http
        .post(format!("{}/generate", c.url))
        .json(&json!({"text": "x".repeat(2048)}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 413);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("1024"),
        "{v}"
    );
    let addr = c.url.trim_start_matches("http://").to_string();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = "POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                content-length: 100\r\n\r\n{\"text\": ";
    s.write_all(head.as_bytes()).await.unwrap();
    let t0 = Instant::now();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer))
        .await
        .expect("a stalled body was never answered")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "{took:?}"
    );
    assert_eq!(c.prefill[0].requests.load(Ordering::Relaxed), 0);
    let (status, _) = c.post("/generate", json!({"text": "a"})).await;
    assert_eq!(status, 200, "the router still serves");
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

#[tokio::test]
async fn manual_policy_keeps_a_session_on_one_decode_worker() {
    let c = cluster(1, 3, |r| {
        r.decode_policy = pdnode_core::config::PolicyName::Manual;
        r.manual.assignment_mode = pdnode_core::config::AssignmentMode::MinGroup;
    })
    .await;
    let served = |c: &Cluster| -> Vec<u64> {
        c.decode
            .iter()
            .map(|w| w.requests.load(Ordering::SeqCst))
            .collect()
    };
    let body = json!({"text": "hello", "sampling_params": {"max_new_tokens": 2}});
    // Three sessions by header: min_group gives each its own worker, and they stay there.
    for round in 0..4 {
        for s in 0..3 {
            let r = c
                .http
                .post(format!("{}/generate", c.url))
                .header("x-smg-routing-key", format!("session-{s}"))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 200, "round {round} session {s}");
        }
    }
    assert_eq!(served(&c), vec![4, 4, 4]);
    // The body's `rid` is a key too: six requests of one rid land on one worker.
    let before = served(&c);
    for _ in 0..6 {
        let (s, _) = c
            .post(
                "/generate",
                json!({"text": "hi", "rid": "conversation-9", "sampling_params": {"max_new_tokens": 2}}),
            )
            .await;
        assert_eq!(s, 200);
    }
    let delta: Vec<u64> = served(&c).iter().zip(&before).map(|(a, b)| a - b).collect();
    assert!(delta.contains(&6), "{delta:?}");
    // A key past 256 bytes is a clear 400, not a memory grab.
    let r = c
        .http
        .post(format!("{}/generate", c.url))
        .header("x-smg-routing-key", "k".repeat(300))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
}

/// A client that reads the first chunk and then nothing: once the socket buffers are full, the
/// router's write waits `router.client_send_timeout_s` and cuts the stream, closing the decode
/// worker's connection and freeing the router's slot, long before `request_timeout_s`.
#[tokio::test]
async fn a_client_that_stops_reading_is_cut_and_frees_its_slot() {
    let c = cluster_paced(1, 1, Duration::ZERO, |r| {
        r.client_send_timeout_s = 1;
        r.max_inflight_requests = 1;
    })
    .await;
    let gauge = |m: &str, name: &str| -> Option<f64> {
        m.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    // ~200 bytes a token: far more than the loopback socket buffers hold.
    let resp = c
        .http
        .post(format!("{}/v1/completions", c.url))
        .json(&json!({"prompt": "hi", "max_tokens": 2_000_000, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut body = resp.bytes_stream();
    use futures::StreamExt;
    assert!(body.next().await.is_some(), "the first chunk arrives");
    // ... and then the client reads nothing more, holding the connection open.
    let started = Instant::now();
    let deadline = started + Duration::from_secs(20);
    loop {
        let m = c.metrics().await;
        if gauge(&m, "pdnode_sglang_clients_gone_total") == Some(1.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stalled client was never cut:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The slot is free again (max_inflight_requests = 1) while the stalled connection is open.
    let (s, _) = c
        .post(
            "/generate",
            json!({"text": "x", "sampling_params": {"max_new_tokens": 2}}),
        )
        .await;
    assert_eq!(s, 200, "the slot of the stalled stream was not given back");
    let m = c.metrics().await;
    let inflight = m
        .lines()
        .find(|l| {
            l.starts_with("pdnode_sglang_worker_inflight_requests") && l.contains("role=\"decode\"")
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok());
    assert_eq!(inflight, Some(0.0), "{m}");
    drop(body);
}

/// Streaming `/generate` with `return_logprob`: every event carries the prefill worker's input
/// logprobs in front of the decode worker's, as whole answers do.
#[tokio::test]
async fn streamed_generate_merges_the_prefill_input_logprobs_into_each_event() {
    let c = cluster(1, 1, |_| {}).await;
    let (s, body) = c
        .post(
            "/generate",
            json!({"text": "hi", "stream": true, "return_logprob": true,
                   "sampling_params": {"max_new_tokens": 3}}),
        )
        .await;
    assert_eq!(s, 200, "{body}");
    let (evs, done) = events(&body);
    assert!(done, "{body}");
    assert_eq!(evs.len(), 3, "{body}");
    for ev in &evs {
        assert_eq!(
            ev["meta_info"]["input_token_logprobs"],
            json!([[null, 1, null], [-0.5, 2, null], [-0.25, 3, null]]),
            "{ev}"
        );
    }
    // Without return_logprob nothing is added.
    let (_, body) = c
        .post(
            "/generate",
            json!({"text": "hi", "stream": true, "sampling_params": {"max_new_tokens": 2}}),
        )
        .await;
    let (evs, _) = events(&body);
    assert!(
        evs.iter()
            .all(|e| e["meta_info"].get("input_token_logprobs").is_none()),
        "{body}"
    );
}
