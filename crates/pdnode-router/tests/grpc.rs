//! The `pdnode.v1.Inference` gRPC frontend against fake nodes.

use crate::common;

use common::Harness;
use pdnode_core::ErrorKind;
use pdnode_proto::v1;
use pdnode_proto::v1::generate_request::Prompt;
use pdnode_proto::v1::generate_response::Event;
use pdnode_proto::v1::inference_client::InferenceClient;
use pdnode_router::NodeError;
use std::time::Duration;
use tonic::transport::Channel;

const OUTPUT: &str = "Hello from the fake node.";

async fn client(h: &Harness) -> InferenceClient<Channel> {
    InferenceClient::connect(format!("http://{}", h.grpc))
        .await
        .unwrap()
}

fn text_request(prompt: &str, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: Some(Prompt::Text(prompt.into())),
        sampling: Some(v1::SamplingParams {
            max_tokens: Some(max_tokens),
            temperature: Some(0.0),
            ..Default::default()
        }),
        client_request_id: "c-1".into(),
        ..Default::default()
    }
}

/// Collects (text, token count, done) from a Generate stream.
async fn collect(
    mut s: tonic::Streaming<v1::GenerateResponse>,
) -> (String, usize, Option<v1::GenerateDone>) {
    let (mut text, mut n, mut done) = (String::new(), 0, None);
    while let Some(m) = s.message().await.unwrap() {
        match m.event {
            Some(Event::Chunk(c)) => {
                text.push_str(&c.text);
                n += c.token_ids.len();
            }
            Some(Event::Done(d)) => done = Some(d),
            None => {}
        }
    }
    (text, n, done)
}

#[tokio::test]
async fn generate_streams_tokens_text_and_a_final_usage() {
    let h = Harness::start(1, 1).await;
    let mut c = client(&h).await;
    let s = c
        .generate(text_request("Say hi", 100))
        .await
        .unwrap()
        .into_inner();
    let (text, n, done) = collect(s).await;
    assert_eq!(text, OUTPUT);
    assert_eq!(n, OUTPUT.len());
    let done = done.expect("a done message");
    assert_eq!(done.finish_reason, v1::FinishReason::Stop as i32);
    assert_eq!(done.client_request_id, "c-1");
    assert!(done.request_id.starts_with("req-"));
    let u = done.usage.unwrap();
    assert_eq!(
        (u.prompt_tokens, u.completion_tokens),
        (6, OUTPUT.len() as u32)
    );

    // Token ids and chat prompts; max_tokens cuts.
    let mut req = text_request("", 4);
    req.prompt = Some(Prompt::TokenIds(v1::TokenIds { ids: vec![1, 2, 3] }));
    let (text, _, done) = collect(c.generate(req).await.unwrap().into_inner()).await;
    assert_eq!(text, "Hell");
    assert_eq!(done.unwrap().finish_reason, v1::FinishReason::Length as i32);
    let mut req = text_request("", 2);
    req.prompt = Some(Prompt::Chat(v1::ChatMessages {
        messages: vec![v1::ChatMessage {
            role: "user".into(),
            content: "Hi".into(),
        }],
    }));
    let (text, _, done) = collect(c.generate(req).await.unwrap().into_inner()).await;
    assert_eq!(text, "He");
    let u = done.unwrap().usage.unwrap();
    assert_eq!(u.prompt_tokens as usize, "user: Hi\nassistant:".len());
    h.stop().await;
}

#[tokio::test]
async fn errors_map_to_grpc_codes_and_mid_stream_failures_end_with_error_done() {
    let h = Harness::start(1, 1).await;
    let mut c = client(&h).await;
    let mut bad = text_request("x", 5);
    bad.sampling.as_mut().unwrap().top_p = Some(2.0);
    let e = c.generate(bad).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("top_p"), "{}", e.message());
    let e = c
        .generate(v1::GenerateRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    // a model name past 256 bytes is refused as such, not echoed into the status (a header)
    let mut long = text_request("x", 5);
    long.model = "m".repeat(100_000);
    let e = c.generate(long).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(
        e.message().contains("model") && e.message().len() < 300,
        "{}",
        e.message()
    );
    // chat roles as on HTTP: an unknown one is refused by its field
    let chat = |role: &str| v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::Chat(v1::ChatMessages {
            messages: vec![v1::ChatMessage {
                role: role.into(),
                content: "hi".into(),
            }],
        })),
        sampling: Some(v1::SamplingParams {
            max_tokens: Some(2),
            ..Default::default()
        }),
        ..Default::default()
    };
    let e = c.generate(chat("tool")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(
        e.message().contains("chat.messages[0].role"),
        "{}",
        e.message()
    );

    h.decode[0].set(|b| b.die_after = Some((2, NodeError::new(ErrorKind::Unavailable, "gone"))));
    let s = c
        .generate(text_request("x", 50))
        .await
        .unwrap()
        .into_inner();
    let (text, _, done) = tokio::time::timeout(Duration::from_secs(3), collect(s))
        .await
        .expect("the stream ends quickly");
    assert_eq!(text, "Hel");
    let done = done.unwrap();
    assert_eq!(done.finish_reason, v1::FinishReason::Error as i32);
    assert!(done.error.unwrap().message.contains("gone"));

    h.membership.remove(&pdnode_core::NodeId::new("d0"));
    let e = c.generate(text_request("x", 5)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    h.stop().await;
}

#[tokio::test]
async fn api_keys_health_list_nodes_and_reflection() {
    let h = Harness::start_with(2, 1, |d| d.api_keys = vec!["sk-grpc".into()]).await;
    let mut c = client(&h).await;
    let e = c.generate(text_request("x", 2)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    let mut req = tonic::Request::new(text_request("x", 2));
    req.metadata_mut()
        .insert("authorization", "Bearer sk-grpc".parse().unwrap());
    let (text, _, _) = collect(c.generate(req).await.unwrap().into_inner()).await;
    assert_eq!(text, "He");

    let mut req = tonic::Request::new(v1::ListNodesRequest {
        role: v1::Role::Prefill as i32,
    });
    req.metadata_mut()
        .insert("authorization", "Bearer sk-grpc".parse().unwrap());
    let nodes = c.list_nodes(req).await.unwrap().into_inner().nodes;
    let mut ids: Vec<_> = nodes.iter().map(|n| n.id.clone()).collect();
    ids.sort();
    assert_eq!(ids, vec!["p0", "p1"]);

    // A role-`all` node is listed once, as `all`, with its `colocated` flag; unspecified = any.
    let mut all = h.prefill[0].worker(pdnode_core::Role::All);
    all.card.id = pdnode_core::NodeId::new("a0");
    all.card.colocated = true;
    h.membership.add(all);
    let mut req = tonic::Request::new(v1::ListNodesRequest {
        role: v1::Role::Unspecified as i32,
    });
    req.metadata_mut()
        .insert("authorization", "Bearer sk-grpc".parse().unwrap());
    let nodes = c.list_nodes(req).await.unwrap().into_inner().nodes;
    let mut listed: Vec<_> = nodes
        .iter()
        .map(|n| (n.id.as_str(), n.role, n.colocated))
        .collect();
    listed.sort();
    let (p, d, a) = (
        v1::Role::Prefill as i32,
        v1::Role::Decode as i32,
        v1::Role::All as i32,
    );
    assert_eq!(
        listed,
        vec![
            ("a0", a, true),
            ("d0", d, false),
            ("p0", p, false),
            ("p1", p, false)
        ]
    );
    let mut req = tonic::Request::new(v1::HealthRequest {});
    req.metadata_mut()
        .insert("authorization", "Bearer sk-grpc".parse().unwrap());
    let hr = c.health(req).await.unwrap().into_inner();
    assert_eq!(hr.status, v1::ServingStatus::Serving as i32);

    // Reflection lists the Inference service.
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", h.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut rc = ServerReflectionClient::new(channel);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut resp = rc
        .server_reflection_info(tokio_stream::iter(vec![req]))
        .await
        .unwrap()
        .into_inner();
    let msg = resp.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else {
        panic!("unexpected reflection answer: {msg:?}");
    };
    assert!(
        list.service.iter().any(|s| s.name == "pdnode.v1.Inference"),
        "{list:?}"
    );
    assert!(
        !list.service.iter().any(|s| s.name == "pdnode.v1.Node"),
        "{list:?}"
    );
    h.stop().await;
}

/// What a generic client finds on the client port by reflection v1alpha (grpcio-reflection,
/// Postman and evans speak only it): the client API and reflection, never `pdnode.v1.Node`;
/// the node API's symbols are unknown there and calling it answers UNIMPLEMENTED.
#[tokio::test]
async fn client_port_reflects_v1alpha_and_never_the_node_api() {
    use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
    let h = Harness::start(1, 1).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", h.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut rc = ServerReflectionClient::new(channel.clone());
    let ask = |m: MessageRequest| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(m),
    };
    let mut resp = rc
        .server_reflection_info(tokio_stream::iter(vec![
            ask(MessageRequest::ListServices(String::new())),
            ask(MessageRequest::FileContainingSymbol(
                "pdnode.v1.Inference".into(),
            )),
            ask(MessageRequest::FileContainingSymbol(
                "pdnode.v1.Node".into(),
            )),
        ]))
        .await
        .expect("reflection v1alpha is served")
        .into_inner();
    let msg = resp.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else {
        panic!("unexpected reflection answer: {msg:?}");
    };
    let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"pdnode.v1.Inference"), "{names:?}");
    assert!(!names.contains(&"pdnode.v1.Node"), "{names:?}");
    let msg = resp.message().await.unwrap().unwrap();
    assert!(
        matches!(
            msg.message_response,
            Some(MessageResponse::FileDescriptorResponse(ref f)) if !f.file_descriptor_proto.is_empty()
        ),
        "{msg:?}"
    );
    // Unknown there: tonic-reflection ends the stream with NOT_FOUND.
    match resp.message().await {
        Err(s) => assert_eq!(s.code(), tonic::Code::NotFound, "{s:?}"),
        Ok(Some(msg)) => assert!(
            matches!(
                msg.message_response,
                Some(MessageResponse::ErrorResponse(_))
            ),
            "pdnode.v1.Node is described on the client port: {msg:?}"
        ),
        Ok(None) => panic!("the reflection stream ended without an answer"),
    }

    let mut node = pdnode_proto::v1::node_client::NodeClient::new(channel);
    let e = node.stats(v1::StatsRequest {}).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
    let e = node
        .reserve_kv(v1::ReserveKvRequest {
            request_id: 1,
            prompt_token_ids: vec![1, 2, 3],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
    h.stop().await;
}

#[tokio::test]
async fn dropping_the_generate_stream_aborts_on_both_nodes() {
    let h = Harness::start_with(1, 1, |d| d.config.token_timeout_s = 60).await;
    h.decode[0].set(|b| b.token_interval = Duration::from_secs(20));
    let mut c = client(&h).await;
    let mut s = c
        .generate(text_request("x", 50))
        .await
        .unwrap()
        .into_inner();
    let first = s.message().await.unwrap().unwrap();
    assert!(matches!(first.event, Some(Event::Chunk(_))));
    drop(s);
    let aborted = |calls: &[pdnode_router::testing::FakeCall]| {
        calls
            .iter()
            .any(|c| matches!(c, pdnode_router::testing::FakeCall::Abort(_)))
    };
    let limit = Duration::from_secs(5);
    assert!(h.decode[0].wait_for(limit, aborted).await);
    assert!(h.prefill[0].wait_for(limit, aborted).await);
    h.stop().await;
}
