//! The OpenAI HTTP frontend against fake nodes: answers, streaming, every error status, aborts
//! on disconnect, prefill retry, decode death.

use crate::common;

use common::{Harness, post, post_sse, sse_data};
use futures::StreamExt;
use pdnode_core::ErrorKind;
use pdnode_router::NodeError;
use pdnode_router::testing::FakeCall;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const OUTPUT: &str = "Hello from the fake node.";

#[tokio::test]
async fn completion_whole_and_limited() {
    let h = Harness::start(1, 1).await;
    let (s, b) = post(
        &h,
        "/v1/completions",
        json!({"model": "fake-model", "prompt": "Say hi", "max_tokens": 100}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["object"], "text_completion");
    assert_eq!(b["choices"][0]["text"], OUTPUT);
    assert_eq!(b["choices"][0]["finish_reason"], "stop");
    assert_eq!(b["usage"]["prompt_tokens"], 6);
    assert_eq!(b["usage"]["completion_tokens"], OUTPUT.len());
    assert_eq!(b["usage"]["total_tokens"], 6 + OUTPUT.len());

    // Token-id prompt, max_tokens cuts the output.
    let (s, b) = post(
        &h,
        "/v1/completions",
        json!({"prompt": [72, 105], "max_tokens": 5}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["choices"][0]["text"], "Hello");
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    assert_eq!(b["usage"]["completion_tokens"], 5);
    assert_eq!(b["usage"]["prompt_tokens"], 2);

    // A stop string: cut before it.
    let (s, b) = post(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 100, "stop": ["fake"]}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["choices"][0]["text"], "Hello from the ");
    assert_eq!(b["choices"][0]["finish_reason"], "stop");
    h.stop().await;
}

#[tokio::test]
async fn completion_streams_and_ends_with_done() {
    let h = Harness::start(1, 1).await;
    let (s, data) = post_sse(
        &h,
        "/v1/completions",
        json!({"prompt": "Say hi", "max_tokens": 100, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"]
                .get(0)
                .and_then(|ch| ch["text"].as_str())
                .map(str::to_string)
        })
        .collect();
    assert_eq!(text, OUTPUT);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], OUTPUT.len());
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    h.stop().await;
}

#[tokio::test]
async fn chat_whole_and_streaming() {
    let h = Harness::start(1, 1).await;
    let msgs =
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
    let (s, b) = post(
        &h,
        "/v1/chat/completions",
        json!({"messages": msgs, "max_completion_tokens": 5}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["object"], "chat.completion");
    assert_eq!(b["choices"][0]["message"]["role"], "assistant");
    assert_eq!(b["choices"][0]["message"]["content"], "Hello");
    // The fake chat template: "system: Be brief.\nuser: Hi\nassistant:".
    assert_eq!(
        b["usage"]["prompt_tokens"],
        "system: Be brief.\nuser: Hi\nassistant:".len()
    );

    let (s, data) = post_sse(
        &h,
        "/v1/chat/completions",
        json!({"messages": msgs, "stream": true}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    let text: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(text, OUTPUT);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    h.stop().await;
}

#[tokio::test]
async fn invalid_requests_get_400_413_and_the_server_keeps_serving() {
    let h = Harness::start(1, 1).await;
    let c = reqwest::Client::new();
    let r = c
        .post(h.url("/v1/completions"))
        .header("content-type", "application/json")
        .body("{\"prompt\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["type"], "invalid_request_error");

    let cases = [
        (json!({"prompt": "x", "frobnicate": true}), "frobnicate"),
        (json!({"prompt": "x", "max_tokens": -3}), "max_tokens"),
        (json!({"prompt": "x", "n": 2}), "n"),
        (json!({"prompt": "x", "temperature": 7000}), "temperature"),
        (json!({"prompt": [1, 99999]}), "prompt"),
    ];
    for (body, param) in cases {
        let (s, b) = post(&h, "/v1/completions", body.clone()).await;
        assert_eq!(s, 400, "{body}: {b}");
        assert_eq!(b["error"]["param"], param, "{body}: {b}");
        assert!(b["error"]["message"].as_str().unwrap().len() > 5);
    }
    let (s, b) = post(
        &h,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}),
    )
    .await;
    assert_eq!((s, b["error"]["param"].clone()), (400, json!("tools")));
    // An unknown model is a 404 `model_not_found`, as OpenAI and vLLM answer it.
    let (s, b) = post(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "model": "other"}),
    )
    .await;
    assert_eq!(s, 404, "{b}");
    assert_eq!(
        (b["error"]["param"].clone(), b["error"]["code"].clone()),
        (json!("model"), json!("model_not_found"))
    );

    // Over the context (256 tokens).
    let (s, b) = post(&h, "/v1/completions", json!({"prompt": "y".repeat(300)})).await;
    assert_eq!(s, 400, "{b}");
    assert_eq!(b["error"]["code"], "context_length_exceeded");
    // It names the completions API's prompt field, as OpenAI does; chat names `messages`.
    assert_eq!(b["error"]["param"], "prompt", "{b}");
    let (s, b) = post(
        &h,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "y".repeat(300)}]}),
    )
    .await;
    assert_eq!(
        (s, b["error"]["code"].clone(), b["error"]["param"].clone()),
        (400, json!("context_length_exceeded"), json!("messages")),
        "{b}"
    );
    let (s, b) = post(
        &h,
        "/v1/completions",
        json!({"prompt": "y".repeat(200), "max_tokens": 100}),
    )
    .await;
    assert_eq!(
        (s, b["error"]["code"].clone()),
        (400, json!("context_length_exceeded"))
    );

    // Over the body limit.
    let big = json!({"prompt": "z".repeat(pdnode_router::http::MAX_BODY_BYTES + 10)});
    let (s, b) = post(&h, "/v1/completions", big).await;
    assert_eq!(s, 413, "{b}");
    assert_eq!(b["error"]["code"], "request_too_large");

    // None of it reached a node, and the server still answers.
    assert_eq!(h.prefill[0].count(|c| matches!(c, FakeCall::Prefill(_))), 0);
    let (s, _) = post(&h, "/v1/completions", json!({"prompt": "ok"})).await;
    assert_eq!(s, 200);
    h.stop().await;
}

/// A client that sends its headers and then trickles (here: stops) its body gets 408 once
/// `router.client_send_timeout_s` has passed, and its connection is closed; nothing reaches a
/// node and the server keeps serving.
#[tokio::test]
async fn a_body_that_never_arrives_gets_408_at_the_client_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let h = Harness::start_with(1, 1, |d| d.config.client_send_timeout_s = 1).await;
    let mut c = tokio::net::TcpStream::connect(h.http).await.unwrap();
    let head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                content-length: 100\r\n\r\n{\"prompt\": ";
    c.write_all(head.as_bytes()).await.unwrap();
    let t0 = Instant::now();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut answer))
        .await
        .expect("the server never answered a stalled body")
        .unwrap();
    let took = t0.elapsed();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "{took:?}"
    );
    assert_eq!(h.prefill[0].count(|c| matches!(c, FakeCall::Prefill(_))), 0);
    let (s, _) = post(&h, "/v1/completions", json!({"prompt": "ok"})).await;
    assert_eq!(s, 200);
    h.stop().await;
}

#[tokio::test]
async fn api_keys_are_required_when_configured() {
    let h = Harness::start_with(1, 1, |d| d.api_keys = vec!["sk-test".into()]).await;
    let c = reqwest::Client::new();
    let body = json!({"prompt": "x", "max_tokens": 2});
    let r = c
        .post(h.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let b: Value = r.json().await.unwrap();
    assert_eq!(b["error"]["type"], "authentication_error");
    let r = c
        .post(h.url("/v1/completions"))
        .bearer_auth("wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = c.get(h.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = c
        .post(h.url("/v1/completions"))
        .bearer_auth("sk-test")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // Health and metrics stay open for probes.
    assert_eq!(
        c.get(h.url("/health"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
        200
    );
    h.stop().await;
}

#[tokio::test]
async fn no_nodes_is_503_and_overload_is_429() {
    let h = Harness::start(1, 0).await;
    let (s, b) = post(&h, "/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(s, 503, "{b}");
    assert!(b["error"]["message"].as_str().unwrap().contains("decode"));
    assert_eq!(
        reqwest::get(h.url("/health"))
            .await
            .unwrap()
            .status()
            .as_u16(),
        503
    );
    h.stop().await;

    let h = Harness::start_with(1, 1, |d| d.config.max_inflight_requests = 1).await;
    h.decode[0].set(|b| b.token_interval = Duration::from_millis(100));
    let c = reqwest::Client::new();
    let held = c
        .post(h.url("/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 20, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(held.status().as_u16(), 200);
    let (s, b) = post(&h, "/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(s, 429, "{b}");
    assert_eq!(b["error"]["type"], "rate_limit_error");
    drop(held);
    h.stop().await;
}

#[tokio::test]
async fn client_disconnect_aborts_on_both_nodes() {
    // Long timeouts and a slow decode: only noticing the disconnect itself can abort in time.
    let h = Harness::start_with(1, 1, |d| d.config.token_timeout_s = 60).await;
    h.decode[0].set(|b| {
        b.token_interval = Duration::from_secs(20);
        b.output = vec![b'a' as u32; 200];
    });
    let r = reqwest::Client::new()
        .post(h.url("/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 200, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let mut body = r.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("data:"));
    drop(body);
    let limit = Duration::from_secs(5);
    let aborted = |calls: &[FakeCall]| calls.iter().any(|c| matches!(c, FakeCall::Abort(_)));
    assert!(
        h.decode[0].wait_for(limit, aborted).await,
        "decode saw no abort: {:?}",
        h.decode[0].calls()
    );
    assert!(
        h.prefill[0].wait_for(limit, aborted).await,
        "prefill saw no abort: {:?}",
        h.prefill[0].calls()
    );
    assert_eq!(h.decode[0].aborts(), h.prefill[0].aborts());
    // The stream stopped: not all 200 tokens were produced.
    h.stop().await;
}

#[tokio::test]
async fn prefill_failure_is_retried_once_on_another_node() {
    let h = Harness::start(2, 1).await;
    let fail = NodeError::new(ErrorKind::Unavailable, "prefill node exploded");
    h.prefill[0].set(|b| b.fail_prefill = Some(fail.clone()));
    let (s, b) = post(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 100}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["choices"][0]["text"], OUTPUT);
    let prefills =
        |n: &pdnode_router::testing::FakeNode| n.count(|c| matches!(c, FakeCall::Prefill(_)));
    assert_eq!((prefills(&h.prefill[0]), prefills(&h.prefill[1])), (1, 1));
    // The failed attempt was aborted on both nodes.
    assert_eq!(h.prefill[0].aborts().len(), 1);
    assert!(h.decode[0].aborts().contains(&h.prefill[0].aborts()[0]));

    // Both fail: one retry, then a clear 503 naming the failure.
    h.prefill[1].set(|b| b.fail_prefill = Some(fail.clone()));
    let (s, b) = post(&h, "/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(s, 503, "{b}");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("prefill node exploded"),
        "{b}"
    );
    assert_eq!(prefills(&h.prefill[0]) + prefills(&h.prefill[1]), 4);
    h.stop().await;
}

#[tokio::test]
async fn decode_death_mid_stream_ends_the_stream_with_an_error_quickly() {
    let h = Harness::start(1, 1).await;
    let dead = NodeError::new(ErrorKind::Unavailable, "decode node lost");
    h.decode[0].set(|b| b.die_after = Some((3, dead.clone())));
    let t0 = Instant::now();
    let (s, data) = post_sse(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 100, "stream": true}),
    )
    .await;
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert_eq!(s, 200);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let err: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("decode node lost"),
        "{err}"
    );
    // Non-streaming: an error status.
    let (s, b) = post(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 100}),
    )
    .await;
    assert_eq!(s, 503, "{b}");
    // A stalled decode (no token within token_timeout_s = 2) fails too, and D is aborted.
    h.decode[0].set(|b| {
        b.die_after = None;
        b.token_interval = Duration::from_secs(60);
    });
    let t0 = Instant::now();
    let (s, b) = post(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 100}),
    )
    .await;
    assert_eq!(s, 504, "{b}");
    assert!(t0.elapsed() < Duration::from_secs(6));
    h.stop().await;
}

#[tokio::test]
async fn models_health_and_metrics() {
    let h = Harness::start(1, 1).await;
    let m: Value = reqwest::get(h.url("/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(m["data"][0]["id"], "fake-model");
    let hl: Value = reqwest::get(h.url("/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(hl["status"], "ok");
    let (s, _) = post(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 3}),
    )
    .await;
    assert_eq!(s, 200);
    let (s, _) = post(&h, "/v1/completions", json!({"prompt": "x", "n": 3})).await;
    assert_eq!(s, 400);
    // Stats are polled every 100 ms: wait for the per-node gauges.
    let deadline = Instant::now() + Duration::from_secs(5);
    let text = loop {
        let t = reqwest::get(h.url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if t.contains("pdnode_kv_blocks_total{node=\"d0\"}") || Instant::now() > deadline {
            break t;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for needle in [
        "pdnode_router_requests_total{endpoint=\"completions\",outcome=\"ok\"} 1",
        "pdnode_router_ttft_seconds_count 1",
        "pdnode_router_e2e_seconds_count 1",
        "pdnode_router_tpot_seconds_count 1",
        "pdnode_router_inflight_requests 0",
        "pdnode_router_output_tokens_total 3",
        "pdnode_kv_blocks_total{node=\"d0\"} 100",
        "pdnode_kv_blocks_in_use{node=\"p0\"} 0",
        "pdnode_engine_queue_depth{node=\"p0\"} 0",
        "pdnode_transfer_bytes_total{direction=\"sent\",node=\"p0\"} 4096",
        "pdnode_transfer_handoffs_total{node=\"p0\",outcome=\"ok\"} 1",
        "pdnode_router_nodes{role=\"decode\"} 1",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    h.stop().await;
}

#[tokio::test]
async fn logprobs_in_both_api_shapes() {
    let h = Harness::start(1, 1).await;
    let (s, b) = post(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 3, "logprobs": 2}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let lp = &b["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"], json!(["H", "e", "l"]));
    assert_eq!(lp["token_logprobs"], json!([-0.25, -0.25, -0.25]));
    assert_eq!(lp["top_logprobs"][0], json!({"H": -0.25, "I": -1.0}));

    let body = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": true, "top_logprobs": 1});
    let (s, b) = post(&h, "/v1/chat/completions", body).await;
    assert_eq!(s, 200, "{b}");
    let content = &b["choices"][0]["logprobs"]["content"];
    assert_eq!(content[0]["token"], "H");
    assert_eq!(content[0]["logprob"], -0.25);
    assert_eq!(content[0]["bytes"], json!([72]));
    assert_eq!(
        content[1]["top_logprobs"],
        json!([{"token": "e", "logprob": -0.25, "bytes": [101]}])
    );
    // Without logprobs the field is null.
    let (_, b) = post(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 2}),
    )
    .await;
    assert_eq!(b["choices"][0]["logprobs"], Value::Null);
    // Streaming chunks carry their tokens' logprobs.
    let (_, data) = post_sse(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 2, "logprobs": 0, "stream": true}),
    )
    .await;
    let c: Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(c["choices"][0]["logprobs"]["tokens"], json!(["H"]));
    h.stop().await;
}

#[tokio::test]
async fn client_gone_during_prefill_aborts_both_nodes() {
    // prefill_timeout_s far above the wait below: only noticing the disconnect can abort in time.
    let h = Harness::start_with(1, 1, |d| d.config.prefill_timeout_s = 60).await;
    h.prefill[0].set(|b| b.prefill_delay = Duration::from_secs(30));
    let c = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let r = c
        .post(h.url("/v1/completions"))
        .json(&json!({"prompt": "x"}))
        .send()
        .await;
    assert!(r.is_err(), "the client timed out before any answer");
    let aborted = |calls: &[FakeCall]| calls.iter().any(|c| matches!(c, FakeCall::Abort(_)));
    let limit = Duration::from_secs(5);
    assert!(
        h.prefill[0].wait_for(limit, aborted).await,
        "{:?}",
        h.prefill[0].calls()
    );
    assert!(
        h.decode[0].wait_for(limit, aborted).await,
        "{:?}",
        h.decode[0].calls()
    );
    assert_eq!(h.decode[0].count(|c| matches!(c, FakeCall::Decode(_))), 0);
    // The router's in-flight count returns to zero.
    let deadline = Instant::now() + limit;
    while h.router.inflight() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(h.router.inflight(), 0);
    h.stop().await;
}

#[tokio::test]
async fn shutdown_drains_in_flight_streams() {
    let h = Harness::start(1, 1).await;
    h.decode[0].set(|b| b.token_interval = Duration::from_millis(20));
    let r = reqwest::Client::new()
        .post(h.url("/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 100, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    h.begin_shutdown();
    // New work is refused once draining is seen (the flag is set right after the token fires).
    let deadline = Instant::now() + Duration::from_secs(5);
    while !h.router.is_draining() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(h.router.is_draining());
    let refused = h.router.generate(pdnode_router::GenRequest {
        prompt_token_ids: vec![1, 2],
        sampling: pdnode_core::SamplingParams::default(),
        endpoint: "test",
        routing_key: None,
        slo: Default::default(),
    });
    assert!(matches!(refused, Err(pdnode_router::RouterError::Draining)));
    // The open stream still runs to its end.
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let text: String = data[..data.len() - 1]
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, OUTPUT);
    h.stop().await;
}

#[tokio::test]
async fn failed_reservation_is_retried_once_on_another_decode_node() {
    let h = Harness::start(1, 2).await;
    let full = NodeError::new(ErrorKind::Overloaded, "no free KV blocks");
    h.decode[0].set(|b| b.fail_reserve = Some(full.clone()));
    let (s, b) = post(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 100}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["choices"][0]["text"], OUTPUT);
    let reserves =
        |n: &pdnode_router::testing::FakeNode| n.count(|c| matches!(c, FakeCall::ReserveKv(_)));
    assert_eq!((reserves(&h.decode[0]), reserves(&h.decode[1])), (1, 1));
    assert_eq!(h.decode[1].count(|c| matches!(c, FakeCall::Decode(_))), 1);
    // Both refuse: one retry, then the node's verdict (overloaded: 429).
    h.decode[1].set(|b| b.fail_reserve = Some(full.clone()));
    let (s, b) = post(&h, "/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(s, 429, "{b}");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no free KV blocks")
    );
    assert_eq!(reserves(&h.decode[0]) + reserves(&h.decode[1]), 4);
    assert_eq!(h.prefill[0].count(|c| matches!(c, FakeCall::Prefill(_))), 1);
    h.stop().await;
}
