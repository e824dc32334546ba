//! Incremental parser of `text/event-stream` bodies: feed it bytes as they arrive, get the `data`
//! payload of every complete event.

/// Longest event accepted; a server that never ends an event is an error, not unbounded memory.
pub const MAX_EVENT_BYTES: usize = 16 << 20;

#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("an event exceeds {MAX_EVENT_BYTES} bytes")]
    TooLong,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds bytes; returns the data of every event completed by them (multi-line data joined
    /// with `\n`). Events without data lines (comments, keep-alives) are skipped.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>, SseError> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some((end, sep)) = find_event_end(&self.buf) {
            let event: Vec<u8> = self.buf.drain(..end + sep).take(end).collect();
            if let Some(data) = event_data(&event) {
                out.push(data);
            }
        }
        if self.buf.len() > MAX_EVENT_BYTES {
            return Err(SseError::TooLong);
        }
        Ok(out)
    }

    /// Data of a last event the stream ended without a blank line after, if any.
    pub fn finish(&mut self) -> Option<String> {
        let rest = std::mem::take(&mut self.buf);
        event_data(&rest)
    }
}

/// Position and length of the first blank-line separator (`\n\n`, `\r\n\r\n`, `\r\r`).
fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\n' && b.get(i + 1) == Some(&b'\n') {
            return Some((i, 2));
        }
        if b[i..].starts_with(b"\r\n\r\n") {
            return Some((i, 4));
        }
        if b[i] == b'\r' && b.get(i + 1) == Some(&b'\r') {
            return Some((i, 2));
        }
        i += 1;
    }
    None
}

fn event_data(event: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(event);
    let mut data: Option<String> = None;
    for line in text.split(['\n', '\r']) {
        let Some(rest) = line.strip_prefix("data:") else {
            continue;
        };
        let rest = rest.strip_prefix(' ').unwrap_or(rest);
        match data.as_mut() {
            Some(d) => {
                d.push('\n');
                d.push_str(rest);
            }
            None => data = Some(rest.to_string()),
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: {\"a\"").unwrap().is_empty());
        assert_eq!(p.push(b":1}\n\ndata: [DONE]\n").unwrap(), vec!["{\"a\":1}"]);
        assert_eq!(p.push(b"\n").unwrap(), vec!["[DONE]"]);
        assert_eq!(p.finish(), None);
    }

    #[test]
    fn crlf_comments_and_multiline() {
        let mut p = SseParser::new();
        let got = p
            .push(b": keep-alive\r\n\r\nevent: x\r\ndata:one\r\ndata: two\r\n\r\n")
            .unwrap();
        assert_eq!(got, vec!["one\ntwo"]);
        p.push(b"data: tail").unwrap();
        assert_eq!(p.finish().as_deref(), Some("tail"));
    }

    #[test]
    fn endless_event_is_an_error() {
        let mut p = SseParser::new();
        let big = vec![b'x'; MAX_EVENT_BYTES + 1];
        assert_eq!(p.push(&big), Err(SseError::TooLong));
    }
}
