//! Incremental, UTF-8-safe detokenization for streaming.
//!
//! The prefix/read-offset technique of vLLM and TGI: keep the generated ids; on each new id decode
//! two windows that start at `prefix_offset`, one ending at `read_offset` (text already emitted)
//! and one ending at the newest id. The new text is what the longer window adds, emitted only when
//! it does not end in U+FFFD (a multi-byte character whose remaining bytes are still to come, in
//! byte-level BPE or byte-fallback vocabularies). Decoding a short window instead of the whole
//! sequence keeps each step O(window), and starting the window one emission back keeps decoders
//! that look at neighbours (SentencePiece's leading-space rule) right.

use super::{TextError, Tokenizer};

/// Prompt ids kept as leading context, so the first generated token decodes as it would after
/// the prompt (vLLM keeps 5).
const PROMPT_CONTEXT: usize = 5;

/// Per-request streaming decoder. Feed ids with [`IncrementalDecoder::step`]; call
/// [`IncrementalDecoder::flush`] at the end to release text held back for an incomplete character.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    skip_special: bool,
    /// Prompt context followed by the generated ids.
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// A decoder with no prompt context.
    pub fn new(skip_special: bool) -> Self {
        Self {
            skip_special,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// A decoder whose first output decodes as a continuation of `prompt_ids`' last few tokens.
    pub fn with_prompt(prompt_ids: &[u32], skip_special: bool) -> Self {
        let ctx = &prompt_ids[prompt_ids.len().saturating_sub(PROMPT_CONTEXT)..];
        Self {
            skip_special,
            ids: ctx.to_vec(),
            prefix_offset: 0,
            read_offset: ctx.len(),
        }
    }

    /// Adds one generated id; returns the text it completes (often empty while a character or a
    /// special token is pending).
    pub fn step(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TextError> {
        tok.check_ids(&[id])?;
        self.ids.push(id);
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = suffix_after(&full, &prefix);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(delta)
    }

    /// Releases whatever is held back (an incomplete character comes out as U+FFFD).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String, TextError> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        let delta = suffix_after(&full, &prefix);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(delta)
    }

    /// Generated ids not yet turned into text.
    pub fn pending(&self) -> usize {
        self.ids.len() - self.read_offset
    }
}

/// `full` minus the already-emitted `prefix`. When a decoder rewrote the prefix (it normally
/// does not), fall back to what follows the longest common prefix, on a character boundary.
fn suffix_after(full: &str, prefix: &str) -> String {
    if let Some(rest) = full.strip_prefix(prefix) {
        return rest.to_string();
    }
    let mut common = 0;
    for ((i, a), b) in full.char_indices().zip(prefix.chars()) {
        if a != b {
            break;
        }
        common = i + a.len_utf8();
    }
    full[common..].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffix_after_handles_rewritten_prefixes_on_char_boundaries() {
        assert_eq!(suffix_after("héllo", "hé"), "llo");
        assert_eq!(suffix_after("h\u{FFFD}llo", "hé"), "\u{FFFD}llo");
        assert_eq!(suffix_after("abc", ""), "abc");
    }
}
