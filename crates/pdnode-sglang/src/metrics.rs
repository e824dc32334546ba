//! Prometheus metrics of the SGLang router (`/metrics`, and the `--prometheus-port` listener).

use crate::worker::{FailureCause, Worker};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Arc;
use std::time::Instant;

pub const REQUESTS_TOTAL: &str = "pdnode_sglang_requests_total";
pub const RETRIES_TOTAL: &str = "pdnode_sglang_retries_total";
pub const WORKER_FAILURES_TOTAL: &str = "pdnode_sglang_worker_failures_total";
pub const BREAKER_OPENS_TOTAL: &str = "pdnode_sglang_breaker_opens_total";
pub const STREAMS_FAILED_TOTAL: &str = "pdnode_sglang_streams_failed_total";
pub const CLIENTS_GONE_TOTAL: &str = "pdnode_sglang_clients_gone_total";
pub const WORKER_HEALTHY: &str = "pdnode_sglang_worker_healthy";
pub const WORKER_INFLIGHT: &str = "pdnode_sglang_worker_inflight_requests";
pub const WORKER_BREAKER_OPEN: &str = "pdnode_sglang_worker_breaker_open";

#[derive(Default)]
pub struct Metrics {
    /// (route, status) -> count.
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    retries: Mutex<u64>,
    /// (worker url, cause) -> count.
    failures: Mutex<BTreeMap<(String, &'static str), u64>>,
    breaker_opens: Mutex<BTreeMap<(String, &'static str), u64>>,
    streams_failed: Mutex<u64>,
    clients_gone: Mutex<u64>,
}

impl Metrics {
    pub fn request(&self, route: &'static str, status: u16) {
        *self.requests.lock().entry((route, status)).or_default() += 1;
    }

    pub fn retry(&self) {
        *self.retries.lock() += 1;
    }

    pub fn stream_failed(&self) {
        *self.streams_failed.lock() += 1;
    }

    /// A streaming client stopped reading for `router.client_send_timeout_s`: its stream was
    /// cut and its slot freed.
    pub fn client_gone(&self) {
        *self.clients_gone.lock() += 1;
    }

    pub fn worker_failure(&self, url: &str, cause: FailureCause, opened: bool) {
        let key = (url.to_string(), cause.as_str());
        *self.failures.lock().entry(key.clone()).or_default() += 1;
        if opened {
            *self.breaker_opens.lock().entry(key).or_default() += 1;
        }
    }

    pub fn render(&self, workers: &[Arc<Worker>]) -> String {
        let mut out = String::new();
        let now = Instant::now();
        let _ = writeln!(out, "# TYPE {REQUESTS_TOTAL} counter");
        for ((route, status), n) in self.requests.lock().iter() {
            let _ = writeln!(
                out,
                "{REQUESTS_TOTAL}{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        let _ = writeln!(out, "# TYPE {RETRIES_TOTAL} counter");
        let _ = writeln!(out, "{RETRIES_TOTAL} {}", *self.retries.lock());
        let _ = writeln!(out, "# TYPE {STREAMS_FAILED_TOTAL} counter");
        let _ = writeln!(
            out,
            "{STREAMS_FAILED_TOTAL} {}",
            *self.streams_failed.lock()
        );
        let _ = writeln!(out, "# TYPE {CLIENTS_GONE_TOTAL} counter");
        let _ = writeln!(out, "{CLIENTS_GONE_TOTAL} {}", *self.clients_gone.lock());
        for (name, map) in [
            (WORKER_FAILURES_TOTAL, &self.failures),
            (BREAKER_OPENS_TOTAL, &self.breaker_opens),
        ] {
            let _ = writeln!(out, "# TYPE {name} counter");
            for ((url, cause), n) in map.lock().iter() {
                let _ = writeln!(out, "{name}{{worker=\"{url}\",cause=\"{cause}\"}} {n}");
            }
        }
        for (name, kind) in [
            (WORKER_HEALTHY, "gauge"),
            (WORKER_INFLIGHT, "gauge"),
            (WORKER_BREAKER_OPEN, "gauge"),
        ] {
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for w in workers {
                let labels = format!("worker=\"{}\",role=\"{}\"", w.url, w.role.as_str());
                match name {
                    WORKER_HEALTHY => {
                        let _ = writeln!(out, "{name}{{{labels}}} {}", u8::from(w.healthy()));
                    }
                    WORKER_INFLIGHT => {
                        let _ = writeln!(out, "{name}{{{labels}}} {}", w.inflight());
                    }
                    _ => {
                        let open = w.open_breakers(now);
                        for c in FailureCause::ALL {
                            let v = u8::from(open.contains(&c));
                            let _ =
                                writeln!(out, "{name}{{{labels},cause=\"{}\"}} {v}", c.as_str());
                        }
                    }
                }
            }
        }
        out
    }
}
