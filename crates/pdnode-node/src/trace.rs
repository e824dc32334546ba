//! Tracing of the node's data-path streams: a `Decode` answer keeps its RPC span open until the
//! stream ends, polled inside it, with the tokens streamed and the finish reason recorded.

use crate::pd::wire::WireDecodeStream;
use futures::Stream;
use pdnode_proto::v1;
use std::pin::Pin;
use std::task::{Context, Poll};
use tonic::Status;

struct Traced {
    span: tracing::Span,
    inner: WireDecodeStream,
    tokens: u64,
    ended: bool,
}

impl Stream for Traced {
    type Item = Result<v1::DecodeResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        let _in = this.span.enter();
        let next = this.inner.as_mut().poll_next(cx);
        match &next {
            Poll::Ready(Some(Ok(m))) => {
                this.tokens += m.token_ids.len() as u64;
                if m.finish_reason != 0 && !this.ended {
                    this.ended = true;
                    this.span.record("tokens", this.tokens);
                    let reason = pdnode_proto::convert::finish_reason_from_wire(m.finish_reason)
                        .ok()
                        .flatten();
                    this.span
                        .record("finish_reason", reason.map_or("unknown", |r| r.as_str()));
                    if let Some(e) = &m.error {
                        pdnode_telemetry::fail(&this.span, &e.message);
                    }
                }
            }
            Poll::Ready(Some(Err(s))) => {
                pdnode_telemetry::fail(&this.span, &s.message());
            }
            Poll::Ready(None) | Poll::Pending => {}
        }
        next
    }
}

/// `inner`, polled inside `span` (which it keeps open until dropped).
pub(crate) fn traced_stream(span: tracing::Span, inner: WireDecodeStream) -> WireDecodeStream {
    span.record("tokens", 0u64);
    Box::pin(Traced {
        span,
        inner,
        tokens: 0,
        ended: false,
    })
}

/// Runs `fut` inside `span` and records its error, if any, on it (the step that failed).
pub(crate) async fn in_span<T, E: std::fmt::Display>(
    span: tracing::Span,
    fut: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, E> {
    use tracing::Instrument;
    let r = fut.instrument(span.clone()).await;
    if let Err(e) = &r {
        pdnode_telemetry::fail(&span, e);
    }
    r
}
