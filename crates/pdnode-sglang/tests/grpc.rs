//! `pdnode.v1.Inference` over **mock** SGLang workers (`pdnode_testkit::sglang_mock`) on
//! loopback: a gRPC client's text, token-id and chat prompts reach a prefill/decode pair with
//! the bootstrap fields (the decode mock waits for its prefill in the room), the events come
//! back as token chunks with ids, text, logprobs and usage, a broken decode stream ends with an
//! error message, no usable worker is an RPC status, API keys are checked, and `Health` and
//! `ListNodes` show the workers.

// Wire messages are built with `..Default::default()` (fields are only added within v1).
#![allow(clippy::needless_update)]

use pdnode_core::config::{RouterConfig, SglangDecodeWorker, SglangPrefillWorker};
use pdnode_proto::v1;
use pdnode_proto::v1::generate_request::Prompt;
use pdnode_proto::v1::generate_response::Event;
use pdnode_proto::v1::inference_client::InferenceClient;
use pdnode_sglang::SglangRouter;
use pdnode_testkit::sglang_mock::{Fault, MockRole, MockWorker, Rendezvous};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

struct Cluster {
    prefill: Arc<MockWorker>,
    decode: Arc<MockWorker>,
    client: InferenceClient<Channel>,
    stop: CancellationToken,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop.cancel();
        self.prefill.kill();
        self.decode.kill();
    }
}

async fn cluster(keys: Vec<String>, tweak: impl FnOnce(&mut RouterConfig)) -> Cluster {
    let rv = Arc::new(Rendezvous::default());
    let prefill =
        MockWorker::start(MockRole::Prefill, Some(9200), rv.clone(), Duration::ZERO).await;
    let decode = MockWorker::start(MockRole::Decode, None, rv, Duration::from_millis(1)).await;
    let mut cfg = RouterConfig::default();
    cfg.sglang.prefill = vec![SglangPrefillWorker {
        url: prefill.url.clone(),
        bootstrap_port: prefill.bootstrap_port,
    }];
    cfg.sglang.decode = vec![SglangDecodeWorker {
        url: decode.url.clone(),
    }];
    tweak(&mut cfg);
    let router = SglangRouter::new(&cfg, keys).unwrap();
    let stop = CancellationToken::new();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    tokio::spawn(pdnode_sglang::serve(http, router.clone(), stop.clone()));
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = grpc.local_addr().unwrap();
    tokio::spawn(pdnode_sglang::serve_grpc(
        grpc,
        router.clone(),
        stop.clone(),
    ));
    let deadline = Instant::now() + Duration::from_secs(10);
    while router.usable() != (1, 1) {
        assert!(Instant::now() < deadline, "workers never became usable");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client = InferenceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    Cluster {
        prefill,
        decode,
        client,
        stop,
    }
}

fn text_request(text: &str, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(Prompt::Text(text.into())),
        sampling: Some(v1::SamplingParams {
            max_tokens: Some(max_tokens),
            temperature: Some(0.0),
            ..Default::default()
        }),
        client_request_id: "client-1".into(),
        ..Default::default()
    }
}

/// Every message of one `Generate` call: the chunks, then the done message.
async fn generate(
    client: &mut InferenceClient<Channel>,
    req: tonic::Request<v1::GenerateRequest>,
) -> Result<(Vec<v1::TokenChunk>, v1::GenerateDone), tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let mut chunks = Vec::new();
    let deadline = Duration::from_secs(20);
    while let Some(m) = tokio::time::timeout(deadline, stream.message())
        .await
        .expect("a message within the deadline")?
    {
        match m.event {
            Some(Event::Chunk(c)) => chunks.push(c),
            Some(Event::Done(d)) => {
                let rest = tokio::time::timeout(deadline, stream.message()).await;
                assert!(
                    matches!(rest, Ok(Ok(None))),
                    "done is the last message: {rest:?}"
                );
                return Ok((chunks, d));
            }
            None => panic!("a message without an event"),
        }
    }
    panic!("the stream ended without done");
}

#[tokio::test]
async fn a_text_prompt_streams_ids_text_and_usage_through_a_worker_pair() {
    let mut c = cluster(Vec::new(), |_| {}).await;
    let mut req = tonic::Request::new(text_request("Hi", 4));
    req.metadata_mut()
        .insert("x-request-id", "grpc-7".parse().unwrap());
    let (chunks, done) = generate(&mut c.client, req).await.unwrap();
    let ids: Vec<u32> = chunks.iter().flat_map(|c| c.token_ids.clone()).collect();
    let text: String = chunks.iter().map(|c| c.text.as_str()).collect();
    assert_eq!(ids, vec![100, 101, 102, 103]);
    assert_eq!(text, "t0 t1 t2 t3 ");
    assert_eq!(done.finish_reason, v1::FinishReason::Length as i32);
    assert_eq!(done.client_request_id, "client-1");
    assert_eq!(done.request_id, "d");
    let u = done.usage.unwrap();
    assert_eq!(
        (u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens),
        (3, 4, 1)
    );
    // Both workers got the same /generate body with the bootstrap fields; the decode mock only
    // answered because its prefill deposited the KV in the room it was told.
    let (pb, _) = c.prefill.last.lock().clone().unwrap();
    let (db, dh) = c.decode.last.lock().clone().unwrap();
    assert_eq!(pb, db);
    assert_eq!(db["text"], "Hi");
    assert_eq!(db["stream"], true);
    assert_eq!(db["sampling_params"]["max_new_tokens"], 4);
    assert_eq!(db["bootstrap_host"], "127.0.0.1");
    assert_eq!(db["bootstrap_port"], 9200);
    assert!(db["bootstrap_room"].as_u64().is_some());
    assert_eq!(dh.get("x-request-id").unwrap(), "grpc-7");
}

#[tokio::test]
async fn token_ids_with_logprobs_and_return_text_off() {
    let mut c = cluster(Vec::new(), |_| {}).await;
    let req = v1::GenerateRequest {
        prompt: Some(Prompt::TokenIds(v1::TokenIds { ids: vec![1, 2, 3] })),
        sampling: Some(v1::SamplingParams {
            max_tokens: Some(3),
            logprobs: Some(1),
            ..Default::default()
        }),
        return_text: Some(false),
        ..Default::default()
    };
    let (chunks, done) = generate(&mut c.client, tonic::Request::new(req))
        .await
        .unwrap();
    assert_eq!(done.finish_reason, v1::FinishReason::Length as i32);
    assert!(chunks.iter().all(|c| c.text.is_empty()));
    let lps: Vec<&v1::TokenLogprob> = chunks.iter().flat_map(|c| &c.logprobs).collect();
    let ids: Vec<u32> = chunks.iter().flat_map(|c| c.token_ids.clone()).collect();
    assert_eq!(ids, vec![100, 101, 102]);
    assert_eq!(lps.len(), 3);
    for (k, lp) in lps.iter().enumerate() {
        assert_eq!(lp.token_id, 100 + k as u32);
        assert!(
            (lp.logprob + (k as f32 + 1.0) / 10.0).abs() < 1e-6,
            "{lp:?}"
        );
        assert_eq!(lp.top.len(), 2);
        assert_eq!(lp.top[1].token_id, 7);
    }
    let (db, _) = c.decode.last.lock().clone().unwrap();
    assert_eq!(db["input_ids"], serde_json::json!([1, 2, 3]));
    assert_eq!(db["return_logprob"], true);
}

#[tokio::test]
async fn chat_goes_to_the_chat_route_and_comes_back_as_text() {
    let mut c = cluster(Vec::new(), |_| {}).await;
    let req = v1::GenerateRequest {
        prompt: Some(Prompt::Chat(v1::ChatMessages {
            messages: vec![v1::ChatMessage {
                role: "user".into(),
                content: "Capital of France?".into(),
                ..Default::default()
            }],
            ..Default::default()
        })),
        sampling: Some(v1::SamplingParams {
            max_tokens: Some(2),
            ..Default::default()
        }),
        ..Default::default()
    };
    let (chunks, done) = generate(&mut c.client, tonic::Request::new(req))
        .await
        .unwrap();
    let text: String = chunks.iter().map(|c| c.text.as_str()).collect();
    assert_eq!(text, "t0 t1 ");
    assert!(chunks.iter().all(|c| c.token_ids.is_empty()));
    assert_eq!(done.finish_reason, v1::FinishReason::Length as i32);
    assert_eq!(done.usage.unwrap().completion_tokens, 2);
    let (db, _) = c.decode.last.lock().clone().unwrap();
    assert_eq!(db["messages"][0]["content"], "Capital of France?");
    assert_eq!(db["max_tokens"], 2);
}

#[tokio::test]
async fn a_broken_decode_stream_ends_with_an_error_message() {
    let mut c = cluster(Vec::new(), |_| {}).await;
    c.decode.set_fault(Fault::DropMidStream(2));
    let (chunks, done) = generate(&mut c.client, tonic::Request::new(text_request("Hi", 8)))
        .await
        .unwrap();
    // The mock breaks after two events; the second may be lost with the connection.
    assert!((1..=2).contains(&chunks.len()), "{chunks:?}");
    assert_eq!(chunks[0].token_ids, vec![100]);
    assert_eq!(done.finish_reason, v1::FinishReason::Error as i32);
    assert!(done.error.is_some(), "{done:?}");
}

#[tokio::test]
async fn failures_before_the_stream_are_rpc_statuses() {
    let mut c = cluster(Vec::new(), |r| {
        r.sglang.max_retries = 0;
        r.prefill_timeout_s = 1;
        r.token_timeout_s = 1;
    })
    .await;
    // Bad input never reaches a worker.
    let before = c.decode.requests.load(std::sync::atomic::Ordering::Relaxed);
    let st = generate(
        &mut c.client,
        tonic::Request::new(v1::GenerateRequest::default()),
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
    let st = generate(&mut c.client, tonic::Request::new(text_request("Hi", 0)))
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
    assert_eq!(
        c.decode.requests.load(std::sync::atomic::Ordering::Relaxed),
        before
    );
    // A decode worker answering 500: a clear Unavailable, not a hang.
    c.decode.set_fault(Fault::Http500);
    let st = generate(&mut c.client, tonic::Request::new(text_request("Hi", 2)))
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::Unavailable, "{st:?}");
    assert!(st.message().contains("500"), "{st:?}");
    // A hung prefill: the request ends at its deadline.
    c.decode.set_fault(Fault::None);
    c.prefill.set_fault(Fault::Hang);
    let t0 = Instant::now();
    let r = generate(&mut c.client, tonic::Request::new(text_request("Hi", 2))).await;
    let st = r.unwrap_err();
    assert!(
        matches!(
            st.code(),
            tonic::Code::DeadlineExceeded | tonic::Code::Unavailable
        ),
        "{st:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

fn authed<T>(m: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(m);
    r.metadata_mut()
        .insert("authorization", "Bearer k1".parse().unwrap());
    r
}

#[tokio::test]
async fn api_keys_are_checked_and_health_and_nodes_show_the_workers() {
    let mut c = cluster(vec!["k1".into()], |_| {}).await;
    let st = generate(&mut c.client, tonic::Request::new(text_request("Hi", 1)))
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::Unauthenticated);
    let st = c
        .client
        .health(tonic::Request::new(v1::HealthRequest {}))
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::Unauthenticated);

    let (chunks, _) = generate(&mut c.client, authed(text_request("Hi", 1)))
        .await
        .unwrap();
    assert_eq!(chunks.len(), 1);
    let h = c
        .client
        .health(authed(v1::HealthRequest {}))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(h.status, v1::ServingStatus::Serving as i32);
    let all = c
        .client
        .list_nodes(authed(v1::ListNodesRequest::default()))
        .await
        .unwrap()
        .into_inner();
    let urls: Vec<(&str, i32)> = all.nodes.iter().map(|n| (n.id.as_str(), n.role)).collect();
    assert_eq!(
        urls,
        vec![
            (c.prefill.url.as_str(), v1::Role::Prefill as i32),
            (c.decode.url.as_str(), v1::Role::Decode as i32)
        ]
    );
    let decode = c
        .client
        .list_nodes(authed(v1::ListNodesRequest {
            role: v1::Role::Decode as i32,
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(decode.nodes.len(), 1);
    assert_eq!(decode.nodes[0].model_id, "mock-model");
}
