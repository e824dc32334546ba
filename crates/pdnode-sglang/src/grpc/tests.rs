//! The event reader, request bodies and status mapping of the gRPC frontend.

use super::*;

fn chunks(out: &[v1::GenerateResponse]) -> (Vec<u32>, String) {
    let mut ids = Vec::new();
    let mut text = String::new();
    for m in out {
        if let Some(Event::Chunk(c)) = &m.event {
            ids.extend(&c.token_ids);
            text.push_str(&c.text);
        }
    }
    (ids, text)
}

fn done(out: &[v1::GenerateResponse]) -> &v1::GenerateDone {
    match out.last().and_then(|m| m.event.as_ref()) {
        Some(Event::Done(d)) => d,
        other => panic!("the last message is not done: {other:?}"),
    }
}

fn ev(v: Value) -> Vec<u8> {
    format!("data: {v}\n\n").into_bytes()
}

#[test]
fn whole_so_far_events_become_deltas() {
    let mut r = EventReader::new(Route::Generate, true, "c1".into());
    let mut out = Vec::new();
    out.extend(r.push(&ev(json!({"text": "He", "output_ids": [5],
        "meta_info": {"id": "r1", "completion_tokens": 1, "finish_reason": null}}))));
    out.extend(r.push(&ev(json!({"text": "Hello", "output_ids": [5, 6],
        "meta_info": {"id": "r1", "completion_tokens": 2, "prompt_tokens": 3, "cached_tokens": 1,
                      "finish_reason": {"type": "length", "length": 2}}}))));
    out.extend(r.push(b"data: [DONE]\n\n"));
    assert_eq!(chunks(&out), (vec![5, 6], "Hello".to_string()));
    let d = done(&out);
    assert_eq!(d.finish_reason, v1::FinishReason::Length as i32);
    assert_eq!(d.request_id, "r1");
    assert_eq!(d.client_request_id, "c1");
    let u = d.usage.as_ref().unwrap();
    assert_eq!(
        (u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens),
        (3, 2, 1)
    );
    assert!(r.done && r.finish().is_none());
}

#[test]
fn delta_events_and_split_lines_are_read_too() {
    let mut r = EventReader::new(Route::Generate, true, String::new());
    let a = ev(json!({"text": "ab", "output_ids": [1],
        "meta_info": {"completion_tokens": 1, "finish_reason": null}}));
    let b = ev(json!({"text": "ab", "output_ids": [2],
        "meta_info": {"completion_tokens": 2, "finish_reason": {"type": "stop", "matched": 2}}}));
    let all = [a, b, b"data: [DONE]\n\n".to_vec()].concat();
    let mut out = Vec::new();
    for piece in all.chunks(7) {
        out.extend(r.push(piece));
    }
    // Incremental output_ids (fewer than completion_tokens): the second "ab" is new text.
    assert_eq!(chunks(&out), (vec![1, 2], "abab".to_string()));
    assert_eq!(done(&out).finish_reason, v1::FinishReason::Stop as i32);
}

#[test]
fn logprobs_of_the_new_tokens_only() {
    let mut r = EventReader::new(Route::Generate, false, String::new());
    let mut out = r.push(&ev(json!({"text": "x", "output_ids": [7],
        "meta_info": {"completion_tokens": 1,
                      "output_token_logprobs": [[-0.5, 7, null]],
                      "output_top_logprobs": [[[-0.5, 7, null], [-1.5, 8, null]]]}})));
    out.extend(r.push(&ev(json!({"text": "xy", "output_ids": [7, 9],
        "meta_info": {"completion_tokens": 2,
                      "output_token_logprobs": [[-0.5, 7, null], [-0.25, 9, null]],
                      "output_top_logprobs": [[[-0.5, 7, null]], [[-0.25, 9, null], [-2.0, 3, null]]],
                      "finish_reason": {"type": "length"}}}))));
    let lps: Vec<&v1::TokenLogprob> = out
        .iter()
        .filter_map(|m| match &m.event {
            Some(Event::Chunk(c)) => Some(&c.logprobs),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(lps.len(), 2);
    assert_eq!((lps[0].token_id, lps[0].logprob), (7, -0.5));
    assert_eq!(lps[0].top.len(), 2);
    assert_eq!((lps[1].token_id, lps[1].logprob), (9, -0.25));
    assert_eq!((lps[1].top[1].token_id, lps[1].top[1].logprob), (3, -2.0));
    // return_text = false: no text, the ids still come.
    assert_eq!(chunks(&out), (vec![7, 9], String::new()));
}

#[test]
fn error_events_malformed_lines_and_cut_streams_end_with_an_error() {
    let mut r = EventReader::new(Route::Generate, true, String::new());
    let out = r.push(b"data: {\"error\": {\"message\": \"decode broke\"}}\n\n");
    let d = done(&out);
    assert_eq!(d.finish_reason, v1::FinishReason::Error as i32);
    assert!(d.error.as_ref().unwrap().message.contains("decode broke"));

    let mut r = EventReader::new(Route::Generate, true, String::new());
    let out = r.push(b"data: {'text': 'a Python dict'}\n\n");
    assert!(
        done(&out)
            .error
            .as_ref()
            .unwrap()
            .message
            .contains("not JSON")
    );

    let mut r = EventReader::new(Route::Generate, true, String::new());
    let mut out = r.push(&ev(
        json!({"text": "a", "output_ids": [1], "meta_info": {"completion_tokens": 1}}),
    ));
    out.extend(r.finish());
    let d = done(&out);
    assert_eq!(d.finish_reason, v1::FinishReason::Error as i32);
    assert!(d.error.as_ref().unwrap().message.contains("without [DONE]"));

    // [DONE] with no finish reason ever seen is not a success either.
    let mut r = EventReader::new(Route::Generate, true, String::new());
    let out = r.push(b"data: [DONE]\n\n");
    assert_eq!(done(&out).finish_reason, v1::FinishReason::Error as i32);

    // An abort carries the worker's message.
    let mut r = EventReader::new(Route::Generate, true, String::new());
    let mut out = r.push(&ev(
        json!({"text": "", "output_ids": [], "meta_info": {"completion_tokens": 0,
        "finish_reason": {"type": "abort", "message": "prompt too long"}}}),
    ));
    out.extend(r.push(b"data: [DONE]\n\n"));
    assert!(
        done(&out)
            .error
            .as_ref()
            .unwrap()
            .message
            .contains("prompt too long")
    );
}

#[test]
fn chat_events_give_text_and_usage() {
    let mut r = EventReader::new(Route::ChatCompletions, true, String::new());
    let mut out = Vec::new();
    for e in [
        json!({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
        json!({"id": "c", "choices": [{"index": 0, "delta": {"content": "Pa"}}]}),
        json!({"id": "c", "choices": [{"index": 0, "delta": {"content": "ris"}, "finish_reason": "stop"}]}),
        json!({"id": "c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2,
               "prompt_tokens_details": {"cached_tokens": 4}}}),
    ] {
        out.extend(r.push(&ev(e)));
    }
    out.extend(r.push(b"data: [DONE]\n\n"));
    assert_eq!(chunks(&out), (vec![], "Paris".to_string()));
    let d = done(&out);
    assert_eq!(d.finish_reason, v1::FinishReason::Stop as i32);
    assert_eq!(d.request_id, "c");
    let u = d.usage.as_ref().unwrap();
    assert_eq!(
        (u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens),
        (9, 2, 4)
    );
}

#[test]
fn bodies_carry_the_prompt_and_the_sampling_fields() {
    let req = v1::GenerateRequest {
        prompt: Some(Prompt::TokenIds(v1::TokenIds { ids: vec![1, 2, 3] })),
        sampling: Some(v1::SamplingParams {
            temperature: Some(0.0),
            max_tokens: Some(5),
            seed: Some(7),
            logprobs: Some(2),
            stop: vec!["\n".into()],
            ..Default::default()
        }),
        ..Default::default()
    };
    let (route, body) = request_body(&req).unwrap();
    assert_eq!(route, Route::Generate);
    assert_eq!(body["input_ids"], json!([1, 2, 3]));
    assert_eq!(body["stream"], json!(true));
    assert_eq!(body["sampling_params"]["max_new_tokens"], json!(5));
    assert_eq!(body["sampling_params"]["temperature"], json!(0.0));
    assert_eq!(body["sampling_params"]["sampling_seed"], json!(7));
    assert_eq!(body["sampling_params"]["stop"], json!(["\n"]));
    assert!(body["sampling_params"].get("top_k").is_none());
    assert_eq!(body["return_logprob"], json!(true));
    assert_eq!(body["top_logprobs_num"], json!(2));

    let chat = v1::GenerateRequest {
        model: "m".into(),
        prompt: Some(Prompt::Chat(v1::ChatMessages {
            messages: vec![v1::ChatMessage {
                role: "user".into(),
                content: "hi".into(),
                ..Default::default()
            }],
            ..Default::default()
        })),
        ..Default::default()
    };
    let (route, body) = request_body(&chat).unwrap();
    assert_eq!(route, Route::ChatCompletions);
    assert_eq!(body["messages"][0]["content"], json!("hi"));
    assert_eq!(body["model"], json!("m"));
    assert_eq!(body["max_tokens"], json!(16));
    assert_eq!(body["stream_options"]["include_usage"], json!(true));

    // Refused before any worker is asked.
    let mut bad = chat.clone();
    bad.sampling = Some(v1::SamplingParams {
        logprobs: Some(1),
        ..Default::default()
    });
    assert_eq!(
        request_body(&bad).unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    let none = v1::GenerateRequest::default();
    assert_eq!(
        request_body(&none).unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    let temp = v1::GenerateRequest {
        prompt: Some(Prompt::Text("a".into())),
        sampling: Some(v1::SamplingParams {
            temperature: Some(-1.0),
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(
        request_body(&temp).unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
}

#[test]
fn http_errors_map_to_grpc_codes() {
    let b = br#"{"error": {"message": "no usable decode worker"}}"#;
    let s = status_from_http(StatusCode::SERVICE_UNAVAILABLE, b);
    assert_eq!(s.code(), tonic::Code::Unavailable);
    assert!(s.message().contains("no usable decode worker"));
    assert_eq!(
        status_from_http(StatusCode::GATEWAY_TIMEOUT, b"").code(),
        tonic::Code::DeadlineExceeded
    );
    assert_eq!(
        status_from_http(StatusCode::TOO_MANY_REQUESTS, b"").code(),
        tonic::Code::ResourceExhausted
    );
    assert_eq!(
        status_from_http(StatusCode::BAD_REQUEST, b"x").code(),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        status_from_http(StatusCode::BAD_GATEWAY, b"x").code(),
        tonic::Code::Unavailable
    );
}
