//! `pdnode bench` against an in-process fake OpenAI server whose delays are known: the measured
//! TTFT and TPOT must come out near them.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use pdnode_bench::{Api, BenchConfig, Endpoint, Slo, Workload, report, run};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[derive(Clone)]
struct Fake {
    ttft: Duration,
    per_token: Duration,
    /// Every `fail_every`-th request answers 503 (0: never).
    fail_every: usize,
    seen: Arc<AtomicUsize>,
    ignore_eos_seen: Arc<AtomicUsize>,
}

async fn models() -> Json<serde_json::Value> {
    Json(serde_json::json!({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}))
}

async fn completions(State(f): State<Fake>, Json(body): Json<serde_json::Value>) -> Response {
    stream_answer(f, body, false)
}

async fn chat(State(f): State<Fake>, Json(body): Json<serde_json::Value>) -> Response {
    if body["messages"][0]["role"] != "user" {
        return (StatusCode::BAD_REQUEST, "expected one user message").into_response();
    }
    stream_answer(f, body, true)
}

fn stream_answer(f: Fake, body: serde_json::Value, chat: bool) -> Response {
    let n = f.seen.fetch_add(1, Ordering::SeqCst) + 1;
    if body["ignore_eos"] == serde_json::Value::Bool(true) {
        f.ignore_eos_seen.fetch_add(1, Ordering::SeqCst);
    }
    if f.fail_every > 0 && n.is_multiple_of(f.fail_every) {
        return (StatusCode::SERVICE_UNAVAILABLE, "overloaded").into_response();
    }
    let max_tokens = body["max_tokens"].as_u64().unwrap_or(16) as usize;
    let prompt = if chat {
        body["messages"][0]["content"].as_str()
    } else {
        body["prompt"].as_str()
    };
    let prompt_words = prompt.map_or(0, |p| p.split(' ').count());
    let stream = futures::stream::unfold(0usize, move |i| {
        let f = f.clone();
        async move {
            let event = if i < max_tokens {
                tokio::time::sleep(if i == 0 { f.ttft } else { f.per_token }).await;
                let finish = if i + 1 == max_tokens {
                    serde_json::json!("length")
                } else {
                    serde_json::Value::Null
                };
                let chunk = if chat {
                    serde_json::json!({
                        "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {"content": format!(" t{i}")}, "finish_reason": finish}],
                    })
                } else {
                    serde_json::json!({
                        "object": "text_completion",
                        "choices": [{"index": 0, "text": format!(" t{i}"), "finish_reason": finish}],
                    })
                };
                format!("data: {chunk}\n\n")
            } else if i == max_tokens {
                let usage = serde_json::json!({
                    "choices": [],
                    "usage": {"prompt_tokens": prompt_words, "completion_tokens": max_tokens},
                });
                format!("data: {usage}\n\n")
            } else if i == max_tokens + 1 {
                "data: [DONE]\n\n".to_string()
            } else {
                return None;
            };
            Some((Ok::<_, std::convert::Infallible>(event), i + 1))
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Serves the fake on 127.0.0.1:0; the task is aborted when the guard drops.
struct Server {
    url: String,
    fake: Fake,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(ttft_ms: u64, per_token_ms: u64, fail_every: usize) -> Server {
    let fake = Fake {
        ttft: Duration::from_millis(ttft_ms),
        per_token: Duration::from_millis(per_token_ms),
        fail_every,
        seen: Arc::default(),
        ignore_eos_seen: Arc::default(),
    };
    let app = axum::Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Server {
        url: format!("http://{addr}"),
        fake,
        task,
    }
}

fn endpoint(url: &str, ignore_eos: bool) -> Endpoint {
    Endpoint {
        base_url: url.to_string(),
        model: "fake-model".into(),
        api: Api::Completions,
        api_key: None,
        ignore_eos,
        timeout: Duration::from_secs(60),
    }
}

fn config(endpoints: Vec<Endpoint>, concurrency: Vec<usize>, n: usize, out: u32) -> BenchConfig {
    BenchConfig {
        endpoints,
        workload: Workload::Fixed {
            input_len: 32,
            output_len: out,
        },
        num_requests: n,
        concurrency,
        request_rate: None,
        seed: 7,
        slo: Slo::default(),
        warmup: 0,
        show_progress: false,
    }
}

// Generous tolerances: CI machines are slow and shared. The lower bounds are strict (a token
// cannot arrive before the server sends it); the upper bounds allow scheduling noise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measured_ttft_and_tpot_match_the_server_delays() {
    let s = serve(200, 40, 0).await;
    let cfg = config(vec![endpoint(&s.url, true)], vec![1, 4], 8, 6);
    let report = run(&cfg).await.unwrap();
    assert_eq!(report.runs.len(), 2);
    for r in &report.runs {
        let m = &r.summary;
        assert_eq!((m.completed, m.failed), (8, 0), "{m:?}");
        assert!(
            (195.0..450.0).contains(&m.ttft.p50_ms),
            "TTFT p50 {} ms, server delay 200 ms",
            m.ttft.p50_ms
        );
        assert!(
            (38.0..90.0).contains(&m.tpot.p50_ms),
            "TPOT p50 {} ms, server delay 40 ms",
            m.tpot.p50_ms
        );
        assert!(
            (38.0..90.0).contains(&m.itl.p50_ms),
            "ITL p50 {} ms",
            m.itl.p50_ms
        );
        // 200 + 5 * 40 = 400 ms per request.
        assert!(
            (395.0..700.0).contains(&m.e2e.p50_ms),
            "E2E {}",
            m.e2e.p50_ms
        );
        assert_eq!(m.total_output_tokens, 8 * 6);
        assert_eq!(m.total_input_tokens, 8 * 32, "usage.prompt_tokens is used");
        assert!(m.output_token_throughput > 0.0);
    }
    // Concurrency 4 finishes 8 requests about 4x faster than concurrency 1.
    let d1 = report.runs[0].summary.duration_s;
    let d4 = report.runs[1].summary.duration_s;
    assert!(
        d4 < d1 / 2.0,
        "concurrency 1: {d1} s, concurrency 4: {d4} s"
    );
    assert_eq!(s.fake.ignore_eos_seen.load(Ordering::SeqCst), 16);

    let table = report::table(&report);
    assert!(
        table.contains("TTFT p50") && table.contains("fixed"),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_counted_by_kind_and_goodput_follows_the_slo() {
    let s = serve(50, 10, 3).await;
    let mut cfg = config(vec![endpoint(&s.url, false)], vec![2], 9, 4);
    cfg.slo = Slo {
        ttft_ms: Some(5_000.0),
        tpot_ms: Some(1.0), // impossible: 10 ms per token
    };
    let report = run(&cfg).await.unwrap();
    let m = &report.runs[0].summary;
    assert_eq!((m.completed, m.failed), (6, 3), "{m:?}");
    assert_eq!(m.errors.get("http_503"), Some(&3));
    assert_eq!(m.goodput, 0.0);
    assert_eq!(
        s.fake.ignore_eos_seen.load(Ordering::SeqCst),
        0,
        "no --ignore-eos"
    );

    cfg.slo.tpot_ms = Some(5_000.0);
    let report = run(&cfg).await.unwrap();
    let m = &report.runs[0].summary;
    assert!(
        (m.slo_attainment - 6.0 / 9.0).abs() < 1e-9,
        "{}",
        m.slo_attainment
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_endpoint_is_a_connect_error() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let cfg = config(
        vec![endpoint(&format!("http://127.0.0.1:{port}"), false)],
        vec![1],
        2,
        4,
    );
    let report = run(&cfg).await.unwrap();
    assert_eq!(report.runs[0].summary.errors.get("connect"), Some(&2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_alternates_and_reports_ratios_json_and_plot() {
    let a = serve(100, 20, 0).await;
    let b = serve(100, 40, 0).await;
    let cfg = config(
        vec![endpoint(&a.url, true), endpoint(&b.url, true)],
        vec![1, 2],
        4,
        6,
    );
    let report = run(&cfg).await.unwrap();
    assert_eq!(report.runs.len(), 4);
    // Alternation: A@1, B@1, A@2, B@2.
    let order: Vec<(usize, usize)> = report
        .runs
        .iter()
        .map(|r| (r.endpoint, r.concurrency))
        .collect();
    assert_eq!(order, vec![(0, 1), (1, 1), (0, 2), (1, 2)]);
    assert_eq!(report.comparisons.len(), 2);
    for c in &report.comparisons {
        let tpot = c.tpot_p50.unwrap();
        assert!(
            (1.4..2.6).contains(&tpot),
            "B/A TPOT ratio {tpot}, expected about 2"
        );
        assert!(c.output_token_throughput.unwrap() < 1.0);
    }
    let table = report::table(&report);
    assert!(table.contains("B / A"), "{table}");

    let dir = tempfile::tempdir().unwrap();
    let json = serde_json::to_string_pretty(&report).unwrap();
    let back: pdnode_bench::BenchReport = serde_json::from_str(&json).unwrap();
    // Floats may differ in the last bit through JSON; the structure must not.
    assert_eq!(back.endpoints, report.endpoints);
    assert_eq!(back.runs.len(), report.runs.len());
    for (x, y) in back.runs.iter().zip(&report.runs) {
        assert_eq!((x.endpoint, x.concurrency), (y.endpoint, y.concurrency));
        assert_eq!(x.summary.completed, y.summary.completed);
        assert!((x.summary.tpot.p50_ms - y.summary.tpot.p50_ms).abs() < 1e-6);
    }
    assert_eq!(back.comparisons.len(), 2);
    let svg_path = std::env::var_os("PDNODE_BENCH_TEST_PLOT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| dir.path().join("bench.svg"));
    pdnode_bench::plot::write_svg(&report, &svg_path).unwrap();
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
        "{svg:.200}"
    );
    println!("plot SVG: {} bytes", svg.len());
    // the three panel titles, the x axis, the levels and the legend are text in it
    for label in [
        "TTFT ms",
        "TPOT ms",
        "output tokens/s",
        "concurrency",
        "workload",
    ] {
        assert!(svg.contains(label), "no {label:?} in the plot");
    }
    for run in report.runs_of(0) {
        assert!(
            svg.contains(&format!(">\n{}\n</text>", run.concurrency)),
            "no level {} on the x axis",
            run.concurrency
        );
    }
    let lines = svg.matches("<polyline").count();
    assert!(
        lines >= 3 * 2,
        "{lines} lines: a p50 line per endpoint and panel at least"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_discovery_and_poisson_pacing() {
    let s = serve(10, 5, 0).await;
    let model = pdnode_bench::Client::discover_model(
        &format!("{}/v1/", s.url),
        None,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(model, "fake-model");
    let mut cfg = config(vec![endpoint(&s.url, false)], vec![64], 20, 2);
    // 20 requests at 40 req/s take about half a second to send, even with room for all at once.
    cfg.request_rate = Some(40.0);
    let report = run(&cfg).await.unwrap();
    let m = &report.runs[0].summary;
    assert_eq!(m.completed, 20);
    assert!(
        m.duration_s > 0.2,
        "Poisson pacing spreads sends: {} s",
        m.duration_s
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_api_is_timed_from_delta_content() {
    let s = serve(100, 20, 0).await;
    let mut ep = endpoint(&s.url, false);
    ep.api = Api::Chat;
    let report = run(&config(vec![ep], vec![2], 4, 5)).await.unwrap();
    let m = &report.runs[0].summary;
    assert_eq!((m.completed, m.failed), (4, 0), "{m:?}");
    assert_eq!(m.total_output_tokens, 20);
    assert!(
        (95.0..350.0).contains(&m.ttft.p50_ms),
        "TTFT {}",
        m.ttft.p50_ms
    );
    assert!(
        (18.0..70.0).contains(&m.tpot.p50_ms),
        "TPOT {}",
        m.tpot.p50_ms
    );
}
