//! Shared pieces of the end-to-end tests (`tests/e2e_*.rs`): `pdnode start` processes killed by
//! PID, the SmolLM2 GGUF (skip or fail when absent), HTTP helpers with deadlines.

#![allow(dead_code)] // each e2e test binary uses a different subset

use pdnode_testkit::{ChildGuard, wait_for_async};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

pub const BIN: &str = env!("CARGO_BIN_EXE_pdnode");

/// Every HTTP call of the tests ends within this.
pub const HTTP_DEADLINE: Duration = Duration::from_secs(60);

/// The workspace root (the tests start nodes there so `configs/` and `models/` paths resolve).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub const MODEL_REL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Whether the SmolLM2 GGUF is there. Absent: prints SKIPPED and returns false, unless `CI` is
/// set (CI fetches it with scripts/fetch-model.sh first), where it panics.
pub fn model_present(test: &str) -> bool {
    let p = repo_root().join(MODEL_REL);
    if p.is_file() {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!(
            "{test}: {} is missing and CI is set (run scripts/fetch-model.sh)",
            p.display()
        );
    }
    eprintln!(
        "SKIPPED {test}: {} is absent (scripts/fetch-model.sh fetches it)",
        p.display()
    );
    false
}

/// A `pdnode start` process and its log file.
pub struct Node {
    pub guard: ChildGuard,
    pub log: PathBuf,
}

impl Node {
    /// `pdnode start --config <config> --set <sets>...` in the workspace root, output to
    /// `<dir>/<name>.log`, UCX on loopback.
    pub fn start(dir: &Path, name: &str, config: &str, sets: &[String]) -> Node {
        let log = dir.join(format!("{name}.log"));
        let f = std::fs::File::create(&log).expect("create log");
        let mut cmd = Command::new(BIN);
        cmd.current_dir(repo_root())
            .arg("start")
            .arg("--config")
            .arg(config);
        for s in sets {
            cmd.arg("--set").arg(s);
        }
        let child = cmd
            .env_remove("RUST_LOG")
            .env("UCX_NET_DEVICES", "lo")
            .stdin(Stdio::null())
            .stdout(f.try_clone().expect("clone log"))
            .stderr(f)
            .spawn()
            .expect("spawn pdnode start");
        Node {
            guard: ChildGuard::new(name, child),
            log,
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// Prints the logs of `nodes` (for a failing assertion).
/// Each log without its effective-configuration block, and only its last `DUMP_LINES` lines
/// (a CI report keeps the head of a failure's output and cuts the rest).
pub fn dump(nodes: &[&Node]) -> String {
    let mut s = String::new();
    for n in nodes {
        let log = n.log();
        let lines = log_lines(&log);
        let skip = lines.len().saturating_sub(DUMP_LINES);
        s.push_str(&format!(
            "\n---- {} log (last {} of {} lines) ----\n",
            n.guard.name(),
            lines.len() - skip,
            lines.len()
        ));
        for l in &lines[skip..] {
            s.push_str(l);
            s.push('\n');
        }
    }
    s
}

const DUMP_LINES: usize = 60;

/// The log's lines, less the configuration dump that follows "effective configuration:" (its
/// lines do not start with a timestamp).
fn log_lines(log: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut in_config = false;
    for l in log.lines() {
        let stamped = l.starts_with(|c: char| c.is_ascii_digit());
        if in_config && !stamped {
            continue;
        }
        in_config = l.contains("effective configuration:");
        out.push(l);
    }
    out
}

/// A free loopback port, as `127.0.0.1:PORT`.
pub fn free_addr() -> String {
    format!(
        "127.0.0.1:{}",
        pdnode_testkit::free_port().expect("free port")
    )
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(HTTP_DEADLINE)
        .build()
        .expect("reqwest client")
}

/// Waits until `GET http://{addr}/health` answers 200 (a prefill and a decode node are known).
pub async fn wait_healthy(addr: &str, deadline: Duration, nodes: &[&Node]) {
    let c = client();
    let url = format!("http://{addr}/health");
    let r = wait_for_async(&format!("{url} answers 200"), deadline, || {
        let c = c.clone();
        let url = url.clone();
        async move {
            matches!(
                c.get(&url).timeout(Duration::from_secs(2)).send().await,
                Ok(r) if r.status() == reqwest::StatusCode::OK
            )
        }
    })
    .await;
    if let Err(e) = r {
        panic!("{e}{}", dump(nodes));
    }
}

/// `POST http://{addr}{path}` with a JSON body; returns (status, body as JSON or a string).
pub async fn post_json(
    addr: &str,
    path: &str,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    post_raw(addr, path, body.to_string(), None).await
}

/// `POST` of raw bytes with `Content-Type: application/json` and an optional bearer key.
pub async fn post_raw(
    addr: &str,
    path: &str,
    body: String,
    key: Option<&str>,
) -> (u16, serde_json::Value) {
    let mut rb = client()
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(body);
    if let Some(k) = key {
        rb = rb.bearer_auth(k);
    }
    let r = rb.send().await.expect("HTTP request");
    let status = r.status().as_u16();
    let text = r.text().await.expect("HTTP body");
    let v = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (status, v)
}

/// A greedy `/v1/completions` request; returns (text, completion_tokens, prompt_tokens).
pub async fn greedy_completion(addr: &str, prompt: &str, max_tokens: u32) -> (String, u64, u64) {
    let (st, v) = post_json(
        addr,
        "/v1/completions",
        &serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
    )
    .await;
    assert_eq!(st, 200, "completion of {prompt:?}: {v}");
    let text = v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string();
    let ct = v["usage"]["completion_tokens"].as_u64().expect("usage");
    let pt = v["usage"]["prompt_tokens"].as_u64().expect("usage");
    (text, ct, pt)
}

/// One series of `GET http://{http}/metrics` (labels included in `series`, e.g.
/// `pdnode_router_nodes{role="prefill"}`); `None` when absent or unreachable.
pub async fn metric(http: &str, series: &str) -> Option<f64> {
    let text = client()
        .get(format!("http://{http}/metrics"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// The `data:` payloads of an SSE stream, read with a deadline per chunk; returns them and
/// whether the stream ended (false: `per_read` passed with no bytes).
pub async fn read_sse(mut resp: reqwest::Response, per_read: Duration) -> (Vec<String>, bool) {
    let mut buf = String::new();
    let mut ended = false;
    loop {
        match tokio::time::timeout(per_read, resp.chunk()).await {
            Ok(Ok(Some(b))) => buf.push_str(&String::from_utf8_lossy(&b)),
            Ok(Ok(None)) | Ok(Err(_)) => {
                ended = true;
                break;
            }
            Err(_) => break,
        }
    }
    let data = buf
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim_start().to_string())
        .collect();
    (data, ended)
}
