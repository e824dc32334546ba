//! The pairing benchmark (`tests/cluster/run.sh --pairing SECONDS`; issue 21, "pairing by
//! cost"): the cluster with one slow pair, the same load under each prefill policy, TTFT p50 /
//! p99 and where the prompts went. A benchmark, not a test: it prints figures and passes or
//! fails nothing on them.
//!
//! The slow pair: prefill0 -> decode0's KV pushes go over their direct link (`net::KV_LINK`),
//! whose egress on prefill0 a token bucket (`tc ... tbf`; this kernel has no netem) holds to
//! [`SLOW_RATE`]; every other pair, and every other message, goes over the bridge at full
//! speed. The mock engines (100 us a prompt token) hand off their real, small KV pool over UCX
//! `tcp` (32 bytes a token: 2 layers, 1 head of 2 values, f32), so a 1000-token prompt's 32 KB
//! take ~130 ms over the slow link and well under a millisecond elsewhere.

use crate::cluster::{Cluster, Extra};
use crate::load::{End, Load, Spec};
use crate::net::{self, Net};
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// prefill0 -> decode0 (the KV link's egress on prefill0).
pub const SLOW_RATE: &str = "2mbit";
/// The prefill policies compared (the decode policy is `power_of_two`, the default, in all).
pub const POLICIES: [&str; 3] = ["round_robin", "cache_aware", "cost"];
/// Clients: light load (the prefill nodes mostly idle: what the link adds shows in every
/// figure), and saturated (queues dominate: a closed loop's mean TTFT is clients / throughput,
/// whatever the link, and the slow pair shows in the tail).
const CONCURRENCY: [usize; 2] = [2, 8];
const PROMPT_LEN: usize = 1000;
/// One prompt's KV in the mock engine's pool: 32 bytes a token, whole 16-token blocks.
const PROMPT_KV_BYTES: usize = PROMPT_LEN.div_ceil(16) * 16 * 32;
/// Load before the measured window (the policies learn, queues settle).
const WARM: Duration = Duration::from_secs(5);

fn tc(args: &[&str]) -> Result<()> {
    let out = Command::new("tc")
        .args(args)
        .output()
        .context("running tc")?;
    if !out.status.success() {
        bail!(
            "tc {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// One policy's figures.
pub struct Row {
    pub policy: &'static str,
    pub clients: usize,
    pub completed: usize,
    pub failed: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub ttft_mean_ms: f64,
    /// Hand-offs over the slow pair in the whole run: the bytes prefill0 sent over the KV link
    /// over one prompt's KV bytes.
    pub slow_pair: f64,
    /// Hand-offs each prefill node made in the whole run (the router's counter).
    pub handoffs: [f64; 2],
}

fn pct(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Runs each policy for `window` after the warm-up; one row each.
pub async fn run(
    net_: &Net,
    bin: &Path,
    repo: &Path,
    dir: &Path,
    window: Duration,
) -> Result<Vec<Row>> {
    let ns = net_.ns(net::KV_LINK.a.name);
    let mut rows = Vec::new();
    for (clients, policy) in CONCURRENCY
        .into_iter()
        .flat_map(|c| POLICIES.map(|p| (c, p)))
    {
        let extra = Extra {
            prefill: vec!["engine.mock.prefill_us_per_token=100".into()],
            decode: vec![
                "engine.mock.decode_us_per_token=2000".into(),
                "engine.mock.output_len=8".into(),
            ],
            router: vec![
                format!("router.prefill_policy=\"{policy}\""),
                "router.decode_policy=\"power_of_two\"".into(),
            ],
            ..Extra::default()
        };
        let c = Cluster::start(
            net_,
            bin,
            repo,
            &dir.join(format!("{policy}-{clients}")),
            &extra,
        )
        .await?;
        tc(&[
            "-n",
            &ns,
            "qdisc",
            "add",
            "dev",
            net::KV_LINK.name,
            "root",
            "tbf",
            "rate",
            SLOW_RATE,
            "burst",
            "4kb",
            "latency",
            "5s",
        ])?;
        let tx0 = net_.link_tx_bytes(net::KV_LINK)?;
        let load = Load::start(Spec {
            url: c.router_url("/v1/completions"),
            concurrency: clients,
            max_tokens: 8,
            prompt_len: PROMPT_LEN,
            keep_chunks: false,
            greedy: false,
        });
        tokio::time::sleep(WARM).await;
        let from = Instant::now();
        tokio::time::sleep(window).await;
        load.stop();
        let outs = load.finish().await;
        let m = crate::metrics::scrape(&c.router_url("/metrics"))
            .await
            .unwrap_or_default();
        let handoffs = net::PREFILL.map(|h| {
            m.get(&format!(
                "pdnode_transfer_handoffs_total{{node=\"{}\",outcome=\"ok\"}}",
                h.name
            ))
            .unwrap_or(0.0)
        });
        let slow_pair =
            net_.link_tx_bytes(net::KV_LINK)?.saturating_sub(tx0) as f64 / PROMPT_KV_BYTES as f64;
        let _ = tc(&["-n", &ns, "qdisc", "del", "dev", net::KV_LINK.name, "root"]);
        drop(c);
        let measured: Vec<_> = outs.iter().filter(|o| o.sent >= from).collect();
        let mut ttft: Vec<f64> = measured
            .iter()
            .filter(|o| o.end == End::Completed)
            .filter_map(|o| o.chunks.first().map(|c| (*c - o.sent).as_secs_f64() * 1e3))
            .collect();
        ttft.sort_by(f64::total_cmp);
        rows.push(Row {
            policy,
            clients,
            completed: ttft.len(),
            failed: measured.len() - ttft.len(),
            ttft_p50_ms: pct(&ttft, 0.5),
            ttft_p99_ms: pct(&ttft, 0.99),
            ttft_mean_ms: ttft.iter().sum::<f64>() / ttft.len().max(1) as f64,
            slow_pair,
            handoffs,
        });
        eprintln!(
            "cluster: pairing {policy}, {clients} clients: {} completed, TTFT p50 {:.0} ms p99 {:.0} ms",
            ttft.len(),
            pct(&ttft, 0.5),
            pct(&ttft, 0.99)
        );
    }
    Ok(rows)
}

pub fn table(rows: &[Row], window: Duration) -> String {
    let mut s = format!(
        "prefill0 -> decode0 KV link at {SLOW_RATE}, the other pairs unlimited; \
         {PROMPT_LEN}-token prompts, 8 output tokens; {:.0} s measured after {:.0} s\n\
         | clients | prefill policy | completed | failed | TTFT p50 (ms) | TTFT p99 (ms) | TTFT mean (ms) | hand-offs prefill0 / prefill1 | of them over the slow pair (KV link bytes / one prompt's KV) |\n\
         |---|---|---|---|---|---|---|---|---|\n",
        window.as_secs_f64(),
        WARM.as_secs_f64()
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} / {:.0} | {:.0} |\n",
            r.clients,
            r.policy,
            r.completed,
            r.failed,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.ttft_mean_ms,
            r.handoffs[0],
            r.handoffs[1],
            r.slow_pair
        ));
    }
    s
}
