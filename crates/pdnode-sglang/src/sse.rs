//! The decode worker's SSE stream, relayed line by line: every `data:` line must be JSON or
//! `[DONE]`; a stream that breaks, stalls, or carries a line that is not JSON ends for the
//! client with one JSON error event and `data: [DONE]`, never truncated.

use serde_json::{Value, json};

/// Line-by-line relay state of one stream.
#[derive(Debug, Default)]
pub struct SseRelay {
    partial: Vec<u8>,
    done: bool,
    ended: bool,
    /// The prefill worker's answer, whose `meta_info.input_token_logprobs` go in front of each
    /// event's (`/generate` with `return_logprob`); `None`: events pass through as they are.
    merge: Option<Value>,
}

/// Why a relayed stream failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamFault {
    #[error("the decode worker sent a stream line that is not JSON: {0}")]
    Malformed(String),
    #[error("the decode worker's stream broke: {0}")]
    Broken(String),
    #[error("the decode worker sent nothing for {0} s")]
    Stalled(u64),
    #[error("the decode worker's stream ended without [DONE]")]
    Truncated,
}

/// `complete` lines (checked JSON already) with the prefill's input logprobs merged into each
/// JSON event; other lines unchanged.
fn merged(complete: &[u8], prefill: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(complete.len() + 64);
    for line in complete.split_inclusive(|&b| b == b'\n') {
        let body = line.strip_suffix(b"\n").unwrap_or(line);
        let body = body.strip_suffix(b"\r").unwrap_or(body);
        let event = body
            .strip_prefix(b"data:")
            .map(<[u8]>::trim_ascii)
            .filter(|p| *p != b"[DONE]")
            .and_then(|p| serde_json::from_slice::<Value>(p).ok());
        match event {
            Some(mut v) => {
                crate::router::merge_input_logprobs(&mut v, prefill);
                out.extend_from_slice(b"data: ");
                // A JSON value always serializes.
                out.extend_from_slice(&serde_json::to_vec(&v).unwrap_or_default());
                out.push(b'\n');
            }
            None => out.extend_from_slice(line),
        }
    }
    out
}

/// Largest line kept while waiting for its end, bytes.
const MAX_LINE: usize = 16 << 20;

impl SseRelay {
    /// A relay that puts `prefill`'s input logprobs in front of every event's.
    pub fn merging(prefill: Value) -> Self {
        Self {
            merge: Some(prefill),
            ..Self::default()
        }
    }

    /// Takes one chunk from the worker; returns the complete lines to send on (with their
    /// newlines), or the fault. Bytes of an unfinished line wait for the next chunk.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<u8>, StreamFault> {
        if self.ended {
            return Ok(Vec::new());
        }
        self.partial.extend_from_slice(chunk);
        let Some(last_nl) = self.partial.iter().rposition(|&b| b == b'\n') else {
            if self.partial.len() > MAX_LINE {
                return Err(StreamFault::Malformed(format!(
                    "a line longer than {MAX_LINE} bytes"
                )));
            }
            return Ok(Vec::new());
        };
        let rest = self.partial.split_off(last_nl + 1);
        let complete = std::mem::replace(&mut self.partial, rest);
        for line in complete.split(|&b| b == b'\n') {
            self.check_line(line)?;
        }
        match &self.merge {
            None => Ok(complete),
            Some(prefill) => Ok(merged(&complete, prefill)),
        }
    }

    fn check_line(&mut self, line: &[u8]) -> Result<(), StreamFault> {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(payload) = line.strip_prefix(b"data:") else {
            return Ok(()); // blank separators, comments, event:/id: lines
        };
        let payload = payload.trim_ascii();
        if payload == b"[DONE]" {
            self.done = true;
            return Ok(());
        }
        if serde_json::from_slice::<serde::de::IgnoredAny>(payload).is_err() {
            let shown = String::from_utf8_lossy(&payload[..payload.len().min(200)]).into_owned();
            return Err(StreamFault::Malformed(shown));
        }
        Ok(())
    }

    /// Whether the worker's `[DONE]` went through.
    pub fn saw_done(&self) -> bool {
        self.done
    }

    /// The worker closed the stream: what is left to send, or the fault when it never said
    /// `[DONE]`.
    pub fn finish(&mut self) -> Result<Vec<u8>, StreamFault> {
        let mut out = Vec::new();
        if !self.partial.is_empty() {
            let mut line = std::mem::take(&mut self.partial);
            self.check_line(&line)?;
            line.extend_from_slice(b"\n\n");
            out = line;
        }
        if !self.done {
            return Err(StreamFault::Truncated);
        }
        self.ended = true;
        Ok(out)
    }

    /// The end a client gets after `fault`: one JSON error event, then `[DONE]`. Call once;
    /// the relay passes nothing after it.
    pub fn fail(&mut self, fault: &StreamFault) -> Vec<u8> {
        self.ended = true;
        let mut out = Vec::new();
        // A line the worker left unfinished is dropped, and the event starts on its own line.
        self.partial.clear();
        out.extend_from_slice(&error_event(&fault.to_string(), "stream_error", 502));
        out.extend_from_slice(b"data: [DONE]\n\n");
        out
    }
}

/// `data: {"error": {...}}` followed by a blank line.
pub fn error_event(message: &str, kind: &str, code: u16) -> Vec<u8> {
    let body = json!({"error": {"message": message, "type": kind, "code": code}});
    format!("data: {body}\n\n").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_and_split_lines_pass_through_in_order() {
        let mut r = SseRelay::default();
        let mut out = r.push(b"data: {\"a\":1}\n\ndata: {\"b\"").unwrap();
        assert_eq!(out, b"data: {\"a\":1}\n\n");
        out = r.push(b":2}\n\n").unwrap();
        assert_eq!(out, b"data: {\"b\":2}\n\n");
        assert!(!r.saw_done());
        out = r.push(b"data: [DONE]\n\n").unwrap();
        assert_eq!(out, b"data: [DONE]\n\n");
        assert!(r.saw_done());
        assert_eq!(r.finish(), Ok(Vec::new()));
    }

    #[test]
    fn a_line_that_is_not_json_is_a_fault() {
        let mut r = SseRelay::default();
        let e = r.push(b"data: {'error': 'Python dict'}\n\n").unwrap_err();
        assert!(matches!(e, StreamFault::Malformed(ref s) if s.contains("Python dict")));
        let tail = String::from_utf8(r.fail(&e)).unwrap();
        let mut lines = tail.lines().filter(|l| !l.is_empty());
        let ev: serde_json::Value =
            serde_json::from_str(lines.next().unwrap().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(ev["error"]["code"], 502);
        assert_eq!(lines.next(), Some("data: [DONE]"));
        assert_eq!(r.push(b"data: {}\n").unwrap(), b"", "nothing after the end");
    }

    #[test]
    fn a_stream_that_ends_without_done_is_truncated() {
        let mut r = SseRelay::default();
        r.push(b"data: {\"a\":1}\n\n").unwrap();
        assert_eq!(r.finish(), Err(StreamFault::Truncated));
        let mut r = SseRelay::default();
        r.push(b"data: {\"a\":1}\n\ndata: [DO").unwrap();
        assert_eq!(r.finish(), Err(StreamFault::Malformed("[DO".into())));
        let mut r = SseRelay::default();
        r.push(b"data: [DONE]").unwrap();
        assert_eq!(r.finish(), Ok(b"data: [DONE]\n\n".to_vec()));
    }

    #[test]
    fn comments_and_crlf_are_fine() {
        let mut r = SseRelay::default();
        let out = r
            .push(b": keepalive\r\nevent: x\r\ndata: {}\r\n\r\n")
            .unwrap();
        assert_eq!(out.len(), 35);
    }
}
