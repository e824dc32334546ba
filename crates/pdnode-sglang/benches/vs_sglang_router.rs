//! Side by side: `pdnode sglang-router` and sglang-router 0.3.2 in front of the same **mock**
//! SGLang PD workers (zero-time, `pdnode_testkit::sglang_mock`, in a process of their own), and
//! a client that dispatches to the two workers itself ("direct", the floor both routers add to).
//!
//! Streaming `/v1/completions`, 64 tokens, at concurrency 1 and 64; per target: TTFT p50/p99,
//! its p50 over direct (the router's added TTFT), end-to-end p50, requests/s, and the router
//! process's CPU time (user + system, itself and its children) per request.
//!
//! Run through `scripts/bench-sglang-router.sh` (it installs sglang-router 0.3.2 into a venv
//! under `.cache/` and builds pdnode in release), or directly:
//! `cargo bench -p pdnode-sglang --bench vs_sglang_router -- --pdnode target/release/pdnode
//!  --python .cache/sglang-router-0.3.2/bin/python [--requests 2000] [--out FILE.json]`.

use futures::StreamExt;
use pdnode_testkit::sglang_mock::{MockRole, MockWorker, Rendezvous};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKENS: u64 = 64;
const BOOTSTRAP_PORT: u16 = 8998;

struct Opts {
    pdnode: Option<String>,
    python: Option<String>,
    requests: usize,
    out: Option<String>,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        pdnode: None,
        python: None,
        requests: 2000,
        out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--pdnode" => o.pdnode = Some(val()?),
            "--python" => o.python = Some(val()?),
            "--requests" => o.requests = val()?.parse().map_err(|e| format!("--requests: {e}"))?,
            "--out" => o.out = Some(val()?),
            // What `cargo bench` adds.
            "--bench" => {}
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(o)
}

fn main() -> ExitCode {
    if std::env::args().nth(1).as_deref() == Some("mocks") {
        return run_mocks();
    }
    let opts = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("vs_sglang_router: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vs_sglang_router: tokio: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(opts)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vs_sglang_router: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The worker process: one prefill and one decode mock sharing a rendezvous; prints their URLs,
/// serves until its stdin closes (the parent is gone).
fn run_mocks() -> ExitCode {
    let Ok(rt) = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    else {
        return ExitCode::FAILURE;
    };
    rt.block_on(async {
        let rv = Arc::new(Rendezvous::default());
        let p = MockWorker::start(
            MockRole::Prefill,
            Some(BOOTSTRAP_PORT),
            rv.clone(),
            Duration::ZERO,
        )
        .await;
        let d = MockWorker::start(MockRole::Decode, None, rv, Duration::ZERO).await;
        println!("prefill {}", p.url);
        println!("decode {}", d.url);
        let _ = std::io::stdout().flush();
        let _ = tokio::task::spawn_blocking(|| {
            let mut sink = String::new();
            while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {}
        })
        .await;
    });
    ExitCode::SUCCESS
}

/// A child process killed (by PID) when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// CPU seconds (user + system) of `pid` and its descendants, from `/proc`.
fn cpu_seconds(pid: u32) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let mut procs: Vec<(u32, u32, u64)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
                continue;
            };
            // Fields after the command's closing parenthesis: state ppid ... utime(14) stime(15).
            let Some((_, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            let f: Vec<&str> = rest.split_whitespace().collect();
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            procs.push((p, num(1) as u32, num(11) + num(12)));
        }
    }
    let mut total = 0u64;
    let mut tree = vec![pid];
    while let Some(p) = tree.pop() {
        for &(q, ppid, t) in &procs {
            if q == p {
                total += t;
            }
            if ppid == p {
                tree.push(q);
            }
        }
    }
    total as f64 / tick
}

async fn wait_ready(http: &reqwest::Client, url: &str, what: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if one(http, url, None).await.is_ok() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{what} never answered a request at {url}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn body() -> Value {
    json!({"model": "mock-model", "prompt": "The capital of France is", "max_tokens": TOKENS,
           "stream": true, "temperature": 0})
}

/// One streamed request; `(ttft, total)`. With `direct = Some((prefill, decode))` the client
/// plays the router: the same body with bootstrap fields to both workers at once.
async fn one(
    http: &reqwest::Client,
    url: &str,
    direct: Option<(&str, &str)>,
) -> Result<(Duration, Duration), String> {
    let t0 = Instant::now();
    let (stream_resp, prefill) = match direct {
        None => (
            http.post(format!("{url}/v1/completions"))
                .json(&body())
                .send()
                .await,
            None,
        ),
        Some((p, d)) => {
            let mut b = body();
            b["bootstrap_host"] = json!("127.0.0.1");
            b["bootstrap_port"] = json!(BOOTSTRAP_PORT);
            b["bootstrap_room"] = json!(rand::random::<u64>() >> 1);
            let pf = http.post(format!("{p}/v1/completions")).json(&b).send();
            let df = http.post(format!("{d}/v1/completions")).json(&b).send();
            let (pr, dr) = tokio::join!(pf, df);
            (dr, Some(pr))
        }
    };
    let r = stream_resp.map_err(|e| e.to_string())?;
    if !r.status().is_success() {
        return Err(format!("HTTP {}", r.status()));
    }
    let mut ttft = None;
    let mut done = false;
    let mut chunks = r.bytes_stream();
    let mut tail = Vec::new();
    while let Some(c) = chunks.next().await {
        let c = c.map_err(|e| e.to_string())?;
        if ttft.is_none() && !c.is_empty() {
            ttft = Some(t0.elapsed());
        }
        tail.extend_from_slice(&c);
        if tail.len() > 64 {
            tail.drain(..tail.len() - 64);
        }
    }
    if tail.windows(6).any(|w| w == b"[DONE]") {
        done = true;
    }
    if let Some(pr) = prefill {
        let pr = pr.map_err(|e| format!("prefill: {e}"))?;
        let _ = pr.bytes().await;
    }
    if !done {
        return Err("stream ended without [DONE]".into());
    }
    Ok((ttft.unwrap_or_default(), t0.elapsed()))
}

struct Row {
    target: &'static str,
    c: usize,
    n: usize,
    errors: usize,
    ttft_p50: f64,
    ttft_p99: f64,
    e2e_p50: f64,
    rps: f64,
    cpu_ms_per_req: Option<f64>,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

async fn measure(
    target: &'static str,
    url: Arc<String>,
    direct: Option<Arc<(String, String)>>,
    pid: Option<u32>,
    c: usize,
    n: usize,
) -> Row {
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(2 * c)
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("an HTTP client");
    // Warm-up: connections, the routers' worker pools.
    for _ in 0..c.max(16) {
        let d = direct.as_deref().map(|(p, d)| (p.as_str(), d.as_str()));
        let _ = one(&http, &url, d).await;
    }
    let cpu0 = pid.map(cpu_seconds);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for k in 0..c {
        let http = http.clone();
        let url = url.clone();
        let direct = direct.clone();
        let share = n / c + usize::from(k < n % c);
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::with_capacity(share);
            for _ in 0..share {
                let d = direct.as_deref().map(|(p, d)| (p.as_str(), d.as_str()));
                out.push(one(&http, &url, d).await);
            }
            out
        }));
    }
    let mut ttft = Vec::new();
    let mut e2e = Vec::new();
    let mut errors = 0;
    for t in tasks {
        for r in t.await.unwrap_or_default() {
            match r {
                Ok((a, b)) => {
                    ttft.push(a.as_secs_f64() * 1e3);
                    e2e.push(b.as_secs_f64() * 1e3);
                }
                Err(_) => errors += 1,
            }
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = match (pid, cpu0) {
        (Some(p), Some(c0)) => Some((cpu_seconds(p) - c0) * 1e3 / n as f64),
        _ => None,
    };
    Row {
        target,
        c,
        n,
        errors,
        ttft_p50: pct(&mut ttft, 0.5),
        ttft_p99: pct(&mut ttft, 0.99),
        e2e_p50: pct(&mut e2e, 0.5),
        rps: n as f64 / wall,
        cpu_ms_per_req: cpu,
    }
}

async fn run(o: Opts) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut mocks = Command::new(exe)
        .arg("mocks")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("mock workers: {e}"))?;
    let out = mocks.stdout.take().ok_or("mock stdout")?;
    let mocks = Proc(mocks);
    let mut lines = BufReader::new(out).lines();
    let mut next = |what: &str| -> Result<String, String> {
        let l = lines
            .next()
            .ok_or(format!("mock workers printed no {what}"))?
            .map_err(|e| e.to_string())?;
        l.strip_prefix(&format!("{what} "))
            .map(str::to_owned)
            .ok_or(format!("unexpected mock line {l:?}"))
    };
    let prefill = next("prefill")?;
    let decode = next("decode")?;
    eprintln!(
        "mock workers (pid {}): prefill {prefill}, decode {decode}",
        mocks.0.id()
    );
    let http = reqwest::Client::builder()
        .no_proxy()
        .build()
        .map_err(|e| e.to_string())?;
    let bp = BOOTSTRAP_PORT.to_string();
    let mut routers: Vec<(&'static str, Proc, String)> = Vec::new();
    // Both routers take sglang-router 0.3.2's flags; only the program differs.
    let flags = [
        "--pd-disaggregation",
        "--prefill",
        &prefill,
        &bp,
        "--decode",
        &decode,
    ]
    .map(String::from);
    let launchers: [(&'static str, Option<&String>, &[&str]); 2] = [
        (
            "pdnode sglang-router",
            o.pdnode.as_ref(),
            &["sglang-router"],
        ),
        (
            "sglang-router 0.3.2",
            o.python.as_ref(),
            &["-m", "sglang_router.launch_router"],
        ),
    ];
    for (name, program, lead) in launchers {
        let Some(program) = program else { continue };
        let (port, prom) = (free_port()?, free_port()?);
        let child = Command::new(program)
            .args(lead)
            .args(&flags)
            .args(["--policy", "round_robin", "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .args(["--prometheus-host", "127.0.0.1", "--prometheus-port"])
            .arg(prom.to_string())
            .args(["--log-level", "warn"])
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("{program}: {e}"))?;
        routers.push((name, Proc(child), format!("http://127.0.0.1:{port}")));
    }
    for (name, _, url) in &routers {
        wait_ready(&http, url, name).await?;
    }
    let direct = Arc::new((prefill.clone(), decode.clone()));
    let mut rows = Vec::new();
    for c in [1usize, 64] {
        let n = if c == 1 { o.requests / 4 } else { o.requests };
        rows.push(
            measure(
                "direct (client dispatches)",
                Arc::new(String::new()),
                Some(direct.clone()),
                None,
                c,
                n,
            )
            .await,
        );
        for (name, p, url) in &routers {
            rows.push(measure(name, Arc::new(url.clone()), None, Some(p.0.id()), c, n).await);
        }
    }
    println!(
        "| target | C | requests | errors | TTFT p50 ms | TTFT p99 ms | added TTFT p50 ms | e2e p50 ms | req/s | router CPU ms/req |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut json_rows = Vec::new();
    for r in &rows {
        let base = rows
            .iter()
            .find(|b| b.c == r.c && b.target.starts_with("direct"))
            .map_or(f64::NAN, |b| b.ttft_p50);
        let cpu = r
            .cpu_ms_per_req
            .map_or("-".to_string(), |v| format!("{v:.3}"));
        println!(
            "| {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {} |",
            r.target,
            r.c,
            r.n,
            r.errors,
            r.ttft_p50,
            r.ttft_p99,
            r.ttft_p50 - base,
            r.e2e_p50,
            r.rps,
            cpu
        );
        json_rows.push(
            json!({"target": r.target, "concurrency": r.c, "requests": r.n,
            "errors": r.errors, "ttft_p50_ms": r.ttft_p50, "ttft_p99_ms": r.ttft_p99,
            "added_ttft_p50_ms": r.ttft_p50 - base, "e2e_p50_ms": r.e2e_p50, "rps": r.rps,
            "router_cpu_ms_per_request": r.cpu_ms_per_req}),
        );
    }
    if let Some(path) = &o.out {
        std::fs::write(
            path,
            serde_json::to_string_pretty(&json!({"tokens": TOKENS, "rows": json_rows}))
                .unwrap_or_default(),
        )
        .map_err(|e| format!("{path}: {e}"))?;
    }
    drop(routers);
    drop(mocks);
    Ok(())
}
