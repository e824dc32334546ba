//! End to end, separate processes, OpenTelemetry traces (`[telemetry]`): an OTLP/gRPC trace
//! receiver in the test (tonic, the OTLP protobufs) on a free loopback port; router, prefill and
//! decode from configs/cpu-*.toml (simulated engine, KV over UCX on loopback, real etcd) export
//! to it with sampling 1.0.
//!
//! - One request with a client `traceparent`: every span of its trace carries the client's
//!   trace id, the three processes' spans are there (service.name = node id), every parent is
//!   in the trace (or is the client's span), and the steps are named: admission, pair choice,
//!   reservation, prefill (compute, KV hand-off), decode admission, stream.
//! - The same through the gRPC client port (`traceparent` metadata).
//! - The router logs as JSON: the request's lines carry its request id and trace id.
//! - The decode node killed: the next request's trace has an error status on the step that
//!   failed (`reserve_kv` at the router, the call to the dead node).

use crate::e2e_support;

use e2e_support::{Node, dump, free_addr};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use pdnode_proto::v1::{
    GenerateRequest, SamplingParams, generate_request, inference_client::InferenceClient,
};
use pdnode_testkit::{EtcdServer, skip_etcd_tests, wait_for_async};
use serde_json::json;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const READY: Duration = Duration::from_secs(120);
/// How long spans may take to reach the receiver (batch delay 200 ms in these nodes).
const EXPORTED: Duration = Duration::from_secs(30);

/// One received span, flattened.
#[derive(Debug, Clone)]
struct Got {
    service: String,
    trace_id: String,
    span_id: String,
    parent: String,
    name: String,
    start_ns: u64,
    error: Option<String>,
    attrs: BTreeMap<String, String>,
}

/// The in-test OTLP receiver: keeps every span it is sent.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Got>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = Vec::new();
        for rs in req.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| r.attributes.iter())
                .find(|kv| kv.key == "service.name")
                .map(|kv| value_str(kv.value.as_ref()))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    let error = s
                        .status
                        .as_ref()
                        .filter(|st| st.code == StatusCode::Error as i32)
                        .map(|st| st.message.clone());
                    out.push(Got {
                        service: service.clone(),
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent: hex(&s.parent_span_id),
                        name: s.name.clone(),
                        start_ns: s.start_time_unix_nano,
                        error,
                        attrs: s
                            .attributes
                            .iter()
                            .map(|kv| (kv.key.clone(), value_str(kv.value.as_ref())))
                            .collect(),
                    });
                }
            }
        }
        self.spans.lock().unwrap().extend(out);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn value_str(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Receiver {
    /// Serves on a free loopback port; returns its address.
    async fn start(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let svc = TraceServiceServer::new(self.clone());
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await;
        });
        addr
    }

    fn trace(&self, trace_id: &str) -> Vec<Got> {
        self.spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .cloned()
            .collect()
    }
}

/// A W3C trace id and span id no other run uses.
fn client_ids() -> (String, String) {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let mixed =
        t ^ (u128::from(std::process::id()) << 64) ^ 0x5eed_0000_0000_0000_0000_0000_0000_0001;
    (format!("{mixed:032x}"), "00f067aa0ba902b7".to_string())
}

/// The spans as an indented tree (children under their parent, in the order they started).
fn tree(spans: &[Got], client_span: &str) -> String {
    let mut kids: HashMap<&str, Vec<&Got>> = HashMap::new();
    for s in spans {
        kids.entry(s.parent.as_str()).or_default().push(s);
    }
    for v in kids.values_mut() {
        v.sort_by_key(|s| s.start_ns);
    }
    fn walk(kids: &HashMap<&str, Vec<&Got>>, id: &str, depth: usize, out: &mut String) {
        for s in kids.get(id).map(|v| v.as_slice()).unwrap_or_default() {
            let keep = [
                "request_id",
                "node",
                "prefill",
                "decode",
                "prefill_policy",
                "decode_policy",
                "prefill_candidates",
                "decode_candidates",
                "bytes",
                "via",
                "early_blocks",
                "layer_puts",
                "layer_group",
                "overlap",
                "kv_reports",
                "cached_tokens",
                "tokens",
                "finish_reason",
                "completion_tokens",
                "transfer_bytes",
            ];
            let attrs: Vec<String> = s
                .attrs
                .iter()
                .filter(|(k, _)| keep.contains(&k.as_str()))
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            out.push_str(&format!(
                "{}{} [{}]{}{}\n",
                "  ".repeat(depth),
                s.name,
                s.service,
                if attrs.is_empty() {
                    String::new()
                } else {
                    format!(" {}", attrs.join(" "))
                },
                s.error
                    .as_ref()
                    .map(|e| format!(" ERROR: {e}"))
                    .unwrap_or_default()
            ));
            walk(kids, &s.span_id, depth + 1, out);
        }
    }
    let mut out = format!("(client span {client_span})\n");
    walk(&kids, client_span, 1, &mut out);
    out
}

struct Split {
    router: Node,
    prefill: Node,
    decode: Node,
    http: String,
    grpc: String,
    ids: [String; 3],
}

/// `real`: the configs' SmolLM2 on the CPU engine; else the simulated engine.
fn start_split(dir: &Path, etcd: &str, cluster: &str, otlp: &str, real: bool) -> Split {
    let engine: Vec<String> = if real {
        // Two engines share the cores.
        vec!["engine.cpu_threads=1".to_string()]
    } else {
        [
            "engine.backend=\"mock\"",
            "model.format=\"dummy\"",
            "model.preset=\"smollm2-135m\"",
            "model.path=\"\"",
        ]
        .map(String::from)
        .to_vec()
    };
    let common = |role: &str| {
        let mut v = vec![
            format!("registry.endpoints=[\"{etcd}\"]"),
            format!("node.cluster=\"{cluster}\""),
            format!("node.id=\"{cluster}-{role}\""),
            format!("node.listen=\"{}\"", free_addr()),
            "registry.lease_ttl_s=3".to_string(),
            format!("telemetry.endpoint=\"http://{otlp}\""),
            "telemetry.sampling_ratio=1.0".to_string(),
            "telemetry.batch_delay_ms=200".to_string(),
        ];
        v.extend(engine.iter().cloned());
        v
    };
    let (http, grpc) = (free_addr(), free_addr());
    let mut r = common("router");
    r.push(format!("router.http_listen=\"{http}\""));
    r.push(format!("router.grpc_listen=\"{grpc}\""));
    r.push("log.format=\"json\"".to_string());
    let mut p = common("prefill");
    p.push(format!("node.http_listen=\"{}\"", free_addr()));
    let mut d = common("decode");
    d.push(format!("node.http_listen=\"{}\"", free_addr()));
    if !real {
        d.push("engine.mock.decode_us_per_token=2000".to_string());
    }
    Split {
        prefill: Node::start(dir, "prefill", "configs/cpu-prefill.toml", &p),
        decode: Node::start(dir, "decode", "configs/cpu-decode.toml", &d),
        router: Node::start(dir, "router", "configs/cpu-router.toml", &r),
        http,
        grpc,
        ids: ["router", "prefill", "decode"].map(|r| format!("{cluster}-{r}")),
    }
}

/// Attribute `key` of the first span named `name`, if both are there.
fn attr_of(spans: &[Got], name: &str, key: &str) -> String {
    spans
        .iter()
        .find(|s| s.name == name)
        .and_then(|s| s.attrs.get(key).cloned())
        .unwrap_or_default()
}

/// Every span name the trace of one successful request must have.
const STEPS: [&str; 12] = [
    "request",
    "admission",
    "pair_choice",
    "attempt",
    "reserve_kv",
    "reservation",
    "prefill",
    "compute",
    "queue",
    "chunk",
    "kv_handoff",
    "stream",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_the_three_processes() {
    if skip_etcd_tests() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start().expect("etcd");
    let rx = Receiver::default();
    let otlp = rx.start().await;
    // SmolLM2 on the CPU when it is there (CI fetches it), else the simulated engine: the
    // trace's shape is the same.
    let real = e2e_support::repo_root()
        .join(e2e_support::MODEL_REL)
        .is_file();
    if !real {
        eprintln!(
            "{} is absent: the simulated engine serves",
            e2e_support::MODEL_REL
        );
    }
    let split = start_split(dir.path(), &etcd.endpoint(), "e2e-trace", &otlp, real);
    let nodes = [&split.router, &split.prefill, &split.decode];
    e2e_support::wait_healthy(&split.http, READY, &nodes).await;

    // A request with the client's trace context.
    let (trace_id, client_span) = client_ids();
    let resp = e2e_support::client()
        .post(format!("http://{}/v1/completions", split.http))
        .header("traceparent", format!("00-{trace_id}-{client_span}-01"))
        .json(&json!({"prompt": "a prompt of a few words for the trace test", "max_tokens": 8}))
        .send()
        .await
        .unwrap();
    let status = resp.status();
    let body = resp.text().await.unwrap();
    assert_eq!(status, 200, "{body}{}", dump(&nodes));

    // Wait until the trace is complete: every step there and every parent known.
    let complete = |spans: &[Got]| {
        let names: HashSet<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        let ids: HashSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
        STEPS.iter().all(|n| names.contains(n))
            && names.contains("node.Decode")
            && spans
                .iter()
                .all(|s| s.parent == client_span || ids.contains(s.parent.as_str()))
    };
    let r = wait_for_async("the request's trace is complete", EXPORTED, || {
        let spans = rx.trace(&trace_id);
        async move { complete(&spans) }
    })
    .await;
    let spans = rx.trace(&trace_id);
    if let Err(e) = r {
        panic!(
            "{e}\nreceived:\n{}\nall traces: {:?}{}",
            tree(&spans, &client_span),
            rx.spans
                .lock()
                .unwrap()
                .iter()
                .map(|s| (&s.trace_id, &s.name))
                .collect::<Vec<_>>(),
            dump(&nodes)
        );
    }
    let shown = tree(&spans, &client_span);
    eprintln!("span tree of one request:\n{shown}");

    // One trace: the client's (the filter above), and its root is the router's request span.
    let roots: Vec<&Got> = spans.iter().filter(|s| s.parent == client_span).collect();
    assert_eq!(roots.len(), 1, "one child of the client's span:\n{shown}");
    assert_eq!(roots[0].name, "request");
    assert_eq!(roots[0].service, split.ids[0]);
    // The three processes, each named by its node id.
    let services: HashSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
    for id in &split.ids {
        assert!(services.contains(id.as_str()), "no span of {id}:\n{shown}");
    }
    // Who is whose parent, across the processes.
    let by_id: HashMap<&str, &Got> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let parent_of = |name: &str| -> (&str, &str) {
        let s = spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name}:\n{shown}"));
        let p = by_id
            .get(s.parent.as_str())
            .unwrap_or_else(|| panic!("{name}'s parent is not in the trace:\n{shown}"));
        (p.name.as_str(), p.service.as_str())
    };
    let (router, prefill, decode) = (
        split.ids[0].as_str(),
        split.ids[1].as_str(),
        split.ids[2].as_str(),
    );
    assert_eq!(parent_of("admission"), ("request", router));
    assert_eq!(parent_of("pair_choice"), ("request", router));
    assert_eq!(parent_of("attempt"), ("request", router));
    assert_eq!(parent_of("reserve_kv"), ("attempt", router));
    assert_eq!(parent_of("node.ReserveKv"), ("reserve_kv", router));
    assert_eq!(parent_of("reservation"), ("node.ReserveKv", decode));
    assert_eq!(parent_of("node.Prefill"), ("prefill", router));
    assert_eq!(parent_of("compute"), ("prefill", prefill));
    // The prefill's queue wait, then its chunks (the prompt's positions each one ran).
    assert_eq!(parent_of("queue"), ("compute", prefill));
    assert_eq!(parent_of("chunk"), ("compute", prefill));
    assert!(
        attr_of(&spans, "chunk", "tokens").parse::<u64>().unwrap() > 0,
        "{shown}"
    );
    assert_eq!(parent_of("kv_handoff"), ("prefill", prefill));
    assert_eq!(parent_of("node.Decode"), ("decode", router));
    assert_eq!(parent_of("decode_admission"), ("node.Decode", decode));
    assert_eq!(parent_of("stream"), ("decode", router));
    // The node spans carry the request id, as the router's attempt names it.
    let attempt_id = &spans.iter().find(|s| s.name == "attempt").unwrap().attrs["request_id"];
    for n in ["node.ReserveKv", "node.Prefill", "node.Decode"] {
        let s = spans.iter().find(|s| s.name == n).unwrap();
        assert_eq!(&s.attrs["request_id"], attempt_id, "{n}:\n{shown}");
    }
    // What the steps recorded.
    let attr = |name: &str, key: &str| -> String {
        spans
            .iter()
            .find(|s| s.name == name)
            .and_then(|s| s.attrs.get(key).cloned())
            .unwrap_or_else(|| panic!("{name} has no {key}:\n{shown}"))
    };
    assert!(
        attr("kv_handoff", "bytes").parse::<u64>().unwrap() > 0,
        "{shown}"
    );
    // Whether the decode node asked for a checksum of the hand-off (transfer.verify).
    let verify = attr("kv_handoff", "verify");
    assert!(verify == "true" || verify == "false", "{shown}");
    // The decode node checked what landed (host staging on the CPU: fence records) and, as
    // the prefill node was asked, the checksum.
    assert_eq!(attr("decode_admission", "checked"), "true", "{shown}");
    assert_eq!(attr("decode_admission", "verified"), verify, "{shown}");
    // 8 tokens, or fewer if the model ended its answer first.
    let finish = attr("stream", "finish_reason");
    assert!(finish == "length" || finish == "stop", "{shown}");
    let tokens = attr("request", "completion_tokens");
    assert_eq!(attr("stream", "tokens"), tokens, "{shown}");
    assert_eq!(attr("request", "finish_reason"), finish, "{shown}");
    if finish == "length" {
        assert_eq!(tokens, "8", "{shown}");
    }
    assert_eq!(attr("pair_choice", "prefill"), prefill, "{shown}");
    assert_eq!(attr("pair_choice", "decode"), decode, "{shown}");
    assert!(spans.iter().all(|s| s.error.is_none()), "{shown}");

    // A gRPC client's `traceparent` metadata parents its request's trace the same way.
    let (grpc_trace, grpc_span) = client_ids();
    let mut client = InferenceClient::connect(format!("http://{}", split.grpc))
        .await
        .expect("gRPC connect");
    let mut req = tonic::Request::new(GenerateRequest {
        prompt: Some(generate_request::Prompt::Text("a gRPC prompt".into())),
        sampling: Some(SamplingParams {
            max_tokens: Some(4),
            ..Default::default()
        }),
        ..Default::default()
    });
    req.metadata_mut().insert(
        "traceparent",
        format!("00-{grpc_trace}-{grpc_span}-01").parse().unwrap(),
    );
    let mut stream = client.generate(req).await.expect("Generate").into_inner();
    while let Some(m) = tokio::time::timeout(Duration::from_secs(30), stream.message())
        .await
        .expect("gRPC stream stalled")
        .expect("gRPC stream error")
    {
        drop(m);
    }
    let r = wait_for_async("the gRPC request's trace", EXPORTED, || {
        let spans = rx.trace(&grpc_trace);
        async move {
            let names: HashSet<String> = spans.iter().map(|s| s.name.clone()).collect();
            ["request", "node.Prefill", "node.Decode"]
                .iter()
                .all(|n| names.contains(*n))
        }
    })
    .await;
    let spans = rx.trace(&grpc_trace);
    r.unwrap_or_else(|e| panic!("{e}:\n{}", tree(&spans, &grpc_span)));
    let root = spans.iter().find(|s| s.name == "request").unwrap();
    assert_eq!(root.parent, grpc_span);
    assert_eq!(root.attrs["endpoint"], "grpc");

    // The decode node dies; the next request fails at its reservation, and its trace says so.
    drop(split.decode);
    let (failing, failing_span) = client_ids();
    let resp = e2e_support::client()
        .post(format!("http://{}/v1/completions", split.http))
        .header("traceparent", format!("00-{failing}-{failing_span}-01"))
        .json(&json!({"prompt": "this one finds no decode node", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_server_error(), "{:?}", resp.status());
    let r = wait_for_async("the failing request's trace", EXPORTED, || {
        let spans = rx.trace(&failing);
        async move {
            spans
                .iter()
                .any(|s| s.name == "request" && s.error.is_some())
        }
    })
    .await;
    let spans = rx.trace(&failing);
    let shown = tree(&spans, &failing_span);
    eprintln!("span tree of the failing request:\n{shown}");
    r.unwrap_or_else(|e| panic!("{e}:\n{shown}{}", dump(&[&split.router])));
    // The step that failed is named: the router's call to the dead decode node (or, had the
    // registry dropped it already, the admission that found no decode node).
    let failed: Vec<&str> = spans
        .iter()
        .filter(|s| s.error.is_some())
        .map(|s| s.name.as_str())
        .collect();
    assert!(
        failed.contains(&"reserve_kv") || failed.contains(&"admission"),
        "no failed step in {failed:?}:\n{shown}"
    );

    // JSON log lines of the router carry the request's trace id and request id.
    let log = split.router.log();
    let line = log
        .lines()
        .find(|l| l.contains(&failing) && l.contains("request_id"))
        .unwrap_or_else(|| panic!("no router log line with trace id {failing}:\n{log}"));
    let v: serde_json::Value = serde_json::from_str(line).expect("a JSON log line");
    assert_eq!(v["span"]["trace_id"], failing.as_str(), "{line}");
    assert!(v["span"]["request_id"].is_string(), "{line}");
}
