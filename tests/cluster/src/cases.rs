//! The fault cases: a fresh cluster each, load at concurrency 64, one fault, then the checks.

use crate::cluster::{Cluster, Extra, Proc, wait_until};
use crate::load::{End, Load, Outcome, Spec};
use crate::metrics::{Held, scrape};
use crate::net::{self, Net};
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::time::{Duration, Instant};

pub const CONCURRENCY: usize = 64;
/// A completed request that waited longer than this for its next byte after the fault counts
/// as affected by it.
pub const STALL: Duration = Duration::from_secs(1);
/// The goal for the end of the last affected request after the fault.
pub const GOAL: Duration = Duration::from_secs(2);
/// After the load, every surviving node must own nothing within this (one transfer lease of
/// the multi-host configs' 30 s, plus slack).
const DRAIN_DEADLINE: Duration = Duration::from_secs(45);
/// How long a trigger may wait for the node it watches to get busy.
const TRIGGER_DEADLINE: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Prefill0,
    Decode0,
    Decode1,
}

#[derive(Debug, Clone, Copy)]
pub enum Fault {
    None,
    Kill(Target),
    /// SIGSTOP, hold, SIGCONT.
    Stop(Target, Duration),
    /// A direct link down (on its `b` end), hold, up.
    LinkDown(net::Link, Duration),
    /// etcd SIGSTOPped, hold, SIGCONT.
    EtcdStop(Duration),
    /// A direct link down; once the pushes over it stall (`after`), the target SIGKILLed;
    /// the link up again after `hold`.
    KillDuringLinkDown {
        link: net::Link,
        target: Target,
        after: Duration,
        hold: Duration,
    },
}

/// When the fault is injected.
#[derive(Debug, Clone, Copy)]
pub enum Trigger {
    After(Duration),
    /// Once the node runs (or queues) at least this many requests.
    Busy(Target, u64),
}

/// What the clients must see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Every request completes.
    AllComplete,
    /// Some requests fail with a clear error (the fault hit them), none hang.
    SomeFail,
    /// Every request ends with tokens or a clear error, none hangs: a fault whose requests
    /// are retried when nothing was streamed yet and fail clearly otherwise, and which may
    /// catch a stream or not.
    EveryEnds,
}

pub struct Case {
    pub name: &'static str,
    pub what: &'static str,
    pub extra: Extra,
    pub max_tokens: u32,
    pub prompt_len: usize,
    pub trigger: Trigger,
    pub fault: Fault,
    /// Load after the fault is over.
    pub tail: Duration,
    pub expect: Expect,
}

fn sets(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// 20 ms a decode step, 100 tokens: 2 s streams, so a fault lands mid-decode.
fn long_decode() -> Extra {
    Extra {
        decode: sets(&[
            "engine.mock.decode_us_per_token=20000",
            "engine.mock.output_len=100",
        ]),
        ..Extra::default()
    }
}

/// 200 us a prompt token, 64 tokens a step: a queue of prefills to hit; short decodes.
fn slow_prefill() -> Extra {
    Extra {
        prefill: sets(&[
            "engine.mock.prefill_us_per_token=200",
            "engine.max_batch_tokens=64",
        ]),
        decode: sets(&[
            "engine.mock.decode_us_per_token=1000",
            "engine.mock.output_len=4",
        ]),
        ..Extra::default()
    }
}

/// The `--quick` matrix (mock engines).
pub fn quick() -> Vec<Case> {
    let s = Duration::from_secs;
    vec![
        Case {
            name: "baseline",
            what: "no fault",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(1)),
            fault: Fault::None,
            tail: s(2),
            expect: Expect::AllComplete,
        },
        Case {
            name: "decode-kill",
            what: "decode0 SIGKILLed while decoding",
            extra: long_decode(),
            max_tokens: 100,
            prompt_len: 64,
            trigger: Trigger::Busy(Target::Decode0, 8),
            fault: Fault::Kill(Target::Decode0),
            tail: s(3),
            expect: Expect::SomeFail,
        },
        Case {
            name: "decode-stop",
            what: "decode0 SIGSTOPped 5 s while decoding",
            extra: long_decode(),
            max_tokens: 100,
            prompt_len: 64,
            trigger: Trigger::Busy(Target::Decode0, 8),
            fault: Fault::Stop(Target::Decode0, s(5)),
            tail: s(2),
            expect: Expect::SomeFail,
        },
        Case {
            name: "prefill-stop",
            what: "prefill0 SIGSTOPped 5 s while prefilling",
            extra: slow_prefill(),
            max_tokens: 4,
            prompt_len: 60,
            trigger: Trigger::Busy(Target::Prefill0, 2),
            fault: Fault::Stop(Target::Prefill0, s(5)),
            tail: s(2),
            expect: Expect::AllComplete,
        },
        Case {
            name: "prefill-kill",
            what: "prefill0 SIGKILLed while prefilling",
            extra: slow_prefill(),
            max_tokens: 4,
            prompt_len: 60,
            trigger: Trigger::Busy(Target::Prefill0, 2),
            fault: Fault::Kill(Target::Prefill0),
            tail: s(3),
            expect: Expect::AllComplete,
        },
        Case {
            name: "link-down",
            what: "prefill0 <-> decode0 link down 10 s",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(2)),
            fault: Fault::LinkDown(net::KV_LINK, s(10)),
            tail: s(3),
            expect: Expect::AllComplete,
        },
        Case {
            name: "router-cut",
            what: "router <-> decode1 link down 10 s while decoding",
            extra: long_decode(),
            max_tokens: 100,
            prompt_len: 64,
            trigger: Trigger::Busy(Target::Decode1, 8),
            fault: Fault::LinkDown(net::ROUTER_LINK, s(10)),
            tail: s(3),
            expect: Expect::SomeFail,
        },
        Case {
            // The pushes in flight stall behind the cut link, then their writer dies: the
            // decode node's spans have no writer left and no record will come (fenced to their
            // deadline); every request is retried on prefill1.
            name: "prefill-kill-pushing",
            what: "prefill0 SIGKILLed while its KV pushes to decode0 stall (link down)",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(2)),
            fault: Fault::KillDuringLinkDown {
                link: net::KV_LINK,
                target: Target::Prefill0,
                after: Duration::from_millis(500),
                hold: s(3),
            },
            tail: s(3),
            expect: Expect::AllComplete,
        },
        Case {
            // decode0 holds reservations for prefills still running when it dies: those are
            // retried on decode1 (nothing was streamed); a stream it was serving fails clearly.
            name: "decode-kill-reserved",
            what: "decode0 SIGKILLed while prefills for it run (between ReserveKv and Decode)",
            extra: slow_prefill(),
            max_tokens: 4,
            prompt_len: 60,
            trigger: Trigger::Busy(Target::Prefill0, 2),
            fault: Fault::Kill(Target::Decode0),
            tail: s(3),
            expect: Expect::EveryEnds,
        },
        Case {
            name: "etcd-stop",
            what: "etcd SIGSTOPped 4 s (within the 10 s lease TTL)",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(1)),
            fault: Fault::EtcdStop(s(4)),
            tail: s(3),
            expect: Expect::AllComplete,
        },
        Case {
            // etcd, back after more than a TTL without keepalives, may expire every lease
            // before the nodes' next keepalive lands: the router keeps a role's last cards
            // for a grace while none is listed, and a watched node that still answers keeps
            // its requests.
            name: "etcd-stop-long",
            what: "etcd SIGSTOPped 15 s (past the 10 s lease TTL)",
            extra: Extra::default(),
            max_tokens: 32,
            prompt_len: 64,
            trigger: Trigger::After(s(1)),
            fault: Fault::EtcdStop(s(15)),
            tail: s(3),
            expect: Expect::AllComplete,
        },
    ]
}

/// Cases run only by name (`--case`): known to fail today, kept out of the CI matrix and listed
/// with their figures in docs/benchmarks.md ("Faults").
pub fn known_failing() -> Vec<Case> {
    Vec::new()
}

/// One row of the table.
#[derive(Debug, Default)]
pub struct Row {
    pub name: String,
    pub sent: usize,
    pub completed: usize,
    pub failed: usize,
    pub unclear: usize,
    pub hung: usize,
    /// From the fault to the end of the last affected request (None: nothing was affected).
    pub fault_to_end: Option<Duration>,
    /// The longest an affected request took from the fault (or its sending, when later) to
    /// its end: under a fault that lasts, requests sent into it are affected too, and this
    /// says how long each had to live with it.
    pub longest_affected: Option<Duration>,
    /// KV blocks and staging spans owned on the surviving nodes after the load.
    pub kv_blocks: u64,
    pub staging_spans: u64,
    /// From the last request's end until the router and every surviving node held nothing.
    pub drain: Duration,
    pub wall: Duration,
    /// Why the case failed (empty: passed).
    pub problems: Vec<String>,
    /// Distinct client-visible errors, for the report.
    pub errors: Vec<String>,
}

impl Row {
    pub fn passed(&self) -> bool {
        self.problems.is_empty()
    }
}

/// The direct link a fault cuts, if any.
fn link_of(f: &Fault) -> Option<net::Link> {
    match *f {
        Fault::LinkDown(l, _) | Fault::KillDuringLinkDown { link: l, .. } => Some(l),
        _ => None,
    }
}

fn node(c: &Cluster, t: Target) -> &Proc {
    match t {
        Target::Prefill0 => &c.prefill[0],
        Target::Decode0 => &c.decode[0],
        Target::Decode1 => &c.decode[1],
    }
}

async fn held(p: &Proc) -> Option<Held> {
    let m = scrape(&p.metrics_url()).await?;
    Held::of(&m, p.host.name)
}

pub async fn run(case: &Case, net: &Net, bin: &Path, repo: &Path, dir: &Path) -> Result<Row> {
    let t0 = Instant::now();
    let c = Cluster::start(net, bin, repo, dir, &case.extra).await?;
    let mut row = Row {
        name: case.name.to_string(),
        ..Row::default()
    };
    let link = match case.fault {
        Fault::LinkDown(l, _) | Fault::KillDuringLinkDown { link: l, .. } => Some(l),
        _ => None,
    };
    let tx_before = match link {
        Some(l) => net.link_tx_bytes(l)?,
        None => 0,
    };
    let load = Load::start(Spec {
        url: c.router_url("/v1/completions"),
        concurrency: CONCURRENCY,
        max_tokens: case.max_tokens,
        prompt_len: case.prompt_len,
    });
    // Any early return stops the clients' loop; the cluster's guards stop the processes.
    let r = drive(case, net, &c, &load, tx_before, &mut row).await;
    let outcomes = load.finish().await;
    let at = match r {
        Ok(at) => at,
        Err(e) => bail!("{e:#}{}", c.logs()),
    };
    tally(&mut row, &outcomes, at);
    check_after(case, &c, &mut row).await;
    match case.expect {
        Expect::AllComplete if row.failed > 0 => row.problems.push(format!(
            "{} requests failed, expected all to complete",
            row.failed
        )),
        Expect::SomeFail if row.failed == 0 => row
            .problems
            .push("no request failed: the fault did not reach the clients".into()),
        Expect::EveryEnds => {
            // One fault, two attempts: a request refused before its stream began (a non-200
            // answer) should have been retried on another pair.
            let refused = outcomes
                .iter()
                .filter(|o| matches!(&o.end, End::Failed(m) if m.starts_with("HTTP ")))
                .count();
            if refused > 0 {
                row.problems.push(format!(
                    "{refused} requests were refused before streaming instead of retried elsewhere"
                ));
            }
        }
        _ => {}
    }
    // A KV link that stays down must not hold the requests through it until it returns: the
    // prefill node gives up on a stalled push after `transfer.stall_ms` and the router retries
    // on another pair (without that, they end only after the link is back: 10 s and more).
    if let (Fault::LinkDown(l, hold), Some(longest)) = (&case.fault, row.longest_affected)
        && *l == net::KV_LINK
        && longest >= *hold / 2
    {
        row.problems.push(format!(
            "a request through the cut KV link waited for it: {:.2} s from the cut or its sending to its end, the link was down {:.0} s",
            longest.as_secs_f64(),
            hold.as_secs_f64()
        ));
    }
    if row.hung > 0 {
        row.problems.push(format!("{} hung", row.hung));
    }
    if row.unclear > 0 {
        row.problems
            .push(format!("{} ended without a clear error", row.unclear));
    }
    if !row.passed() {
        eprintln!("case {}: logs{}", case.name, c.logs());
    }
    row.wall = t0.elapsed();
    Ok(row)
}

/// Waits for the trigger, injects the fault, holds it, restores, lets the load run its tail.
/// Returns when the fault was injected.
async fn drive(
    case: &Case,
    net: &Net,
    c: &Cluster,
    load: &Load,
    tx_before: u64,
    row: &mut Row,
) -> Result<Instant> {
    match case.trigger {
        Trigger::After(d) => tokio::time::sleep(d).await,
        Trigger::Busy(t, n) => {
            let p = node(c, t);
            let busy = wait_until(TRIGGER_DEADLINE, || async {
                held(p).await.is_some_and(|h| h.running + h.queued >= n)
            })
            .await;
            if !busy {
                load.stop();
                bail!(
                    "{} never had {n} requests within {TRIGGER_DEADLINE:?}",
                    p.host.name
                );
            }
        }
    }
    if let Some(l) = link_of(&case.fault) {
        // The pair's traffic went over the direct link, not the bridge: otherwise the case
        // tests nothing.
        let tx = net.link_tx_bytes(l)?;
        if tx <= tx_before + 4096 {
            row.problems.push(format!(
                "{} sent {} bytes over {} under load: the pair does not use it",
                l.a.name,
                tx.saturating_sub(tx_before),
                l.name
            ));
        }
    }
    let at = Instant::now();
    match case.fault {
        Fault::None => {}
        Fault::Kill(t) => node(c, t).signal("KILL")?,
        Fault::Stop(t, hold) => {
            let p = node(c, t);
            p.signal("STOP")?;
            tokio::time::sleep(hold).await;
            p.signal("CONT")?;
        }
        Fault::LinkDown(l, hold) => {
            net.link_down(l)?;
            tokio::time::sleep(hold).await;
            net.link_up(l)?;
        }
        Fault::EtcdStop(hold) => {
            c.etcd.signal("STOP")?;
            tokio::time::sleep(hold).await;
            c.etcd.signal("CONT")?;
        }
        Fault::KillDuringLinkDown {
            link,
            target,
            after,
            hold,
        } => {
            net.link_down(link)?;
            tokio::time::sleep(after).await;
            node(c, target).signal("KILL")?;
            tokio::time::sleep(hold.saturating_sub(after)).await;
            net.link_up(link)?;
        }
    }
    tokio::time::sleep(case.tail).await;
    load.stop();
    Ok(at)
}

fn tally(row: &mut Row, outcomes: &[Outcome], at: Instant) {
    row.sent = outcomes.len();
    for o in outcomes {
        match &o.end {
            End::Completed => row.completed += 1,
            End::Failed(m) | End::Unclear(m) => {
                if matches!(o.end, End::Failed(_)) {
                    row.failed += 1;
                } else {
                    row.unclear += 1;
                }
                if row.errors.len() < 4 && !row.errors.contains(m) {
                    row.errors.push(m.clone());
                }
            }
            End::Hung => row.hung += 1,
        }
    }
    row.fault_to_end = outcomes
        .iter()
        .filter(|o| o.affected(at, STALL))
        .map(|o| o.end_at.saturating_duration_since(at))
        .max();
    row.longest_affected = outcomes
        .iter()
        .filter(|o| o.affected(at, STALL))
        .map(|o| o.end_at.saturating_duration_since(o.sent.max(at)))
        .max();
}

/// After the load: the router holds nothing in flight, sees the nodes it should, and every
/// surviving node owns no KV block and no staging span.
async fn check_after(case: &Case, c: &Cluster, row: &mut Row) {
    let t0 = Instant::now();
    let killed = match case.fault {
        Fault::Kill(t) | Fault::KillDuringLinkDown { target: t, .. } => Some(node(c, t).host.name),
        _ => None,
    };
    if let Fault::EtcdStop(_) = case.fault {
        // Nodes whose leases expired during the outage register again.
        let want = (net::PREFILL.len(), net::DECODE.len());
        if !wait_until(Duration::from_secs(30), || async {
            c.router_nodes().await == Some(want)
        })
        .await
        {
            row.problems.push(format!(
                "after etcd returned the router sees {:?} (prefill, decode), not {want:?}",
                c.router_nodes().await
            ));
        }
    }
    let idle_router = wait_until(DRAIN_DEADLINE, || async {
        c.router_metrics()
            .await
            .and_then(|m| m.get("pdnode_router_inflight_requests"))
            == Some(0.0)
    })
    .await;
    if !idle_router {
        row.problems
            .push("the router still has requests in flight".into());
    }
    for p in c.nodes().filter(|p| Some(p.host.name) != killed) {
        let (before, t) = (held(p).await, Instant::now());
        wait_until(DRAIN_DEADLINE, || async {
            held(p).await.is_some_and(|h| h.idle())
        })
        .await;
        if before.is_some_and(|h| !h.idle()) && t.elapsed() > Duration::from_secs(1) {
            eprintln!(
                "cluster: {} held {before:?} when the load ended; idle {:.1} s later",
                p.host.name,
                t0.elapsed().as_secs_f64()
            );
        }
        match held(p).await {
            Some(h) => {
                row.kv_blocks += h.kv_blocks();
                row.staging_spans += h.staging_spans;
                if !h.idle() {
                    row.problems.push(format!(
                        "{} still holds {h:?} {DRAIN_DEADLINE:?} after the load",
                        p.host.name
                    ));
                }
            }
            None => row
                .problems
                .push(format!("{}: /metrics unreadable", p.host.name)),
        }
    }
    row.drain = t0.elapsed();
}

/// The Markdown table.
pub fn table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| case | sent | completed | failed (clear error) | unclear | hung | fault -> last affected end (s) | longest affected request (s) | KV blocks / staging spans held after | drained in (s) | wall (s) | result |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let end = match r.fault_to_end {
            None => "-".to_string(),
            Some(d) if d > GOAL => format!("{:.2} (goal 2)", d.as_secs_f64()),
            Some(d) => format!("{:.2}", d.as_secs_f64()),
        };
        let longest = match r.longest_affected {
            None => "-".to_string(),
            Some(d) => format!("{:.2}", d.as_secs_f64()),
        };
        let result = if r.passed() {
            "pass".to_string()
        } else {
            format!("FAIL: {}", r.problems.join("; "))
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {:.1} | {:.0} | {} |\n",
            r.name,
            r.sent,
            r.completed,
            r.failed,
            r.unclear,
            r.hung,
            end,
            longest,
            r.kv_blocks,
            r.staging_spans,
            r.drain.as_secs_f64(),
            r.wall.as_secs_f64(),
            result
        ));
    }
    s
}

/// Runs `case` and turns a harness error into a failed row.
pub async fn run_row(case: &Case, net: &Net, bin: &Path, repo: &Path, dir: &Path) -> Row {
    let t0 = Instant::now();
    match run(case, net, bin, repo, dir)
        .await
        .with_context(|| format!("case {}", case.name))
    {
        Ok(r) => r,
        Err(e) => Row {
            name: case.name.to_string(),
            wall: t0.elapsed(),
            problems: vec![format!("{e:#}")],
            ..Row::default()
        },
    }
}
