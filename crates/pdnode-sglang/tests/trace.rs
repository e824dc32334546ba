//! Trace context in front of SGLang workers: with an OpenTelemetry layer installed (the
//! exporter of `[telemetry]`, pointed at a closed port: spans are made, their export fails
//! quietly), the router passes the workers a `traceparent` of its own span in the client's
//! trace; a malformed client `traceparent` starts a new trace, never an error.

use pdnode_core::config::{RouterConfig, SglangDecodeWorker, SglangPrefillWorker, TelemetryConfig};
use pdnode_sglang::SglangRouter;
use pdnode_telemetry::Telemetry;
use pdnode_telemetry::export::ServiceInfo;
use pdnode_testkit::sglang_mock::{MockRole, MockWorker, Rendezvous};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// The (trace id, parent span id) of a `traceparent` header value.
fn parts(tp: &str) -> (String, String) {
    let f: Vec<&str> = tp.split('-').collect();
    assert_eq!(f.len(), 4, "{tp}");
    (f[1].to_string(), f[2].to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_get_the_routers_span_in_the_clients_trace() {
    let cfg = TelemetryConfig {
        endpoint: "http://127.0.0.1:1".into(),
        batch_delay_ms: 60_000,
        ..TelemetryConfig::default()
    };
    let who = ServiceInfo {
        node_id: "sglang-router-test".into(),
        cluster: "c".into(),
        role: "router".into(),
        version: "0".into(),
    };
    let telemetry = Telemetry::start(&cfg, &who).unwrap().expect("telemetry on");
    tracing_subscriber::registry()
        .with(telemetry.layer::<tracing_subscriber::Registry>())
        .try_init()
        .expect("the only subscriber of this test binary");

    let rv = Arc::new(Rendezvous::default());
    let prefill =
        MockWorker::start(MockRole::Prefill, Some(9300), rv.clone(), Duration::ZERO).await;
    let decode =
        MockWorker::start(MockRole::Decode, None, rv.clone(), Duration::from_millis(1)).await;
    let mut rc = RouterConfig::default();
    rc.sglang.prefill = vec![SglangPrefillWorker {
        url: prefill.url.clone(),
        bootstrap_port: prefill.bootstrap_port,
    }];
    rc.sglang.decode = vec![SglangDecodeWorker {
        url: decode.url.clone(),
    }];
    let router = SglangRouter::new(&rc, Vec::new()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(pdnode_sglang::serve(listener, router, stop.clone()));
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(r) = http.get(format!("{url}/health")).send().await
            && r.status() == 200
        {
            break;
        }
        assert!(Instant::now() < deadline, "workers never became usable");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let send = |tp: &'static str| {
        let http = http.clone();
        let url = url.clone();
        async move {
            let r = http
                .post(format!("{url}/generate"))
                .header("traceparent", tp)
                .json(&json!({"text": "Hi", "sampling_params": {"max_new_tokens": 2}}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
        }
    };
    let seen = |w: &MockWorker| -> String {
        let last = w.last.lock();
        let (_, h) = last.as_ref().expect("the worker got a request");
        h.get("traceparent")
            .expect("a traceparent")
            .to_str()
            .unwrap()
            .to_string()
    };

    // The client's trace goes on; the workers' parent is the router's span, not the client's.
    send("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").await;
    for w in [&prefill, &decode] {
        let (trace, parent) = parts(&seen(w));
        assert_eq!(trace, TRACE);
        assert_ne!(parent, CLIENT_SPAN, "the router's own span is the parent");
    }
    assert_eq!(
        seen(&prefill),
        seen(&decode),
        "one attempt span for both workers"
    );

    // A malformed one: a new trace, and the request is served.
    send("00-not-a-trace-01").await;
    let (trace, _) = parts(&seen(&decode));
    assert_ne!(trace, TRACE);
    assert_eq!(trace.len(), 32);

    stop.cancel();
    prefill.kill();
    decode.kill();
    tokio::task::spawn_blocking(move || {
        let _ = telemetry.shutdown();
    })
    .await
    .unwrap();
}
