//! OpenTelemetry traces for pdnode (docs/runtime-semantics.md, "Traces").
//!
//! - [`propagate`]: W3C trace context (`traceparent`, `tracestate`) read from a client's HTTP
//!   headers or gRPC metadata into a tracing span's parent, and written from the current span
//!   into the metadata of router -> node calls and the headers of router -> SGLang worker calls.
//!   A malformed `traceparent` is ignored (the span starts a new trace), never an error.
//! - [`export`]: the OTLP/gRPC exporter behind `[telemetry]` and the tracing layer that feeds it
//!   (the binary installs it; off by default).
//! - [`fail`]: marks a span as the step that failed (error status and message).
//!
//! Everything here is a no-op while no OpenTelemetry layer is installed: spans then carry only
//! their tracing fields (`request_id`, and `trace_id` when the client sent one) for the logs.

pub mod export;
pub mod propagate;

use opentelemetry::trace::Status;
use tracing_opentelemetry::OpenTelemetrySpanExt;

pub use export::{Telemetry, TelemetryError};
pub use propagate::{
    HeaderCarrier, MetadataCarrier, Remote, inject_headers, inject_metadata, remote_parent,
    trace_id,
};

/// Marks `span` as failed with `err`: the span's status is `Error` with the message, so a trace
/// names the step that failed. A no-op without the OpenTelemetry layer.
pub fn fail(span: &tracing::Span, err: &dyn std::fmt::Display) {
    span.set_status(Status::error(err.to_string()));
}

/// Adds an event named `name` with a `detail` attribute to `span`'s exported span, without a
/// log line (for per-chunk facts too chatty for the logs). A no-op without the layer.
pub fn event(span: &tracing::Span, name: &'static str, detail: String) {
    span.add_event(name, vec![opentelemetry::KeyValue::new("detail", detail)]);
}
