//! Tokenizer: GGUF byte-level BPE against transformers' reference ids (fixture made by
//! scripts/fixtures/text_reference.py), special tokens, BOS flags, bad ids.

use crate::text_support;

use pdnode_engine::loader::TokenizerSource;
use pdnode_engine::text::{TextError, Tokenizer};
use serde_json::Value;
use text_support::{byte_id, spell, toy, toy_gguf};

#[test]
fn smollm2_encodes_every_reference_string_like_transformers() {
    let Some(tok) = text_support::smollm2() else {
        eprintln!("SmolLM2 GGUF not present; skipped");
        return;
    };
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/text/smollm2_tokens.json"
    );
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(
        tok.vocab_size(),
        fx["vocab_size"].as_u64().unwrap() as usize
    );
    assert_eq!(
        tok.eos_token_ids(),
        &[fx["eos_token_id"].as_u64().unwrap() as u32]
    );
    assert_eq!(
        tok.bos_token_id(),
        fx["bos_token_id"].as_u64().map(|v| v as u32)
    );
    let cases = fx["cases"].as_array().unwrap();
    assert!(cases.len() >= 30);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tok.encode(text, false).unwrap(), want, "encode {text:?}");
        // SmolLM2 adds no BOS (add_bos_token = false in the GGUF).
        assert_eq!(
            tok.encode(text, true).unwrap(),
            want,
            "encode+special {text:?}"
        );
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            text,
            "round trip {text:?}"
        );
        assert_eq!(case["decoded"].as_str().unwrap(), text);
    }
    // Chat markup is one id per control token.
    assert_eq!(tok.encode("<|im_start|>", false).unwrap(), vec![1]);
    assert!(tok.is_special(1) && !tok.is_special(19556));
    assert_eq!(tok.decode(&[1, 19556, 2], true).unwrap(), "Hello");
}

#[test]
fn smollm2_chat_template_comes_from_the_gguf() {
    let Some(tok) = text_support::smollm2() else {
        eprintln!("SmolLM2 GGUF not present; skipped");
        return;
    };
    let prompt = tok
        .chat_template()
        .unwrap()
        .render_user_prompt("Hi")
        .unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode(&prompt, false).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(tok.decode(&ids, false).unwrap(), prompt);
}

#[test]
fn control_tokens_are_single_special_ids_and_merges_apply() {
    let tok = toy();
    let ids = tok.encode("<|user|>Hello<|end|>", false).unwrap();
    let hel = tok.token_to_id(&spell("Hel")).unwrap();
    let lo = tok.token_to_id(&spell("lo")).unwrap();
    assert_eq!(ids, vec![1, hel, lo, 0]);
    assert_eq!(tok.decode(&ids, true).unwrap(), "Hello");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|user|>Hello<|end|>");
    assert_eq!(tok.id_to_token(hel).unwrap(), "Hel");
    // Digits are split one by one (the smollm pre-tokenizer).
    let d: Vec<u32> = b"123".iter().map(|&b| byte_id(b)).collect();
    assert_eq!(tok.encode("123", false).unwrap(), d);
}

#[test]
fn gguf_add_bos_flag_inserts_bos_only_with_special_tokens() {
    let mut g = toy_gguf();
    g.add_bos_token = Some(true);
    let tok = Tokenizer::from_gguf(&g).unwrap();
    assert_eq!(tok.encode("a", true).unwrap(), vec![1, byte_id(b'a')]);
    assert_eq!(tok.encode("a", false).unwrap(), vec![byte_id(b'a')]);
}

#[test]
fn out_of_range_ids_and_missing_tokenizers_are_typed_errors() {
    let tok = toy();
    let n = tok.vocab_size() as u32;
    assert!(matches!(
        tok.decode(&[0, n], false),
        Err(TextError::TokenOutOfRange { id, .. }) if id == n
    ));
    assert!(matches!(
        Tokenizer::from_source(&TokenizerSource::None),
        Err(TextError::NoTokenizer)
    ));
    let mut g = toy_gguf();
    g.model = "t5".into();
    assert!(matches!(
        Tokenizer::from_source(&TokenizerSource::Gguf(Box::new(g))),
        Err(TextError::Unsupported { .. })
    ));
}

#[test]
fn hf_tokenizer_json_with_config_gives_special_ids_and_template() {
    // Write the toy tokenizer as an HF tokenizer.json and read it back through the HF path.
    let dir = std::env::temp_dir().join(format!("pdnode-text-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, toy().inner().to_string(false).unwrap()).unwrap();
    let config = pdnode_engine::loader::HfTokenizerConfig {
        chat_template: Some("{{ bos_token }}{{ messages[0].content }}".into()),
        bos_token: Some("<|user|>".into()),
        eos_token: Some("<|end|>".into()),
        ..Default::default()
    };
    let tok = Tokenizer::from_hf_file(&path, &config).unwrap();
    assert_eq!(tok.bos_token_id(), Some(1));
    assert_eq!(tok.eos_token_ids(), &[0]);
    assert_eq!(
        tok.chat_template()
            .unwrap()
            .render_user_prompt("hi")
            .unwrap(),
        "<|user|>hi"
    );
    let bad = pdnode_engine::loader::HfTokenizerConfig {
        eos_token: Some("<|nope|>".into()),
        ..Default::default()
    };
    assert!(matches!(
        Tokenizer::from_hf_file(&path, &bad),
        Err(TextError::Load { .. })
    ));
    let missing = Tokenizer::from_hf_file(&dir.join("missing.json"), &config);
    assert!(matches!(
        missing,
        Err(TextError::Load { path: Some(_), .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_supported_pre_tokenizer_splits_like_transformers() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/text/pretokenizers.json"
    );
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let strs = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    };
    let tokens = strs(&fx["tokens"]);
    let strings = strs(&fx["strings"]);
    let by_pre = fx["by_pre"].as_object().unwrap();
    assert_eq!(by_pre.len(), 4);
    let mut distinct = std::collections::HashSet::new();
    for (pre, cases) in by_pre {
        let g = pdnode_engine::loader::GgufTokenizer {
            model: "gpt2".into(),
            pre: Some(pre.clone()),
            token_types: (0..tokens.len())
                .map(|i| if i == 0 { 3 } else { 1 })
                .collect(),
            tokens: tokens.clone(),
            merges: strs(&fx["merges"]),
            bos_token_id: Some(0),
            eos_token_id: Some(0),
            ..Default::default()
        };
        let tok = Tokenizer::from_gguf(&g).unwrap();
        for (s, want) in strings.iter().zip(cases.as_array().unwrap()) {
            let want: Vec<u32> = want
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(tok.encode(s, false).unwrap(), want, "pre {pre}, text {s:?}");
            assert_eq!(tok.decode(&want, false).unwrap(), *s);
            distinct.insert((s.clone(), want));
        }
    }
    // The fixture tells the pre-tokenizers apart (they do not all give the same ids).
    assert!(distinct.len() > strings.len());
}

#[test]
fn sentencepiece_gguf_vocabularies_tokenize_like_transformers() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/text/sentencepiece.json"
    );
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let g = pdnode_engine::loader::GgufTokenizer {
        model: "llama".into(),
        tokens: fx["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect(),
        token_types: fx["token_types"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_i64().unwrap() as i32)
            .collect(),
        scores: fx["scores"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_f64().unwrap() as f32)
            .collect(),
        bos_token_id: Some(1),
        eos_token_id: Some(2),
        unk_token_id: Some(0),
        ..Default::default()
    };
    let tok = Tokenizer::from_gguf(&g).unwrap();
    for case in fx["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text, false).unwrap(), want, "encode {text:?}");
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            case["decoded"].as_str().unwrap(),
            "decode {text:?}"
        );
        assert_eq!(
            tok.decode(&want, true).unwrap(),
            case["decoded_skip_special"].as_str().unwrap(),
            "decode skipping specials {text:?}"
        );
        // llama.cpp adds BOS to SentencePiece prompts unless the file says not to.
        let mut with_bos = vec![1];
        with_bos.extend(&want);
        assert_eq!(tok.encode(text, true).unwrap(), with_bos, "BOS {text:?}");
    }
    let mut no_bos = g.clone();
    no_bos.add_bos_token = Some(false);
    let tok = Tokenizer::from_gguf(&no_bos).unwrap();
    assert_eq!(
        tok.encode("the", true).unwrap(),
        tok.encode("the", false).unwrap()
    );
    // Streaming through byte-fallback tokens yields whole characters.
    let stream = tok.encode("中文 é 😀 ab", false).unwrap();
    let mut dec = pdnode_engine::text::IncrementalDecoder::new(true);
    let mut out = String::new();
    for &id in &stream {
        let d = dec.step(&tok, id).unwrap();
        assert!(!d.contains('\u{FFFD}'), "{d:?}");
        out.push_str(&d);
    }
    out.push_str(&dec.flush(&tok).unwrap());
    assert_eq!(out, tok.decode(&stream, true).unwrap());
}
