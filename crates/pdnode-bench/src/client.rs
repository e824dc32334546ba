//! One streaming request against an OpenAI-compatible endpoint, timed from the stream.

use crate::error::BenchError;
use crate::sse::SseParser;
use crate::workload::RequestSpec;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// Which OpenAI API to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Api {
    /// `POST /v1/completions` with `prompt`.
    Completions,
    /// `POST /v1/chat/completions` with one user message.
    Chat,
}

/// Where and how to send requests.
#[derive(Debug, Clone, Serialize)]
pub struct Endpoint {
    /// Base URL, e.g. `http://127.0.0.1:8000` (a trailing `/v1` is accepted).
    pub base_url: String,
    pub model: String,
    pub api: Api,
    #[serde(skip)]
    pub api_key: Option<String>,
    /// Send `"ignore_eos": true` (vLLM/SGLang/pdnode extension) so outputs reach `max_tokens`.
    pub ignore_eos: bool,
    /// Deadline of one request, connect to last byte.
    pub timeout: Duration,
}

/// What one request measured. Times are seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestResult {
    /// `None`: succeeded. Otherwise the error kind: `connect`, `timeout`, `http_<status>`,
    /// `stream` (malformed stream or an error event), `no_tokens`, `incomplete` (the stream ended
    /// before its finish).
    pub error: Option<String>,
    pub error_detail: Option<String>,
    /// Time to the first non-empty output chunk.
    pub ttft_s: Option<f64>,
    /// Gaps between consecutive output chunks.
    pub itl_s: Vec<f64>,
    /// Send to the end of the stream.
    pub e2e_s: f64,
    /// The server's `usage.prompt_tokens`, else the workload's estimate.
    pub input_tokens: u32,
    /// The server's `usage.completion_tokens`, else the number of output chunks.
    pub output_tokens: u32,
}

impl RequestResult {
    pub fn is_ok(&self) -> bool {
        self.error.is_none()
    }

    /// Time per output token after the first: `(e2e - ttft) / (output_tokens - 1)`.
    pub fn tpot_s(&self) -> Option<f64> {
        let ttft = self.ttft_s?;
        (self.output_tokens > 1).then(|| (self.e2e_s - ttft) / f64::from(self.output_tokens - 1))
    }

    fn failed(kind: &str, detail: impl Into<String>, e2e: f64, input_tokens: u32) -> Self {
        RequestResult {
            error: Some(kind.to_string()),
            error_detail: Some(detail.into()),
            ttft_s: None,
            itl_s: Vec::new(),
            e2e_s: e2e,
            input_tokens,
            output_tokens: 0,
        }
    }
}

/// Normalises a base URL: no trailing `/`, no trailing `/v1`.
pub fn normalize_base(url: &str) -> String {
    let u = url.trim().trim_end_matches('/');
    u.strip_suffix("/v1").unwrap_or(u).to_string()
}

#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    ep: Endpoint,
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    completion_tokens: Option<u32>,
}

impl Client {
    pub fn new(mut ep: Endpoint) -> Result<Self, BenchError> {
        ep.base_url = normalize_base(&ep.base_url);
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(10).min(ep.timeout))
            .pool_max_idle_per_host(1024)
            .build()
            .map_err(|e| BenchError::Endpoint {
                url: ep.base_url.clone(),
                reason: e.to_string(),
            })?;
        Ok(Self { http, ep })
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.ep
    }

    /// The first model the endpoint lists at `/v1/models`.
    pub async fn discover_model(
        base_url: &str,
        api_key: Option<&str>,
        timeout: Duration,
    ) -> Result<String, BenchError> {
        let base = normalize_base(base_url);
        let url = format!("{base}/v1/models");
        let err = |reason: String| BenchError::Endpoint {
            url: url.clone(),
            reason,
        };
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            .timeout(timeout)
            .build()
            .map_err(|e| err(e.to_string()))?;
        let mut req = http.get(&url);
        if let Some(k) = api_key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await.map_err(|e| err(e.to_string()))?;
        if !resp.status().is_success() {
            return Err(err(format!("HTTP {}", resp.status())));
        }
        let v: serde_json::Value = resp.json().await.map_err(|e| err(e.to_string()))?;
        v["data"][0]["id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| err("no model listed (pass --model)".into()))
    }

    fn body(&self, spec: &RequestSpec) -> serde_json::Value {
        let mut b = serde_json::json!({
            "model": self.ep.model,
            "max_tokens": spec.output_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
            "temperature": 0.0,
        });
        match self.ep.api {
            Api::Completions => b["prompt"] = spec.prompt.clone().into(),
            Api::Chat => {
                b["messages"] = serde_json::json!([{"role": "user", "content": spec.prompt}])
            }
        }
        if self.ep.ignore_eos {
            b["ignore_eos"] = true.into();
        }
        b
    }

    /// Sends one request and times its stream. Never fails: errors are part of the result.
    pub async fn send(&self, spec: &RequestSpec) -> RequestResult {
        let start = Instant::now();
        match tokio::time::timeout(self.ep.timeout, self.stream(spec, start)).await {
            Ok(r) => r,
            Err(_) => RequestResult::failed(
                "timeout",
                format!("no complete answer within {:?}", self.ep.timeout),
                start.elapsed().as_secs_f64(),
                spec.input_tokens,
            ),
        }
    }

    async fn stream(&self, spec: &RequestSpec, start: Instant) -> RequestResult {
        let path = match self.ep.api {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        };
        let mut req = self
            .http
            .post(format!("{}{path}", self.ep.base_url))
            .json(&self.body(spec));
        if let Some(k) = &self.ep.api_key {
            req = req.bearer_auth(k);
        }
        let fail = |kind: &str, detail: String| {
            RequestResult::failed(
                kind,
                detail,
                start.elapsed().as_secs_f64(),
                spec.input_tokens,
            )
        };
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) if e.is_timeout() => return fail("timeout", e.to_string()),
            Err(e) => return fail("connect", e.to_string()),
        };
        let status = resp.status();
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            let detail: String = body.chars().take(300).collect();
            return fail(&format!("http_{}", status.as_u16()), detail);
        }

        let mut parser = SseParser::new();
        let mut body = resp.bytes_stream();
        let mut ttft = None;
        let mut last = None::<Instant>;
        let mut itl = Vec::new();
        let mut chunks = 0u32;
        let mut usage_out = None;
        let mut usage_in = None;
        let mut finished = false;
        let mut done = false;

        'read: while let Some(bytes) = body.next().await {
            let bytes = match bytes {
                Ok(b) => b,
                Err(e) => return fail("stream", format!("body: {e}")),
            };
            let events = match parser.push(&bytes) {
                Ok(ev) => ev,
                Err(e) => return fail("stream", e.to_string()),
            };
            let now = Instant::now();
            for data in events {
                let data = data.trim();
                if data == "[DONE]" {
                    done = true;
                    break 'read;
                }
                let chunk: Chunk = match serde_json::from_str(data) {
                    Ok(c) => c,
                    Err(e) => return fail("stream", format!("bad chunk {data:?}: {e}")),
                };
                if let Some(err) = chunk.error {
                    return fail("stream", format!("error event: {err}"));
                }
                if let Some(u) = chunk.usage {
                    usage_in = u.prompt_tokens.or(usage_in);
                    usage_out = u.completion_tokens.or(usage_out);
                }
                for c in chunk.choices {
                    let text = c.text.or(c.delta.and_then(|d| d.content));
                    if text.is_some_and(|t| !t.is_empty()) {
                        chunks += 1;
                        match last {
                            None => ttft = Some(now.duration_since(start).as_secs_f64()),
                            Some(prev) => itl.push(now.duration_since(prev).as_secs_f64()),
                        }
                        last = Some(now);
                    }
                    if c.finish_reason.is_some() {
                        finished = true;
                    }
                }
            }
        }
        let e2e = start.elapsed().as_secs_f64();
        if !done && !finished {
            return fail("incomplete", "the stream ended before [DONE]".into());
        }
        if ttft.is_none() {
            return fail("no_tokens", "the stream carried no output text".into());
        }
        RequestResult {
            error: None,
            error_detail: None,
            ttft_s: ttft,
            itl_s: itl,
            e2e_s: e2e,
            input_tokens: usage_in.unwrap_or(spec.input_tokens),
            output_tokens: usage_out.unwrap_or(chunks).max(1),
        }
    }
}
