//! The processes of one case: etcd, a router, two prefill and two decode nodes, each in its
//! host's namespace (`ip netns exec`, which execs in place: the PID we hold is the server's),
//! stopped by PID when dropped. [`node_sets`] is the one place where the harness turns
//! `configs/multi-host/` into this cluster's configuration (addresses, mock engine, UCX device,
//! and the mTLS certificates `pdnode certs init` makes for each case).

use crate::metrics::{Scrape, scrape};
use crate::net::{self, Host, Net};
use anyhow::{Context, Result, bail};
use pdnode_testkit::ChildGuard;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// How long a cluster may take to come up (etcd answers, the router sees every node).
pub const READY_DEADLINE: Duration = Duration::from_secs(90);

pub const ETCD_PORT: u16 = 2379;
/// The ports of `configs/multi-host/` (each host has its own address, so they never clash).
pub const NODE_PORT: u16 = 7001;
pub const NODE_HTTP_PORT: u16 = 9001;
pub const ROUTER_NODE_PORT: u16 = 7000;
pub const ROUTER_HTTP_PORT: u16 = 8000;
pub const ROUTER_GRPC_PORT: u16 = 50051;

/// `node.cluster` of every node.
pub const CLUSTER: &str = "quick";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Router,
    Prefill,
    Decode,
}

/// Per-role `--set`s a case adds (engine timings, policies), and the engine the nodes run.
#[derive(Debug, Clone, Default)]
pub struct Extra {
    pub prefill: Vec<String>,
    pub decode: Vec<String>,
    pub router: Vec<String>,
    pub engine: EngineKind,
}

/// The engine of the prefill and decode nodes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum EngineKind {
    /// The simulated engine (`--quick`): timed steps, a real (small) KV pool.
    #[default]
    Mock,
    /// The CPU engine on this model (`--full`: the demo model, or `--model`: a GGUF file or an
    /// HF directory), one thread per node (four engines share the machine); the router
    /// tokenizes with the same model's tokenizer.
    Cpu(PathBuf),
}

/// The multi-host file a role starts from.
fn config_file(role: Role) -> &'static str {
    match role {
        Role::Router => "configs/multi-host/router.toml",
        Role::Prefill => "configs/multi-host/prefill-b.toml",
        Role::Decode => "configs/multi-host/decode-d.toml",
    }
}

/// What turns a `configs/multi-host/` file into host `h` of this cluster. The node API is
/// mutual TLS, as the files have it: each host gets its own certificate from `certs` (made by
/// [`make_certs`]), which names its cluster, role and id.
/// `router.request_timeout_s` in every case: under [`crate::load::REQUEST_DEADLINE`].
pub const ROUTER_REQUEST_TIMEOUT_S: u64 = 55;

pub fn node_sets(role: Role, h: Host, certs: &Path, engine: &EngineKind) -> Vec<String> {
    let q = |k: &str, v: &str| format!("{k}=\"{v}\"");
    let mut s = vec![
        q("node.cluster", CLUSTER),
        q("node.id", h.name),
        format!(
            "registry.endpoints=[\"http://{}:{ETCD_PORT}\"]",
            net::ETCD.ip
        ),
    ];
    match engine {
        // The simulated engine: timed steps, a real (small) KV pool that moves over UCX.
        EngineKind::Mock => s.extend([
            q("engine.backend", "mock"),
            q("model.format", "dummy"),
            q("model.preset", "smollm2-135m"),
            q("model.path", ""),
        ]),
        EngineKind::Cpu(model) => {
            s.extend([
                q("model.format", if model.is_dir() { "hf" } else { "gguf" }),
                q("model.path", &model.to_string_lossy()),
            ]);
            if role != Role::Router {
                s.extend([
                    q("engine.backend", "cpu"),
                    "engine.gpus=[]".into(),
                    "engine.tensor_parallel=1".into(),
                    "engine.cpu_threads=1".into(),
                    "engine.context_length=2048".into(),
                    // ~2 s a prefill step on one thread (the node's engine_stall is 60 s on
                    // the CPU; shorter steps keep TTFT, and the figures, readable).
                    "engine.max_batch_tokens=256".into(),
                ]);
            }
        }
    }
    s.extend([
        // The files pin to their GPUs' NUMA node ("auto"); neither engine here binds a GPU.
        "engine.cpu_affinity=[]".to_string(),
        q("security.tls_ca", &certs.join("ca.pem").to_string_lossy()),
        q(
            "security.tls_cert",
            &certs.join(format!("{}.pem", h.name)).to_string_lossy(),
        ),
        q(
            "security.tls_key",
            &certs.join(format!("{}.key", h.name)).to_string_lossy(),
        ),
    ]);
    // Bind the host's own address, never 0.0.0.0: nothing listens outside these namespaces.
    match role {
        Role::Router => {
            let a = |p: u16| format!("{}:{p}", h.ip);
            s.push(q("node.listen", &a(ROUTER_NODE_PORT)));
            s.push(q("node.advertise", &a(ROUTER_NODE_PORT)));
            s.push(q("router.http_listen", &a(ROUTER_HTTP_PORT)));
            s.push(q("router.grpc_listen", &a(ROUTER_GRPC_PORT)));
            // The router's whole-request deadline below the clients' (load::REQUEST_DEADLINE,
            // 60 s), as an operator sets it: a request the cluster cannot finish in time ends
            // with the router's clear error instead of the client giving up on silence.
            s.push(format!(
                "router.request_timeout_s={ROUTER_REQUEST_TIMEOUT_S}"
            ));
        }
        Role::Prefill | Role::Decode => {
            let a = |p: u16| format!("{}:{p}", h.ip);
            s.push(q("node.listen", &a(NODE_PORT)));
            s.push(q("node.advertise", &a(NODE_PORT)));
            s.push(q("node.http_listen", &a(NODE_HTTP_PORT)));
            // KV over UCX tcp on the host's interface (no shared memory between "hosts").
            s.push(q("transfer.ucx_net_devices", net::HOST_IF));
            s.push(q("transfer.ucx_tls", "tcp"));
            // The namespaces' bridge reaches only this cluster's hosts.
            s.push("security.trusted_kv_network=true".into());
        }
    }
    s
}

/// A running server: its host, process and log.
pub struct Proc {
    pub host: Host,
    pub guard: ChildGuard,
    pub log: PathBuf,
}

impl Proc {
    /// `/metrics` of a prefill or decode node.
    pub fn metrics_url(&self) -> String {
        format!("http://{}:{NODE_HTTP_PORT}/metrics", self.host.ip)
    }

    pub fn signal(&self, sig: &str) -> Result<()> {
        self.guard
            .signal(sig)
            .with_context(|| format!("SIG{sig} to {}", self.host.name))
    }
}

/// One case's processes, and what it takes to start more of them (a host joining, a restart).
pub struct Cluster {
    pub etcd: Proc,
    pub router: Proc,
    /// prefill0, prefill1, and [`net::SPARE_PREFILL`] once a case started it.
    pub prefill: Vec<Proc>,
    pub decode: Vec<Proc>,
    bin: PathBuf,
    repo: PathBuf,
    dir: PathBuf,
    certs: PathBuf,
    extra: Extra,
}

impl Cluster {
    /// Starts etcd, then the nodes, then waits until the router serves and sees all four.
    pub async fn start(
        net: &Net,
        bin: &Path,
        repo: &Path,
        dir: &Path,
        extra: &Extra,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let etcd = spawn_etcd(net, dir)?;
        let health = format!("http://{}:{ETCD_PORT}/health", net::ETCD.ip);
        wait_http_ok(&health, READY_DEADLINE)
            .await
            .with_context(|| format!("etcd did not come up; its log:\n{}", tail(&etcd.log)))?;
        let certs = dir.join("certs");
        make_certs(bin, &certs)?;
        let node = |role: Role, h: Host, more: &[String]| {
            let mut sets = node_sets(role, h, &certs, &extra.engine);
            sets.extend(more.iter().cloned());
            spawn_node(net, bin, repo, dir, role, h, &sets)
        };
        let prefill = net::PREFILL
            .iter()
            .map(|h| node(Role::Prefill, *h, &extra.prefill))
            .collect::<Result<Vec<_>>>()?;
        let decode = net::DECODE
            .iter()
            .map(|h| node(Role::Decode, *h, &extra.decode))
            .collect::<Result<Vec<_>>>()?;
        let router = node(Role::Router, net::ROUTER, &extra.router)?;
        let c = Self {
            etcd,
            router,
            prefill,
            decode,
            bin: bin.to_path_buf(),
            repo: repo.to_path_buf(),
            dir: dir.to_path_buf(),
            certs,
            extra: extra.clone(),
        };
        let ok = wait_until(READY_DEADLINE, || async {
            c.router_nodes().await == Some((net::PREFILL.len(), net::DECODE.len()))
        })
        .await;
        if !ok {
            bail!(
                "the router did not see 2 prefill and 2 decode nodes within {READY_DEADLINE:?}{}",
                c.logs()
            );
        }
        Ok(c)
    }

    /// Starts one more node of `role` on host `h` (configured as the others of its role); its
    /// log goes to a fresh file when the host ran a node before.
    pub fn spawn(&self, net: &Net, role: Role, h: Host) -> Result<Proc> {
        let mut sets = node_sets(role, h, &self.certs, &self.extra.engine);
        sets.extend(
            match role {
                Role::Router => &self.extra.router,
                Role::Prefill => &self.extra.prefill,
                Role::Decode => &self.extra.decode,
            }
            .iter()
            .cloned(),
        );
        spawn_node(net, &self.bin, &self.repo, &self.dir, role, h, &sets)
    }

    /// Starts etcd again on the same data directory (after it was killed).
    pub fn respawn_etcd(&self, net: &Net) -> Result<Proc> {
        spawn_etcd(net, &self.dir)
    }

    /// Waits until etcd answers `/health`.
    pub async fn etcd_ready(&self, deadline: Duration) -> bool {
        let health = format!("http://{}:{ETCD_PORT}/health", net::ETCD.ip);
        wait_http_ok(&health, deadline).await.is_ok()
    }

    pub fn router_url(&self, path: &str) -> String {
        format!("http://{}:{ROUTER_HTTP_PORT}{path}", net::ROUTER.ip)
    }

    /// (prefill, decode) nodes in the router's view.
    pub async fn router_nodes(&self) -> Option<(usize, usize)> {
        let m = scrape(&self.router_url("/metrics")).await?;
        let p = m.get("pdnode_router_nodes{role=\"prefill\"}")?;
        let d = m.get("pdnode_router_nodes{role=\"decode\"}")?;
        Some((p as usize, d as usize))
    }

    pub async fn router_metrics(&self) -> Option<Scrape> {
        scrape(&self.router_url("/metrics")).await
    }

    pub fn nodes(&self) -> impl Iterator<Item = &Proc> {
        self.prefill.iter().chain(&self.decode)
    }

    /// The last lines of every log, for a failure message.
    pub fn logs(&self) -> String {
        let mut s = String::new();
        for p in [&self.etcd, &self.router].into_iter().chain(self.nodes()) {
            s.push_str(&format!(
                "\n---- {} ({}) ----\n{}",
                p.host.name,
                p.log.display(),
                tail(&p.log)
            ));
        }
        s
    }
}

fn spawn_etcd(net: &Net, dir: &Path) -> Result<Proc> {
    let h = net::ETCD;
    let client = format!("http://{}:{ETCD_PORT}", h.ip);
    // The peer port stays on the namespace's loopback: a one-member cluster.
    let peer = "http://127.0.0.1:2380";
    let data = dir.join("etcd-data").to_string_lossy().into_owned();
    let initial = format!("quick={peer}");
    let args: Vec<String> = [
        "etcd",
        "--name",
        "quick",
        "--data-dir",
        data.as_str(),
        "--listen-client-urls",
        &client,
        "--advertise-client-urls",
        &client,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        initial.as_str(),
        "--log-level",
        "warn",
        // As configs/multi-host/README.md asks: nodes rewrite their cards as their load changes,
        // and etcd keeps every revision until compacted.
        "--auto-compaction-mode",
        "periodic",
        "--auto-compaction-retention",
        "5m",
    ]
    .map(String::from)
    .to_vec();
    spawn_in(net, h, dir, &args, None)
}

/// `pdnode certs init` into `dir`: the cluster CA and one certificate per node of the cluster.
pub fn make_certs(bin: &Path, dir: &Path) -> Result<()> {
    let mut cmd = Command::new(bin);
    cmd.args(["certs", "init", "--dir"])
        .arg(dir)
        .args(["--cluster", CLUSTER]);
    let nodes = [(net::ROUTER, "router")]
        .into_iter()
        .chain(net::PREFILL.iter().map(|h| (*h, "prefill")))
        .chain([(net::SPARE_PREFILL, "prefill")])
        .chain(net::DECODE.iter().map(|h| (*h, "decode")));
    for (h, role) in nodes {
        cmd.arg("--node").arg(format!("{}:{role}@{}", h.name, h.ip));
    }
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .context("run pdnode certs init")?;
    if !out.status.success() {
        bail!(
            "pdnode certs init failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn spawn_node(
    net: &Net,
    bin: &Path,
    repo: &Path,
    dir: &Path,
    role: Role,
    h: Host,
    sets: &[String],
) -> Result<Proc> {
    let mut args = vec![
        bin.to_string_lossy().into_owned(),
        "start".into(),
        "--config".into(),
        config_file(role).into(),
    ];
    for s in sets {
        args.push("--set".into());
        args.push(s.clone());
    }
    spawn_in(net, h, dir, &args, Some(repo))
}

/// `ip netns exec {ns} ARGS...`, output to `{dir}/{host}.log` (`{host}-2.log`, ... for a host's
/// later processes: a restart keeps the first one's log).
fn spawn_in(net: &Net, h: Host, dir: &Path, args: &[String], cwd: Option<&Path>) -> Result<Proc> {
    let log = (1..)
        .map(|n| match n {
            1 => dir.join(format!("{}.log", h.name)),
            n => dir.join(format!("{}-{n}.log", h.name)),
        })
        .find(|p| !p.exists())
        .context("no free log file name")?;
    let f = std::fs::File::create(&log)?;
    let mut cmd = Command::new("ip");
    cmd.arg("netns").arg("exec").arg(net.ns(h.name)).args(args);
    if let Some(d) = cwd {
        cmd.current_dir(d);
    }
    let child = cmd
        .env_remove("RUST_LOG")
        .env_remove("UCX_NET_DEVICES")
        .env_remove("UCX_TLS")
        .stdin(Stdio::null())
        .stdout(f.try_clone()?)
        .stderr(f)
        .spawn()
        .with_context(|| format!("start {} in {}", args[0], net.ns(h.name)))?;
    Ok(Proc {
        host: h,
        guard: ChildGuard::new(h.name, child),
        log,
    })
}

/// The last 40 lines of a log.
pub fn tail(p: &Path) -> String {
    let s = std::fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Polls `cond` every 100 ms until it holds (true) or `deadline` passes (false).
pub async fn wait_until<F, Fut>(deadline: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = tokio::time::Instant::now() + deadline;
    loop {
        if cond().await {
            return true;
        }
        if tokio::time::Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_http_ok(url: &str, deadline: Duration) -> Result<()> {
    let c = crate::metrics::client();
    let ok = wait_until(deadline, || async {
        matches!(c.get(url).send().await, Ok(r) if r.status().is_success())
    })
    .await;
    if ok {
        Ok(())
    } else {
        bail!("{url} did not answer 200 within {deadline:?}")
    }
}

const _: () = assert!(ROUTER_REQUEST_TIMEOUT_S < crate::load::REQUEST_DEADLINE.as_secs());
