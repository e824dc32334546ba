//! The OTLP/gRPC span exporter behind `[telemetry]` and the tracing layer that feeds it.
//!
//! Spans of pdnode's own crates (targets `pdnode*`) at `info` and above are exported, whatever
//! `log.filter` says (it filters the log lines only). Spans go through a batch processor on its
//! own thread; [`Telemetry::shutdown`] exports what is left, so a node that stops cleanly loses
//! no span. Sampling: `ParentBased(TraceIdRatioBased(telemetry.sampling_ratio))`, so a request
//! that comes with a trace context follows its caller's decision and the three processes of a
//! request agree.

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider,
};
use pdnode_core::config::TelemetryConfig;
use std::time::Duration;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::registry::LookupSpan;

/// How long one export call may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("telemetry.endpoint = {endpoint:?}: cannot build the OTLP exporter: {reason}")]
    Exporter { endpoint: String, reason: String },
    #[error("flushing spans at shutdown: {reason}")]
    Shutdown { reason: String },
}

/// Who this process is, as its spans' resource says.
#[derive(Debug, Clone)]
pub struct ServiceInfo {
    /// The node id (`service.name` unless `telemetry.service_name` is set).
    pub node_id: String,
    pub cluster: String,
    pub role: String,
    pub version: String,
}

/// The running exporter. Dropping it without [`Telemetry::shutdown`] may lose the last batch.
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Starts the exporter `cfg` asks for; `None` when traces are off (no `telemetry.endpoint`).
    /// Needs a Tokio runtime (the gRPC channel runs on it).
    pub fn start(cfg: &TelemetryConfig, who: &ServiceInfo) -> Result<Option<Self>, TelemetryError> {
        if !cfg.enabled() {
            return Ok(None);
        }
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(cfg.endpoint.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| TelemetryError::Exporter {
                endpoint: cfg.endpoint.clone(),
                reason: e.to_string(),
            })?;
        let batch = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_scheduled_delay(Duration::from_millis(cfg.batch_delay_ms))
                    .build(),
            )
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(batch)
            .with_sampler(sampler(cfg.sampling_ratio))
            .with_resource(resource(cfg, who))
            .build();
        Ok(Some(Self { provider }))
    }

    /// The tracing layer that turns pdnode's spans into exported OpenTelemetry spans.
    pub fn layer<S>(&self) -> Box<dyn Layer<S> + Send + Sync + 'static>
    where
        S: tracing::Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
    {
        let tracer = self.provider.tracer("pdnode");
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_filter(span_filter())
            .boxed()
    }

    /// Exports the spans still batched and stops the exporter. Blocks (up to the export
    /// timeout): call it from a blocking context.
    pub fn shutdown(self) -> Result<(), TelemetryError> {
        self.provider
            .shutdown()
            .map_err(|e| TelemetryError::Shutdown {
                reason: e.to_string(),
            })
    }
}

/// pdnode's own spans at `info` and above; never the exporter's own (tonic, h2, hyper), which
/// would trace every export.
pub fn span_filter() -> Targets {
    // A target matches by prefix: `pdnode` covers `pdnode_router::...`, `pdnode_node::...`.
    Targets::new().with_target("pdnode", tracing::Level::INFO)
}

/// Parent-based: a sampled caller is followed, an unsampled one too; new traces by trace id
/// ratio (so every process decides the same for one trace id).
pub fn sampler(ratio: f64) -> Sampler {
    Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio)))
}

fn resource(cfg: &TelemetryConfig, who: &ServiceInfo) -> Resource {
    let name = if cfg.service_name.is_empty() {
        who.node_id.clone()
    } else {
        cfg.service_name.clone()
    };
    Resource::builder_empty()
        .with_service_name(name)
        .with_attributes([
            KeyValue::new("service.namespace", who.cluster.clone()),
            KeyValue::new("service.instance.id", who.node_id.clone()),
            KeyValue::new("service.version", who.version.clone()),
            KeyValue::new("pdnode.role", who.role.clone()),
        ])
        .build()
}

/// The `service.name` `cfg` gives a node called `node_id`.
pub fn service_name(cfg: &TelemetryConfig, node_id: &str) -> String {
    let who = ServiceInfo {
        node_id: node_id.to_string(),
        cluster: String::new(),
        role: String::new(),
        version: String::new(),
    };
    resource(cfg, &who)
        .get(&opentelemetry::Key::new("service.name"))
        .map(|v| v.to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_name_is_the_node_id_unless_set() {
        let mut cfg = TelemetryConfig::default();
        assert_eq!(service_name(&cfg, "cpu-router-0"), "cpu-router-0");
        cfg.service_name = "edge".into();
        assert_eq!(service_name(&cfg, "cpu-router-0"), "edge");
    }

    #[test]
    fn the_ratio_decides_new_traces_and_a_caller_decides_its_own() {
        use crate::propagate::{HeaderCarrier, extract};
        use opentelemetry::trace::{SpanKind, TraceId};
        use opentelemetry_sdk::trace::{SamplingDecision, ShouldSample};
        let decide = |ratio: f64, parent: Option<&opentelemetry::Context>, id: u128| {
            sampler(ratio)
                .should_sample(
                    parent,
                    TraceId::from(id),
                    "request",
                    &SpanKind::Server,
                    &[],
                    &[],
                )
                .decision
        };
        // New traces: none at 0, all at 1, about half at 0.5 (by trace id).
        let ids = (1..=1000u128).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c834));
        let kept = |ratio| {
            ids.clone()
                .filter(|&id| decide(ratio, None, id) == SamplingDecision::RecordAndSample)
                .count()
        };
        assert_eq!(kept(0.0), 0);
        assert_eq!(kept(1.0), 1000);
        let half = kept(0.5);
        assert!((350..=650).contains(&half), "{half} of 1000 at 0.5");
        // A caller's sampled flag wins over the ratio, both ways.
        let caller = |flags: &str| {
            let mut h = http::HeaderMap::new();
            h.insert(
                "traceparent",
                format!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}")
                    .parse()
                    .unwrap(),
            );
            extract(&HeaderCarrier(&h))
        };
        let sampled = caller("01");
        let unsampled = caller("00");
        assert_eq!(
            decide(0.0, Some(&sampled), 7),
            SamplingDecision::RecordAndSample
        );
        assert_ne!(
            decide(1.0, Some(&unsampled), 7),
            SamplingDecision::RecordAndSample
        );
    }

    #[test]
    fn off_without_an_endpoint() {
        let who = ServiceInfo {
            node_id: "n".into(),
            cluster: "c".into(),
            role: "router".into(),
            version: "0".into(),
        };
        assert!(
            Telemetry::start(&TelemetryConfig::default(), &who)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn the_filter_takes_pdnode_spans_only() {
        let t = span_filter();
        let on = |target: &str, level| t.would_enable(target, &level);
        assert!(on("pdnode_router::router::flow", tracing::Level::INFO));
        assert!(on("pdnode_node::grpc", tracing::Level::INFO));
        assert!(!on("pdnode_node::grpc", tracing::Level::DEBUG));
        assert!(!on("h2::codec", tracing::Level::INFO));
        assert!(!on("tonic::transport", tracing::Level::INFO));
    }
}
