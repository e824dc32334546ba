//! Building a `tokenizers::Tokenizer` from the tokenizer a GGUF file stores in its metadata.
//!
//! A GGUF has no `tokenizer.json`: it stores the vocabulary (`tokenizer.ggml.tokens`), the BPE
//! merges, token types and special ids under llama.cpp's key names, and names the pre-tokenizer
//! (`tokenizer.ggml.pre`). We write the equivalent `tokenizer.json` document and let `tokenizers`
//! parse it, so the resulting tokenizer is the same kind of object an HF directory gives.
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with the pre-tokenizers in
//! [`pre_tokenizer_for`], and `"llama"` (SentencePiece BPE, as HF's `LlamaTokenizer`: Metaspace
//! with a prefix space on the first word, byte fallback, merges recovered from the scores when the
//! file has none, BOS added unless `add_bos_token` is false). Other kinds (`t5`, `bert`, ...) are
//! refused with an error naming the supported ones.

use super::TextError;
use crate::loader::GgufTokenizer;
use serde_json::{Value, json};

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_UNKNOWN: i32 = 2;
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Bytes one vocabulary token may have. Real vocabularies stay within a few hundred (SmolLM2's
/// longest is 162); the bound keeps the work per token small.
pub(crate) const MAX_TOKEN_BYTES: usize = 4096;
/// Merges a SentencePiece vocabulary may imply (every split of a token into two tokens is one):
/// real ones imply a few per token, a few hundred thousand for a 256k vocabulary.
const MAX_SPM_MERGES: usize = 1 << 22;

/// Llama 3's split regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_LLAMA3, HF Llama-3 tokenizer.json).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2, HF Qwen2 tokenizer.json).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const GPT2_PRE: &[&str] = &["default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "phi-2"];
const DIGITS_GPT2_PRE: &[&str] = &[
    "smollm",
    "starcoder",
    "refact",
    "codeshell",
    "command-r",
    "exaone",
    "minerva",
];
const LLAMA3_PRE: &[&str] = &[
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "smaug-bpe",
    "dbrx",
    "pixtral",
];
const QWEN2_PRE: &[&str] = &["qwen2", "deepseek-r1-qwen", "megrez"];

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_byte_level(regex: &str) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        byte_level(false),
    ]})
}

/// The pre-tokenizer (and whether BPE ignores merges for whole-vocabulary words) for a
/// `tokenizer.ggml.pre` value of a byte-level BPE vocabulary.
fn pre_tokenizer_for(pre: Option<&str>) -> Result<(Value, bool), TextError> {
    let name = pre.unwrap_or("default");
    if GPT2_PRE.contains(&name) {
        return Ok((byte_level(true), false));
    }
    if DIGITS_GPT2_PRE.contains(&name) {
        // llama.cpp: regexes "\p{N}" then GPT-2's; HF tokenizer.json: Digits then ByteLevel.
        let seq = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(true),
        ]});
        return Ok((seq, false));
    }
    if LLAMA3_PRE.contains(&name) {
        return Ok((split_then_byte_level(LLAMA3_SPLIT), true));
    }
    if QWEN2_PRE.contains(&name) {
        return Ok((split_then_byte_level(QWEN2_SPLIT), false));
    }
    let known: Vec<&str> = [GPT2_PRE, DIGITS_GPT2_PRE, LLAMA3_PRE, QWEN2_PRE].concat();
    Err(TextError::Unsupported {
        model: "gpt2".into(),
        reason: format!(
            "pre-tokenizer `{name}` is not supported; supported: {}",
            known.join(", ")
        ),
    })
}

fn check_id(what: &str, id: Option<u32>, n: usize) -> Result<(), TextError> {
    match id {
        Some(i) if i as usize >= n => Err(TextError::Load {
            path: None,
            reason: format!("GGUF {what} {i} is outside the vocabulary of {n} tokens"),
        }),
        _ => Ok(()),
    }
}

/// The `tokenizer.json` document equivalent to a GGUF tokenizer.
pub(crate) fn tokenizer_json(g: &GgufTokenizer) -> Result<Value, TextError> {
    let spm = match g.model.as_str() {
        "gpt2" => false,
        "llama" => true,
        other => {
            return Err(TextError::Unsupported {
                model: other.into(),
                reason: "supported GGUF tokenizers: `gpt2` (byte-level BPE), `llama` \
                         (SentencePiece BPE)"
                    .into(),
            });
        }
    };
    let n = g.tokens.len();
    if n == 0 {
        return Err(TextError::Load {
            path: None,
            reason: "GGUF tokenizer.ggml.tokens is empty".into(),
        });
    }
    if !g.token_types.is_empty() && g.token_types.len() != n {
        return Err(TextError::Load {
            path: None,
            reason: format!(
                "GGUF tokenizer.ggml.token_type has {} entries for {n} tokens",
                g.token_types.len()
            ),
        });
    }
    if let Some((id, t)) = g
        .tokens
        .iter()
        .enumerate()
        .find(|(_, t)| t.len() > MAX_TOKEN_BYTES)
    {
        return Err(TextError::Load {
            path: None,
            reason: format!(
                "GGUF token {id} is {} bytes long (at most {MAX_TOKEN_BYTES})",
                t.len()
            ),
        });
    }
    check_id("bos_token_id", g.bos_token_id, n)?;
    check_id("eos_token_id", g.eos_token_id, n)?;
    check_id("unknown_token_id", g.unk_token_id, n)?;
    check_id("padding_token_id", g.pad_token_id, n)?;

    // A duplicated spelling maps to its last id, as `{token: id for id, token in ...}` does in
    // transformers (control/user-defined duplicates stay reachable as added tokens).
    let mut vocab = serde_json::Map::with_capacity(n);
    for (id, tok) in g.tokens.iter().enumerate() {
        vocab.insert(tok.clone(), Value::from(id as u64));
    }
    let merges = if spm && g.merges.is_empty() {
        spm_merges(g, MAX_SPM_MERGES)?
    } else {
        let mut merges = Vec::with_capacity(g.merges.len());
        for (i, m) in g.merges.iter().enumerate() {
            let Some((a, b)) = m.split_once(' ') else {
                return Err(TextError::Load {
                    path: None,
                    reason: format!(
                        "GGUF merge {i} ({m:?}) is not two tokens separated by a space"
                    ),
                });
            };
            merges.push(json!([a, b]));
        }
        merges
    };
    let mut added = Vec::new();
    for (id, ty) in g.token_types.iter().enumerate() {
        let special = match *ty {
            TOKEN_TYPE_CONTROL => true,
            TOKEN_TYPE_USER_DEFINED => false,
            TOKEN_TYPE_UNKNOWN if spm => true,
            _ => continue,
        };
        added.push(json!({
            "id": id, "content": g.tokens[id], "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": special,
        }));
    }
    let post_processor = post_processor(g, spm)?;
    if spm {
        let unk = g.unk_token_id.map(|id| g.tokens[id as usize].clone());
        return Ok(json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": false},
            "post_processor": post_processor,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ]},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                "ignore_merges": false, "vocab": vocab, "merges": merges,
            },
        }));
    }
    let (pre_tokenizer, ignore_merges) = pre_tokenizer_for(g.pre.as_deref())?;
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges,
        },
    }))
}

/// BPE merges implied by a SentencePiece vocabulary and its scores (GGUF files of SentencePiece
/// models carry no merges): every split of a token into two vocabulary pieces is a merge ranked by
/// the token's score, highest first (then longer left, longer right piece), as transformers'
/// `generate_merges` ranks them. At most `max_merges`, else an error.
///
/// Linear in the vocabulary's bytes plus the merges' bytes: a rolling hash of every prefix and
/// suffix of a token filters the splits, and only a split whose two hashes are vocabulary
/// tokens' is compared byte for byte (hashing each piece of each split would be quadratic in a
/// token's length).
fn spm_merges(g: &GgufTokenizer, max_merges: usize) -> Result<Vec<Value>, TextError> {
    if g.scores.len() != g.tokens.len() {
        return Err(TextError::Load {
            path: None,
            reason: format!(
                "GGUF SentencePiece vocabulary has {} scores for {} tokens and no merges",
                g.scores.len(),
                g.tokens.len()
            ),
        });
    }
    let mut id: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let mut score: std::collections::HashMap<&str, f32> = std::collections::HashMap::new();
    let mut order: Vec<&str> = Vec::new();
    for (i, (t, &sc)) in g.tokens.iter().zip(&g.scores).enumerate() {
        id.insert(t, i);
        if score.insert(t, sc).is_none() {
            order.push(t);
        }
    }
    let hash = PieceHash::new(order.iter().map(|t| t.len()).max().unwrap_or(0));
    // Hash -> the id of the spelling with that hash; `true` when two spellings share it (then
    // the exact map decides).
    let mut by_hash: std::collections::HashMap<u64, (usize, bool)> =
        std::collections::HashMap::with_capacity(order.len());
    let mut prefixes = Vec::new();
    for &t in &order {
        hash.prefixes(t.as_bytes(), &mut prefixes);
        by_hash
            .entry(prefixes[t.len()])
            .and_modify(|e| e.1 = true)
            .or_insert((id[t], false));
    }
    let lookup = |piece: &str, h: u64| match by_hash.get(&h) {
        None => None,
        Some(&(i, false)) => (g.tokens[i] == piece).then_some(i),
        Some(&(_, true)) => id.get(piece).copied(),
    };
    // (left id, right id, left, right, score, chars of left, chars of right)
    let mut merges: Vec<(usize, usize, &str, &str, f32, usize, usize)> = Vec::new();
    for &tok in &order {
        let sc = score[tok];
        hash.prefixes(tok.as_bytes(), &mut prefixes);
        let chars = tok.chars().count();
        let mut local = Vec::new();
        for (left_chars, (cut, _)) in tok.char_indices().enumerate().skip(1) {
            let (l, r) = tok.split_at(cut);
            let Some(li) = lookup(l, prefixes[cut]) else {
                continue;
            };
            let Some(ri) = lookup(r, hash.suffix(&prefixes, cut)) else {
                continue;
            };
            local.push((li, ri, l, r, sc, left_chars, chars - left_chars));
        }
        local.sort_by_key(|m| (m.0, m.1));
        merges.extend(local);
        if merges.len() > max_merges {
            return Err(TextError::Load {
                path: None,
                reason: format!(
                    "GGUF SentencePiece vocabulary implies more than {max_merges} merges"
                ),
            });
        }
    }
    // Stable: equal keys keep their order.
    merges.sort_by(|a, b| b.4.total_cmp(&a.4).then(b.5.cmp(&a.5)).then(b.6.cmp(&a.6)));
    Ok(merges
        .into_iter()
        .map(|(_, _, l, r, ..)| json!([l, r]))
        .collect())
}

/// A polynomial rolling hash modulo the Mersenne prime 2^61 - 1 with a random base, so that a
/// crafted vocabulary cannot aim collisions at it (a collision costs a byte comparison, never a
/// wrong answer).
struct PieceHash {
    base: u64,
    /// `base^k` for every length up to the longest token.
    powers: Vec<u64>,
}

impl PieceHash {
    const P: u64 = (1 << 61) - 1;

    fn new(max_len: usize) -> Self {
        use std::hash::BuildHasher;
        let seed = std::collections::hash_map::RandomState::new().hash_one(0x5eed_u64);
        // Above every byte value + 1, below P.
        let base = 257 + seed % (Self::P - 257);
        let mut powers = Vec::with_capacity(max_len + 1);
        let mut p = 1;
        for _ in 0..=max_len {
            powers.push(p);
            p = Self::mul(p, base);
        }
        PieceHash { base, powers }
    }

    fn mul(a: u64, b: u64) -> u64 {
        let x = u128::from(a) * u128::from(b);
        // 2^61 = 1 (mod P).
        ((x as u64 & Self::P) + (x >> 61) as u64) % Self::P
    }

    /// `out[k]` = the hash of `bytes[..k]`, for `k` in `0..=bytes.len()`.
    fn prefixes(&self, bytes: &[u8], out: &mut Vec<u64>) {
        out.clear();
        out.push(0);
        let mut h = 0;
        for &b in bytes {
            h = (Self::mul(h, self.base) + u64::from(b) + 1) % Self::P;
            out.push(h);
        }
    }

    /// The hash of `bytes[cut..]`, from the prefix hashes of `bytes`.
    fn suffix(&self, prefixes: &[u64], cut: usize) -> u64 {
        let len = prefixes.len() - 1;
        let head = Self::mul(prefixes[cut], self.powers[len - cut]);
        (prefixes[len] + Self::P - head) % Self::P
    }
}

/// BOS/EOS insertion as the GGUF flags say (`encode(text, add_special = true)` applies it).
/// A byte-level vocabulary adds nothing unless the file asks for it; a SentencePiece one adds BOS.
fn post_processor(g: &GgufTokenizer, spm: bool) -> Result<Value, TextError> {
    let mut single = Vec::new();
    let mut specials = serde_json::Map::new();
    let mut add = |id: Option<u32>, flag: &str| -> Result<Option<Value>, TextError> {
        let Some(id) = id else {
            return Err(TextError::Load {
                path: None,
                reason: format!("GGUF sets add_{flag}_token but has no {flag}_token_id"),
            });
        };
        let tok = g.tokens[id as usize].clone();
        specials.insert(
            tok.clone(),
            json!({"id": tok, "ids": [id], "tokens": [tok]}),
        );
        Ok(Some(json!({"SpecialToken": {"id": tok, "type_id": 0}})))
    };
    // llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    let bos = if g.add_bos_token.unwrap_or(spm) {
        add(g.bos_token_id, "bos")?
    } else {
        None
    };
    let eos = if g.add_eos_token == Some(true) {
        add(g.eos_token_id, "eos")?
    } else {
        None
    };
    if bos.is_none() && eos.is_none() {
        return Ok(Value::Null);
    }
    single.extend(bos);
    single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    single.extend(eos);
    let mut pair = single.clone();
    pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
    Ok(
        json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(pre: Option<&str>) -> GgufTokenizer {
        GgufTokenizer {
            model: "gpt2".into(),
            pre: pre.map(str::to_string),
            tokens: vec!["<s>".into(), "a".into(), "b".into(), "ab".into()],
            merges: vec!["a b".into()],
            token_types: vec![3, 1, 1, 1],
            bos_token_id: Some(0),
            eos_token_id: Some(0),
            ..Default::default()
        }
    }

    #[test]
    fn unknown_models_and_pre_tokenizers_are_clear_errors() {
        let mut g = tiny(None);
        g.model = "t5".into();
        assert!(matches!(
            tokenizer_json(&g),
            Err(TextError::Unsupported { model, .. }) if model == "t5"
        ));
        // SentencePiece without merges needs scores.
        let mut g = tiny(None);
        g.model = "llama".into();
        g.merges.clear();
        assert!(matches!(tokenizer_json(&g), Err(TextError::Load { .. })));
        assert!(matches!(
            tokenizer_json(&tiny(Some("klingon"))),
            Err(TextError::Unsupported { .. })
        ));
    }

    #[test]
    fn malformed_metadata_is_an_error() {
        let mut g = tiny(None);
        g.merges = vec!["ab".into()];
        assert!(matches!(tokenizer_json(&g), Err(TextError::Load { .. })));
        let mut g = tiny(None);
        g.eos_token_id = Some(99);
        assert!(matches!(tokenizer_json(&g), Err(TextError::Load { .. })));
        let mut g = tiny(None);
        g.token_types = vec![1];
        assert!(matches!(tokenizer_json(&g), Err(TextError::Load { .. })));
        let mut g = tiny(None);
        g.add_bos_token = Some(true);
        g.bos_token_id = None;
        assert!(matches!(tokenizer_json(&g), Err(TextError::Load { .. })));
    }

    /// A SentencePiece vocabulary: tokens with scores, no merges.
    fn spm(tokens: Vec<String>) -> GgufTokenizer {
        let n = tokens.len();
        GgufTokenizer {
            model: "llama".into(),
            scores: (0..n).map(|i| -(i as f32 % 7.0)).collect(),
            token_types: vec![1; n],
            tokens,
            ..Default::default()
        }
    }

    /// The merges as transformers' `generate_merges` finds them: every split of every token
    /// looked up whole (quadratic in a token's length; what `spm_merges` replaced).
    fn merges_by_lookup(g: &GgufTokenizer) -> Vec<Value> {
        let mut id = std::collections::HashMap::new();
        let mut score = std::collections::HashMap::new();
        let mut order = Vec::new();
        for (i, (t, &sc)) in g.tokens.iter().zip(&g.scores).enumerate() {
            id.insert(t.as_str(), i);
            if score.insert(t.as_str(), sc).is_none() {
                order.push(t.as_str());
            }
        }
        let mut merges = Vec::new();
        for &tok in &order {
            let mut local = Vec::new();
            for (cut, _) in tok.char_indices().skip(1) {
                let (l, r) = tok.split_at(cut);
                if id.contains_key(l) && id.contains_key(r) {
                    local.push((l, r, score[tok], l.chars().count(), r.chars().count()));
                }
            }
            local.sort_by_key(|m| (id[m.0], id[m.1]));
            merges.extend(local);
        }
        merges.sort_by(|a, b| b.2.total_cmp(&a.2).then(b.3.cmp(&a.3)).then(b.4.cmp(&a.4)));
        merges.into_iter().map(|(l, r, ..)| json!([l, r])).collect()
    }

    #[test]
    fn spm_merges_are_those_of_whole_lookups() {
        // Every substring of a few words (multi-byte characters included), and duplicates.
        let mut tokens = Vec::new();
        for w in [
            "\u{2581}hello",
            "\u{2581}héllo",
            "aaaaaa",
            "ab\u{2581}ab",
            "日本語です",
        ] {
            let chars: Vec<char> = w.chars().collect();
            for i in 0..chars.len() {
                for j in i + 1..=chars.len() {
                    tokens.push(chars[i..j].iter().collect::<String>());
                }
            }
        }
        tokens.push("aa".into());
        tokens.push("\u{2581}h".into());
        let g = spm(tokens);
        let got = spm_merges(&g, MAX_SPM_MERGES).unwrap();
        assert!(got.len() > 100, "{}", got.len());
        assert_eq!(got, merges_by_lookup(&g));
    }

    /// A 1 MB token cost 10^12 bytes of hashing (every split, each piece hashed whole); tokens
    /// now have a bound, and a vocabulary of long tokens takes time linear in its bytes.
    #[test]
    fn long_tokens_are_refused_or_linear() {
        let g = spm(vec!["a".into(), "a".repeat(1 << 20)]);
        assert!(matches!(
            tokenizer_json(&g),
            Err(TextError::Load { reason, .. }) if reason.contains("token 1 ")
        ));
        // 2000 distinct tokens of the longest length: 8M splits, each filtered by its hashes.
        let mut tokens: Vec<String> = vec!["a".into(), "b".into()];
        for i in 0..2000u32 {
            let mut t = "a".repeat(MAX_TOKEN_BYTES - 32);
            t.push_str(&format!("{i:b}").replace('0', "a").replace('1', "b"));
            t.push_str(&"b".repeat(MAX_TOKEN_BYTES - t.len()));
            tokens.push(t);
        }
        let g = spm(tokens);
        let t0 = std::time::Instant::now();
        let merges = spm_merges(&g, MAX_SPM_MERGES).unwrap();
        let took = t0.elapsed();
        assert!(merges.is_empty());
        assert!(took < std::time::Duration::from_secs(5), "{took:?}");
    }

    #[test]
    fn too_many_implied_merges_is_an_error() {
        // a, aa, ..., a^100: 4950 splits.
        let g = spm((1..=100).map(|n| "a".repeat(n)).collect());
        assert_eq!(spm_merges(&g, 5000).unwrap().len(), 4950);
        assert!(matches!(spm_merges(&g, 4000), Err(TextError::Load { .. })));
    }

    #[test]
    fn every_supported_pre_tokenizer_parses() {
        for pre in [None, Some("smollm"), Some("llama-bpe"), Some("qwen2")] {
            let doc = tokenizer_json(&tiny(pre)).unwrap();
            let t: tokenizers::Tokenizer = serde_json::from_value(doc).unwrap();
            let ids = t.encode_fast("ab<s>", false).unwrap().get_ids().to_vec();
            assert_eq!(ids, vec![3, 0], "pre {pre:?}");
        }
    }
}
