//! The faults that end, add or restart a whole process under load: a drain (SIGTERM), the
//! router killed and started again, a prefill host joining, and etcd killed while a host
//! joins. Each writes its own figures into the row (`claims`) and its own failures
//! (`problems`); a harness error (a process that cannot be started) is an `Err`.

use crate::cases::{LEASE_TTL, Target};
use crate::cluster::{Cluster, Proc, READY_DEADLINE, Role, wait_until};
use crate::drive::{Row, held, node_mut};
use crate::load::Load;
use crate::metrics::scrape;
use crate::net::{self, Net};
use anyhow::{Result, bail};
use std::time::{Duration, Instant};

/// `node.drain_timeout_s` of the multi-host files (the default): a drained node must exit
/// within this and some slack.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a join is waited for past its goal, to measure it.
const JOIN_PATIENCE: Duration = Duration::from_secs(60);
/// How long after a failed start a supervisor starts a node again (systemd's `RestartSec`).
const RESTART_SEC: Duration = Duration::from_secs(1);
/// A joined node past its TTL still passes when it served within this of the first request
/// sent after it entered the view (see [`joined`]).
const ARRIVAL_SLACK: Duration = Duration::from_secs(2);

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// SIGTERM to `t`: it must revoke its card, finish what it holds and exit 0 (the load must not
/// lose a request: checked by the case's `AllComplete`).
pub async fn drain(c: &mut Cluster, t: Target, row: &mut Row) -> Result<()> {
    let p = node_mut(c, t);
    p.signal("TERM")?;
    let t0 = Instant::now();
    let deadline = DRAIN_TIMEOUT + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = p.guard.try_wait()? {
            break Some(s);
        }
        if t0.elapsed() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    match status {
        Some(s) if s.success() => row.claims.push(format!(
            "{} exited 0 {} after SIGTERM",
            p.host.name,
            secs(t0.elapsed())
        )),
        Some(s) => row.problems.push(format!(
            "{} exited with {s} after SIGTERM (a drain exits 0)",
            p.host.name
        )),
        None => row.problems.push(format!(
            "{} still runs {} after SIGTERM",
            p.host.name,
            secs(deadline)
        )),
    }
    // A decode node draining by migration (`node.drain = "migrate"`): the streams it moved.
    if let Some(m) = c.router_metrics().await {
        let moved = m
            .get("pdnode_router_migrations_total{outcome=\"ok\"}")
            .unwrap_or(0.0);
        if moved > 0.0 {
            row.claims.push(format!("{moved} streams moved (router)"));
        }
    }
    Ok(())
}

/// Whether every node owns nothing and runs nothing.
async fn all_idle(c: &Cluster) -> bool {
    for p in c.nodes() {
        if !held(p).await.is_some_and(|h| h.idle()) {
            return false;
        }
    }
    true
}

/// The router SIGKILLed: every node must drop what the dead router's requests held (streams
/// end with the connections, reservations at their transfer lease) within the lease and a
/// little slack; then the router starts again (it waits out its own stale key, at most one
/// lease TTL) and must see every node. Returns when it serves again.
pub async fn router_restart(
    net: &Net,
    c: &mut Cluster,
    lease: Duration,
    row: &mut Row,
) -> Result<Instant> {
    c.router.signal("KILL")?;
    let at = Instant::now();
    // Blocks go back at the lease end; a staging span one lease later (its writer may still
    // be pushing until then: docs/runtime-semantics.md); then a sweep.
    let limit = 2 * lease + Duration::from_secs(3);
    if wait_until(limit, || all_idle(c)).await {
        row.claims
            .push(format!("nodes idle {} after the kill", secs(at.elapsed())));
    } else {
        let mut held_now = Vec::new();
        for p in c.nodes() {
            held_now.push(format!("{}: {:?}", p.host.name, held(p).await));
        }
        row.problems.push(format!(
            "{} after the router died (transfer lease {}) nodes still hold its requests' state: {}",
            secs(limit),
            secs(lease),
            held_now.join(", ")
        ));
    }
    // The old guard reaps the killed process when replaced.
    c.router = c.spawn(net, Role::Router, net::ROUTER)?;
    let want = (c.prefill.len(), c.decode.len());
    if !wait_until(READY_DEADLINE, || async {
        c.router_nodes().await == Some(want)
    })
    .await
    {
        bail!("the restarted router did not serve with {want:?} nodes within {READY_DEADLINE:?}");
    }
    let back = Instant::now();
    row.claims.push(format!(
        "router serving again {} after the kill",
        secs(back - at)
    ));
    Ok(back)
}

/// Whether `p` has prefilled prompts: its prefix cache holds blocks (a finished prompt's KV
/// stays there), or it holds or runs requests now.
async fn served(p: &Proc) -> bool {
    let Some(m) = scrape(&p.metrics_url()).await else {
        return false;
    };
    let cached = m
        .get(&format!(
            "pdnode_kv_cached_blocks{{node=\"{}\"}}",
            p.host.name
        ))
        .unwrap_or(0.0);
    cached > 0.0 || crate::metrics::Held::of(&m, p.host.name).is_some_and(|h| !h.idle())
}

/// Waits until the router lists `want` prefill nodes and then until `p` served prompts. Being
/// in the view must happen within `limit` of `from`; serving too, or within [`ARRIVAL_SLACK`] of
/// the first request sent after the node entered the view: a node can only take traffic that
/// arrives, and a closed loop whose clients all wait on queued requests sends none. Past the limit the wait goes on
/// (up to [`JOIN_PATIENCE`]) so the row says how long it took, not only that it was late.
async fn joined(
    c: &Cluster,
    load: &Load,
    p: &Proc,
    from: Instant,
    limit: Duration,
    what: &str,
    row: &mut Row,
) {
    let want = c.prefill.len() + 1;
    let patience = limit.max(JOIN_PATIENCE);
    let in_view = wait_until(patience.saturating_sub(from.elapsed()), || async {
        c.router_nodes().await.is_some_and(|(n, _)| n == want)
    })
    .await;
    if !in_view {
        row.problems.push(format!(
            "{} not in the router's view {} after {what} (it shows {:?})",
            p.host.name,
            secs(patience),
            c.router_nodes().await
        ));
        return;
    }
    let t_view = from.elapsed();
    let sent_at_view = load.sent();
    // When the first request after the view was sent (sampled with the serving check).
    let mut arrival = None;
    let served_in_time = wait_until(patience.saturating_sub(from.elapsed()), || {
        if arrival.is_none() && load.sent() > sent_at_view {
            arrival = Some(from.elapsed());
        }
        served(p)
    })
    .await;
    if !served_in_time {
        row.problems.push(format!(
            "{} took no traffic within {} of {what} (in the view after {})",
            p.host.name,
            secs(patience),
            secs(t_view)
        ));
        return;
    }
    let t_served = from.elapsed();
    let arrival = arrival.unwrap_or(t_served);
    row.claims.push(format!(
        "{} in the view {} and serving {} after {what} (first request sent after it was in the view: {})",
        p.host.name,
        secs(t_view),
        secs(t_served),
        secs(arrival)
    ));
    if t_view > limit {
        row.problems.push(format!(
            "{} in the view {} after {what}, past the goal of {} (the lease TTL)",
            p.host.name,
            secs(t_view),
            secs(limit)
        ));
    } else if t_served > limit && t_served > arrival + ARRIVAL_SLACK {
        row.problems.push(format!(
            "{} served {} after {what}, past the goal of {} (the lease TTL; the first request after it was in the view was sent at {})",
            p.host.name,
            secs(t_served),
            secs(limit),
            secs(arrival)
        ));
    }
}

/// A third prefill host started under load: in the router's view and serving prompts within
/// one lease TTL of its start.
pub async fn prefill_join(net: &Net, c: &mut Cluster, load: &Load, row: &mut Row) -> Result<()> {
    let t0 = Instant::now();
    let p = c.spawn(net, Role::Prefill, net::SPARE_PREFILL)?;
    joined(c, load, &p, t0, LEASE_TTL, "its start", row).await;
    c.prefill.push(p);
    Ok(())
}

/// etcd SIGKILLed for `down`; `join_after` into the outage a third prefill host starts, and is
/// started again [`RESTART_SEC`] after each exit until it stays up (a node exits 1 when it
/// cannot reach the registry at start); etcd then starts again on its data directory. The
/// requests must all complete meanwhile (the case's `AllComplete`), and the new host must be
/// in the view and serving within one lease TTL of etcd's return.
pub async fn etcd_outage_join(
    net: &Net,
    c: &mut Cluster,
    load: &Load,
    down: Duration,
    join_after: Duration,
    row: &mut Row,
) -> Result<()> {
    c.etcd.signal("KILL")?;
    let at = Instant::now();
    tokio::time::sleep(join_after).await;
    let mut p = c.spawn(net, Role::Prefill, net::SPARE_PREFILL)?;
    let mut starts = 1u32;
    let mut exits = Vec::new();
    let mut restart_at = None;
    // Supervises the new node until `until`: restarts it after each exit.
    let mut supervise = |p: &mut Proc, c: &Cluster, starts: &mut u32| -> Result<()> {
        if let Some(t) = restart_at {
            if Instant::now() >= t {
                *p = c.spawn(net, Role::Prefill, net::SPARE_PREFILL)?;
                *starts += 1;
                restart_at = None;
            }
        } else if let Some(s) = p.guard.try_wait()? {
            if exits.len() < 3 {
                exits.push(s.to_string());
            }
            restart_at = Some(Instant::now() + RESTART_SEC);
        }
        Ok(())
    };
    while at.elapsed() < down {
        supervise(&mut p, c, &mut starts)?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The old guard reaps the killed etcd when replaced.
    c.etcd = c.respawn_etcd(net)?;
    if !c.etcd_ready(READY_DEADLINE).await {
        bail!("etcd did not come back on its data directory within {READY_DEADLINE:?}");
    }
    let back = Instant::now();
    // Until the node stays up and registered (or the deadline): keep supervising it.
    let want = c.prefill.len() + 1;
    while back.elapsed() < LEASE_TTL {
        supervise(&mut p, c, &mut starts)?;
        if c.router_nodes().await.is_some_and(|(n, _)| n == want) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    row.claims.push(format!(
        "{} started {starts}x in the outage{}",
        p.host.name,
        if exits.is_empty() {
            String::new()
        } else {
            format!(" (exits: {})", exits.join(", "))
        }
    ));
    joined(c, load, &p, back, LEASE_TTL, "etcd's return", row).await;
    // The nodes that were there before the outage are all still (or again) in the view:
    // checked after the load with the rest.
    c.prefill.push(p);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_shown_in_tenths_of_seconds() {
        assert_eq!(secs(Duration::from_millis(1234)), "1.2 s");
        assert_eq!(secs(Duration::ZERO), "0.0 s");
    }
}
