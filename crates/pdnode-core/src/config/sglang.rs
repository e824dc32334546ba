//! `[router.sglang]`: the router in front of SGLang prefill and decode HTTP workers (the drop-in
//! for sglang-router's PD mode; `pdnode sglang-router` maps that router's flags onto these keys).

use serde::{Deserialize, Serialize};

/// SGLang PD workers behind the router. With at least one prefill and one decode worker listed,
/// a `role = "router"` node forwards `/generate`, `/v1/completions` and `/v1/chat/completions`
/// to them instead of to pdnode nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SglangConfig {
    /// Also route to the SGLang workers registered in the registry (`registry.*`, cluster
    /// `node.cluster`) by `pdnode sglang-register`; they come and go with their cards.
    pub discover: bool,
    pub prefill: Vec<SglangPrefillWorker>,
    pub decode: Vec<SglangDecodeWorker>,
    /// Seconds between two `GET /health` probes of a worker.
    pub health_check_interval_s: u64,
    /// Deadline of one probe, seconds.
    pub health_check_timeout_s: u64,
    /// Consecutive failed probes that mark a worker unhealthy.
    pub health_failure_threshold: u32,
    /// Consecutive good probes that mark an unhealthy worker healthy again.
    pub health_success_threshold: u32,
    /// Attempts after the first, each with a new bootstrap room, while nothing was sent to the
    /// client yet.
    pub max_retries: u32,
    /// Consecutive failures of one cause that open a worker's breaker for that cause.
    pub breaker_failure_threshold: u32,
    /// Seconds an open breaker keeps its worker out before one trial request.
    pub breaker_timeout_s: u64,
    /// Largest request body accepted, bytes.
    pub max_payload_bytes: u64,
    /// Sent as `Authorization: Bearer <key>` on every request to a worker (sglang-router's
    /// `--api-key`); empty: the client's own `Authorization` header is forwarded.
    pub worker_api_key: String,
    /// A second listener that serves only `/metrics` (sglang-router's `--prometheus-host` /
    /// `--prometheus-port`); empty: none (`/metrics` is on `router.http_listen` either way).
    pub prometheus_listen: String,
}

impl Default for SglangConfig {
    fn default() -> Self {
        Self {
            discover: false,
            prefill: Vec::new(),
            decode: Vec::new(),
            health_check_interval_s: 60,
            health_check_timeout_s: 5,
            health_failure_threshold: 3,
            health_success_threshold: 2,
            max_retries: 5,
            breaker_failure_threshold: 10,
            breaker_timeout_s: 60,
            max_payload_bytes: 512 << 20,
            worker_api_key: String::new(),
            prometheus_listen: String::new(),
        }
    }
}

impl SglangConfig {
    /// Whether the router serves SGLang workers (both lists non-empty).
    pub fn enabled(&self) -> bool {
        self.discover || !self.prefill.is_empty() || !self.decode.is_empty()
    }
}

/// One SGLang prefill worker: its HTTP URL and the port of its KV bootstrap server (`None`:
/// the decode worker uses the prefill worker's default).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SglangPrefillWorker {
    pub url: String,
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

/// One SGLang decode worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SglangDecodeWorker {
    pub url: String,
}

/// `http://host:port` (or https), no path beyond `/`; the host part is what a decode worker
/// gets as `bootstrap_host`.
pub fn worker_url_host(url: &str) -> Option<&str> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))?;
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains('/') || authority.contains(char::is_whitespace) {
        return None;
    }
    if let Some(v6) = authority.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        let port_ok = after.is_empty() || after.strip_prefix(':').is_some_and(is_port);
        return (port_ok && !host.is_empty()).then_some(host);
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && is_port(port) && !host.contains(':') => {
            Some(host)
        }
        None => Some(authority),
        _ => None,
    }
}

fn is_port(p: &str) -> bool {
    p.parse::<u16>().is_ok_and(|n| n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_url_host_takes_the_host_of_well_formed_urls_only() {
        assert_eq!(worker_url_host("http://10.0.0.1:30000"), Some("10.0.0.1"));
        assert_eq!(
            worker_url_host("https://p0.example:443/"),
            Some("p0.example")
        );
        assert_eq!(worker_url_host("http://[::1]:8000"), Some("::1"));
        assert_eq!(worker_url_host("http://host"), Some("host"));
        for bad in [
            "10.0.0.1:30000",
            "http://",
            "http://h:0",
            "http://h:99999",
            "http://h:1/generate",
            "ftp://h:1",
            "http://[::1",
            "http://a b:1",
        ] {
            assert_eq!(worker_url_host(bad), None, "{bad}");
        }
    }
}
