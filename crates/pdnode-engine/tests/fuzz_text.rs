//! Fuzz-style property tests (proptest, stable Rust) of the text path: any string through the
//! tokenizer (the toy byte-level BPE, and SmolLM2's when its GGUF is present), any ids (valid or
//! not) through decoding and the incremental detokenizer, and any messages through the shipped
//! chat templates (SmolLM2, Llama 3, Qwen2). Each input gives text, ids or an error, never a
//! panic. Bounded: a few hundred cases per target.

use crate::text_support;

use pdnode_engine::text::{ChatTemplate, IncrementalDecoder, RenderOptions, TemplateValue};
use pdnode_testkit::fuzz::Fuzz;
use pdnode_testkit::fuzz_regressions;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::Value;

/// Strings with the characters tokenizers trip on: control tokens, byte-fallback edges,
/// combining marks, invalid-looking sequences, long runs.
fn texts() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        any::<String>(),
        prop::sample::select(vec![
            "<|end|>",
            "<|user|>",
            "<|im_start|>",
            "<|eot_id|>",
            "<|",
            "|>",
            "Hello",
            " wo",
            "STOP",
            "\u{FFFD}",
            "\u{0}",
            "\r\n",
            "\t",
            "é",
            "e\u{301}",
            "漢字",
            "🦀",
            "\u{10FFFF}",
            "    ",
            "'s",
            "1234567890",
        ])
        .prop_map(str::to_string),
    ];
    prop::collection::vec(piece, 0..8).prop_map(|v| v.concat())
}

fn check_tokenizer(
    tok: &pdnode_engine::text::Tokenizer,
    text: &str,
    ids: &[u32],
) -> Result<(), TestCaseError> {
    for add_special in [false, true] {
        let enc = tok
            .encode(text, add_special)
            .map_err(|e| TestCaseError::fail(format!("encode {text:?}: {e}")))?;
        prop_assert!(enc.iter().all(|&i| (i as usize) < tok.vocab_size()));
        // What it encoded decodes (special tokens kept), and to the text when it has none.
        let back = tok
            .decode(&enc, false)
            .map_err(|e| TestCaseError::fail(format!("decode of encode {text:?}: {e}")))?;
        if !add_special && !text.contains("<|") {
            prop_assert_eq!(&back, text);
        }
    }
    // Any ids: text or an error (ids past the vocabulary), and the incremental detokenizer
    // agrees: an error exactly when some id is unknown.
    let known = ids.iter().all(|&i| (i as usize) < tok.vocab_size());
    for skip in [false, true] {
        let whole = tok.decode(ids, skip);
        prop_assert_eq!(whole.is_ok(), known, "{:?}", whole);
        let mut d = IncrementalDecoder::new(skip);
        let mut failed = false;
        for &id in ids {
            if d.step(tok, id).is_err() {
                failed = true;
                break;
            }
        }
        if !failed {
            failed = d.flush(tok).is_err();
        }
        prop_assert_eq!(failed, !known);
    }
    Ok(())
}

#[test]
fn any_text_and_any_ids_through_the_toy_tokenizer() {
    let tok = text_support::toy();
    let vocab = tok.vocab_size() as u32;
    let ids = prop::collection::vec(
        prop_oneof![8 => 0..vocab, 1 => vocab..vocab + 4, 1 => any::<u32>()],
        0..24,
    );
    Fuzz::new(fuzz_regressions!("text_toy_tokenizer"), 500)
        .run(&(texts(), ids), |(text, ids)| {
            check_tokenizer(&tok, &text, &ids)
        })
        .unwrap();
}

#[test]
fn any_text_and_any_ids_through_smollm2s_tokenizer() {
    let Some(tok) = text_support::smollm2() else {
        eprintln!("SmolLM2 GGUF not present; skipped");
        return;
    };
    let vocab = tok.vocab_size() as u32;
    let ids = prop::collection::vec(
        prop_oneof![8 => 0..vocab, 1 => vocab..vocab + 4, 1 => any::<u32>()],
        0..24,
    );
    Fuzz::new(fuzz_regressions!("text_smollm2_tokenizer"), 256)
        .run(&(texts(), ids), |(text, ids)| {
            check_tokenizer(&tok, &text, &ids)
        })
        .unwrap();
}

#[test]
fn any_messages_through_the_shipped_chat_templates() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/text/chat_templates.json"
    );
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let templates: Vec<ChatTemplate> = ["smollm2", "llama3", "qwen2"]
        .iter()
        .map(|name| {
            let src = fx["templates"][name].as_str().unwrap();
            ChatTemplate::new(src, "<s>", "</s>").unwrap()
        })
        .collect();
    let value = prop_oneof![
        texts().prop_map(Value::String),
        Just(Value::Null),
        any::<i64>().prop_map(Value::from),
        any::<bool>().prop_map(Value::Bool),
        prop::collection::vec(texts().prop_map(Value::String), 0..3).prop_map(Value::Array),
        Just(serde_json::json!([{"type": "text", "text": "hi"}])),
        Just(serde_json::json!({"nested": {"deep": [1, 2]}})),
    ];
    let role = prop_oneof![
        prop::sample::select(vec!["system", "user", "assistant", "tool", "ipython"])
            .prop_map(str::to_string),
        texts(),
    ];
    let message = (role, value.clone(), prop::option::of(value)).prop_map(|(r, c, extra)| {
        let mut m = serde_json::json!({"role": r, "content": c});
        if let Some(x) = extra {
            m["tool_calls"] = x;
        }
        m
    });
    let input = (
        0..templates.len(),
        prop::collection::vec(message, 0..5),
        any::<bool>(),
        prop::option::of(prop::collection::vec(texts(), 0..3)),
    );
    Fuzz::new(fuzz_regressions!("text_chat_templates"), 500)
        .run(&input, |(which, messages, add_generation_prompt, tools)| {
            let msgs: Vec<TemplateValue> =
                messages.iter().map(TemplateValue::from_serialize).collect();
            let opts = RenderOptions {
                add_generation_prompt,
                tools: tools.map(|t| TemplateValue::from_serialize(&t)),
                ..Default::default()
            };
            // Text, or a template error (e.g. `raise_exception` on a role it refuses).
            let _ = templates[which].render(&msgs, &opts);
            Ok(())
        })
        .unwrap();
}
