//! `pdnode sglang-router` as a process, with sglang-router 0.3.2's PD flags, in front of
//! **mock** SGLang workers (`pdnode_testkit::sglang_mock`) on loopback: it serves a stream with
//! the right bootstrap fields, serves `/metrics` on the Prometheus listener, refuses a flag it
//! does not implement by name, serves `pdnode.v1.Inference` with `--grpc-port`, and drains on
//! SIGTERM. `pdnode start` runs the same router from
//! `configs/sglang-router.toml`'s keys.

use pdnode_testkit::ChildGuard;
use pdnode_testkit::sglang_mock::{MockRole, MockWorker, Rendezvous};
use serde_json::{Value, json};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_pdnode");

async fn wait_healthy(http: &reqwest::Client, url: &str, guard: &mut ChildGuard) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = http.get(format!("{url}/health")).send().await
            && r.status().is_success()
        {
            return;
        }
        assert!(guard.try_wait().unwrap().is_none(), "the router exited");
        assert!(Instant::now() < deadline, "the router never became healthy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_drop_in_command_serves_and_drains() {
    let rv = Arc::new(Rendezvous::default());
    let p = MockWorker::start(MockRole::Prefill, Some(8998), rv.clone(), Duration::ZERO).await;
    let d = MockWorker::start(MockRole::Decode, None, rv, Duration::from_millis(1)).await;
    let port = pdnode_testkit::free_port().unwrap();
    let prom = pdnode_testkit::free_port().unwrap();
    let grpc = pdnode_testkit::free_port().unwrap();
    let child = Command::new(BIN)
        .args([
            "sglang-router",
            "--pd-disaggregation",
            "--prefill",
            &p.url,
            "8998",
            "--decode",
        ])
        .arg(&d.url)
        .args([
            "--prefill-policy",
            "cache_aware",
            "--decode-policy",
            "round_robin",
        ])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args([
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            &prom.to_string(),
        ])
        .args(["--health-check-interval-secs", "1"])
        .args(["--grpc-port", &grpc.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut guard = ChildGuard::new("pdnode sglang-router", child);
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let url = format!("http://127.0.0.1:{port}");
    wait_healthy(&http, &url, &mut guard).await;

    let body = http
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": "mock-model", "prompt": "Hi", "max_tokens": 5, "stream": true}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let datas: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(datas.last(), Some(&"[DONE]"), "{body}");
    assert_eq!(datas.len(), 6, "{body}");
    let first: Value = serde_json::from_str(datas[0]).unwrap();
    assert_eq!(first["mock_seen"]["bootstrap_port"], 8998);
    assert_eq!(first["mock_seen"]["bootstrap_host"], "127.0.0.1");

    // pdnode's own --grpc-port: pdnode.v1.Inference over the same workers.
    let mut client = pdnode_proto::v1::inference_client::InferenceClient::connect(format!(
        "http://127.0.0.1:{grpc}"
    ))
    .await
    .unwrap();
    let mut stream = client
        .generate(pdnode_proto::v1::GenerateRequest {
            prompt: Some(pdnode_proto::v1::generate_request::Prompt::Text(
                "Hi".into(),
            )),
            sampling: Some(pdnode_proto::v1::SamplingParams {
                max_tokens: Some(3),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut ids = Vec::new();
    let mut finish = None;
    while let Some(m) = stream.message().await.unwrap() {
        match m.event {
            Some(pdnode_proto::v1::generate_response::Event::Chunk(c)) => ids.extend(c.token_ids),
            Some(pdnode_proto::v1::generate_response::Event::Done(d)) => {
                finish = Some(d.finish_reason)
            }
            None => {}
        }
    }
    assert_eq!(ids, vec![100, 101, 102]);
    assert_eq!(finish, Some(pdnode_proto::v1::FinishReason::Length as i32));

    let m = http
        .get(format!("http://127.0.0.1:{prom}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        m.contains("pdnode_sglang_requests_total{route=\"completions\",status=\"200\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("pdnode_sglang_requests_total{route=\"generate\",status=\"200\"} 1"),
        "{m}"
    );

    // The gRPC client stays connected: an idle connection must not hold the shutdown.
    guard.signal("TERM").unwrap();
    let _keep = (stream, client);
    let st = guard.wait_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(
        st.and_then(|s| s.code()),
        Some(0),
        "SIGTERM drains and exits 0"
    );
}

#[test]
fn flags_it_does_not_implement_are_refused_by_name() {
    let out = Command::new(BIN)
        .args(["sglang-router", "--pd-disaggregation", "--dp-aware"])
        .args([
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:2",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--dp-aware"), "{err}");
    let out = Command::new(BIN)
        .args([
            "sglang-router",
            "--prefill",
            "http://127.0.0.1:1",
            "--decode",
            "http://127.0.0.1:2",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--pd-disaggregation"));
}

#[tokio::test]
async fn pdnode_start_serves_the_same_router_from_config() {
    let rv = Arc::new(Rendezvous::default());
    let p = MockWorker::start(MockRole::Prefill, None, rv.clone(), Duration::ZERO).await;
    let d = MockWorker::start(MockRole::Decode, None, rv, Duration::ZERO).await;
    let port = pdnode_testkit::free_port().unwrap();
    let config =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/sglang-router.toml");
    // the client keys from a file only (`security.api_keys` left empty), the workers' own key
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# clients\nclient-key\n\n").unwrap();
    let child = Command::new(BIN)
        .args(["start", "--config"])
        .arg(&config)
        .args(["--set", &format!("router.http_listen=\"127.0.0.1:{port}\"")])
        .args([
            "--set",
            &format!("security.api_keys_file={:?}", keys.to_str().unwrap()),
        ])
        .args(["--set", "router.sglang.worker_api_key=\"worker-key\""])
        .args([
            "--set",
            &format!("router.sglang.prefill=[{{url=\"{}\"}}]", p.url),
        ])
        .args([
            "--set",
            &format!("router.sglang.decode=[{{url=\"{}\"}}]", d.url),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut guard = ChildGuard::new("pdnode start (sglang)", child);
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let url = format!("http://127.0.0.1:{port}");
    wait_healthy(&http, &url, &mut guard).await;
    let generate = |key: Option<&str>| {
        let mut b = http
            .post(format!("{url}/generate"))
            .json(&json!({"text": "Hi", "sampling_params": {"max_new_tokens": 3}}));
        if let Some(k) = key {
            b = b.bearer_auth(k);
        }
        b.send()
    };
    for key in [None, Some("worker-key"), Some("# clients")] {
        let r = generate(key).await.unwrap();
        assert_eq!(r.status(), 401, "key {key:?}: {:?}", r.text().await);
    }
    let v: Value = generate(Some("client-key"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["text"], "t0 t1 t2 ", "{v}");
    assert_eq!(v["meta_info"]["mock_seen"]["bootstrap_port"], Value::Null);
    // the workers see `router.sglang.worker_api_key`, never the client's key
    assert_eq!(
        v["meta_info"]["mock_seen"]["headers"]["authorization"], "Bearer worker-key",
        "{v}"
    );
}
