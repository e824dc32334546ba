//! Running one case: a fresh cluster, the load, the trigger, the fault (`lifecycle` for the
//! faults that stop, add or restart a whole process), the tally and the checks after the load.

use crate::cases::{
    CONCURRENCY, Case, Expect, Fault, GOAL, LEASE_TTL, STALL, Sig, Target, Trigger,
};
use crate::cluster::{Cluster, Proc, wait_until};
use crate::lifecycle;
use crate::load::{End, Load, Outcome, Spec};
use crate::metrics::{Held, scrape};
use crate::net::{self, Net};
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::time::{Duration, Instant};

/// After the load, every surviving node must own nothing within this (one transfer lease of
/// the multi-host configs' 30 s, plus slack).
pub const DRAIN_DEADLINE: Duration = Duration::from_secs(45);
/// How long a trigger may wait for the node it watches to get busy.
const TRIGGER_DEADLINE: Duration = Duration::from_secs(30);

/// One row of the table.
#[derive(Debug, Default)]
pub struct Row {
    pub name: String,
    pub sent: usize,
    pub completed: usize,
    pub failed: usize,
    pub unclear: usize,
    pub hung: usize,
    /// Requests the router held when it died or that were sent while it was down, ended cut
    /// or refused (`router-restart` only; not counted as failed or unclear).
    pub outage: usize,
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
    /// The case's own figures (a join's time to the view, a drain's exit, ...).
    pub claims: Vec<String>,
    /// Why the case failed (empty: passed).
    pub problems: Vec<String>,
    /// Distinct client-visible errors, for the report.
    pub errors: Vec<String>,
    /// (prompt, text) of each completed greedy request (`--full`), compared across cases.
    pub texts: Vec<(String, String)>,
}

impl Row {
    pub fn passed(&self) -> bool {
        self.problems.is_empty()
    }
}

/// When the fault began, and (for a fault the clients cannot be served through: the router
/// down) when serving was back.
#[derive(Debug, Clone, Copy)]
pub struct Injected {
    pub at: Instant,
    pub back: Option<Instant>,
}

/// The direct link a fault cuts, if any.
fn link_of(f: &Fault) -> Option<net::Link> {
    match *f {
        Fault::LinkDown(l, _) | Fault::DuringLinkDown { link: l, .. } => Some(l),
        _ => None,
    }
}

pub fn node(c: &Cluster, t: Target) -> &Proc {
    match t {
        Target::Prefill0 => &c.prefill[0],
        Target::Decode0 => &c.decode[0],
        Target::Decode1 => &c.decode[1],
    }
}

pub fn node_mut(c: &mut Cluster, t: Target) -> &mut Proc {
    match t {
        Target::Prefill0 => &mut c.prefill[0],
        Target::Decode0 => &mut c.decode[0],
        Target::Decode1 => &mut c.decode[1],
    }
}

pub async fn held(p: &Proc) -> Option<Held> {
    let m = scrape(&p.metrics_url()).await?;
    Held::of(&m, p.host.name)
}

/// Hosts whose node the fault ends for good (not checked after the load, not expected in the
/// router's view).
fn gone(f: &Fault) -> Vec<&'static str> {
    match *f {
        Fault::Kill(t)
        | Fault::DuringLinkDown {
            target: t,
            sig: Sig::Kill,
            ..
        }
        | Fault::Drain(t) => {
            vec![t.host().name]
        }
        _ => Vec::new(),
    }
}

pub async fn run(case: &Case, net: &Net, bin: &Path, repo: &Path, dir: &Path) -> Result<Row> {
    let t0 = Instant::now();
    let mut c = Cluster::start(net, bin, repo, dir, &case.extra).await?;
    let mut row = Row {
        name: case.name.to_string(),
        ..Row::default()
    };
    let link = link_of(&case.fault);
    let tx_before = match link {
        Some(l) => net.link_tx_bytes(l)?,
        None => 0,
    };
    let load = Load::start(Spec {
        url: c.router_url("/v1/completions"),
        concurrency: CONCURRENCY,
        max_tokens: case.max_tokens,
        prompt_len: case.prompt_len,
        keep_chunks: true,
        greedy: case.extra.engine != crate::cluster::EngineKind::Mock,
    });
    // Any early return stops the clients' loop; the cluster's guards stop the processes.
    let r = drive(case, net, &mut c, &load, tx_before, &mut row).await;
    let outcomes = load.finish().await;
    let inj = match r {
        Ok(inj) => inj,
        Err(e) => bail!("{e:#}{}", c.logs()),
    };
    tally(&mut row, &outcomes, inj);
    row.texts = outcomes.iter().filter_map(|o| o.text.clone()).collect();
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
        Expect::CompleteOutsideOutage => {
            if row.failed > 0 {
                row.problems.push(format!(
                    "{} requests outside the router's outage failed",
                    row.failed
                ));
            }
            let after = inj.back.map_or(0, |b| {
                outcomes
                    .iter()
                    .filter(|o| o.sent >= b && o.end == End::Completed)
                    .count()
            });
            row.claims
                .push(format!("{after} completed after the restart"));
            if after == 0 {
                row.problems
                    .push("no request completed after the router's restart".into());
            }
        }
        _ => {}
    }
    // A decode node killed: what the survivor alone served afterwards (requests sent after the
    // fault that completed, per second of the rest of the load), and how the rest ended: the
    // figure that says whether it kept serving or stalled.
    if let Fault::Kill(Target::Decode0 | Target::Decode1) = case.fault
        && let Some(last) = outcomes.iter().map(|o| o.end_at).max()
        && last > inj.at
    {
        let after: Vec<&Outcome> = outcomes.iter().filter(|o| o.sent > inj.at).collect();
        let done = after.iter().filter(|o| o.end == End::Completed).count();
        let failed = after
            .iter()
            .filter(|o| matches!(o.end, End::Failed(_)))
            .count();
        let span = last.duration_since(inj.at).as_secs_f64();
        row.claims.push(format!(
            "after the kill: {} sent, {done} completed ({:.2}/s by the surviving decode node), {failed} failed clearly",
            after.len(),
            done as f64 / span.max(1e-3)
        ));
    }
    // A KV link that stays down must not hold the requests through it until it returns: the
    // prefill node gives up on a stalled push after `transfer.stall_ms` and the router retries
    // on another pair (without that, they end only after the link is back: 10 s and more).
    // (Mock engines only: on the CPU engine every request waits seconds in the queues anyway,
    // so the figure is reported against the baseline's instead.)
    if let (Fault::LinkDown(l, hold), Some(longest)) = (&case.fault, row.longest_affected)
        && *l == net::KV_LINK
        && case.extra.engine == crate::cluster::EngineKind::Mock
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
async fn drive(
    case: &Case,
    net: &Net,
    c: &mut Cluster,
    load: &Load,
    tx_before: u64,
    row: &mut Row,
) -> Result<Injected> {
    match case.trigger {
        Trigger::After(d) => tokio::time::sleep(d).await,
        Trigger::Busy(t, n) | Trigger::Queued(t, n) => {
            let queued_only = matches!(case.trigger, Trigger::Queued(..));
            let p = node(c, t);
            let busy = wait_until(TRIGGER_DEADLINE, || async {
                held(p).await.is_some_and(|h| {
                    if queued_only {
                        h.queued >= n
                    } else {
                        h.running + h.queued >= n
                    }
                })
            })
            .await;
            if !busy {
                load.stop();
                bail!(
                    "{} never had {n} requests{} within {TRIGGER_DEADLINE:?}",
                    p.host.name,
                    if queued_only { " queued" } else { "" }
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
    let mut back = None;
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
        Fault::DuringLinkDown {
            link,
            target,
            sig,
            after,
            hold,
        } => {
            net.link_down(link)?;
            tokio::time::sleep(after).await;
            node(c, target).signal(match sig {
                Sig::Kill => "KILL",
                Sig::Stop => "STOP",
            })?;
            tokio::time::sleep(hold.saturating_sub(after)).await;
            net.link_up(link)?;
            if sig == Sig::Stop {
                node(c, target).signal("CONT")?;
            }
        }
        Fault::Drain(t) => lifecycle::drain(c, t, row).await?,
        Fault::RouterRestart { lease } => {
            back = Some(lifecycle::router_restart(net, c, lease, row).await?)
        }
        Fault::PrefillJoin => lifecycle::prefill_join(net, c, load, row).await?,
        Fault::EtcdOutageJoin { down, join_after } => {
            lifecycle::etcd_outage_join(net, c, load, down, join_after, row).await?
        }
    }
    tokio::time::sleep(case.tail).await;
    load.stop();
    Ok(Injected { at, back })
}

/// Whether `o` overlapped the router's outage `[at, back)` and ended without completing: it
/// was cut when the router died, or refused while it was down.
fn in_outage(o: &Outcome, inj: Injected) -> bool {
    inj.back
        .is_some_and(|back| o.sent < back && o.end_at >= inj.at && o.end != End::Completed)
}

pub fn tally(row: &mut Row, outcomes: &[Outcome], inj: Injected) {
    row.sent = outcomes.len();
    for o in outcomes {
        if in_outage(o, inj) {
            row.outage += 1;
            continue;
        }
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
    let affected = || {
        outcomes
            .iter()
            .filter(move |o| !in_outage(o, inj) && o.affected(inj.at, STALL))
    };
    row.fault_to_end = affected()
        .map(|o| o.end_at.saturating_duration_since(inj.at))
        .max();
    row.longest_affected = affected()
        .map(|o| o.end_at.saturating_duration_since(o.sent.max(inj.at)))
        .max();
    // A hung request either stalled (no byte for a while when its deadline came) or was still
    // streaming, slowly: a wedge and a long queue are different findings.
    let hung: Vec<&Outcome> = outcomes.iter().filter(|o| o.end == End::Hung).collect();
    if !hung.is_empty() {
        let stalled = hung
            .iter()
            .filter(|o| {
                let last = o.chunks.last().copied().unwrap_or(o.sent);
                o.end_at.saturating_duration_since(last) > HUNG_STALL
            })
            .count();
        let streamed = hung.iter().filter(|o| !o.chunks.is_empty()).count();
        row.claims.push(format!(
            "hung: {stalled} of {} without a byte in their last {} s ({streamed} had streamed something)",
            hung.len(),
            HUNG_STALL.as_secs()
        ));
    }
}

/// A hung request whose last byte is older than this at its deadline had stalled.
const HUNG_STALL: Duration = Duration::from_secs(5);

/// After the load: the router holds nothing in flight, sees the nodes it should, and every
/// surviving node owns no KV block and no staging span.
pub async fn check_after(case: &Case, c: &Cluster, row: &mut Row) {
    let t0 = Instant::now();
    let gone = gone(&case.fault);
    let view_changes = matches!(
        case.fault,
        Fault::EtcdStop(_)
            | Fault::EtcdOutageJoin { .. }
            | Fault::PrefillJoin
            | Fault::Drain(_)
            | Fault::RouterRestart { .. }
    );
    if view_changes {
        // Nodes whose leases expired in an outage register again; a joined host stays; a
        // drained one is gone.
        let alive = |ps: &[Proc]| ps.iter().filter(|p| !gone.contains(&p.host.name)).count();
        let want = (alive(&c.prefill), alive(&c.decode));
        if !wait_until(3 * LEASE_TTL, || async {
            c.router_nodes().await == Some(want)
        })
        .await
        {
            row.problems.push(format!(
                "after the fault the router sees {:?} (prefill, decode), not {want:?}",
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
    for p in c.nodes().filter(|p| !gone.contains(&p.host.name)) {
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
        "| case | sent | completed | failed (clear error) | unclear | hung | fault -> last affected end (s) | longest affected request (s) | KV blocks / staging spans held after | drained in (s) | wall (s) | the case's own figures | result |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
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
        let mut claims = r.claims.clone();
        if r.outage > 0 {
            claims.insert(0, format!("{} cut or refused in the outage", r.outage));
        }
        let claims = if claims.is_empty() {
            "-".to_string()
        } else {
            claims.join("; ")
        };
        let result = if r.passed() {
            "pass".to_string()
        } else {
            format!("FAIL: {}", r.problems.join("; "))
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {:.1} | {:.0} | {} | {} |\n",
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
            claims,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_unfinished_requests_that_overlap_the_outage_are_excused() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let o = |sent, end, e: End| Outcome {
            sent: ms(sent),
            end_at: ms(end),
            chunks: Vec::new(),
            end: e,
            text: None,
        };
        let inj = Injected {
            at: ms(1000),
            back: Some(ms(5000)),
        };
        let cut = o(900, 1000, End::Unclear("body: reset".into()));
        let refused = o(3000, 3001, End::Unclear("request: refused".into()));
        let before = o(100, 900, End::Unclear("cut".into()));
        let after = o(5001, 5100, End::Failed("x".into()));
        let done = o(900, 6000, End::Completed);
        assert!(in_outage(&cut, inj) && in_outage(&refused, inj));
        assert!(!in_outage(&before, inj), "ended before the router died");
        assert!(!in_outage(&after, inj), "sent after it was back");
        assert!(!in_outage(&done, inj), "completed: nothing to excuse");
        let none = Injected {
            at: ms(1000),
            back: None,
        };
        assert!(!in_outage(&cut, none), "no outage: nothing is excused");
        let mut row = Row::default();
        tally(&mut row, &[cut, refused, before, after, done], inj);
        assert_eq!(
            (row.sent, row.outage, row.completed, row.failed, row.unclear),
            (5, 2, 1, 1, 1)
        );
    }

    #[test]
    fn hung_requests_are_told_apart_stalled_from_still_streaming() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let hung = |chunks: Vec<u64>| Outcome {
            sent: t0,
            end_at: ms(60_000),
            chunks: chunks.into_iter().map(ms).collect(),
            end: End::Hung,
            text: None,
        };
        let streaming = hung(vec![1_000, 30_000, 58_000]);
        let stalled = hung(vec![1_000]);
        let silent = hung(vec![]);
        let mut row = Row::default();
        let inj = Injected { at: t0, back: None };
        tally(&mut row, &[streaming, stalled, silent], inj);
        assert_eq!(row.hung, 3);
        assert_eq!(
            row.claims,
            ["hung: 2 of 3 without a byte in their last 5 s (2 had streamed something)"]
        );
    }
}
