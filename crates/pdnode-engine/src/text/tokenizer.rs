//! [`Tokenizer`]: the model's tokenizer with its special tokens and chat template.

use super::chat::ChatTemplate;
use super::{TextError, gguf};
use crate::loader::{GgufTokenizer, HfTokenizerConfig, TokenizerSource};
use std::collections::HashSet;
use std::path::Path;

/// A model's tokenizer. Cheap to share behind an `Arc`; every method takes `&self`.
///
/// `encode(text, add_special = true)` adds what the tokenizer's post-processor adds (BOS for
/// Llama-family `tokenizer.json`s, or what the GGUF `add_bos_token`/`add_eos_token` flags say).
/// Chat prompts rendered by [`ChatTemplate`] already carry their special tokens and are encoded
/// with `add_special = false`, as HF's `apply_chat_template(tokenize=True)` and vLLM do. Special
/// tokens written in the text (`<|im_start|>`) are always matched as single tokens.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    vocab_size: usize,
    special_ids: HashSet<u32>,
    bos_token: Option<String>,
    bos_token_id: Option<u32>,
    eos_token: Option<String>,
    eos_token_ids: Vec<u32>,
    chat_template: Option<String>,
}

fn load_err(path: Option<&Path>, reason: impl ToString) -> TextError {
    TextError::Load {
        path: path.map(Path::to_path_buf),
        reason: reason.to_string(),
    }
}

impl Tokenizer {
    /// Builds the tokenizer the loader found. [`TokenizerSource::None`] is [`TextError::NoTokenizer`].
    pub fn from_source(source: &TokenizerSource) -> Result<Self, TextError> {
        match source {
            TokenizerSource::HfFile { path, config } => Self::from_hf_file(path, config),
            TokenizerSource::Gguf(g) => Self::from_gguf(g),
            TokenizerSource::None => Err(TextError::NoTokenizer),
        }
    }

    /// From an HF `tokenizer.json` and what `tokenizer_config.json` says about it.
    pub fn from_hf_file(path: &Path, config: &HfTokenizerConfig) -> Result<Self, TextError> {
        let bytes = std::fs::read(path).map_err(|e| load_err(Some(path), e))?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| load_err(Some(path), e))?;
        let mut t = Self::wrap(inner, 0);
        if let Some(bos) = &config.bos_token {
            t.bos_token_id = t.inner.token_to_id(bos);
            t.bos_token = Some(bos.clone());
        }
        if let Some(eos) = &config.eos_token {
            t.eos_token = Some(eos.clone());
            match t.inner.token_to_id(eos) {
                Some(id) => t.eos_token_ids.push(id),
                None => {
                    return Err(load_err(
                        Some(path),
                        format!(
                            "eos_token {eos:?} of tokenizer_config.json is not in the vocabulary"
                        ),
                    ));
                }
            }
        }
        t.chat_template = config.chat_template.clone();
        Ok(t)
    }

    /// From the tokenizer stored in GGUF metadata (byte-level BPE; see `text::gguf`).
    pub fn from_gguf(g: &GgufTokenizer) -> Result<Self, TextError> {
        let doc = gguf::tokenizer_json(g)?;
        let inner: tokenizers::Tokenizer =
            serde_json::from_value(doc).map_err(|e| load_err(None, e))?;
        let mut t = Self::wrap(inner, g.tokens.len());
        t.bos_token_id = g.bos_token_id;
        t.bos_token = g.bos_token_id.map(|id| g.tokens[id as usize].clone());
        t.eos_token = g.eos_token_id.map(|id| g.tokens[id as usize].clone());
        t.eos_token_ids = g.eos_token_id.into_iter().collect();
        t.chat_template = g.chat_template.clone();
        Ok(t)
    }

    /// Wraps a ready `tokenizers::Tokenizer` (tests, embedders). No special tokens or template.
    pub fn from_tokenizers(inner: tokenizers::Tokenizer) -> Self {
        Self::wrap(inner, 0)
    }

    fn wrap(inner: tokenizers::Tokenizer, min_vocab: usize) -> Self {
        let added = inner.get_added_tokens_decoder();
        // Ids are dense in practice; the largest known id bounds what decode accepts.
        let max_added = added.keys().map(|&id| id as usize + 1).max().unwrap_or(0);
        let special_ids = added
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        let vocab_size = inner.get_vocab_size(true).max(max_added).max(min_vocab);
        Self {
            inner,
            vocab_size,
            special_ids,
            bos_token: None,
            bos_token_id: None,
            eos_token: None,
            eos_token_ids: Vec::new(),
            chat_template: None,
        }
    }

    /// Adds end-of-sequence ids (e.g. `generation_config.json`'s, or `ModelSpec::eos_token_ids`).
    pub fn add_eos_token_ids(&mut self, ids: impl IntoIterator<Item = u32>) {
        for id in ids {
            if !self.eos_token_ids.contains(&id) {
                self.eos_token_ids.push(id);
            }
        }
    }

    /// Replaces the chat template (e.g. one given in the config, overriding the model's).
    pub fn set_chat_template(&mut self, template: Option<String>) {
        self.chat_template = template;
    }

    /// Token ids of `text`; `add_special` applies the post-processor (BOS/EOS insertion).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TextError> {
        let enc = self
            .inner
            .encode_fast(text, add_special)
            .map_err(|e| TextError::Encode {
                reason: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Checks every id against the vocabulary.
    pub fn check_ids(&self, ids: &[u32]) -> Result<(), TextError> {
        match ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            Some(&id) => Err(TextError::TokenOutOfRange {
                id,
                vocab_size: self.vocab_size,
            }),
            None => Ok(()),
        }
    }

    /// Text of `ids`; `skip_special` drops special tokens (EOS, `<|im_start|>`, ...). Bytes that
    /// do not form valid UTF-8 come out as U+FFFD. An id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TextError> {
        self.check_ids(ids)?;
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TextError::Decode {
                reason: e.to_string(),
            })
    }

    /// Ids the tokenizer knows (model vocabulary plus added tokens). A model's embedding may have
    /// more rows (padding); those ids have no text.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary entry of `id` (byte-level spelling, e.g. "Ġthe"), if any.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is a special token (dropped by `decode(.., skip_special = true)`).
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Ids that end generation (unless a request sets `ignore_eos`).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// The raw chat template source, if the model has one.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The compiled chat template; [`TextError::NoChatTemplate`] for a model without one.
    pub fn chat_template(&self) -> Result<ChatTemplate, TextError> {
        let src = self
            .chat_template
            .as_deref()
            .ok_or(TextError::NoChatTemplate)?;
        ChatTemplate::new(
            src,
            self.bos_token.as_deref().unwrap_or(""),
            self.eos_token.as_deref().unwrap_or(""),
        )
    }

    /// The wrapped `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
