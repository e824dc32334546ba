//! The soak (`tests/cluster/soak.sh`): one cluster, closed-loop load at concurrency 64 for a
//! long time, no fault; every process's resident memory and open descriptors sampled. Passes
//! when every request completed, nothing is held afterwards, and no process grew 5 % or more
//! from the end of the warm-up to the end (descriptors: 5 % or more and more than 2).

use crate::cases::{CONCURRENCY, Case, Expect, Fault, Trigger};
use crate::cluster::{Cluster, Extra, Proc};
use crate::drive::{self, Injected, Row};
use crate::load::{Load, Spec};
use crate::net::Net;
use anyhow::Result;
use std::path::Path;
use std::time::{Duration, Instant};

/// Growth from the warm-up to the end that fails the soak.
const MAX_GROWTH: f64 = 0.05;
/// Descriptors may move by this many whatever the ratio (a connection reopened).
const FD_SLACK: u64 = 2;

/// One process's samples over the run.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    /// (seconds into the load, RSS bytes, open descriptors)
    pub samples: Vec<(f64, u64, u64)>,
}

fn rss_bytes(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

fn open_fds(pid: u32) -> Option<u64> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64)
}

/// The mean of `(rss, fds)` over `samples`.
fn mean(samples: &[(f64, u64, u64)]) -> Option<(f64, f64)> {
    if samples.is_empty() {
        return None;
    }
    let n = samples.len() as f64;
    let rss = samples.iter().map(|s| s.1 as f64).sum::<f64>() / n;
    let fds = samples.iter().map(|s| s.2 as f64).sum::<f64>() / n;
    Some((rss, fds))
}

/// (RSS at the warm-up, RSS at the end, descriptors at the warm-up, at the end): the means of
/// the first three samples from `warm` on and of the last three.
pub fn growth(s: &Series, warm: f64) -> Option<(f64, f64, f64, f64)> {
    let after: Vec<_> = s.samples.iter().copied().filter(|x| x.0 >= warm).collect();
    if after.len() < 4 {
        return None;
    }
    let k = 3.min(after.len() / 2);
    let (r0, f0) = mean(&after[..k])?;
    let (r1, f1) = mean(&after[after.len() - k..])?;
    Some((r0, r1, f0, f1))
}

/// RSS (MiB) of the sample closest to each `parts`-th of the run, "a / b / ...": whether a
/// growth levels off or keeps on.
fn trajectory(s: &Series, parts: usize) -> String {
    let Some(end) = s.samples.last().map(|x| x.0) else {
        return "-".into();
    };
    (1..=parts)
        .filter_map(|i| {
            let at = end * i as f64 / parts as f64;
            s.samples
                .iter()
                .min_by(|a, b| (a.0 - at).abs().total_cmp(&(b.0 - at).abs()))
                .map(|x| format!("{:.1}", x.1 as f64 / 1048576.0))
        })
        .collect::<Vec<_>>()
        .join(" / ")
}

/// Whether a process grew too much; the reason if so.
pub fn too_much(name: &str, (r0, r1, f0, f1): (f64, f64, f64, f64)) -> Option<String> {
    let rg = (r1 - r0) / r0.max(1.0);
    let fg = (f1 - f0) / f0.max(1.0);
    if rg >= MAX_GROWTH {
        return Some(format!(
            "{name}: RSS grew {:.1} % ({:.1} -> {:.1} MiB)",
            rg * 100.0,
            r0 / 1048576.0,
            r1 / 1048576.0
        ));
    }
    if fg >= MAX_GROWTH && f1 - f0 > FD_SLACK as f64 {
        return Some(format!("{name}: descriptors grew {f0:.0} -> {f1:.0}"));
    }
    None
}

pub async fn run(
    net: &Net,
    bin: &Path,
    repo: &Path,
    dir: &Path,
    duration: Duration,
    router_sets: &[String],
) -> Result<(Row, String)> {
    let t0 = Instant::now();
    let case = Case {
        name: "soak",
        what: "no fault, a long run",
        extra: Extra {
            router: router_sets.to_vec(),
            ..Extra::default()
        },
        max_tokens: 32,
        prompt_len: 64,
        trigger: Trigger::After(Duration::ZERO),
        fault: Fault::None,
        tail: Duration::ZERO,
        expect: Expect::AllComplete,
    };
    let c = Cluster::start(net, bin, repo, dir, &case.extra).await?;
    let procs: Vec<&Proc> = [&c.etcd, &c.router].into_iter().chain(c.nodes()).collect();
    let mut series: Vec<Series> = procs
        .iter()
        .map(|p| Series {
            name: p.host.name.to_string(),
            samples: Vec::new(),
        })
        .collect();
    let load = Load::start(Spec {
        url: c.router_url("/v1/completions"),
        concurrency: CONCURRENCY,
        max_tokens: case.max_tokens,
        prompt_len: case.prompt_len,
        keep_chunks: false,
        greedy: false,
    });
    let start = Instant::now();
    // About 60 samples, at most one every 10 s.
    let every = (duration / 60).clamp(Duration::from_secs(1), Duration::from_secs(10));
    // etcd's revision (every write pdnode makes bumps it) at each sample.
    let etcd_metrics = format!(
        "http://{}:{}/metrics",
        crate::net::ETCD.ip,
        crate::cluster::ETCD_PORT
    );
    let mut revisions: Vec<(f64, f64)> = Vec::new();
    // The router's cache_aware prefix tree (prompt tokens, tree nodes) at each sample: what it
    // keeps per placed prompt, to tell its growth from a leak.
    let mut tree: Vec<(f64, f64, f64)> = Vec::new();
    let metrics_url = c.router_url("/metrics");
    while start.elapsed() < duration {
        tokio::time::sleep(every).await;
        let at = start.elapsed().as_secs_f64();
        if let Some(rev) = crate::metrics::scrape(&etcd_metrics)
            .await
            .and_then(|m| m.get("etcd_debugging_mvcc_current_revision"))
        {
            revisions.push((at, rev));
        }
        if let Some(m) = crate::metrics::scrape(&metrics_url).await {
            let g = |n: &str| m.get(&format!("{n}{{role=\"prefill\"}}"));
            if let (Some(t), Some(n)) = (
                g("pdnode_router_prefix_tree_tokens"),
                g("pdnode_router_prefix_tree_nodes"),
            ) {
                tree.push((at, t, n));
            }
        }
        for (p, s) in procs.iter().zip(&mut series) {
            if let Some(pid) = p.guard.pid()
                && let (Some(r), Some(f)) = (rss_bytes(pid), open_fds(pid))
            {
                s.samples.push((at, r, f));
            }
        }
    }
    load.stop();
    let outcomes = load.finish().await;
    let mut row = Row {
        name: format!("soak {:.0} s", duration.as_secs_f64()),
        ..Row::default()
    };
    drive::tally(
        &mut row,
        &outcomes,
        Injected {
            at: start,
            back: None,
        },
    );
    // No fault: "from the fault to the last affected end" would be the run's length.
    row.fault_to_end = None;
    drive::check_after(&case, &c, &mut row).await;
    if row.failed + row.unclear + row.hung > 0 {
        row.problems.push(format!(
            "{} failed, {} unclear, {} hung in a run without a fault",
            row.failed, row.unclear, row.hung
        ));
    }
    // The warm-up: a third of the run. Pools, caches and connections fill first: at this load
    // (all-new 64-token prompts) the nodes' prefix caches fill their pools for ~4-5 minutes
    // and then hold their RSS flat (a 12-minute run: prefill 36 -> 54 MiB by 250 s, then
    // 54.1 to the end), so a tenth of a 30-minute run judged that fill as a leak.
    let warm = duration.as_secs_f64() / 3.0;
    let mut t = format!(
        "resources over the soak (mean of three samples at {warm:.0} s, the end of the warm-up (a third of the run), and at the end; a sample every {:.0} s)\n\
         | process | RSS at warm-up (MiB) | RSS at end (MiB) | RSS max (MiB) | RSS growth | fds at warm-up | fds at end | fds max | RSS at each sixth of the run (MiB) |\n\
         |---|---|---|---|---|---|---|---|---|\n",
        every.as_secs_f64()
    );
    for s in &series {
        let max_rss = s.samples.iter().map(|x| x.1).max().unwrap_or(0);
        let max_fds = s.samples.iter().map(|x| x.2).max().unwrap_or(0);
        match growth(s, warm) {
            Some(g @ (r0, r1, f0, f1)) => {
                // etcd is not pdnode: its growth is shown (with the revisions pdnode wrote,
                // below), not judged.
                if let Some(why) = too_much(&s.name, g).filter(|_| s.name != "etcd") {
                    row.problems.push(why);
                }
                t.push_str(&format!(
                    "| {} | {:.1} | {:.1} | {:.1} | {:+.1} % | {f0:.0} | {f1:.0} | {max_fds} | {} |\n",
                    s.name,
                    r0 / 1048576.0,
                    r1 / 1048576.0,
                    max_rss as f64 / 1048576.0,
                    (r1 - r0) / r0.max(1.0) * 100.0,
                    trajectory(s, 6),
                ));
            }
            None => row.problems.push(format!(
                "{}: too few samples after the warm-up ({})",
                s.name,
                s.samples.len()
            )),
        }
    }
    if !tree.is_empty() {
        let step = tree.len().div_ceil(6).max(1);
        let points: Vec<String> = tree
            .iter()
            .step_by(step)
            .chain(tree.last())
            .map(|(at, t, n)| format!("{at:.0} s: {t:.0} tokens / {n:.0} nodes"))
            .collect();
        t.push_str(&format!(
            "\nrouter prefix tree (cache_aware, prefill): {}\n",
            points.join("; ")
        ));
    }
    if let (Some(first), Some(last)) = (
        revisions.iter().find(|r| r.0 >= warm).or(revisions.first()),
        revisions.last(),
    ) {
        t.push_str(&format!(
            "etcd revision (writes to etcd): {:.0} at {:.0} s, {:.0} at {:.0} s; etcd's RSS is shown, not judged (not pdnode)\n",
            first.1, first.0, last.1, last.0
        ));
    }
    if !router_sets.is_empty() {
        t.push_str(&format!("router --set: {}\n", router_sets.join(" ")));
    }
    row.wall = t0.elapsed();
    if !row.passed() {
        eprintln!("soak: logs{}", c.logs());
    }
    Ok((row, t))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(v: &[(u64, u64)]) -> Series {
        Series {
            name: "p".into(),
            samples: v
                .iter()
                .enumerate()
                .map(|(i, &(r, f))| (i as f64 * 10.0, r, f))
                .collect(),
        }
    }

    #[test]
    fn growth_is_measured_from_the_warm_up_and_judged() {
        let flat = series(&[
            (50, 9),
            (100, 20),
            (100, 20),
            (101, 20),
            (100, 21),
            (102, 21),
        ]);
        let g = growth(&flat, 10.0).expect("enough samples");
        assert_eq!(g.0, 100.0, "the warm-up sample (50) is left out");
        assert!(too_much("p", g).is_none(), "{g:?}");
        let leak = series(&[
            (100, 20),
            (100, 20),
            (110, 20),
            (120, 20),
            (130, 20),
            (140, 20),
        ]);
        let g = growth(&leak, 0.0).expect("enough samples");
        assert!(too_much("p", g).is_some_and(|w| w.contains("RSS")), "{g:?}");
        let fds = series(&[
            (100, 20),
            (100, 20),
            (100, 20),
            (100, 40),
            (100, 40),
            (100, 40),
        ]);
        let g = growth(&fds, 0.0).expect("enough samples");
        assert!(
            too_much("p", g).is_some_and(|w| w.contains("descriptors")),
            "{g:?}"
        );
        assert!(growth(&series(&[(1, 1), (1, 1)]), 0.0).is_none());
        // Samples at 0, 10, .. 50 s: the fifths of the run are the samples at 10, .. 50 s.
        let mib = |m: u64| m * 1048576;
        let t = series(&[
            (mib(1), 1),
            (mib(2), 1),
            (mib(3), 1),
            (mib(4), 1),
            (mib(5), 1),
            (mib(6), 1),
        ]);
        assert_eq!(trajectory(&t, 5), "2.0 / 3.0 / 4.0 / 5.0 / 6.0");
        assert_eq!(trajectory(&series(&[]), 6), "-");
    }
}
