//! Chat templates against HF `apply_chat_template` output (fixture made by
//! scripts/fixtures/text_reference.py with transformers + jinja2).

use pdnode_engine::text::{
    ChatMessage, ChatTemplate, MAX_RENDER_BYTES, RenderOptions, TemplateValue, TextError, Tokenizer,
};
use serde_json::Value;
use std::time::{Duration, Instant};

fn fixture_text() -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/text/chat_templates.json"
    );
    std::fs::read_to_string(path).unwrap()
}

fn fixture() -> Value {
    serde_json::from_str(&fixture_text()).unwrap()
}

/// The same cases parsed into template values, which keep the file's key order (as Python does).
fn ordered_cases() -> Vec<TemplateValue> {
    let v: TemplateValue = serde_json::from_str(&fixture_text()).unwrap();
    v.get_attr("cases").unwrap().try_iter().unwrap().collect()
}

#[test]
fn every_template_renders_exactly_like_transformers() {
    let fx = fixture();
    let templates = fx["templates"].as_object().unwrap();
    let cases = fx["cases"].as_array().unwrap();
    let ordered = ordered_cases();
    assert_eq!(ordered.len(), cases.len());
    assert!(cases.len() >= 20);
    let mut seen = std::collections::BTreeSet::new();
    for (i, case) in cases.iter().enumerate() {
        let name = case["template"].as_str().unwrap();
        seen.insert(name.to_string());
        let src = templates[name].as_str().unwrap();
        let t = ChatTemplate::new(
            src,
            case["bos_token"].as_str().unwrap(),
            case["eos_token"].as_str().unwrap(),
        )
        .unwrap();
        let messages: Vec<TemplateValue> = ordered[i]
            .get_attr("messages")
            .unwrap()
            .try_iter()
            .unwrap()
            .collect();
        let tools = ordered[i].get_attr("tools").unwrap();
        let opts = RenderOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            tools: (!tools.is_undefined()).then_some(tools),
            ..Default::default()
        };
        let got = t.render(&messages, &opts).unwrap();
        assert_eq!(
            got,
            case["expected"].as_str().unwrap(),
            "case {i}: template {name}, messages {messages:?}"
        );
    }
    for name in ["smollm2", "llama3", "qwen2", "extras"] {
        assert!(seen.contains(name), "no case for {name}");
    }
}

#[test]
fn user_prompt_helper_matches_the_single_user_case() {
    let fx = fixture();
    let case = fx["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["template"] == "smollm2"
                && c["add_generation_prompt"] == true
                && c["messages"].as_array().unwrap().len() == 1
        })
        .unwrap();
    let t = ChatTemplate::new(
        fx["templates"]["smollm2"].as_str().unwrap(),
        "<|im_start|>",
        "<|im_end|>",
    )
    .unwrap();
    let content = case["messages"][0]["content"].as_str().unwrap();
    assert_eq!(
        t.render_user_prompt(content).unwrap(),
        case["expected"].as_str().unwrap()
    );
}

#[test]
fn a_model_without_a_template_is_a_clear_error() {
    let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
        "normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
        "model":{"type":"WordLevel","vocab":{"a":0,"[UNK]":1},"unk_token":"[UNK]"}}"#;
    let inner: tokenizers::Tokenizer = json.parse().unwrap();
    let tok = Tokenizer::from_tokenizers(inner);
    let e = tok.chat_template().unwrap_err();
    assert!(matches!(e, TextError::NoChatTemplate));
    assert_eq!(
        pdnode_core::error::Classify::kind(&e),
        pdnode_core::ErrorKind::InvalidRequest
    );
}

/// A template comes from the model's files and runs on every chat request: a loop that runs away
/// or writes without end is a render error within a fraction of a second (fuel, output cap), not
/// a stuck request or an exhausted memory.
#[test]
fn runaway_templates_are_render_errors_fast() {
    for src in [
        // 100000 iterations of 100 MB each: the output cap stops the first.
        r#"{% for i in range(100000) %}{{ "x" * 100000000 }}{% endfor %}"#,
        // 10^10 iterations writing little: the fuel stops them.
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
    ] {
        let t = ChatTemplate::new(src, "", "").unwrap();
        let t0 = Instant::now();
        let r = t.render_user_prompt("hi");
        let took = t0.elapsed();
        assert!(
            matches!(r, Err(TextError::TemplateRender { .. })),
            "{src}: {:?}",
            r.map(|s| s.len())
        );
        assert!(took < Duration::from_secs(1), "{src}: {took:?}");
    }
    // The cap is on the whole output: up to it renders, one byte past it does not.
    let exactly = ChatTemplate::new(&format!(r#"{{{{ "x" * {MAX_RENDER_BYTES} }}}}"#), "", "")
        .unwrap()
        .render_user_prompt("")
        .unwrap();
    assert_eq!(exactly.len(), MAX_RENDER_BYTES);
    let over = format!(r#"{{{{ "x" * {MAX_RENDER_BYTES} }}}}{{{{ "y" }}}}"#);
    assert!(matches!(
        ChatTemplate::new(&over, "", "")
            .unwrap()
            .render_user_prompt(""),
        Err(TextError::TemplateRender { .. })
    ));
}

/// The budgets leave room for long conversations: every shipped template renders 20,000
/// messages (published templates spend at most about 70 fuel per message).
#[test]
fn long_conversations_fit_the_render_budgets() {
    let fx = fixture();
    let mut messages = vec![ChatMessage::system("You are helpful.")];
    for i in 0..20_000 {
        let text = format!("message {i}");
        messages.push(if i % 2 == 0 {
            ChatMessage::user(text)
        } else {
            ChatMessage::assistant(text)
        });
    }
    let opts = RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let templates = fx["templates"].as_object().unwrap();
    assert!(templates.len() >= 4);
    for (name, src) in templates {
        let t = ChatTemplate::new(src.as_str().unwrap(), "<s>", "</s>").unwrap();
        let out = t
            .render(&messages, &opts)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(out.contains("message 19999"), "{name}");
    }
}
