//! `run`: etcd, the registrar processes, the routers' views, and every measurement.

use crate::etcd_load::{self, GrpcCounters};
use crate::placement;
use anyhow::{Context, Result, bail};
use pdnode_registry::{EtcdRegistry, LiveMembership, MembershipView, Registry};
use pdnode_testkit::EtcdServer;
use serde_json::json;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};
use tokio::sync::watch;

pub const CLUSTER: &str = "scale";

#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// Registered nodes (half prefill, half decode).
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// Registrar processes the nodes are spread over.
    #[arg(long, default_value_t = 4)]
    pub registrars: usize,
    /// Routers watching (each its own etcd connection and membership view).
    #[arg(long, default_value_t = 4)]
    pub routers: usize,
    /// Cards per etcd connection in the registrars (1: every node its own, as real nodes).
    #[arg(long, default_value_t = 1)]
    pub nodes_per_conn: usize,
    /// Nodes that join (and then leave) at once.
    #[arg(long, default_value_t = 100)]
    pub burst: usize,
    /// Join-then-leave rounds.
    #[arg(long, default_value_t = 3)]
    pub bursts: usize,
    /// Lease TTL of every card, seconds (keepalive every third of it).
    #[arg(long, default_value_t = 10)]
    pub ttl_s: u64,
    /// The steady window over which etcd's load is measured, seconds.
    #[arg(long, default_value_t = 20)]
    pub window_s: u64,
    /// New routers started one after another (convergence samples).
    #[arg(long, default_value_t = 5)]
    pub new_routers: usize,
    /// Skip killing a registrar process (its nodes' leases expire).
    #[arg(long)]
    pub skip_crash: bool,
    #[command(flatten)]
    pub placement: placement::PlacementArgs,
    /// Skip the placement latency.
    #[arg(long)]
    pub skip_placement: bool,
    /// Also write the figures as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One router's membership view, as a router keeps it: the registry's watch applied to a
/// `MembershipView`. Publishes (cards in the view, when that count was reached).
struct RouterView {
    count: watch::Receiver<(usize, Instant)>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RouterView {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RouterView {
    async fn start(endpoint: &str, ttl_s: u64) -> Result<Self> {
        let reg = EtcdRegistry::connect(&[endpoint.to_string()], crate::registrar::options(ttl_s))
            .await
            .context("router: connect to etcd")?;
        let mut w = reg.watch(CLUSTER).await.context("router: watch")?;
        let (tx, count) = watch::channel((0, Instant::now()));
        let task = tokio::spawn(async move {
            let _reg = reg;
            let mut view = MembershipView::new();
            while let Some(ev) = w.next().await {
                if view.apply(&ev) {
                    let n = view.len();
                    tx.send_if_modified(|c| {
                        let changed = c.0 != n;
                        if changed {
                            *c = (n, Instant::now());
                        }
                        changed
                    });
                }
            }
        });
        Ok(Self { count, task })
    }
}

/// Waits until every view holds `n` cards; each view's time from `from` (None: not within
/// `deadline`).
async fn wait_views(
    views: &[RouterView],
    n: usize,
    from: Instant,
    deadline: Duration,
) -> Vec<Option<Duration>> {
    let until = tokio::time::Instant::from_std(from + deadline);
    let waits = views.iter().map(|v| {
        let mut rx = v.count.clone();
        async move {
            let r = tokio::time::timeout_at(until, rx.wait_for(|c| c.0 == n)).await;
            match r {
                Ok(Ok(c)) => Some(c.1.saturating_duration_since(from)),
                _ => None,
            }
        }
    });
    futures::future::join_all(waits).await
}

struct Registrar {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    count: usize,
}

impl Registrar {
    /// A registrar of nodes `first..first + count`; the nodes it adds on `join` are numbered
    /// from `join_first`.
    fn spawn(
        a: &RunArgs,
        endpoint: &str,
        first: usize,
        count: usize,
        join_first: usize,
    ) -> Result<Self> {
        let exe = std::env::current_exe().context("this binary's path")?;
        let mut child = tokio::process::Command::new(exe)
            .args(["registrar", "--etcd", endpoint, "--cluster", CLUSTER])
            .args(["--first", &first.to_string(), "--count", &count.to_string()])
            .args(["--join-first", &join_first.to_string()])
            .args(["--per-conn", &a.nodes_per_conn.to_string()])
            .args(["--ttl-s", &a.ttl_s.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("spawn a registrar")?;
        let stdin = child.stdin.take().context("registrar stdin")?;
        let stdout = child.stdout.take().context("registrar stdout")?;
        Ok(Self {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
            count,
        })
    }

    async fn send(&mut self, cmd: &str) -> Result<()> {
        self.stdin.write_all(format!("{cmd}\n").as_bytes()).await?;
        self.stdin.flush().await?;
        Ok(())
    }

    /// The next line, whose first word must be `word`; its numbers.
    async fn expect(&mut self, word: &str, deadline: Duration) -> Result<Vec<u64>> {
        let line = tokio::time::timeout(deadline, self.lines.next_line())
            .await
            .with_context(|| format!("registrar: no `{word}` within {deadline:?}"))??
            .with_context(|| format!("registrar exited before `{word}`"))?;
        let mut w = line.split_whitespace();
        if w.next() != Some(word) {
            bail!("registrar said {line:?}, expected `{word} ...`");
        }
        Ok(w.filter_map(|n| n.parse().ok()).collect())
    }

    fn pid(&self) -> Option<u32> {
        self.child.id()
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e4).round() / 10.0
}

fn max_ms(ts: &[Option<Duration>]) -> Option<f64> {
    ts.iter()
        .map(|t| t.map(ms))
        .try_fold(0.0f64, |m, t| t.map(|t| m.max(t)))
}

fn cpu_of(pids: &[u32]) -> Duration {
    pids.iter().filter_map(|p| etcd_load::cpu_time(*p)).sum()
}

/// The figures as they are printed (what, figure) and kept for `--json`.
#[derive(Default)]
struct Report {
    lines: Vec<(String, String)>,
    json: serde_json::Map<String, serde_json::Value>,
    ok: bool,
}

impl Report {
    fn line(&mut self, what: &str, figure: String) {
        eprintln!("control-bench: {what}: {figure}");
        self.lines.push((what.to_string(), figure));
    }
}

fn shown(ms: Option<f64>) -> String {
    ms.map_or("not within the deadline".into(), |m| format!("{m} ms"))
}

/// etcd's load and the processes' CPU over `dur` of steady state.
async fn steady(
    ep: &str,
    etcd_pid: u32,
    reg_pids: &[u32],
    nodes: usize,
    dur: Duration,
    label: &str,
    r: &mut Report,
) -> Result<()> {
    let me = std::process::id();
    let (c0, e0, r0, m0) = (
        etcd_load::scrape(ep).await?,
        cpu_of(&[etcd_pid]),
        cpu_of(reg_pids),
        cpu_of(&[me]),
    );
    let w0 = Instant::now();
    tokio::time::sleep(dur).await;
    let (c1, e1, r1, m1) = (
        etcd_load::scrape(ep).await?,
        cpu_of(&[etcd_pid]),
        cpu_of(reg_pids),
        cpu_of(&[me]),
    );
    let window = w0.elapsed();
    let rates = GrpcCounters::rates(&c0, &c1, window);
    let n = nodes as f64;
    let pct = |d: Duration| 100.0 * d.as_secs_f64() / window.as_secs_f64();
    let methods: Vec<String> = rates
        .received
        .iter()
        .map(|(k, v)| format!("{k} {v:.1}/s"))
        .collect();
    r.line(
        &format!("etcd requests, {label}"),
        format!(
            "{:.1}/s in all, {:.3}/s per node ({})",
            rates.total_received(),
            rates.total_received() / n,
            methods.join(", ")
        ),
    );
    r.line(
        &format!("etcd keepalives, {label}"),
        format!(
            "{:.1}/s, {:.3}/s per node; LeaseKeepAlive streams opened {:.1}/s",
            rates.keepalives(),
            rates.keepalives() / n,
            rates.keepalive_streams()
        ),
    );
    let etcd_rss = etcd_load::rss_bytes(etcd_pid).unwrap_or(0);
    let reg_rss: u64 = reg_pids
        .iter()
        .filter_map(|p| etcd_load::rss_bytes(*p))
        .sum();
    let (ec, rc, mc) = (
        pct(e1.saturating_sub(e0)),
        pct(r1.saturating_sub(r0)),
        pct(m1.saturating_sub(m0)),
    );
    r.line(
        &format!("CPU, {label} (one core = 100 %)"),
        format!(
            "etcd {ec:.1} % (RSS {} MiB), registrars {rc:.1} % in all (RSS {} MiB), the routers' process {mc:.1} %",
            etcd_rss >> 20,
            reg_rss >> 20,
        ),
    );
    r.json.insert(
        format!(
            "steady_{}",
            label.split(" (").next().unwrap_or(label).replace(' ', "_")
        ),
        json!({
            "window_s": window.as_secs_f64(),
            "etcd_requests_per_s": rates.total_received(),
            "etcd_requests_per_s_per_node": rates.total_received() / n,
            "by_method_per_s": rates.received,
            "streams_opened_per_s": rates.started,
            "keepalives_per_s": rates.keepalives(),
            "keepalives_per_s_per_node": rates.keepalives() / n,
            "etcd_cpu_pct": ec,
            "etcd_rss_bytes": etcd_rss,
            "registrars_cpu_pct": rc,
            "routers_process_cpu_pct": mc,
        }),
    );
    Ok(())
}

/// `count` per registrar of `total`, as evenly as it goes.
fn split(total: usize, k: usize) -> Vec<usize> {
    (0..k)
        .map(|i| total / k + usize::from(i < total % k))
        .collect()
}

/// `burst` nodes join at once (spread over the registrars), every router sees them, then they
/// leave at once (revoked) and every router sees that. Returns the two figures.
async fn burst_round(
    regs: &mut [Registrar],
    views: &[RouterView],
    base: usize,
    burst: usize,
) -> Result<(serde_json::Value, serde_json::Value)> {
    let deadline = Duration::from_secs(30 + burst as u64 / 10);
    let mut out = Vec::new();
    for (verb, answer, target) in [("join", "joined", base + burst), ("leave", "left", base)] {
        let parts = split(burst, regs.len());
        let t = Instant::now();
        for (r, k) in regs.iter_mut().zip(&parts) {
            if *k > 0 {
                r.send(&format!("{verb} {k}")).await?;
            }
        }
        let seen = wait_views(views, target, t, deadline).await;
        let mut done_ms = 0u64;
        for (r, k) in regs.iter_mut().zip(&parts) {
            if *k > 0 {
                let n = r.expect(answer, deadline).await?;
                done_ms = done_ms.max(n.get(1).copied().unwrap_or(0));
            }
        }
        out.push(json!({"all_routers_ms": max_ms(&seen), "registrars_done_ms": done_ms}));
    }
    let leave = out.pop().context("two figures")?;
    let join = out.pop().context("two figures")?;
    Ok((join, leave))
}

fn fmt_bursts(v: &[serde_json::Value]) -> String {
    v.iter()
        .map(|j| {
            format!(
                "{} (registrars done in {} ms)",
                shown(j["all_routers_ms"].as_f64()),
                j["registrars_done_ms"]
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

async fn tell_all(regs: &mut [Registrar], cmd: &str, answer: &str) -> Result<Vec<Vec<u64>>> {
    for r in regs.iter_mut() {
        r.send(cmd).await?;
    }
    let mut out = Vec::new();
    for r in regs.iter_mut() {
        out.push(r.expect(answer, Duration::from_secs(30)).await?);
    }
    Ok(out)
}

pub async fn run(a: RunArgs) -> Result<bool> {
    if a.registrars == 0 || a.routers == 0 || a.nodes < a.registrars {
        bail!("need at least one registrar and one router, and a node per registrar");
    }
    let etcd = tokio::task::spawn_blocking(EtcdServer::start)
        .await?
        .context("start etcd")?;
    let ep = etcd.endpoint();
    let etcd_pid = etcd.pid().context("etcd pid")?;
    let mut r = Report {
        ok: true,
        ..Report::default()
    };

    // Routers first: they watch every node arrive.
    let mut views = Vec::new();
    for _ in 0..a.routers {
        views.push(RouterView::start(&ep, a.ttl_s).await?);
    }

    // Registration of every node.
    let t0 = Instant::now();
    let mut regs = Vec::new();
    let mut first = 0;
    for (i, count) in split(a.nodes, a.registrars).into_iter().enumerate() {
        // Joined nodes are numbered past every registrar's own and each other's.
        let join_first = a.nodes + i * (a.burst * (a.bursts + 1) + 1);
        regs.push(Registrar::spawn(&a, &ep, first, count, join_first)?);
        first += count;
    }
    let reg_deadline = Duration::from_secs(60 + a.nodes as u64 / 10);
    for g in &mut regs {
        g.expect("ready", reg_deadline).await?;
    }
    let seen = wait_views(&views, a.nodes, t0, reg_deadline).await;
    let reg_all = max_ms(&seen);
    r.ok &= reg_all.is_some();
    r.line(
        "register every node (all routers see them)",
        format!(
            "{} for {} nodes from {} processes, {} card(s) per etcd connection",
            shown(reg_all),
            a.nodes,
            a.registrars,
            a.nodes_per_conn
        ),
    );
    r.json.insert("register_all_ms".into(), json!(reg_all));

    let reg_pids: Vec<u32> = regs.iter().filter_map(Registrar::pid).collect();
    let window = Duration::from_secs(a.window_s);
    steady(
        &ep,
        etcd_pid,
        &reg_pids,
        a.nodes,
        window,
        "idle nodes",
        &mut r,
    )
    .await?;

    // A new router's convergence: connect, list, watch, the view applied.
    let mut conv = Vec::new();
    for _ in 0..a.new_routers {
        let t = Instant::now();
        let reg = EtcdRegistry::connect(
            std::slice::from_ref(&ep),
            crate::registrar::options(a.ttl_s),
        )
        .await?;
        let live = LiveMembership::start(&reg, CLUSTER).await?;
        let d = t.elapsed();
        let len = live.snapshot().len();
        if len != a.nodes {
            r.ok = false;
            r.line("new router", format!("saw {len} cards, not {}", a.nodes));
        }
        conv.push(ms(d));
    }
    let mut sorted = conv.clone();
    sorted.sort_by(f64::total_cmp);
    r.line(
        "a new router converges (connect, list, watch, apply)",
        format!(
            "median {} ms, max {} ms over {} routers",
            sorted.get(sorted.len() / 2).copied().unwrap_or(0.0),
            sorted.last().copied().unwrap_or(0.0),
            sorted.len()
        ),
    );
    r.json.insert("new_router_ms".into(), json!(conv));

    // Bursts on idle nodes.
    let (mut joins, mut leaves) = (Vec::new(), Vec::new());
    for _ in 0..a.bursts {
        let (j, l) = burst_round(&mut regs, &views, a.nodes, a.burst).await?;
        joins.push(j);
        leaves.push(l);
    }
    // Busy nodes: every card's load put once a second, as a loaded node's registrar does.
    tell_all(&mut regs, "busy 1000", "busy").await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    steady(
        &ep,
        etcd_pid,
        &reg_pids,
        a.nodes,
        window,
        "busy nodes (a card put per node per second)",
        &mut r,
    )
    .await?;
    let (j, l) = burst_round(&mut regs, &views, a.nodes, a.burst).await?;
    tell_all(&mut regs, "busy 0", "busy").await?;
    let all_seen = |v: &[serde_json::Value]| v.iter().all(|j| j["all_routers_ms"].is_number());
    r.ok &= all_seen(&joins)
        && all_seen(&leaves)
        && j["all_routers_ms"].is_number()
        && l["all_routers_ms"].is_number();
    r.line(
        &format!(
            "{} nodes join at once: all routers see them (idle nodes)",
            a.burst
        ),
        fmt_bursts(&joins),
    );
    r.line(
        &format!(
            "{} nodes leave at once (revoked): all routers see it (idle nodes)",
            a.burst
        ),
        fmt_bursts(&leaves),
    );
    r.line(
        &format!("{} nodes join, then leave, at once (busy nodes)", a.burst),
        format!(
            "{}; {}",
            fmt_bursts(std::slice::from_ref(&j)),
            fmt_bursts(std::slice::from_ref(&l))
        ),
    );
    r.json.insert("join_bursts".into(), json!(joins));
    r.json.insert("leave_bursts".into(), json!(leaves));
    r.json.insert("busy_join_burst".into(), j);
    r.json.insert("busy_leave_burst".into(), l);

    let failures: u64 = tell_all(&mut regs, "failures", "failures")
        .await?
        .iter()
        .filter_map(|n| n.first())
        .sum();
    r.line(
        "keepalive or re-registration failures so far",
        failures.to_string(),
    );
    r.json.insert("keepalive_failures".into(), json!(failures));

    // A registrar process SIGKILLed: its nodes go when their leases expire.
    if !a.skip_crash && regs.len() > 1 {
        let mut last = regs.pop().context("a registrar")?;
        let t = Instant::now();
        last.child.start_kill()?;
        let target = a.nodes - last.count;
        let deadline = Duration::from_secs(3 * a.ttl_s + 30);
        let seen = wait_views(&views, target, t, deadline).await;
        let all = max_ms(&seen);
        r.ok &= all.is_some();
        r.line(
            &format!(
                "a registrar SIGKILLed: its {} nodes gone from all routers (lease TTL {} s)",
                last.count, a.ttl_s
            ),
            shown(all),
        );
        r.json.insert("crash_gone_ms".into(), json!(all));
        let _ = last.child.wait().await;
    }
    drop(regs);
    drop(views);
    drop(etcd);

    let mut table = format!(
        "control plane: {} nodes, {} registrar processes, {} routers, lease TTL {} s\n\
         | what | figure |\n|---|---|\n",
        a.nodes, a.registrars, a.routers, a.ttl_s
    );
    for (k, v) in &r.lines {
        table.push_str(&format!("| {k} | {v} |\n"));
    }
    println!("{table}");
    if !a.skip_placement {
        // After etcd and the registrars are gone: the policies alone on the CPU.
        let rows = placement::measure(&a.placement);
        println!("{}", placement::table(&rows, a.placement.candidates));
        r.json.insert(
            "placement".into(),
            json!(
                rows.iter()
                    .map(|p| json!({"policy": p.policy, "depth": p.depth, "p50_ns": p.p50_ns, "p99_ns": p.p99_ns, "max_ns": p.max_ns}))
                    .collect::<Vec<_>>()
            ),
        );
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&r.json)?)
            .with_context(|| format!("write {}", p.display()))?;
    }
    if !r.ok {
        eprintln!("control-bench: a view did not converge within its deadline");
    }
    Ok(r.ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_total_splits_evenly_and_adds_up() {
        assert_eq!(split(10, 3), vec![4, 3, 3]);
        assert_eq!(split(2, 4), vec![1, 1, 0, 0]);
        assert_eq!(split(1000, 4).iter().sum::<usize>(), 1000);
    }

    #[test]
    fn the_slowest_view_decides_and_a_missing_one_fails() {
        let d = |ms| Some(Duration::from_millis(ms));
        assert_eq!(max_ms(&[d(3), d(7)]), Some(7.0));
        assert_eq!(max_ms(&[d(3), None]), None);
    }
}
