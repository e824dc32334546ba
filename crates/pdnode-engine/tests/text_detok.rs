//! IncrementalDecoder: streamed deltas never split a character and add up to the full decode.

use crate::text_support;

use pdnode_engine::text::{IncrementalDecoder, Tokenizer};
use text_support::{byte_id, toy};

const TEXTS: &[&str] = &[
    "Hello world, Hello world!",
    "emoji 😀🎉👍🏽 and 👨‍👩‍👧‍👦 family",
    "日本語のテキストと中文文本 한국어",
    "café naïve résumé",
    "  spaces\n\nand\ttabs  ",
    "<|user|>special<|end|>tokens",
];

fn stream(tok: &Tokenizer, dec: &mut IncrementalDecoder, ids: &[u32]) -> Vec<String> {
    let mut out: Vec<String> = ids.iter().map(|&id| dec.step(tok, id).unwrap()).collect();
    out.push(dec.flush(tok).unwrap());
    out
}

fn check(tok: &Tokenizer, ids: &[u32], skip_special: bool) {
    let mut dec = IncrementalDecoder::new(skip_special);
    let deltas = stream(tok, &mut dec, ids);
    let full = tok.decode(ids, skip_special).unwrap();
    assert_eq!(deltas.concat(), full, "ids {ids:?}");
    if !full.contains('\u{FFFD}') {
        for d in &deltas {
            assert!(
                !d.contains('\u{FFFD}'),
                "partial character streamed in {d:?}"
            );
        }
    }
}

#[test]
fn deltas_concatenate_to_the_full_decode_with_merges() {
    let tok = toy();
    for t in TEXTS {
        let ids = tok.encode(t, false).unwrap();
        check(&tok, &ids, true);
        check(&tok, &ids, false);
    }
}

#[test]
fn characters_split_across_byte_tokens_come_out_whole() {
    let tok = toy();
    for t in TEXTS {
        let ids: Vec<u32> = t.bytes().map(byte_id).collect();
        let mut dec = IncrementalDecoder::new(true);
        let mut got = String::new();
        for &id in &ids {
            let d = dec.step(&tok, id).unwrap();
            // Each non-empty delta is whole characters: it is a prefix of what remains.
            assert!(
                t[got.len()..].starts_with(&d),
                "{d:?} does not continue {got:?} in {t:?}"
            );
            got.push_str(&d);
        }
        got.push_str(&dec.flush(&tok).unwrap());
        assert_eq!(got, *t);
    }
}

#[test]
fn a_pending_character_is_held_until_complete() {
    let tok = toy();
    let mut dec = IncrementalDecoder::new(true);
    let bytes = "中".as_bytes();
    assert_eq!(dec.step(&tok, byte_id(bytes[0])).unwrap(), "");
    assert_eq!(dec.step(&tok, byte_id(bytes[1])).unwrap(), "");
    assert_eq!(dec.pending(), 2);
    assert_eq!(dec.step(&tok, byte_id(bytes[2])).unwrap(), "中");
    assert_eq!(dec.pending(), 0);
    // An incomplete character at the end comes out as U+FFFD on flush.
    assert_eq!(dec.step(&tok, byte_id(bytes[0])).unwrap(), "");
    assert_eq!(dec.flush(&tok).unwrap(), "\u{FFFD}");
}

#[test]
fn prompt_context_does_not_leak_into_the_output() {
    let tok = toy();
    let prompt = tok
        .encode("Hello world, this is the prompt", false)
        .unwrap();
    let out = tok.encode(" and 中文 output", false).unwrap();
    let mut dec = IncrementalDecoder::with_prompt(&prompt, true);
    assert_eq!(stream(&tok, &mut dec, &out).concat(), " and 中文 output");
}

#[test]
fn out_of_range_ids_are_errors() {
    let tok = toy();
    let mut dec = IncrementalDecoder::new(true);
    assert!(dec.step(&tok, tok.vocab_size() as u32).is_err());
    // The decoder is still usable.
    assert_eq!(dec.step(&tok, byte_id(b'a')).unwrap(), "a");
}

#[test]
fn smollm2_streams_every_reference_string_exactly() {
    let Some(tok) = text_support::smollm2() else {
        eprintln!("SmolLM2 GGUF not present; skipped");
        return;
    };
    for t in TEXTS {
        let ids = tok.encode(t, false).unwrap();
        check(&tok, &ids, false);
    }
}
