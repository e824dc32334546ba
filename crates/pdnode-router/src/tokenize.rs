//! What the router needs of the model's tokenizer: [`Tokenize`] and [`ChatRender`], implemented
//! by the node runtime with the engine's tokenizer (the router does not depend on the engine),
//! and an incremental [`Detokenizer`] with stop-string handling on top of them.

use serde::{Deserialize, Serialize};

/// A tokenizer failure; reported as an invalid request (the input could not be tokenized).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct TokenizeError(pub String);

pub trait Tokenize: Send + Sync + 'static {
    /// Text to token ids. `add_special_tokens`: add BOS etc. as the model's tokenizer does (true
    /// for raw prompts; false for rendered chat templates, which carry their own).
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError>;
    /// Token ids to text, skipping special tokens.
    fn decode(&self, ids: &[u32]) -> Result<String, TokenizeError>;
    /// Vocabulary size: token ids at or above it are refused.
    fn vocab_size(&self) -> u32;
}

/// One chat message with plain-text content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub trait ChatRender: Send + Sync + 'static {
    /// Renders messages with the model's chat template, the generation prompt appended.
    fn render(&self, messages: &[ChatMessage]) -> Result<String, TokenizeError>;
}

/// Turns a growing list of token ids into text deltas (holding back incomplete UTF-8) and cuts
/// the text at the first stop string (holding back what may be the start of one).
pub struct Detokenizer<'a> {
    tok: &'a dyn Tokenize,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    stop: Vec<String>,
    /// Text decoded but not yet emitted (a possible stop-string prefix).
    pending: String,
    stopped: bool,
}

impl<'a> Detokenizer<'a> {
    pub fn new(tok: &'a dyn Tokenize, stop: Vec<String>) -> Self {
        Self {
            tok,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            stop,
            pending: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string was matched (no more text follows).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds tokens; returns the text that can be emitted now.
    pub fn push(&mut self, new_ids: &[u32]) -> Result<String, TokenizeError> {
        if self.stopped {
            return Ok(String::new());
        }
        self.ids.extend_from_slice(new_ids);
        let prefix = self
            .tok
            .decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.tok.decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            self.pending.push_str(&full[prefix.len()..]);
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
        }
        Ok(self.take_emittable())
    }

    /// The end of the stream: flush what was held back.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.pending)
    }

    fn take_emittable(&mut self) -> String {
        if let Some((pos, _)) = self
            .stop
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|p| (p, s.len())))
            .min()
        {
            self.stopped = true;
            let out = self.pending[..pos].to_string();
            self.pending.clear();
            return out;
        }
        // Hold back the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stop {
            for k in (1..s.len().min(self.pending.len() + 1)).rev() {
                if self.pending.is_char_boundary(self.pending.len() - k)
                    && s.is_char_boundary(k)
                    && self.pending.ends_with(&s[..k])
                {
                    keep = keep.max(k);
                    break;
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeTokenizer;

    #[test]
    fn deltas_concatenate_to_the_text_and_stop_strings_cut() {
        let tok = FakeTokenizer;
        let ids = tok.encode("hello world, bye now", true).unwrap();
        let mut d = Detokenizer::new(&tok, vec![]);
        let mut out = String::new();
        for id in &ids {
            out.push_str(&d.push(&[*id]).unwrap());
        }
        out.push_str(&d.finish());
        assert_eq!(out, "hello world, bye now");

        let mut d = Detokenizer::new(&tok, vec![", b".into()]);
        let mut out = String::new();
        for id in &ids {
            out.push_str(&d.push(&[*id]).unwrap());
            if d.stopped() {
                break;
            }
        }
        assert!(d.stopped());
        assert_eq!(out, "hello world");
    }

    #[test]
    fn multibyte_characters_are_held_until_complete() {
        let tok = FakeTokenizer;
        // The fake tokenizer is byte-level: "é" is two tokens.
        let ids = tok.encode("é", true).unwrap();
        assert_eq!(ids.len(), 2);
        let mut d = Detokenizer::new(&tok, vec![]);
        assert_eq!(d.push(&ids[..1]).unwrap(), "");
        assert_eq!(d.push(&ids[1..]).unwrap(), "é");
    }
}
