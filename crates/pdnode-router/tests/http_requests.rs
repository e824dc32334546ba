//! What clients send beyond the core parameters, against fake nodes: the extras of other
//! servers (accepted as implemented or refused by name) and routing keys for the `manual` policy.

use crate::common;

use common::{Harness, post, post_sse};
use pdnode_router::testing::FakeCall;
use serde_json::json;

/// What OpenAI, vLLM and SGLang clients send beyond the core parameters: bookkeeping is accepted
/// and ignored, extras are accepted at the value this server implements and refused by name
/// otherwise, and the context check names the numbers.
#[tokio::test]
async fn client_extras_of_other_servers_are_accepted_or_refused_by_name() {
    let h = Harness::start(1, 1).await;
    let ok = [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 3, "store": false, "metadata": {"k": "v"},
                   "service_tier": "auto", "priority": 0, "skip_special_tokens": true,
                   "spaces_between_special_tokens": true, "include_stop_str_in_output": false,
                   "min_tokens": 0, "add_special_tokens": true, "n": 1, "best_of": 1,
                   "logprobs": null, "stop": null, "user": "u",
                   "stream_options": null}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                   "add_generation_prompt": true, "continue_final_message": false, "echo": false,
                   "add_special_tokens": false, "store": true, "parallel_tool_calls": false,
                   "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}),
        ),
    ];
    for (path, body) in ok {
        let (s, b) = post(&h, path, body.clone()).await;
        assert_eq!(s, 200, "{body}: {b}");
        assert_eq!(b["usage"]["completion_tokens"], 3, "{b}");
    }
    let (s, chunks) = post_sse(
        &h,
        "/v1/completions",
        json!({"prompt": "x", "max_tokens": 2, "stream": true,
               "stream_options": {"include_usage": true, "include_obfuscation": true}}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"));

    let refused = [
        (
            "/v1/completions",
            json!({"prompt": "x", "skip_special_tokens": false}),
            "skip_special_tokens",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "include_stop_str_in_output": true}),
            "include_stop_str_in_output",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "min_tokens": 4}),
            "min_tokens",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "priority": 5}),
            "priority",
        ),
        ("/v1/completions", json!({"prompt": "x", "n": 4}), "n"),
        (
            "/v1/completions",
            json!({"prompt": "x", "guided_json": {}}),
            "guided_json",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true}),
            "continue_final_message",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false}),
            "add_generation_prompt",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": false}}),
            "chat_template_kwargs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "n": 2}),
            "n",
        ),
    ];
    for (path, body, param) in refused {
        let (s, b) = post(&h, path, body.clone()).await;
        assert_eq!(s, 400, "{body}: {b}");
        assert_eq!(b["error"]["param"], param, "{body}: {b}");
        assert_eq!(b["error"]["type"], "invalid_request_error");
    }

    // Prompt + max_tokens over the context: 400 naming every number.
    let (s, b) = post(
        &h,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "y".repeat(100)}], "max_tokens": 200}),
    )
    .await;
    assert_eq!(s, 400, "{b}");
    let msg = b["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("maximum context length is 256") && msg.contains("asks for 200 more"),
        "{msg}"
    );
    // Without max_tokens, chat gets what is left of the context.
    let (s, b) = post(
        &h,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "y".repeat(100)}]}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    // None of the refused requests reached a node.
    assert_eq!(h.prefill[0].count(|c| matches!(c, FakeCall::Prefill(_))), 4);
    h.stop().await;
}

/// The `manual` policy over pdnode nodes: the `X-SMG-Routing-Key` header pins a session to one
/// decode node; a bad key is a 400.
#[tokio::test]
async fn manual_policy_pins_a_routing_key_to_one_decode_node() {
    let h = Harness::start_with(1, 3, |d| {
        d.config.decode_policy = pdnode_core::config::PolicyName::Manual;
        d.config.manual.assignment_mode = pdnode_core::config::AssignmentMode::MinGroup;
    })
    .await;
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let decodes = |h: &Harness| -> Vec<usize> {
        h.decode
            .iter()
            .map(|n| n.count(|c| matches!(c, FakeCall::Decode(_))))
            .collect()
    };
    for _round in 0..3 {
        for s in 0..3 {
            let r = http
                .post(h.url("/v1/completions"))
                .header("x-smg-routing-key", format!("user-{s}"))
                .json(&json!({"prompt": "x", "max_tokens": 4}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 200);
        }
    }
    assert_eq!(decodes(&h), vec![3, 3, 3]);
    let r = http
        .post(h.url("/v1/completions"))
        .header("x-smg-routing-key", "")
        .json(&json!({"prompt": "x", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    h.stop().await;
}
