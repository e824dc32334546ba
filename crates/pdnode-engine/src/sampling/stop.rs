//! From sampled tokens to streamed text and a finish reason.
//!
//! Per token, in vLLM's order:
//! 1. an EOS id (unless `ignore_eos`) or a `stop_token_ids` id finishes with `stop`; the token is
//!    part of `token_ids` but its text is not part of the output;
//! 2. otherwise the token is detokenized incrementally, and the stop strings are searched in the
//!    output text, across token boundaries (only the region the new text can complete); the
//!    earliest match finishes with `stop` and the text is cut where the match begins;
//! 3. the context length (prompt + generated reaching `context_len`) and then `max_tokens` finish
//!    with `length`.
//!
//! While streaming, text that could be the beginning of a stop string is held back (and bytes of
//! an incomplete UTF-8 character, by the decoder); everything held is released when the request
//! finishes without a stop string match. So the concatenated deltas always equal [`OutputAssembler::text`].

use super::SamplingError;
use crate::text::{IncrementalDecoder, Tokenizer};
use pdnode_core::{FinishReason, SamplingParams};
use std::sync::Arc;

/// What finished a request, in detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopCause {
    /// A model EOS id.
    Eos(u32),
    /// One of the request's `stop_token_ids`.
    StopToken(u32),
    /// One of the request's stop strings (the string).
    StopString(String),
    /// `max_tokens` generated.
    MaxTokens,
    /// The context window is full.
    ContextLength,
    /// Ended from outside ([`OutputAssembler::finish`]).
    External(FinishReason),
}

impl StopCause {
    pub fn finish_reason(&self) -> FinishReason {
        match self {
            StopCause::Eos(_) | StopCause::StopToken(_) | StopCause::StopString(_) => {
                FinishReason::Stop
            }
            StopCause::MaxTokens | StopCause::ContextLength => FinishReason::Length,
            StopCause::External(r) => *r,
        }
    }
}

/// The outcome of one token.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepOutput {
    /// New text to stream (may be empty).
    pub delta: String,
    /// Set on the token that finished the request.
    pub finish: Option<StopCause>,
}

/// Per-request output state: tokens in, text deltas and the finish out.
#[derive(Debug)]
pub struct OutputAssembler {
    tokenizer: Option<Arc<Tokenizer>>,
    decoder: IncrementalDecoder,
    eos_ids: Vec<u32>,
    stop_token_ids: Vec<u32>,
    stop: Vec<String>,
    max_stop_len: usize,
    max_tokens: usize,
    prompt_len: usize,
    context_len: usize,
    token_ids: Vec<u32>,
    text: String,
    /// Bytes of `text` already returned as deltas.
    emitted: usize,
    finished: Option<StopCause>,
}

impl OutputAssembler {
    /// `tokenizer` is `None` for a model without one (token ids only; stop strings are refused).
    /// Ids are checked against the model's vocabulary by [`super::SequenceSampler`]; an id the
    /// tokenizer does not know (a padding row of the embedding, e.g. Qwen2.5's 152064 rows for
    /// 151665 tokens) counts as a token with no text.
    /// `eos_ids` are the model's end-of-sequence ids; `context_len` the model's context window.
    /// Special tokens are left out of the text (vLLM's `skip_special_tokens = true`).
    pub fn new(
        tokenizer: Option<Arc<Tokenizer>>,
        params: &SamplingParams,
        eos_ids: &[u32],
        prompt_ids: &[u32],
        context_len: usize,
    ) -> Result<Self, SamplingError> {
        params.validate()?;
        if tokenizer.is_none() && !params.stop.is_empty() {
            return Err(SamplingError::StopStringsWithoutTokenizer);
        }
        // Ids the tokenizer does not know (rows a model pads its vocabulary with) have no text.
        let known: Vec<u32> = match &tokenizer {
            Some(t) => prompt_ids
                .iter()
                .copied()
                .filter(|&id| (id as usize) < t.vocab_size())
                .collect(),
            None => Vec::new(),
        };
        Ok(Self {
            decoder: IncrementalDecoder::with_prompt(&known, true),
            tokenizer,
            eos_ids: if params.ignore_eos {
                Vec::new()
            } else {
                eos_ids.to_vec()
            },
            stop_token_ids: params.stop_token_ids.clone(),
            max_stop_len: params.stop.iter().map(String::len).max().unwrap_or(0),
            stop: params.stop.clone(),
            max_tokens: params.max_tokens as usize,
            prompt_len: prompt_ids.len(),
            context_len,
            token_ids: Vec::new(),
            text: String::new(),
            emitted: 0,
            finished: None,
        })
    }

    /// Takes the next generated token.
    pub fn push(&mut self, token: u32) -> Result<StepOutput, SamplingError> {
        if let Some(c) = &self.finished {
            return Err(SamplingError::AlreadyFinished {
                reason: c.finish_reason().as_str(),
            });
        }
        self.token_ids.push(token);
        let mut cause = if self.eos_ids.contains(&token) {
            Some(StopCause::Eos(token))
        } else if self.stop_token_ids.contains(&token) {
            Some(StopCause::StopToken(token))
        } else {
            None
        };
        if cause.is_none()
            && let Some(t) = &self.tokenizer
            && (token as usize) < t.vocab_size()
        {
            let new = self.decoder.step(t, token)?;
            let before = self.text.len();
            self.text.push_str(&new);
            cause = self.find_stop(before);
        }
        if cause.is_none() {
            let generated = self.token_ids.len();
            if self.prompt_len + generated >= self.context_len {
                cause = Some(StopCause::ContextLength);
            } else if generated >= self.max_tokens {
                cause = Some(StopCause::MaxTokens);
            }
        }
        match cause {
            Some(c) => self.end(c),
            None => {
                let safe = self.text.len() - self.held_back();
                let delta = self.text[self.emitted..safe].to_string();
                self.emitted = safe;
                Ok(StepOutput {
                    delta,
                    finish: None,
                })
            }
        }
    }

    /// Ends the request from outside (abort, error): releases all held text.
    pub fn finish(&mut self, reason: FinishReason) -> Result<StepOutput, SamplingError> {
        if let Some(c) = &self.finished {
            return Err(SamplingError::AlreadyFinished {
                reason: c.finish_reason().as_str(),
            });
        }
        self.end(StopCause::External(reason))
    }

    fn end(&mut self, cause: StopCause) -> Result<StepOutput, SamplingError> {
        if !matches!(cause, StopCause::StopString(_))
            && let Some(t) = &self.tokenizer
        {
            let rest = self.decoder.flush(t)?;
            self.text.push_str(&rest);
        }
        let delta = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        self.finished = Some(cause.clone());
        Ok(StepOutput {
            delta,
            finish: Some(cause),
        })
    }

    /// Searches the stop strings in the part of the text that `before..` can complete; on a match
    /// cuts the text where it begins.
    fn find_stop(&mut self, before: usize) -> Option<StopCause> {
        if self.stop.is_empty() || self.text.len() == before {
            return None;
        }
        let mut from = before.saturating_sub(self.max_stop_len.saturating_sub(1));
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hay = &self.text[from..];
        let (pos, which) = self
            .stop
            .iter()
            .enumerate()
            .filter_map(|(i, s)| hay.find(s.as_str()).map(|p| (p, i)))
            .min()?;
        self.text.truncate(from + pos);
        Some(StopCause::StopString(self.stop[which].clone()))
    }

    /// Bytes at the end of the text that could begin a stop string.
    fn held_back(&self) -> usize {
        let mut held = 0;
        for s in &self.stop {
            let longest = (s.len() - 1).min(self.text.len());
            for k in (held + 1..=longest).rev() {
                if s.is_char_boundary(k) && self.text.as_bytes().ends_with(&s.as_bytes()[..k]) {
                    held = k;
                    break;
                }
            }
        }
        held.min(self.text.len() - self.emitted)
    }

    /// All generated ids, including a final EOS or stop id.
    pub fn token_ids(&self) -> &[u32] {
        &self.token_ids
    }

    /// The output text so far (a stop string and what follows it removed).
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn finished(&self) -> Option<&StopCause> {
        self.finished.as_ref()
    }

    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finished.as_ref().map(StopCause::finish_reason)
    }
}
