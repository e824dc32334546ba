//! Chat templates against HF `apply_chat_template` output (fixture made by
//! scripts/fixtures/text_reference.py with transformers + jinja2).

use pdnode_engine::text::{ChatTemplate, RenderOptions, TemplateValue, TextError, Tokenizer};
use serde_json::Value;

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
