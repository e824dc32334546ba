//! Test helpers shared by the text and sampling tests: a small byte-level BPE tokenizer built
//! through the GGUF path (every byte is a token, plus a few merges and control tokens), and the
//! SmolLM2 GGUF when it is present.

#![allow(dead_code)]

use pdnode_engine::loader::GgufTokenizer;
use pdnode_engine::text::Tokenizer;
use std::path::PathBuf;

/// GPT-2's byte-to-character table (`bytes_to_unicode`).
pub fn byte_char(b: u8) -> char {
    let printable = |b: u8| {
        (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

pub fn spell(s: &str) -> String {
    s.bytes().map(byte_char).collect()
}

/// Ids: 0 `<|end|>` (control, EOS), 1 `<|user|>` (control), 2..258 the 256 bytes, then merges.
pub fn toy_gguf() -> GgufTokenizer {
    let mut tokens = vec!["<|end|>".to_string(), "<|user|>".to_string()];
    let mut types = vec![3, 3];
    for b in 0..=255u8 {
        tokens.push(byte_char(b).to_string());
        types.push(1);
    }
    let mut merges = Vec::new();
    for (a, b) in [
        ("H", "e"),
        ("He", "l"),
        ("l", "o"),
        (" ", "w"),
        (" w", "o"),
        ("S", "T"),
        ("O", "P"),
    ] {
        let (a, b) = (spell(a), spell(b));
        merges.push(format!("{a} {b}"));
        tokens.push(format!("{a}{b}"));
        types.push(1);
    }
    GgufTokenizer {
        model: "gpt2".into(),
        pre: Some("smollm".into()),
        tokens,
        merges,
        token_types: types,
        bos_token_id: Some(1),
        eos_token_id: Some(0),
        chat_template: Some("{% for m in messages %}<|user|>{{ m.content }}{% endfor %}".into()),
        ..Default::default()
    }
}

pub fn toy() -> Tokenizer {
    Tokenizer::from_gguf(&toy_gguf()).unwrap()
}

/// Id of a single byte in the toy vocabulary.
pub fn byte_id(b: u8) -> u32 {
    2 + b as u32
}

pub fn smollm2_path() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.exists().then_some(p)
}

/// SmolLM2's tokenizer read from its GGUF by the loader, when the file is present.
pub fn smollm2() -> Option<Tokenizer> {
    let path = smollm2_path()?;
    let file = pdnode_engine::loader::gguf::GgufFile::open(&path).unwrap();
    let source = pdnode_engine::loader::gguf_model::tokenizer_from_gguf(&file).unwrap();
    Some(Tokenizer::from_source(&source).unwrap())
}
