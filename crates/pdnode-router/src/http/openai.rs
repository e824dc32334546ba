//! OpenAI request bodies: parsing (unknown fields refused, the offending parameter named) and
//! conversion into sampling params and a prompt.
//!
//! Fields that OpenAI, vLLM or SGLang clients commonly send are known here even where this
//! server has nothing to do with them ([`CommonParams::check_compat`]): bookkeeping that cannot
//! change the output (`store`, `metadata`, `service_tier`, `stream_options.include_obfuscation`)
//! is accepted and ignored; `add_special_tokens` is honoured; output-changing extras are
//! accepted at the value that matches what this server does (`skip_special_tokens = true`,
//! `include_stop_str_in_output = false`, `min_tokens = 0`, `priority = 0`, ...) and refused,
//! naming the parameter, at any other value. Anything else unknown is refused rather than
//! silently ignored, as OpenAI does.

use crate::error::RouterError;
use crate::tokenize::ChatMessage;
use pdnode_core::SamplingParams;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use std::collections::HashMap;

/// Parses a JSON body into `T`, naming the parameter at fault.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, RouterError> {
    if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(body) {
        return Err(RouterError::InvalidRequest {
            message: format!("the body is not valid JSON: {e}"),
        });
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        // `unknown field `x`, expected ...`: name the field itself.
        let unknown = inner
            .strip_prefix("unknown field `")
            .and_then(|r| r.split('`').next())
            .map(str::to_string);
        match unknown {
            Some(field) => {
                // The path already ends with the unknown field's name.
                let param = if path == "." || path.is_empty() {
                    field.clone()
                } else {
                    path
                };
                RouterError::param(param, format!("unknown parameter `{field}`"))
            }
            None if path == "." || path.is_empty() => {
                RouterError::InvalidRequest { message: inner }
            }
            None => RouterError::param(path, inner),
        }
    })
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    #[serde(default)]
    pub continuous_usage_stats: bool,
    /// OpenAI's random padding of stream events; never sent here, so accepted and ignored.
    #[serde(default)]
    pub include_obfuscation: Option<bool>,
}

/// `prompt` of `/v1/completions`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// The prompt in one of its two usable forms.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

impl Prompt {
    pub fn into_input(self) -> Result<PromptInput, RouterError> {
        let one = |n: usize| {
            if n == 1 {
                Ok(())
            } else {
                Err(RouterError::param(
                    "prompt",
                    format!("{n} prompts in one request; only one is supported"),
                ))
            }
        };
        match self {
            Prompt::Text(s) => Ok(PromptInput::Text(s)),
            Prompt::Tokens(t) => Ok(PromptInput::Tokens(t)),
            Prompt::Texts(mut v) => {
                one(v.len())?;
                Ok(PromptInput::Text(v.remove(0)))
            }
            Prompt::TokenLists(mut v) => {
                one(v.len())?;
                Ok(PromptInput::Tokens(v.remove(0)))
            }
        }
    }
}

/// Sampling fields shared by both endpoints (flattened into each body).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<StopSpec>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub user: Option<String>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<u32>>,
    // OpenAI / vLLM / SGLang extras: see `CommonParams::check_compat`.
    pub store: Option<bool>,
    pub metadata: Option<serde_json::Value>,
    pub service_tier: Option<String>,
    pub priority: Option<i64>,
    pub skip_special_tokens: Option<bool>,
    pub spaces_between_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    pub add_special_tokens: Option<bool>,
    pub min_tokens: Option<i64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
    // Flattening would defeat deny_unknown_fields; the shared fields are listed here too.
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<StopSpec>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub user: Option<String>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<u32>>,
    // OpenAI / vLLM / SGLang extras: see `CommonParams::check_compat`.
    pub store: Option<bool>,
    pub metadata: Option<serde_json::Value>,
    pub service_tier: Option<String>,
    pub priority: Option<i64>,
    pub skip_special_tokens: Option<bool>,
    pub spaces_between_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    pub add_special_tokens: Option<bool>,
    pub min_tokens: Option<i64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a message's content. Only `text` parts are served; the other fields are kept so
/// that an image, audio or file part is refused by its type (`messages[i].content[j]`) instead of
/// failing the body's parse.
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessageIn {
    pub role: String,
    pub content: Option<Content>,
    pub name: Option<String>,
    pub tool_calls: Option<serde_json::Value>,
    pub tool_call_id: Option<String>,
    pub refusal: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    pub response_format: Option<serde_json::Value>,
    // vLLM / SGLang chat extras, accepted at the value this server implements.
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub echo: Option<bool>,
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<StopSpec>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub user: Option<String>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<u32>>,
    // OpenAI / vLLM / SGLang extras: see `CommonParams::check_compat`.
    pub store: Option<bool>,
    pub metadata: Option<serde_json::Value>,
    pub service_tier: Option<String>,
    pub priority: Option<i64>,
    pub skip_special_tokens: Option<bool>,
    pub spaces_between_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    pub add_special_tokens: Option<bool>,
    pub min_tokens: Option<i64>,
}

macro_rules! common_of {
    ($r:expr) => {
        CommonParams {
            model: $r.model.clone(),
            max_tokens: $r.max_tokens,
            temperature: $r.temperature,
            top_p: $r.top_p,
            top_k: $r.top_k,
            min_p: $r.min_p,
            seed: $r.seed,
            stop: $r.stop.clone(),
            n: $r.n,
            stream: $r.stream,
            stream_options: $r.stream_options.clone(),
            presence_penalty: $r.presence_penalty,
            frequency_penalty: $r.frequency_penalty,
            repetition_penalty: $r.repetition_penalty,
            logit_bias: $r.logit_bias.clone(),
            user: $r.user.clone(),
            ignore_eos: $r.ignore_eos,
            stop_token_ids: $r.stop_token_ids.clone(),
            store: $r.store,
            metadata: $r.metadata.clone(),
            service_tier: $r.service_tier.clone(),
            priority: $r.priority,
            skip_special_tokens: $r.skip_special_tokens,
            spaces_between_special_tokens: $r.spaces_between_special_tokens,
            include_stop_str_in_output: $r.include_stop_str_in_output,
            add_special_tokens: $r.add_special_tokens,
            min_tokens: $r.min_tokens,
        }
    };
}

impl CompletionRequest {
    pub fn common(&self) -> CommonParams {
        common_of!(self)
    }

    /// Refuses documented parameters this server does not implement.
    pub fn check_unsupported(&self) -> Result<(), RouterError> {
        if self.echo == Some(true) {
            return Err(RouterError::param("echo", "echo = true is not supported"));
        }
        if let Some(b) = self.best_of
            && b != 1
        {
            return Err(RouterError::param(
                "best_of",
                "only best_of = 1 is supported",
            ));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(RouterError::param("suffix", "suffix is not supported"));
        }
        self.common().check_compat()
    }
}

impl ChatRequest {
    pub fn common(&self) -> CommonParams {
        let mut c = common_of!(self);
        if self.max_completion_tokens.is_some() {
            c.max_tokens = self.max_completion_tokens;
        }
        c
    }

    pub fn check_unsupported(&self) -> Result<(), RouterError> {
        let set = |v: &Option<serde_json::Value>| {
            v.as_ref().is_some_and(|v| match v {
                serde_json::Value::Null => false,
                serde_json::Value::Array(a) => !a.is_empty(),
                serde_json::Value::String(s) => s != "none",
                _ => true,
            })
        };
        if set(&self.tools) {
            return Err(RouterError::param("tools", "tool calling is not supported"));
        }
        if set(&self.tool_choice) {
            return Err(RouterError::param(
                "tool_choice",
                "tool calling is not supported",
            ));
        }
        if let Some(rf) = &self.response_format {
            let text = rf.get("type").and_then(|t| t.as_str()) == Some("text");
            if !rf.is_null() && !text {
                return Err(RouterError::param(
                    "response_format",
                    "only {\"type\": \"text\"} is supported",
                ));
            }
        }
        if self.top_logprobs.is_some() && self.logprobs != Some(true) {
            return Err(RouterError::param(
                "top_logprobs",
                "top_logprobs needs logprobs = true",
            ));
        }
        only(
            "add_generation_prompt",
            self.add_generation_prompt,
            true,
            "the chat template always ends with the assistant's turn",
        )?;
        only(
            "continue_final_message",
            self.continue_final_message,
            false,
            "continuing the final message is not supported",
        )?;
        only("echo", self.echo, false, "echo = true is not supported")?;
        self.common().check_compat()
    }

    /// The messages as plain text.
    pub fn messages(&self) -> Result<Vec<ChatMessage>, RouterError> {
        if self.messages.is_empty() {
            return Err(RouterError::param(
                "messages",
                "at least one message is needed",
            ));
        }
        let mut out = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            let role = chat_role(&m.role, || format!("messages[{i}].role"))?;
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(s)) => s.clone(),
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        let why = match (p.kind.as_str(), &p.text, p.other.keys().next()) {
                            ("text", Some(t), None) => {
                                s.push_str(t);
                                continue;
                            }
                            ("text", None, _) => "a text part needs `text`".to_string(),
                            ("text", Some(_), Some(k)) => {
                                format!("unknown field `{k}` in a text part")
                            }
                            (other, ..) => format!(
                                "content parts of type `{other}` are not supported (only `text`)"
                            ),
                        };
                        return Err(RouterError::param(
                            format!("messages[{i}].content[{j}]"),
                            why,
                        ));
                    }
                    s
                }
            };
            out.push(ChatMessage {
                role: role.to_string(),
                content,
            });
        }
        Ok(out)
    }
}

/// Refuses `param` when it is set to anything but `supported`.
fn only(param: &str, v: Option<bool>, supported: bool, why: &str) -> Result<(), RouterError> {
    match v {
        Some(b) if b != supported => Err(RouterError::param(param, why)),
        _ => Ok(()),
    }
}

impl CommonParams {
    /// Checks the OpenAI / vLLM / SGLang extras (module docs): bookkeeping is ignored, the rest
    /// must ask for what this server does anyway.
    pub fn check_compat(&self) -> Result<(), RouterError> {
        only(
            "skip_special_tokens",
            self.skip_special_tokens,
            true,
            "special tokens are always skipped in the output text",
        )?;
        only(
            "spaces_between_special_tokens",
            self.spaces_between_special_tokens,
            true,
            "only the default (true) is supported",
        )?;
        only(
            "include_stop_str_in_output",
            self.include_stop_str_in_output,
            false,
            "the matched stop string is never included in the output",
        )?;
        if let Some(n) = self.min_tokens
            && n != 0
        {
            return Err(RouterError::param(
                "min_tokens",
                "min_tokens is not supported (only 0)",
            ));
        }
        if let Some(p) = self.priority
            && p != 0
        {
            return Err(RouterError::param(
                "priority",
                "priority scheduling is not supported (only 0)",
            ));
        }
        Ok(())
    }

    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }

    /// Sampling params; `max_tokens` falls back to `default_max_tokens`. `logprobs` is the
    /// number of top alternatives asked for (None: no logprobs).
    pub fn sampling(
        &self,
        default_max_tokens: u32,
        logprobs: Option<u32>,
    ) -> Result<SamplingParams, RouterError> {
        if let Some(n) = self.n
            && n != 1
        {
            return Err(RouterError::param("n", "only n = 1 is supported"));
        }
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(RouterError::param(
                "logit_bias",
                "logit_bias is not supported",
            ));
        }
        let mut s = SamplingParams::default();
        if let Some(t) = self.temperature {
            s.temperature = t;
        }
        if let Some(p) = self.top_p {
            s.top_p = p;
        }
        if let Some(k) = self.top_k {
            // -1 is the common spelling of "disabled".
            s.top_k = match k {
                -1 | 0 => 0,
                k if k > 0 => u32::try_from(k)
                    .map_err(|_| RouterError::param("top_k", format!("{k} is too large")))?,
                k => return Err(RouterError::param("top_k", format!("{k} is negative"))),
            };
        }
        if let Some(p) = self.min_p {
            s.min_p = p;
        }
        if let Some(seed) = self.seed {
            s.seed = Some(seed as u64);
        }
        if let Some(stop) = &self.stop {
            s.stop = stop.clone().into_vec();
        }
        if let Some(p) = self.presence_penalty {
            s.presence_penalty = p;
        }
        if let Some(p) = self.frequency_penalty {
            s.frequency_penalty = p;
        }
        if let Some(p) = self.repetition_penalty {
            s.repetition_penalty = p;
        }
        s.ignore_eos = self.ignore_eos.unwrap_or(false);
        s.stop_token_ids = self.stop_token_ids.clone().unwrap_or_default();
        s.logprobs = logprobs;
        s.max_tokens = match self.max_tokens {
            None => default_max_tokens,
            Some(n) if n < 1 => {
                return Err(RouterError::param(
                    "max_tokens",
                    format!("{n} is less than the minimum of 1"),
                ));
            }
            Some(n) => u32::try_from(n)
                .map_err(|_| RouterError::param("max_tokens", format!("{n} is too large")))?,
        };
        s.validate()
            .map_err(|e| RouterError::param(e.param, e.reason))?;
        Ok(s)
    }
}

/// The role a chat message is rendered with (`developer` is `system`); any other than system,
/// developer, user and assistant is refused, naming the field (`field()`), on HTTP and gRPC alike.
pub fn chat_role(role: &str, field: impl FnOnce() -> String) -> Result<&'static str, RouterError> {
    match role {
        "system" | "developer" => Ok("system"),
        "user" => Ok("user"),
        "assistant" => Ok("assistant"),
        other => Err(RouterError::param(
            field(),
            format!(
                "unsupported role `{}` (system, developer, user, assistant)",
                other.chars().take(64).collect::<String>()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_and_bad_types_name_the_parameter() {
        let e = parse::<CompletionRequest>(br#"{"prompt": "x", "bogus": 1}"#).unwrap_err();
        assert!(
            matches!(e, RouterError::InvalidParam { ref param, .. } if param == "bogus"),
            "{e:?}"
        );
        let e =
            parse::<CompletionRequest>(br#"{"prompt": "x", "temperature": "hot"}"#).unwrap_err();
        assert!(
            matches!(e, RouterError::InvalidParam { ref param, .. } if param == "temperature"),
            "{e:?}"
        );
        let e = parse::<CompletionRequest>(br#"{"prompt": "x""#).unwrap_err();
        assert!(matches!(e, RouterError::InvalidRequest { .. }), "{e:?}");
        let e =
            parse::<ChatRequest>(br#"{"messages": [{"role": "user", "content": "x", "foo": 1}]}"#)
                .unwrap_err();
        assert!(
            matches!(e, RouterError::InvalidParam { ref param, .. } if param.ends_with("foo")),
            "{e:?}"
        );
    }

    #[test]
    fn sampling_conversion_checks_ranges() {
        let r: CompletionRequest =
            parse(br#"{"prompt": [1, 2], "max_tokens": 5, "stop": "x", "top_k": -1, "seed": 3}"#)
                .unwrap();
        let s = r.common().sampling(16, None).unwrap();
        assert_eq!((s.max_tokens, s.top_k, s.seed), (5, 0, Some(3)));
        assert_eq!(s.stop, vec!["x".to_string()]);
        assert_eq!(
            r.prompt.into_input().unwrap(),
            PromptInput::Tokens(vec![1, 2])
        );
        for (body, param) in [
            (r#"{"prompt": "x", "max_tokens": -1}"#, "max_tokens"),
            (r#"{"prompt": "x", "n": 2}"#, "n"),
            (r#"{"prompt": "x", "temperature": -0.5}"#, "temperature"),
            (r#"{"prompt": "x", "top_p": 0}"#, "top_p"),
            (
                &format!(r#"{{"prompt": "x", "stop_token_ids": {:?}}}"#, [7; 257]),
                "stop_token_ids",
            ),
            (
                &format!(r#"{{"prompt": "x", "stop": ["{}"]}}"#, "s".repeat(1025)),
                "stop",
            ),
        ] {
            let r: CompletionRequest = parse(body.as_bytes()).unwrap();
            let e = r.common().sampling(16, None).unwrap_err();
            assert!(
                matches!(e, RouterError::InvalidParam { param: ref p, .. } if p == param),
                "{body}: {e:?}"
            );
        }
    }

    #[test]
    fn chat_messages_accept_text_parts_and_refuse_tools() {
        let r: ChatRequest = parse(
            br#"{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 3}"#,
        )
        .unwrap();
        let m = r.messages().unwrap();
        assert_eq!(m[1].content, "hi");
        // Other parts are refused by their type, a malformed text part by what it lacks or adds.
        for (part, want) in [
            (
                r#"{"type": "image_url", "image_url": {"url": "data:,"}}"#,
                "type `image_url` are not supported",
            ),
            (r#"{"type": "input_audio"}"#, "type `input_audio`"),
            (r#"{"type": "text"}"#, "needs `text`"),
            (
                r#"{"type": "text", "text": "a", "txt": 1}"#,
                "unknown field `txt`",
            ),
        ] {
            let body = format!(
                r#"{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "a"}}, {part}]}}]}}"#
            );
            let r: ChatRequest = parse(body.as_bytes()).unwrap();
            match r.messages() {
                Err(RouterError::InvalidParam { param, message }) => {
                    assert_eq!(param, "messages[0].content[1]", "{part}");
                    assert!(message.contains(want), "{part}: {message}");
                }
                other => panic!("{part}: {other:?}"),
            }
        }
        assert_eq!(r.common().max_tokens, Some(3));
        let r: ChatRequest = parse(
            br#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}"#,
        )
        .unwrap();
        assert!(
            matches!(r.check_unsupported(), Err(RouterError::InvalidParam { ref param, .. }) if param == "tools")
        );
    }
}
