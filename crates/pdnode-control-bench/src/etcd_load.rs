//! etcd's load: its gRPC counters from `/metrics` (requests by method, keepalive messages and
//! streams) and the CPU time of processes from `/proc`.

use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::time::Duration;

/// etcd's gRPC counters at one moment, by method.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GrpcCounters {
    /// `grpc_server_msg_received_total` by `grpc_method`: every request message (a unary call,
    /// each message on a stream).
    pub received: BTreeMap<String, f64>,
    /// `grpc_server_started_total` by `grpc_method`: calls and streams opened.
    pub started: BTreeMap<String, f64>,
}

impl GrpcCounters {
    pub fn parse(text: &str) -> Self {
        let mut c = Self::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.trim().rsplit_once(' ') else {
                continue;
            };
            let Ok(v) = value.parse::<f64>() else {
                continue;
            };
            let map = if series.starts_with("grpc_server_msg_received_total{") {
                &mut c.received
            } else if series.starts_with("grpc_server_started_total{") {
                &mut c.started
            } else {
                continue;
            };
            if let Some(m) = label(series, "grpc_method") {
                *map.entry(m.to_string()).or_default() += v;
            }
        }
        c
    }

    /// Per-second rates from `self` to `later`, by method (received messages).
    pub fn rates(&self, later: &Self, over: Duration) -> Rates {
        let secs = over.as_secs_f64().max(1e-9);
        let diff = |a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>| {
            b.iter()
                .map(|(k, v)| (k.clone(), (v - a.get(k).copied().unwrap_or(0.0)) / secs))
                .filter(|(_, r)| *r > 0.0)
                .collect::<BTreeMap<_, _>>()
        };
        Rates {
            received: diff(&self.received, &later.received),
            started: diff(&self.started, &later.started),
        }
    }
}

/// Per-second rates by gRPC method.
#[derive(Debug, Clone, Default)]
pub struct Rates {
    pub received: BTreeMap<String, f64>,
    pub started: BTreeMap<String, f64>,
}

impl Rates {
    pub fn total_received(&self) -> f64 {
        self.received.values().sum()
    }

    pub fn keepalives(&self) -> f64 {
        self.received.get("LeaseKeepAlive").copied().unwrap_or(0.0)
    }

    pub fn keepalive_streams(&self) -> f64 {
        self.started.get("LeaseKeepAlive").copied().unwrap_or(0.0)
    }
}

/// The value of label `name` in a series `metric{a="x",b="y"}`.
fn label<'a>(series: &'a str, name: &str) -> Option<&'a str> {
    let inner = series.split_once('{')?.1.strip_suffix('}')?;
    inner.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == name).then(|| v.trim_matches('"'))
    })
}

pub async fn scrape(endpoint: &str) -> Result<GrpcCounters> {
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(5))
        .build()?;
    let text = client
        .get(format!("{endpoint}/metrics"))
        .send()
        .await
        .context("etcd /metrics")?
        .text()
        .await?;
    Ok(GrpcCounters::parse(&text))
}

/// CPU time (user + system) a process used so far, from `/proc/PID/stat`.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: count fields after its closing paren.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the paren: state is field 3, so utime (14) and stime (15) are at 11 and 12.
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf takes a constant and touches no memory of ours.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = u64::try_from(hz).ok().filter(|h| *h > 0)?;
    Some(Duration::from_micros(ticks * 1_000_000 / hz))
}

/// Resident memory of a process, bytes (`VmRSS` of `/proc/PID/status`).
pub fn rss_bytes(pid: u32) -> Option<u64> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_summed_by_method_and_turned_into_rates() {
        let a = GrpcCounters::parse(
            "# HELP x\n\
             grpc_server_msg_received_total{grpc_method=\"LeaseKeepAlive\",grpc_service=\"etcdserverpb.Lease\",grpc_type=\"bidi_stream\"} 100\n\
             grpc_server_started_total{grpc_method=\"LeaseKeepAlive\",grpc_service=\"etcdserverpb.Lease\",grpc_type=\"bidi_stream\"} 50\n\
             grpc_server_msg_received_total{grpc_method=\"Range\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 7\n\
             other_metric 3\n",
        );
        assert_eq!(a.received.get("LeaseKeepAlive"), Some(&100.0));
        assert_eq!(a.started.get("LeaseKeepAlive"), Some(&50.0));
        let mut b = a.clone();
        b.received.insert("LeaseKeepAlive".into(), 300.0);
        b.started.insert("LeaseKeepAlive".into(), 150.0);
        let r = a.rates(&b, Duration::from_secs(2));
        assert_eq!(r.keepalives(), 100.0);
        assert_eq!(r.keepalive_streams(), 50.0);
        assert_eq!(r.total_received(), 100.0, "Range did not move: no rate");
    }

    #[test]
    fn this_process_has_cpu_time_and_memory() {
        let me = std::process::id();
        assert!(cpu_time(me).is_some());
        assert!(rss_bytes(me).is_some_and(|b| b > 0));
        assert!(cpu_time(u32::MAX).is_none());
    }
}
