//! The registrar child process: holds many nodes' registrations, each a real
//! [`pdnode_registry::Registration`] (its own lease, the registry's own keepalive task), spread
//! over etcd connections of `--per-conn` cards each, as that many nodes would.
//!
//! Protocol (one line each way): it prints `ready N MS` once its first `--count` cards are
//! registered; then reads commands from stdin: `join K` (register K more; answers
//! `joined K MS`; their ids from `--join-first` on), `leave K` (revoke the K newest; `left K MS`),
//! `busy MS` (from now on every card's load changes and is put once every MS, as a busy node's
//! registrar does every second; 0: stop; answers `busy MS`), `failures` (`failures N`: keepalive
//! or re-registration attempts that failed so far). It exits when stdin closes.

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use pdnode_core::{NodeCard, Role};
use pdnode_registry::{EtcdRegistry, Registration, Registry, RegistryOptions};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::watch;

/// How many registrations (or connects) run at once.
const PARALLEL: usize = 32;

#[derive(clap::Args, Debug, Clone)]
pub struct RegistrarArgs {
    #[arg(long)]
    pub etcd: String,
    #[arg(long)]
    pub cluster: String,
    /// Index of this process's first node (ids are `node-{index}`).
    #[arg(long)]
    pub first: usize,
    #[arg(long)]
    pub count: usize,
    /// Index of the first node `join` adds (disjoint from every process's own range).
    #[arg(long)]
    pub join_first: usize,
    /// Cards per etcd connection.
    #[arg(long, default_value_t = 1)]
    pub per_conn: usize,
    #[arg(long, default_value_t = 10)]
    pub ttl_s: u64,
}

pub fn options(ttl_s: u64) -> RegistryOptions {
    RegistryOptions {
        lease_ttl: Duration::from_secs(ttl_s),
        call_timeout: Duration::from_secs(5),
        max_backoff: Duration::from_secs(2),
    }
}

/// A card the size of a real node's: addresses (gRPC, HTTP, a UCX worker address), role by
/// index (even: prefill, odd: decode).
pub fn card(cluster: &str, index: usize) -> NodeCard {
    let role = if index.is_multiple_of(2) {
        Role::Prefill
    } else {
        Role::Decode
    };
    let mut c = NodeCard::placeholder(cluster, role, &format!("node-{index}"));
    let (a, b) = ((index / 250) % 250, index % 250);
    c.addresses.grpc = format!("10.1.{a}.{b}:7001");
    c.addresses.http = Some(format!("10.1.{a}.{b}:9001"));
    // A UCX tcp worker address is a few hundred bytes, hex in the card.
    c.addresses.ucx_worker = Some(format!("{index:08x}").repeat(32));
    c.model_id = "Meta-Llama-3.1-8B-Instruct".into();
    c.model_fingerprint = format!("{:064x}", 0xfeed_u64);
    c.version = env!("CARGO_PKG_VERSION").into();
    c.started_at_ms = 1_700_000_000_000 + index as u64;
    c
}

struct Pool {
    conns: Vec<Arc<EtcdRegistry>>,
    per_conn: usize,
}

impl Pool {
    async fn connect(endpoint: &str, n: usize, per_conn: usize, ttl_s: u64) -> Result<Self> {
        let per_conn = per_conn.max(1);
        let want = n.div_ceil(per_conn).max(1);
        let endpoints = [endpoint.to_string()];
        let conns: Vec<Result<EtcdRegistry, _>> = futures::stream::iter(0..want)
            .map(|_| EtcdRegistry::connect(&endpoints, options(ttl_s)))
            .buffer_unordered(PARALLEL)
            .collect()
            .await;
        let conns = conns
            .into_iter()
            .map(|c| c.map(Arc::new))
            .collect::<Result<Vec<_>, _>>()
            .context("connect to etcd")?;
        Ok(Self { conns, per_conn })
    }

    /// The connection of the `k`-th card of this process (new connections for cards past the
    /// first ones share the existing connections round robin).
    fn conn(&self, k: usize) -> Arc<EtcdRegistry> {
        self.conns[(k / self.per_conn) % self.conns.len()].clone()
    }
}

/// Registers the cards of node indexes `first..first + n`; the `k`-th of them goes over the
/// connection of slot `slot0 + k`.
async fn register_many(
    pool: &Pool,
    cluster: &str,
    first: usize,
    n: usize,
    slot0: usize,
) -> Result<Vec<Registration>> {
    let regs: Vec<Result<Registration, _>> = futures::stream::iter(0..n)
        .map(|k| {
            let reg = pool.conn(slot0 + k);
            let card = card(cluster, first + k);
            async move { reg.register(card).await }
        })
        .buffered(PARALLEL)
        .collect()
        .await;
    regs.into_iter()
        .collect::<Result<Vec<_>, _>>()
        .context("register")
}

type Shared = Arc<Mutex<Vec<Registration>>>;

/// Every `every`, each card's load changes and is published (`Registration::update`), as a
/// busy node's registrar does once a second; spread over ten ticks per period so the puts do
/// not all land at once. `None`: idle (no updates).
async fn updates(regs: Shared, every: watch::Receiver<Option<Duration>>) {
    let mut every = every;
    let mut tick = 0u64;
    loop {
        let period = *every.borrow_and_update();
        let Some(period) = period else {
            if every.changed().await.is_err() {
                return;
            }
            continue;
        };
        let step = (period / 10).max(Duration::from_millis(1));
        tokio::select! {
            _ = tokio::time::sleep(step) => {}
            r = every.changed() => {
                if r.is_err() {
                    return;
                }
                continue;
            }
        }
        tick += 1;
        let g = regs.lock().unwrap_or_else(|p| p.into_inner());
        for (i, r) in g.iter().enumerate() {
            if i as u64 % 10 == tick % 10 {
                let mut c = r.card();
                c.capacity.running_requests = (tick % 64) as u32;
                c.capacity.kv_blocks_free = 4096 - tick % 4096;
                // The registration's own task puts it; a full channel is not a thing (a watch).
                let _ = r.update(c);
            }
        }
    }
}

pub async fn run(a: RegistrarArgs) -> Result<bool> {
    let t0 = Instant::now();
    let pool = Pool::connect(&a.etcd, a.count, a.per_conn, a.ttl_s).await?;
    let first = register_many(&pool, &a.cluster, a.first, a.count, 0).await?;
    let regs: Shared = Arc::new(Mutex::new(first));
    let (busy_tx, busy_rx) = watch::channel(None);
    let updater = tokio::spawn(updates(regs.clone(), busy_rx));
    let len = |regs: &Shared| regs.lock().unwrap_or_else(|p| p.into_inner()).len();
    let mut joined = 0;
    let mut out = tokio::io::stdout();
    let say = |line: String| line + "\n";
    out.write_all(say(format!("ready {} {}", len(&regs), t0.elapsed().as_millis())).as_bytes())
        .await?;
    out.flush().await?;
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let mut w = line.split_whitespace();
        let (cmd, k) = (
            w.next().unwrap_or(""),
            w.next().and_then(|n| n.parse::<usize>().ok()),
        );
        let t = Instant::now();
        let answer = match (cmd, k) {
            ("join", Some(k)) => {
                let first = a.join_first + joined;
                let more = register_many(&pool, &a.cluster, first, k, len(&regs)).await?;
                joined += k;
                regs.lock().unwrap_or_else(|p| p.into_inner()).extend(more);
                format!("joined {k} {}", t.elapsed().as_millis())
            }
            ("leave", Some(k)) => {
                let gone: Vec<Registration> = {
                    let mut g = regs.lock().unwrap_or_else(|p| p.into_inner());
                    let k = k.min(g.len());
                    let at = g.len() - k;
                    g.split_off(at)
                };
                let n = gone.len();
                let res: Vec<_> = futures::stream::iter(gone)
                    .map(Registration::shutdown)
                    .buffer_unordered(PARALLEL)
                    .collect()
                    .await;
                let failed = res.iter().filter(|r| r.is_err()).count();
                if failed > 0 {
                    bail!("{failed} of {n} revokes failed");
                }
                format!("left {n} {}", t.elapsed().as_millis())
            }
            ("busy", Some(ms)) => {
                let every = (ms > 0).then(|| Duration::from_millis(ms as u64));
                busy_tx.send_replace(every);
                format!("busy {ms}")
            }
            ("failures", _) => format!(
                "failures {}",
                regs.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .map(Registration::keepalive_failures)
                    .sum::<u64>()
            ),
            _ => bail!("unknown command {line:?}"),
        };
        out.write_all(say(answer).as_bytes()).await?;
        out.flush().await?;
    }
    updater.abort();
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cards_are_well_formed_and_unique_with_both_roles() {
        let a = card("c", 0);
        let b = card("c", 1);
        assert_eq!(a.role, Role::Prefill);
        assert_eq!(b.role, Role::Decode);
        assert_ne!(a.key(), b.key());
        assert_ne!(a.addresses.grpc, card("c", 250).addresses.grpc);
        let json = a.to_json();
        assert!(
            json.len() > 300,
            "a card about a real one's size: {}",
            json.len()
        );
        assert_eq!(NodeCard::from_json(json.as_bytes()).ok(), Some(a));
    }
}
