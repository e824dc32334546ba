//! OutputAssembler: EOS, stop ids, stop strings across token boundaries, hold-back, length.

use crate::text_support;

use pdnode_core::{FinishReason, SamplingParams};
use pdnode_engine::sampling::{OutputAssembler, SamplingError, StopCause};
use pdnode_engine::text::Tokenizer;
use std::sync::Arc;
use text_support::{byte_id, toy};

const EOS: u32 = 0;

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams {
        max_tokens: 1000,
        ..Default::default()
    };
    f(&mut p);
    p
}

fn ids(tok: &Tokenizer, s: &str) -> Vec<u32> {
    tok.encode(s, false).unwrap()
}

/// Feeds ids until the assembler finishes; returns the deltas and the cause.
fn run(asm: &mut OutputAssembler, ids: &[u32]) -> (Vec<String>, Option<StopCause>) {
    let mut deltas = Vec::new();
    for &id in ids {
        let out = asm.push(id).unwrap();
        deltas.push(out.delta);
        if out.finish.is_some() {
            return (deltas, out.finish);
        }
    }
    (deltas, None)
}

fn assembler(tok: &Arc<Tokenizer>, p: &SamplingParams) -> OutputAssembler {
    OutputAssembler::new(Some(tok.clone()), p, &[EOS], &[], 4096).unwrap()
}

#[test]
fn eos_finishes_with_stop_and_its_text_is_not_output() {
    let tok = Arc::new(toy());
    let mut a = assembler(&tok, &params(|_| {}));
    let mut seq = ids(&tok, "Hello");
    seq.push(EOS);
    seq.extend(ids(&tok, "more"));
    let (deltas, cause) = run(&mut a, &seq);
    assert_eq!(cause, Some(StopCause::Eos(EOS)));
    assert_eq!(deltas.concat(), "Hello");
    assert_eq!(a.text(), "Hello");
    assert_eq!(a.finish_reason(), Some(FinishReason::Stop));
    // The EOS id is part of the output ids.
    assert_eq!(a.token_ids().last(), Some(&EOS));
    assert!(matches!(
        a.push(byte_id(b'x')),
        Err(SamplingError::AlreadyFinished { .. })
    ));
}

#[test]
fn ignore_eos_runs_to_max_tokens() {
    let tok = Arc::new(toy());
    let p = params(|p| {
        p.ignore_eos = true;
        p.max_tokens = 3;
    });
    let mut a = assembler(&tok, &p);
    let seq = [byte_id(b'a'), EOS, byte_id(b'b'), byte_id(b'c')];
    let (deltas, cause) = run(&mut a, &seq);
    assert_eq!(cause, Some(StopCause::MaxTokens));
    assert_eq!(a.finish_reason(), Some(FinishReason::Length));
    // EOS is special: skipped in the text.
    assert_eq!(deltas.concat(), "ab");
    assert_eq!(a.token_ids().len(), 3);
}

#[test]
fn stop_token_ids_finish_with_stop() {
    let tok = Arc::new(toy());
    let p = params(|p| p.stop_token_ids = vec![byte_id(b'!')]);
    let mut a = assembler(&tok, &p);
    let (deltas, cause) = run(&mut a, &ids(&tok, "Hi! there"));
    assert_eq!(cause, Some(StopCause::StopToken(byte_id(b'!'))));
    assert_eq!(deltas.concat(), "Hi");
}

#[test]
fn stop_strings_match_across_token_boundaries_and_are_removed() {
    let tok = Arc::new(toy());
    let p = params(|p| p.stop = vec!["o wo".into(), "zzz".into()]);
    let mut a = assembler(&tok, &p);
    let seq = ids(&tok, "Hello world");
    // "Hello world" is several tokens ("Hel", "lo", " wo", ...): "o wo" spans two of them.
    assert!(seq.len() >= 4);
    let (deltas, cause) = run(&mut a, &seq);
    assert_eq!(cause, Some(StopCause::StopString("o wo".into())));
    assert_eq!(deltas.concat(), "Hell");
    assert_eq!(a.text(), "Hell");
}

#[test]
fn the_earliest_stop_string_wins() {
    let tok = Arc::new(toy());
    let p = params(|p| p.stop = vec!["cd".into(), "bcde".into()]);
    let mut a = assembler(&tok, &p);
    // One token at a time; "bcde" is not complete when "cd" matches.
    let (_, cause) = run(&mut a, &ids(&tok, "abcdef"));
    assert_eq!(cause, Some(StopCause::StopString("cd".into())));
    assert_eq!(a.text(), "ab");
}

#[test]
fn text_that_may_start_a_stop_string_is_held_back_then_released() {
    let tok = Arc::new(toy());
    let p = params(|p| p.stop = vec!["STOP".into()]);
    let mut a = assembler(&tok, &p);
    let mut deltas = Vec::new();
    for id in ids(&tok, "xxST") {
        deltas.push(a.push(id).unwrap().delta);
    }
    // "ST" could begin "STOP": not streamed yet.
    assert_eq!(deltas.concat(), "xx");
    // "STA" cannot: released.
    let out = a.push(byte_id(b'A')).unwrap();
    assert_eq!(out.delta, "STA");
    // Held text is released when the request ends for another reason.
    let out = a.push(byte_id(b'S')).unwrap();
    assert_eq!(out.delta, "");
    let out = a.finish(FinishReason::Abort).unwrap();
    assert_eq!(out.delta, "S");
    assert_eq!(out.finish, Some(StopCause::External(FinishReason::Abort)));
    assert_eq!(a.text(), "xxSTAS");
}

#[test]
fn held_text_is_released_at_max_tokens() {
    let tok = Arc::new(toy());
    let p = params(|p| {
        p.stop = vec!["STOP".into()];
        p.max_tokens = 3;
    });
    let mut a = assembler(&tok, &p);
    let seq = [byte_id(b'a'), byte_id(b'S'), byte_id(b'T')];
    let (deltas, cause) = run(&mut a, &seq);
    assert_eq!(cause, Some(StopCause::MaxTokens));
    assert_eq!(deltas, vec!["a", "", "ST"]);
}

#[test]
fn the_context_window_ends_generation_with_length() {
    let tok = Arc::new(toy());
    let prompt = ids(&tok, "abcd");
    let mut a =
        OutputAssembler::new(Some(tok.clone()), &params(|_| {}), &[EOS], &prompt, 6).unwrap();
    let (deltas, cause) = run(&mut a, &ids(&tok, "xyz"));
    assert_eq!(cause, Some(StopCause::ContextLength));
    assert_eq!(cause.unwrap().finish_reason(), FinishReason::Length);
    assert_eq!(deltas.concat(), "xy");
}

#[test]
fn multibyte_characters_split_over_byte_tokens_stream_whole() {
    let tok = Arc::new(toy());
    let text = "emoji 😀🎉👍🏽 中文文本 café";
    let p = params(|p| p.stop = vec!["🎉👍🏾".into()]); // never matches: holds "🎉👍" a while
    let mut a = assembler(&tok, &p);
    // One byte per token: every multi-byte character is split.
    let seq: Vec<u32> = text.bytes().map(byte_id).collect();
    let mut deltas = Vec::new();
    for &id in &seq {
        let d = a.push(id).unwrap().delta;
        assert!(!d.contains('\u{FFFD}'), "partial character streamed: {d:?}");
        deltas.push(d);
    }
    deltas.push(a.finish(FinishReason::Stop).unwrap().delta);
    assert_eq!(deltas.concat(), text);
    assert_eq!(tok.decode(&seq, true).unwrap(), text);
}

#[test]
fn invalid_utf8_never_panics_and_comes_out_as_replacement_characters() {
    let tok = Arc::new(toy());
    let mut a = assembler(&tok, &params(|p| p.max_tokens = 4));
    // A lone continuation byte, a truncated 3-byte sequence, then ASCII.
    let seq = [byte_id(0x80), byte_id(0xE4), byte_id(0xB8), byte_id(b'a')];
    let (deltas, cause) = run(&mut a, &seq);
    assert_eq!(cause, Some(StopCause::MaxTokens));
    let all = deltas.concat();
    assert_eq!(all, tok.decode(&seq, true).unwrap());
    assert!(all.ends_with('a') && all.contains('\u{FFFD}'));
}

#[test]
fn unknown_ids_have_no_text_and_stop_strings_need_a_tokenizer() {
    let tok = Arc::new(toy());
    // Ids past the tokenizer (padding rows of a model's vocabulary) count but have no text, in
    // the prompt and in the output.
    let n = tok.vocab_size() as u32;
    let p = params(|p| p.max_tokens = 3);
    let mut a = OutputAssembler::new(Some(tok.clone()), &p, &[EOS], &[n + 5], 64).unwrap();
    assert_eq!(a.push(byte_id(b'a')).unwrap().delta, "a");
    assert_eq!(a.push(n).unwrap().delta, "");
    let out = a.push(byte_id(b'b')).unwrap();
    assert_eq!(out.delta, "b");
    assert_eq!(out.finish, Some(StopCause::MaxTokens));
    assert_eq!(a.token_ids(), &[byte_id(b'a'), n, byte_id(b'b')]);
    let stop = params(|p| p.stop = vec!["x".into()]);
    assert!(matches!(
        OutputAssembler::new(None, &stop, &[EOS], &[], 64),
        Err(SamplingError::StopStringsWithoutTokenizer)
    ));
    // Without a tokenizer: ids only, no text, same stop rules.
    let mut a = OutputAssembler::new(None, &params(|p| p.max_tokens = 2), &[EOS], &[], 64).unwrap();
    assert_eq!(a.push(5).unwrap().delta, "");
    assert_eq!(a.push(6).unwrap().finish, Some(StopCause::MaxTokens));
}

#[test]
fn random_streams_keep_the_invariants() {
    use rand::{Rng, SeedableRng};
    let tok = Arc::new(toy());
    let pieces = [
        "a", "b", "ab", "ST", "OP", " ", "中", "😀", "é", "\n", "Hel", "lo",
    ];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    for case in 0..300 {
        let text: String = (0..rng.random_range(1..30))
            .map(|_| pieces[rng.random_range(0..pieces.len())])
            .collect();
        // Byte tokens or merged tokens, so characters split or not.
        let ids: Vec<u32> = if rng.random_bool(0.5) {
            text.bytes().map(byte_id).collect()
        } else {
            tok.encode(&text, false).unwrap()
        };
        let stops: Vec<String> = (0..rng.random_range(0..3))
            .map(|_| {
                (0..rng.random_range(1..4))
                    .map(|_| pieces[rng.random_range(0..pieces.len())])
                    .collect()
            })
            .collect();
        let p = params(|p| p.stop = stops.clone());
        let mut a = assembler(&tok, &p);
        let mut deltas = String::new();
        let mut cause = None;
        for &id in &ids {
            let out = a.push(id).unwrap();
            assert!(!out.delta.contains('\u{FFFD}'), "case {case}");
            deltas.push_str(&out.delta);
            if out.finish.is_some() {
                cause = out.finish;
                break;
            }
        }
        if cause.is_none() {
            deltas.push_str(&a.finish(FinishReason::Length).unwrap().delta);
        }
        let out = a.text();
        assert_eq!(deltas, out, "case {case}: deltas vs text");
        assert!(
            text.starts_with(out),
            "case {case}: {out:?} not a prefix of {text:?}"
        );
        for s in &stops {
            assert!(
                !out.contains(s.as_str()),
                "case {case}: {s:?} left in {out:?}"
            );
        }
        match cause {
            Some(StopCause::StopString(s)) => {
                assert!(text[out.len()..].starts_with(&s), "case {case}")
            }
            _ => assert_eq!(out, text, "case {case}: no stop, whole text"),
        }
    }
}
