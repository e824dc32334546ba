//! W3C trace-context propagation (`traceparent`, `tracestate`) over HTTP headers and gRPC
//! metadata, with opentelemetry's `TraceContextPropagator`.

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// HTTP headers as a propagation carrier.
pub struct HeaderCarrier<'a>(pub &'a http::HeaderMap);

impl Extractor for HeaderCarrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct HeaderInjector<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(k, v);
        }
    }
}

/// gRPC request metadata as a propagation carrier.
pub struct MetadataCarrier<'a>(pub &'a tonic::metadata::MetadataMap);

impl Extractor for MetadataCarrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

/// The caller's trace context in `carrier`; an absent or malformed `traceparent` gives a
/// context without a span (the callee starts a new trace).
pub fn extract(carrier: &dyn Extractor) -> Context {
    TraceContextPropagator::new().extract(carrier)
}

/// A caller's trace context, as read from its headers or metadata (maybe none).
#[derive(Debug, Clone, Default)]
pub struct Remote {
    cx: Context,
}

impl Remote {
    /// The context in `carrier`; none for an absent or malformed `traceparent`.
    pub fn extract(carrier: &dyn Extractor) -> Self {
        Self {
            cx: extract(carrier),
        }
    }

    pub fn from_headers(h: &http::HeaderMap) -> Self {
        Self::extract(&HeaderCarrier(h))
    }

    pub fn from_metadata(md: &tonic::metadata::MetadataMap) -> Self {
        Self::extract(&MetadataCarrier(md))
    }

    /// The caller's trace id, when it sent a valid context.
    pub fn trace_id(&self) -> Option<String> {
        let sc = self.cx.span().span_context().clone();
        sc.is_valid().then(|| sc.trace_id().to_string())
    }

    /// Makes the caller's span the parent of `span` (which must not have been entered yet;
    /// without a caller context `span` starts a new trace), and records the trace id in
    /// `span`'s `trace_id` field (so log lines show it: with an exporter always, without one
    /// when the caller sent it). Returns that trace id.
    pub fn adopt(self, span: &tracing::Span) -> Option<String> {
        let client = self.trace_id();
        // Fails only without the OpenTelemetry layer (nothing to parent) or on a span already
        // started: the span then keeps the parent it has.
        let _ = span.set_parent(self.cx);
        let id = trace_id(span).or(client);
        if let Some(id) = &id {
            span.record("trace_id", id.as_str());
        }
        id
    }
}

/// Makes the caller's span in `carrier` the parent of `span`: [`Remote::adopt`].
pub fn remote_parent(span: &tracing::Span, carrier: &dyn Extractor) -> Option<String> {
    Remote::extract(carrier).adopt(span)
}

/// The trace id of `span`, when an OpenTelemetry layer gave it one.
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

fn inject(span: &tracing::Span, injector: &mut dyn Injector) {
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(&cx, injector);
    }
}

/// Writes `span`'s trace context (`traceparent`, `tracestate`) into `headers`; nothing without
/// the OpenTelemetry layer.
pub fn inject_headers(span: &tracing::Span, headers: &mut http::HeaderMap) {
    inject(span, &mut HeaderInjector(headers));
}

/// Writes `span`'s trace context into gRPC request metadata; nothing without the layer.
pub fn inject_metadata(span: &tracing::Span, md: &mut tonic::metadata::MetadataMap) {
    inject(span, &mut MetadataInjector(md));
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn headers(pairs: &[(&str, &str)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                http::HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn a_valid_traceparent_is_read() {
        let h = headers(&[("traceparent", TP), ("tracestate", "k=v")]);
        let cx = extract(&HeaderCarrier(&h));
        let sc = cx.span().span_context().clone();
        assert!(sc.is_valid() && sc.is_remote() && sc.is_sampled());
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert_eq!(sc.trace_state().header(), "k=v");
    }

    #[test]
    fn malformed_traceparents_are_ignored_not_errors() {
        for bad in [
            "",
            "garbage",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01x",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            let h = headers(&[("traceparent", bad)]);
            let cx = extract(&HeaderCarrier(&h));
            assert!(!cx.span().span_context().is_valid(), "{bad:?} was accepted");
        }
        // Not UTF-8 / not ASCII: the header is skipped.
        let mut h = http::HeaderMap::new();
        h.insert(
            "traceparent",
            http::HeaderValue::from_bytes(b"00-\xff\xfe").unwrap(),
        );
        assert!(!extract(&HeaderCarrier(&h)).span().span_context().is_valid());
    }

    #[test]
    fn metadata_round_trips_a_context() {
        let mut md = tonic::metadata::MetadataMap::new();
        md.insert("traceparent", TP.parse().unwrap());
        let cx = extract(&MetadataCarrier(&md));
        let mut out = tonic::metadata::MetadataMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut MetadataInjector(&mut out));
        assert_eq!(out.get("traceparent").unwrap().to_str().unwrap(), TP);
    }

    #[test]
    fn without_a_layer_the_client_trace_id_still_reaches_the_logs() {
        let span = tracing::info_span!("t", trace_id = tracing::field::Empty);
        let h = headers(&[("traceparent", TP)]);
        assert_eq!(
            remote_parent(&span, &HeaderCarrier(&h)).as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        // Nothing to inject without the layer.
        let mut out = http::HeaderMap::new();
        inject_headers(&span, &mut out);
        assert!(out.is_empty());
    }
}
