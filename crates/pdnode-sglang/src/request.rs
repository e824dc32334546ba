//! A client's request body as the router sees it: the route, whether it streams, how many
//! sequences it holds (a batch gets one bootstrap entry per sequence), the text the policies
//! route by, and the bootstrap fields added for one attempt. The body is otherwise passed on
//! unchanged: the workers validate it.

use serde_json::{Map, Value, json};

/// The generation routes forwarded to both workers of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    Generate,
    Completions,
    ChatCompletions,
}

impl Route {
    pub fn path(self) -> &'static str {
        match self {
            Route::Generate => "/generate",
            Route::Completions => "/v1/completions",
            Route::ChatCompletions => "/v1/chat/completions",
        }
    }

    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            Route::Generate => "generate",
            Route::Completions => "completions",
            Route::ChatCompletions => "chat_completions",
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestError {
    #[error("the request body is not valid JSON: {0}")]
    NotJson(String),
    #[error("the request body must be a JSON object")]
    NotObject,
    #[error("`{field}` must be {expected}")]
    BadField {
        field: &'static str,
        expected: &'static str,
    },
}

/// A parsed client request.
#[derive(Debug, Clone)]
pub struct ClientRequest {
    pub route: Route,
    pub body: Map<String, Value>,
    pub stream: bool,
    /// Sequences in the request when it is a batch (`text`/`input_ids`/`prompt` arrays, or
    /// `n` > 1 on the OpenAI routes); `None` for one sequence.
    pub batch: Option<usize>,
    /// The text the policies route by (cache-aware prefix matching): the prompt, or the chat
    /// messages' text.
    pub routing_text: String,
    /// Whether the client asked for logprobs (the prefill worker's input logprobs are then
    /// merged in front of the decode worker's on `/generate`).
    pub wants_logprobs: bool,
    /// The key the `manual` policy routes by: the `X-SMG-Routing-Key` header, else the body's
    /// `rid` when it is one string (a batch's `rid` list does not name one session).
    pub routing_key: Option<String>,
}

/// The bootstrap fields of one attempt: where the decode worker fetches the KV from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    pub host: String,
    pub port: Option<u16>,
    /// One room per sequence (one for a single request).
    pub rooms: Vec<u64>,
}

/// Largest routing text kept per request, bytes (the policies need a prefix, not the prompt).
const ROUTING_TEXT_MAX: usize = 4096;

impl ClientRequest {
    pub fn parse(route: Route, bytes: &[u8]) -> Result<Self, RequestError> {
        let value: Value =
            serde_json::from_slice(bytes).map_err(|e| RequestError::NotJson(e.to_string()))?;
        let Value::Object(body) = value else {
            return Err(RequestError::NotObject);
        };
        let stream = match body.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(RequestError::BadField {
                    field: "stream",
                    expected: "a boolean",
                });
            }
        };
        let batch = batch_size(route, &body)?;
        let routing_text = routing_text(route, &body);
        let wants_logprobs = match route {
            Route::Generate => body.get("return_logprob") == Some(&Value::Bool(true)),
            Route::Completions => body.get("logprobs").is_some_and(|v| !v.is_null()),
            Route::ChatCompletions => body.get("logprobs") == Some(&Value::Bool(true)),
        };
        let routing_key = match body.get("rid") {
            Some(Value::String(rid)) => checked_key(Some(rid.as_bytes()))?,
            _ => None,
        };
        Ok(Self {
            route,
            body,
            stream,
            batch,
            routing_text,
            wants_logprobs,
            routing_key,
        })
    }

    /// Parses a request and takes its routing key from `header` (the `X-SMG-Routing-Key`
    /// value) when the client sent one: the header wins over the body's `rid`.
    pub fn parse_with_key(
        route: Route,
        bytes: &[u8],
        header: Option<&[u8]>,
    ) -> Result<Self, RequestError> {
        let mut req = Self::parse(route, bytes)?;
        if header.is_some() {
            req.routing_key = checked_key(header)?;
        }
        Ok(req)
    }

    /// Rooms one attempt needs.
    pub fn sequences(&self) -> usize {
        self.batch.unwrap_or(1)
    }

    /// The body of one attempt: the client's body plus `bootstrap_host`, `bootstrap_port` and
    /// `bootstrap_room` (arrays with one entry per sequence for a batch).
    pub fn body_with(&self, b: &Bootstrap) -> Vec<u8> {
        let mut body = self.body.clone();
        let port = b.port.map_or(Value::Null, |p| json!(p));
        if self.batch.is_some() {
            let n = b.rooms.len();
            body.insert("bootstrap_host".into(), json!(vec![b.host.clone(); n]));
            body.insert("bootstrap_port".into(), Value::Array(vec![port; n]));
            body.insert("bootstrap_room".into(), json!(b.rooms));
        } else {
            body.insert("bootstrap_host".into(), json!(b.host));
            body.insert("bootstrap_port".into(), port);
            body.insert(
                "bootstrap_room".into(),
                json!(b.rooms.first().copied().unwrap_or(0)),
            );
        }
        // A map of JSON values always serializes.
        serde_json::to_vec(&Value::Object(body)).unwrap_or_default()
    }
}

/// A routing key by the router's one rule (`pdnode_router::routing_key`: UTF-8, 1 to
/// `ROUTING_KEY_MAX` bytes).
fn checked_key(key: Option<&[u8]>) -> Result<Option<String>, RequestError> {
    pdnode_router::routing_key(key).map_err(|_| RequestError::BadField {
        field: "rid / X-SMG-Routing-Key",
        expected: "a routing key of 1 to 256 bytes of UTF-8",
    })
}

/// A new bootstrap room: uniform in [0, 2^63 - 1].
pub fn new_room(rng: &mut impl rand::Rng) -> u64 {
    rng.random::<u64>() >> 1
}

/// Most sequences in one request (a batch's arrays, or `n`): each gets a bootstrap host, port
/// and room in every attempt's body, so the batch, not only the body's bytes, is bounded.
pub const MAX_BATCH: usize = 4096;

fn batch_size(route: Route, body: &Map<String, Value>) -> Result<Option<usize>, RequestError> {
    let array_len = |field: &str, nested: bool| -> Option<usize> {
        match body.get(field) {
            Some(Value::Array(items)) if !nested => Some(items.len()),
            // `input_ids` / a token-id `prompt` is one sequence unless it is a list of lists.
            Some(Value::Array(items)) if items.first().is_some_and(Value::is_array) => {
                Some(items.len())
            }
            _ => None,
        }
    };
    let from_arrays = match route {
        Route::Generate => array_len("text", false).or_else(|| array_len("input_ids", true)),
        Route::Completions => match body.get("prompt") {
            Some(Value::Array(items)) if items.is_empty() => Some(0),
            Some(Value::Array(items)) if items.iter().all(Value::is_number) => None,
            Some(Value::Array(items)) => Some(items.len()),
            _ => None,
        },
        Route::ChatCompletions => None,
    };
    if let Some(n) = from_arrays {
        if n == 0 {
            return Err(RequestError::BadField {
                field: "prompt",
                expected: "a non-empty list",
            });
        }
        if n > MAX_BATCH {
            return Err(RequestError::BadField {
                field: "text / input_ids / prompt",
                expected: "a batch of at most 4096 sequences",
            });
        }
        return Ok(Some(n));
    }
    if route == Route::Generate {
        return Ok(None);
    }
    match body.get("n") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(0) | None => Err(RequestError::BadField {
                field: "n",
                expected: "a positive integer",
            }),
            Some(1) => Ok(None),
            Some(n) => match usize::try_from(n) {
                Ok(n) if n <= MAX_BATCH => Ok(Some(n)),
                _ => Err(RequestError::BadField {
                    field: "n",
                    expected: "at most 4096",
                }),
            },
        },
    }
}

fn routing_text(route: Route, body: &Map<String, Value>) -> String {
    let first_text = |v: Option<&Value>| -> String {
        match v {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(items)) => match items.first() {
                Some(Value::String(s)) => s.clone(),
                _ => String::new(),
            },
            _ => String::new(),
        }
    };
    let mut text = match route {
        Route::Generate => first_text(body.get("text")),
        Route::Completions => first_text(body.get("prompt")),
        Route::ChatCompletions => {
            let mut t = String::new();
            if let Some(Value::Array(msgs)) = body.get("messages") {
                for m in msgs {
                    match m.get("content") {
                        Some(Value::String(s)) => t.push_str(s),
                        Some(Value::Array(parts)) => {
                            for p in parts {
                                if let Some(Value::String(s)) = p.get("text") {
                                    t.push_str(s);
                                }
                            }
                        }
                        _ => {}
                    }
                    if t.len() >= ROUTING_TEXT_MAX {
                        break;
                    }
                }
            }
            t
        }
    };
    if text.len() > ROUTING_TEXT_MAX {
        let mut cut = ROUTING_TEXT_MAX;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(route: Route, v: Value) -> ClientRequest {
        ClientRequest::parse(route, v.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn single_requests_get_scalar_bootstrap_fields() {
        let r = parse(
            Route::Completions,
            json!({"model": "m", "prompt": "Hello", "stream": true}),
        );
        assert!(r.stream);
        assert_eq!(r.batch, None);
        assert_eq!(r.routing_text, "Hello");
        let b = Bootstrap {
            host: "10.0.0.1".into(),
            port: Some(8998),
            rooms: vec![42],
        };
        let out: Value = serde_json::from_slice(&r.body_with(&b)).unwrap();
        assert_eq!(out["bootstrap_host"], "10.0.0.1");
        assert_eq!(out["bootstrap_port"], 8998);
        assert_eq!(out["bootstrap_room"], 42);
        assert_eq!(out["prompt"], "Hello", "the client's fields are kept");
        let b = Bootstrap { port: None, ..b };
        let out: Value = serde_json::from_slice(&r.body_with(&b)).unwrap();
        assert_eq!(out["bootstrap_port"], Value::Null);
    }

    #[test]
    fn batches_get_one_entry_per_sequence() {
        let cases = [
            (Route::Generate, json!({"text": ["a", "b", "c"]}), Some(3)),
            (
                Route::Generate,
                json!({"input_ids": [[1, 2], [3]]}),
                Some(2),
            ),
            (Route::Generate, json!({"input_ids": [1, 2, 3]}), None),
            (Route::Generate, json!({"text": "a"}), None),
            (Route::Completions, json!({"prompt": ["a", "b"]}), Some(2)),
            (Route::Completions, json!({"prompt": [1, 2, 3]}), None),
            (Route::Completions, json!({"prompt": [[1], [2]]}), Some(2)),
            (Route::Completions, json!({"prompt": "a", "n": 4}), Some(4)),
            (
                Route::ChatCompletions,
                json!({"messages": [], "n": 2}),
                Some(2),
            ),
            (
                Route::ChatCompletions,
                json!({"messages": [], "n": 1}),
                None,
            ),
        ];
        for (route, body, want) in cases {
            let r = parse(route, body.clone());
            assert_eq!(r.batch, want, "{route:?} {body}");
        }
        // At most MAX_BATCH sequences, however they are given.
        let at = vec!["a"; MAX_BATCH];
        assert_eq!(
            parse(Route::Generate, json!({ "text": at })).batch,
            Some(MAX_BATCH)
        );
        assert_eq!(
            parse(Route::Completions, json!({"prompt": "a", "n": MAX_BATCH})).batch,
            Some(MAX_BATCH)
        );
        let over = vec!["a"; MAX_BATCH + 1];
        for (route, body) in [
            (Route::Generate, json!({ "text": over })),
            (Route::Completions, json!({ "prompt": over })),
            (
                Route::Generate,
                json!({ "input_ids": vec![vec![1]; MAX_BATCH + 1] }),
            ),
        ] {
            let e = ClientRequest::parse(route, &serde_json::to_vec(&body).unwrap());
            assert!(
                matches!(e, Err(RequestError::BadField { .. })),
                "{route:?}: {e:?}"
            );
        }
        let r = parse(Route::Generate, json!({"text": ["a", "b"]}));
        let b = Bootstrap {
            host: "h".into(),
            port: None,
            rooms: vec![1, 2],
        };
        let out: Value = serde_json::from_slice(&r.body_with(&b)).unwrap();
        assert_eq!(out["bootstrap_host"], json!(["h", "h"]));
        assert_eq!(out["bootstrap_port"], json!([null, null]));
        assert_eq!(out["bootstrap_room"], json!([1, 2]));
    }

    #[test]
    fn malformed_bodies_are_errors_not_panics() {
        for (route, text) in [
            (Route::Generate, "not json"),
            (Route::Generate, "[1, 2]"),
            (Route::Completions, r#"{"prompt": "a", "stream": "yes"}"#),
            (Route::Completions, r#"{"prompt": "a", "n": 0}"#),
            (Route::Completions, r#"{"prompt": "a", "n": -1}"#),
            (Route::Completions, r#"{"prompt": []}"#),
            (Route::Completions, r#"{"prompt": "a", "n": 4097}"#),
        ] {
            assert!(
                ClientRequest::parse(route, text.as_bytes()).is_err(),
                "{text}"
            );
        }
    }

    #[test]
    fn routing_text_and_logprobs() {
        let r = parse(
            Route::ChatCompletions,
            json!({"messages": [{"role": "user", "content": "Hi"},
                                {"role": "user", "content": [{"type": "text", "text": " there"}]}],
                   "logprobs": true}),
        );
        assert_eq!(r.routing_text, "Hi there");
        assert!(r.wants_logprobs);
        let r = parse(Route::Generate, json!({"text": "é".repeat(5000)}));
        assert!(r.routing_text.len() <= ROUTING_TEXT_MAX);
        assert!(!r.wants_logprobs);
        assert!(
            parse(
                Route::Generate,
                json!({"text": "a", "return_logprob": true})
            )
            .wants_logprobs
        );
    }

    #[test]
    fn rooms_are_below_2_pow_63() {
        let mut rng = rand::rng();
        for _ in 0..1000 {
            assert!(new_room(&mut rng) < 1 << 63);
        }
    }
}
