//! Closed-loop load: `concurrency` clients, each streaming one `/v1/completions` after another
//! until told to stop; every request ends by a deadline and is classified.

use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A request that has not ended this long after it was sent is hung.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(60);
/// How long a client waits after a request that never reached the router.
pub const RECONNECT_BACKOFF: Duration = Duration::from_millis(200);

/// How one request ended.
#[derive(Debug, Clone, PartialEq)]
pub enum End {
    /// Tokens, then `[DONE]`, no error.
    Completed,
    /// An error the client can read: an SSE error event with a message followed by `[DONE]`,
    /// or a non-200 answer whose JSON body carries `error.message`.
    Failed(String),
    /// Ended, but not cleanly: cut without `[DONE]`, a transport error, a body that says nothing.
    Unclear(String),
    /// Not ended by [`REQUEST_DEADLINE`].
    Hung,
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub sent: Instant,
    pub end_at: Instant,
    /// Arrival of each chunk of the response body.
    pub chunks: Vec<Instant>,
    pub end: End,
    /// The prompt and the streamed text of a completed greedy request ([`Spec::greedy`]).
    pub text: Option<(String, String)>,
}

impl Outcome {
    /// Whether the request ran into the fault at `at`: it ended after `at` and either failed or
    /// waited longer than `stall` for a byte somewhere after `at` (counted from `at`, or from
    /// its sending when it was sent later).
    pub fn affected(&self, at: Instant, stall: Duration) -> bool {
        if self.end_at < at {
            return false;
        }
        if self.end != End::Completed {
            return true;
        }
        let mut prev = self.sent.max(at);
        for &c in self.chunks.iter().filter(|c| **c >= at) {
            if c.duration_since(prev) > stall {
                return true;
            }
            prev = c;
        }
        self.end_at.duration_since(prev) > stall
    }
}

#[derive(Debug, Clone)]
pub struct Spec {
    pub url: String,
    pub concurrency: usize,
    pub max_tokens: u32,
    /// Prompt length in bytes (the mock tokenizer is about one token per byte).
    pub prompt_len: usize,
    /// Keep every chunk's arrival (for the fault figures); else only the first one's, so a
    /// long soak does not grow the driver.
    pub keep_chunks: bool,
    /// Greedy (`temperature` 0), keeping each completed request's prompt and text, to compare
    /// them across runs (`--full`, a real model).
    pub greedy: bool,
}

/// A running load; [`Load::stop`] stops new requests, [`Load::finish`] collects every outcome.
pub struct Load {
    stop: Arc<AtomicBool>,
    /// Requests sent so far, every client together.
    sent: Arc<AtomicUsize>,
    workers: Vec<tokio::task::JoinHandle<Vec<Outcome>>>,
}

impl Load {
    pub fn start(spec: Spec) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicUsize::new(0));
        let client = reqwest::Client::builder()
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5))
            .pool_max_idle_per_host(spec.concurrency)
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        let workers = (0..spec.concurrency)
            .map(|w| {
                let (stop, sent, client, spec) =
                    (stop.clone(), sent.clone(), client.clone(), spec.clone());
                tokio::spawn(async move {
                    let mut out = Vec::new();
                    let mut n = 0usize;
                    while !stop.load(Ordering::Relaxed) {
                        let head = format!("client {w} request {n}: ");
                        let prompt: String = head
                            .chars()
                            .chain(std::iter::repeat('x'))
                            .take(spec.prompt_len.max(head.len()))
                            .collect();
                        sent.fetch_add(1, Ordering::Relaxed);
                        let o = one(&client, &spec, &prompt).await;
                        // A client that could not reach the router (refused, reset before an
                        // answer: it is down or restarting) waits a little before it tries
                        // again, as a real one would, instead of spinning on the refusals.
                        let unreachable = matches!(o.end, End::Unclear(_)) && o.chunks.is_empty();
                        out.push(o);
                        n += 1;
                        if unreachable {
                            tokio::time::sleep(RECONNECT_BACKOFF).await;
                        }
                    }
                    out
                })
            })
            .collect();
        Self {
            stop,
            sent,
            workers,
        }
    }

    /// How many requests the clients have sent so far (a new one is sent when one ends: a
    /// closed loop).
    pub fn sent(&self) -> usize {
        self.sent.load(Ordering::Relaxed)
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Stops new requests and waits for the ones in flight (each ends by its deadline; the
    /// wait is bounded by one more deadline on top).
    pub async fn finish(self) -> Vec<Outcome> {
        self.stop();
        let until = tokio::time::Instant::now() + REQUEST_DEADLINE + Duration::from_secs(10);
        let mut all = Vec::new();
        for w in self.workers {
            let abort = w.abort_handle();
            match tokio::time::timeout_at(until, w).await {
                Ok(Ok(v)) => all.extend(v),
                Ok(Err(e)) => all.push(lost(format!("client task failed: {e}"))),
                Err(_) => {
                    abort.abort();
                    all.push(lost("client task past its deadline".into()));
                }
            }
        }
        all
    }
}

fn lost(why: String) -> Outcome {
    let now = Instant::now();
    Outcome {
        sent: now,
        end_at: now,
        chunks: Vec::new(),
        end: End::Unclear(why),
        text: None,
    }
}

/// One streamed completion, ended by [`REQUEST_DEADLINE`].
async fn one(client: &reqwest::Client, spec: &Spec, prompt: &str) -> Outcome {
    let sent = Instant::now();
    let until = tokio::time::Instant::now() + REQUEST_DEADLINE;
    let mut chunks = Vec::new();
    let mut body = json!({"prompt": prompt, "max_tokens": spec.max_tokens, "stream": true});
    if spec.greedy {
        body["temperature"] = json!(0);
    }
    let done = |chunks: Vec<Instant>, end: End| Outcome {
        sent,
        end_at: Instant::now(),
        chunks,
        end,
        text: None,
    };
    let resp = match tokio::time::timeout_at(until, client.post(&spec.url).json(&body).send()).await
    {
        Err(_) => return done(chunks, End::Hung),
        Ok(Err(e)) => return done(chunks, End::Unclear(format!("request: {e}"))),
        Ok(Ok(r)) => r,
    };
    let status = resp.status();
    let mut resp = resp;
    let mut buf = String::new();
    loop {
        match tokio::time::timeout_at(until, resp.chunk()).await {
            Err(_) => return done(chunks, End::Hung),
            Ok(Err(e)) => {
                return done(chunks, End::Unclear(format!("body: {e}")));
            }
            Ok(Ok(None)) => break,
            Ok(Ok(Some(b))) => {
                if spec.keep_chunks || chunks.is_empty() {
                    chunks.push(Instant::now());
                }
                buf.push_str(&String::from_utf8_lossy(&b));
            }
        }
    }
    let end = if status.is_success() {
        let end = classify_stream(&buf);
        if spec.greedy && end == End::Completed {
            let mut o = done(chunks, end);
            o.text = Some((prompt.to_string(), stream_text(&buf)));
            return o;
        }
        end
    } else {
        match error_message(&buf) {
            Some(m) => End::Failed(format!("HTTP {}: {m}", status.as_u16())),
            None => End::Unclear(format!("HTTP {} without an error message", status.as_u16())),
        }
    };
    done(chunks, end)
}

/// `error.message` of a JSON error body or event.
fn error_message(s: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(s.trim()).ok()?;
    let m = v["error"]["message"].as_str()?;
    (!m.is_empty()).then(|| m.to_string())
}

/// The text of a completion stream: `choices[0].text` of every event, in order.
pub fn stream_text(body: &str) -> String {
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e.trim()).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect()
}

/// Classifies a whole SSE body.
pub fn classify_stream(body: &str) -> End {
    let events: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim)
        .collect();
    let done = events.last() == Some(&"[DONE]");
    let err = events.iter().find_map(|e| {
        serde_json::from_str::<serde_json::Value>(e)
            .ok()
            .filter(|v| v["error"].is_object())
            .map(|v| v["error"]["message"].as_str().unwrap_or("").to_string())
    });
    match (err, done) {
        (Some(m), true) if !m.is_empty() => End::Failed(m),
        (Some(m), _) => End::Unclear(format!(
            "error event {m:?}{}",
            if done { "" } else { " without [DONE]" }
        )),
        (None, true) => End::Completed,
        (None, false) => End::Unclear(format!(
            "stream cut after {} events without [DONE]",
            events.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_classified() {
        let ok = "data: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        assert_eq!(classify_stream(ok), End::Completed);
        let failed = "data: {\"choices\":[]}\n\ndata: {\"error\":{\"message\":\"decode lost\"}}\n\ndata: [DONE]\n\n";
        assert_eq!(classify_stream(failed), End::Failed("decode lost".into()));
        assert!(matches!(
            classify_stream("data: {\"choices\":[]}\n\n"),
            End::Unclear(_)
        ));
        assert!(matches!(
            classify_stream("data: {\"error\":{\"message\":\"\"}}\n\ndata: [DONE]\n"),
            End::Unclear(_)
        ));
    }

    #[test]
    fn a_streams_text_is_its_events_texts_in_order() {
        let body = "data: {\"choices\":[{\"text\":\"Hel\"}]}\n\ndata: {\"choices\":[{\"text\":\"lo\"}]}\n\ndata: [DONE]\n\n";
        assert_eq!(stream_text(body), "Hello");
    }

    #[test]
    fn a_request_is_affected_by_a_failure_or_a_stall_after_the_fault() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let o = |chunks: Vec<u64>, end_ms, end| Outcome {
            sent: t0,
            end_at: ms(end_ms),
            chunks: chunks.into_iter().map(ms).collect(),
            end,
            text: None,
        };
        let stall = Duration::from_millis(500);
        let steady = o(vec![100, 200, 300, 400, 500], 500, End::Completed);
        assert!(!steady.affected(ms(250), stall));
        let stuck = o(vec![100, 200, 1500], 1500, End::Completed);
        assert!(stuck.affected(ms(250), stall));
        assert!(
            !stuck.affected(ms(2000), stall),
            "ended before the fault: not affected"
        );
        let failed = o(vec![100, 300], 300, End::Failed("x".into()));
        assert!(failed.affected(ms(250), stall));
    }
}
