//! The streamed answer of an attempt: the decode worker's SSE relayed to the client after its
//! first chunk (until then a retry is still possible), the prefill's input logprobs merged in
//! where asked, and each write to the client under `router.client_send_timeout_s`.

use super::{AttemptEnd, COALESCE_MAX, PrefillResult, SglangRouter, Slot, error_response};
use crate::request::{ClientRequest, Route};
use crate::sse::{SseRelay, StreamFault};
use crate::worker::{FailureCause, Worker};
use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use serde_json::Value;
use std::sync::Arc;
use std::time::Instant;
use tokio::task::JoinHandle;

impl SglangRouter {
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn stream_answer(
        self: &Arc<Self>,
        req: &ClientRequest,
        resp: reqwest::Response,
        d_guard: crate::worker::InflightGuard,
        p: Arc<Worker>,
        mut prefill: JoinHandle<PrefillResult>,
        mut prefill_result: Option<PrefillResult>,
        first_deadline: Instant,
        deadline_all: Instant,
        slot: &Arc<Slot>,
    ) -> AttemptEnd {
        let d = d_guard.worker().clone();
        let mut chunks = resp.bytes_stream();
        let mut relay = SseRelay::default();
        // `/generate` with logprobs: the prefill's input logprobs go in front of each event's,
        // so the prefill answer is needed before the first event goes out.
        let merge = req.wants_logprobs && req.route == Route::Generate;
        // Nothing goes to the client before the first chunk: until then, a retry is possible.
        let first = loop {
            tokio::select! {
                r = &mut prefill, if prefill_result.is_none() => {
                    match r.unwrap_or_else(|e| Err((FailureCause::Connect, format!("prefill task: {e}")))) {
                        Err((cause, message)) => return AttemptEnd::Retry { worker: p, cause, message, counted: true },
                        ok => prefill_result = Some(ok),
                    }
                }
                c = tokio::time::timeout_at(first_deadline.into(), chunks.next()) => break c,
            }
        };
        let first = match first {
            Err(_) => (
                FailureCause::Timeout,
                "no first chunk within its deadline".to_string(),
            ),
            Ok(None) => (
                FailureCause::Connect,
                "the stream ended before its first chunk".into(),
            ),
            Ok(Some(Err(e))) => (FailureCause::Connect, e.to_string()),
            Ok(Some(Ok(bytes))) => {
                if merge {
                    let pr = match prefill_result.take() {
                        Some(r) => Some(r),
                        None => tokio::time::timeout_at(first_deadline.into(), &mut prefill)
                            .await
                            .ok()
                            .map(|r| {
                                r.unwrap_or_else(|e| {
                                    Err((FailureCause::Connect, format!("prefill task: {e}")))
                                })
                            }),
                    };
                    match pr {
                        Some(Ok((_, pbytes))) => {
                            if let Ok(pv) = serde_json::from_slice::<Value>(&pbytes) {
                                relay = SseRelay::merging(pv);
                            }
                        }
                        Some(Err((cause, message))) => {
                            return AttemptEnd::Retry {
                                worker: p,
                                cause,
                                message,
                                counted: true,
                            };
                        }
                        None => {
                            prefill.abort();
                            return AttemptEnd::Retry {
                                worker: p,
                                cause: FailureCause::Timeout,
                                message: "no prefill answer within its deadline".into(),
                                counted: false,
                            };
                        }
                    }
                }
                match relay.push(&bytes) {
                    Ok(out) => {
                        let _ = req;
                        let body = self.relay_body(relay, out, chunks, d_guard, deadline_all, slot);
                        let mut r = Response::new(body);
                        r.headers_mut().insert(
                            header::CONTENT_TYPE,
                            HeaderValue::from_static("text/event-stream"),
                        );
                        r.headers_mut()
                            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
                        return AttemptEnd::Done(r);
                    }
                    Err(fault) => {
                        self.count_failure(&d, FailureCause::Malformed);
                        return AttemptEnd::Done(error_response(
                            StatusCode::BAD_GATEWAY,
                            "upstream_error",
                            &format!("decode worker {}: {fault}", d.url),
                        ));
                    }
                }
            }
        };
        prefill.abort();
        AttemptEnd::Retry {
            worker: d,
            cause: first.0,
            message: first.1,
            counted: false,
        }
    }

    /// The client's stream after the first chunk: the relay's lines, then on a break, a stall,
    /// a malformed line or a missing `[DONE]`, one error event and `[DONE]`.
    fn relay_body<S>(
        self: &Arc<Self>,
        relay: SseRelay,
        first: Vec<u8>,
        chunks: S,
        guard: crate::worker::InflightGuard,
        deadline_all: Instant,
        slot: &Arc<Slot>,
    ) -> Body
    where
        S: futures::Stream<Item = reqwest::Result<Bytes>> + Send + Unpin + 'static,
    {
        struct St<S> {
            relay: SseRelay,
            chunks: S,
            guard: crate::worker::InflightGuard,
            first: Option<Vec<u8>>,
            over: bool,
            /// One timer for the whole stream, moved forward at each chunk (a new timer per
            /// token was a visible share of the router's CPU).
            stall: std::pin::Pin<Box<tokio::time::Sleep>>,
            /// The stream's end or error, met while coalescing: handled on the next turn.
            pending: Option<Option<reqwest::Result<Bytes>>>,
        }
        let me = self.clone();
        let token_timeout = self.token_timeout;
        let st = St {
            relay,
            chunks,
            guard,
            first: Some(first),
            over: false,
            stall: Box::pin(tokio::time::sleep_until(deadline_all.into())),
            pending: None,
        };
        let stream = futures::stream::unfold(st, move |mut st| {
            let me = me.clone();
            async move {
                if let Some(f) = st.first.take() {
                    return Some((Ok::<Bytes, std::convert::Infallible>(Bytes::from(f)), st));
                }
                if st.over {
                    return None;
                }
                let next = match st.pending.take() {
                    Some(p) => Some(p),
                    None => {
                        let deadline = (Instant::now() + token_timeout).min(deadline_all);
                        st.stall.as_mut().reset(deadline.into());
                        tokio::select! {
                            biased;
                            c = st.chunks.next() => Some(c),
                            _ = st.stall.as_mut() => None,
                        }
                    }
                };
                let fault = match next {
                    Some(Some(Ok(bytes))) => match st.relay.push(&bytes) {
                        Ok(mut out) => {
                            // Chunks that are already here go out in the same write: under load
                            // one write per token per client is most of the router's work.
                            let mut more = None;
                            while out.len() < COALESCE_MAX {
                                match st.chunks.next().now_or_never() {
                                    Some(Some(Ok(b))) => match st.relay.push(&b) {
                                        Ok(o) => out.extend_from_slice(&o),
                                        Err(f) => {
                                            more = Some((f, FailureCause::Malformed));
                                            break;
                                        }
                                    },
                                    // An end or an error is taken on the next turn, after what
                                    // arrived before it.
                                    Some(other) => {
                                        st.pending = Some(other);
                                        break;
                                    }
                                    None => break,
                                }
                            }
                            match more {
                                None => return Some((Ok(Bytes::from(out)), st)),
                                Some(f) => f,
                            }
                        }
                        Err(f) => (f, FailureCause::Malformed),
                    },
                    Some(Some(Err(e))) => {
                        (StreamFault::Broken(e.to_string()), FailureCause::Connect)
                    }
                    Some(None) => match st.relay.finish() {
                        Ok(rest) => {
                            st.guard.worker().success();
                            st.over = true;
                            return Some((Ok(Bytes::from(rest)), st));
                        }
                        Err(f) => (f, FailureCause::Connect),
                    },
                    None => (
                        StreamFault::Stalled(token_timeout.as_secs()),
                        FailureCause::Timeout,
                    ),
                };
                let w = st.guard.worker().clone();
                tracing::warn!(worker = %w.url, "decode stream failed: {}", fault.0);
                me.count_failure(&w, fault.1);
                me.metrics.stream_failed();
                st.over = true;
                let tail = st.relay.fail(&fault.0);
                Some((Ok(Bytes::from(tail)), st))
            }
        });
        // A task drives the relay and hands each write to the client with a deadline: a client
        // that stops reading (its socket buffers full) is cut after `client_send_timeout`, its
        // decode connection closed and its slot freed, instead of holding both until the whole
        // request's deadline. A client that hangs up ends the task at once.
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
        let (me, slot) = (self.clone(), slot.clone());
        let send_timeout = self.client_send_timeout;
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            loop {
                let item = tokio::select! {
                    item = stream.next() => item,
                    _ = tx.closed() => return,
                };
                let Some(Ok(bytes)) = item else { return };
                if bytes.is_empty() {
                    continue;
                }
                match tx.send_timeout(bytes, send_timeout).await {
                    Ok(()) => {}
                    Err(tokio::sync::mpsc::error::SendTimeoutError::Timeout(_)) => {
                        tracing::warn!(
                            timeout_s = send_timeout.as_secs(),
                            "a streaming client stopped reading; its stream is cut"
                        );
                        me.metrics.client_gone();
                        slot.release();
                        return;
                    }
                    Err(tokio::sync::mpsc::error::SendTimeoutError::Closed(_)) => return,
                }
            }
        });
        Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|b| (Ok::<Bytes, std::convert::Infallible>(b), rx))
        }))
    }
}
