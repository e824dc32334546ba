//! Request and sampling parameters, shared by the frontends, the router and the engine.

use crate::error::{Classify, ErrorKind};
use crate::ids::RequestId;
use serde::{Deserialize, Serialize};

/// Where a request's sampler stands in its random stream: what the prefill node hands to the
/// decode node (through the router) so that seeded sampling draws the numbers a colocated engine
/// draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// The seed in use (the request's, or the random one drawn for it).
    pub seed: u64,
    /// ChaCha20 word position.
    pub word_pos: u128,
}

/// How to pick each next token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1.0 disables nucleus sampling.
    pub top_p: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    /// 0 disables min-p.
    pub min_p: f32,
    /// 1.0 disables the repetition penalty (HF semantics: divides positive logits).
    pub repetition_penalty: f32,
    /// OpenAI semantics: subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// OpenAI semantics: subtracted per occurrence of a token already generated.
    pub frequency_penalty: f32,
    /// Same seed, same output. `None` draws a random seed per request.
    pub seed: Option<u64>,
    /// Maximum tokens to generate.
    pub max_tokens: u32,
    /// Stop strings; the matched string is not part of the output.
    pub stop: Vec<String>,
    /// Extra token ids that end generation (the model's EOS ids always do unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Return the log-probability of each sampled token and this many top alternatives.
    pub logprobs: Option<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: 16,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

/// Most top-logprobs a request may ask for.
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 16;

/// Longest stop string, bytes (each is searched in the text every token).
pub const MAX_STOP_STRING_BYTES: usize = 1024;

/// Most stop token ids a request may give (each engine step checks each sampled token against
/// them, on the engine's thread).
pub const MAX_STOP_TOKEN_IDS: usize = 256;

/// Longest latency target a request or the config may set, ms (an hour).
pub const SLO_MAX_MS: u64 = 3_600_000;

/// A parameter out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid parameter `{param}`: {reason}")]
pub struct InvalidParam {
    pub param: &'static str,
    pub reason: String,
}

impl Classify for InvalidParam {
    fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidRequest
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: u32) -> Self {
        Self {
            temperature: 0.0,
            max_tokens,
            ..Self::default()
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks every field's range; the error names the parameter.
    pub fn validate(&self) -> Result<(), InvalidParam> {
        fn bad(param: &'static str, reason: impl Into<String>) -> Result<(), InvalidParam> {
            Err(InvalidParam {
                param,
                reason: reason.into(),
            })
        }
        let t = self.temperature;
        if !t.is_finite() || !(0.0..=100.0).contains(&t) {
            return bad("temperature", format!("{t} is outside [0, 100]"));
        }
        let p = self.top_p;
        if !(p.is_finite() && p > 0.0 && p <= 1.0) {
            return bad("top_p", format!("{p} is outside (0, 1]"));
        }
        let m = self.min_p;
        if !m.is_finite() || !(0.0..=1.0).contains(&m) {
            return bad("min_p", format!("{m} is outside [0, 1]"));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0 && r <= 10.0) {
            return bad("repetition_penalty", format!("{r} is outside (0, 10]"));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() || !(-2.0..=2.0).contains(&v) {
                return bad(name, format!("{v} is outside [-2, 2]"));
            }
        }
        if self.max_tokens == 0 {
            return bad("max_tokens", "must be at least 1");
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return bad(
                "stop",
                format!(
                    "{} stop strings, at most {MAX_STOP_STRINGS}",
                    self.stop.len()
                ),
            );
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return bad("stop", "stop strings must not be empty");
        }
        if let Some(s) = self.stop.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
            return bad(
                "stop",
                format!(
                    "a stop string of {} bytes, at most {MAX_STOP_STRING_BYTES}",
                    s.len()
                ),
            );
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return bad(
                "stop_token_ids",
                format!(
                    "{} stop token ids, at most {MAX_STOP_TOKEN_IDS}",
                    self.stop_token_ids.len()
                ),
            );
        }
        if let Some(n) = self.logprobs
            && n > MAX_TOP_LOGPROBS
        {
            return bad("logprobs", format!("{n} is above {MAX_TOP_LOGPROBS}"));
        }
        Ok(())
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS token, stop token id or stop string.
    Stop,
    /// `max_tokens` reached or the context is full.
    Length,
    /// Cancelled by the client.
    Abort,
    /// Failed; the error accompanies it.
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// A tokenized request as the router hands it to the engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub id: RequestId,
    pub prompt_token_ids: Vec<u32>,
    pub sampling: SamplingParams,
}

/// Log-probability of one token, with its top alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_greedy_is_greedy() {
        assert!(SamplingParams::default().validate().is_ok());
        assert!(SamplingParams::greedy(4).is_greedy());
    }

    #[test]
    fn out_of_range_values_name_the_parameter() {
        let cases: Vec<(SamplingParams, &str)> = vec![
            (
                SamplingParams {
                    temperature: -1.0,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    top_p: 1.5,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingParams {
                    min_p: 2.0,
                    ..Default::default()
                },
                "min_p",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: 3.0,
                    ..Default::default()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: -3.0,
                    ..Default::default()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    max_tokens: 0,
                    ..Default::default()
                },
                "max_tokens",
            ),
            (
                SamplingParams {
                    logprobs: Some(21),
                    ..Default::default()
                },
                "logprobs",
            ),
            (
                SamplingParams {
                    stop: vec![String::new()],
                    ..Default::default()
                },
                "stop",
            ),
            (
                SamplingParams {
                    stop: vec!["x".to_string(); MAX_STOP_STRINGS + 1],
                    ..Default::default()
                },
                "stop",
            ),
            (
                SamplingParams {
                    stop: vec!["x".repeat(MAX_STOP_STRING_BYTES + 1)],
                    ..Default::default()
                },
                "stop",
            ),
            (
                SamplingParams {
                    stop_token_ids: vec![7; MAX_STOP_TOKEN_IDS + 1],
                    ..Default::default()
                },
                "stop_token_ids",
            ),
        ];
        // At the limits: valid.
        let at = SamplingParams {
            stop: vec!["x".repeat(MAX_STOP_STRING_BYTES); MAX_STOP_STRINGS],
            stop_token_ids: vec![7; MAX_STOP_TOKEN_IDS],
            ..Default::default()
        };
        assert!(at.validate().is_ok());
        for (p, name) in cases {
            let e = p.validate().unwrap_err();
            assert_eq!(e.param, name);
            assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        }
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = serde_json::from_str::<SamplingParams>(r#"{"temprature": 0.5}"#);
        assert!(e.is_err());
    }
}
