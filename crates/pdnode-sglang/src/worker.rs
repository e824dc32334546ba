//! One SGLang worker as the router sees it: its address, health (from periodic probes), one
//! breaker per failure cause, and the requests it has in flight. The health and breaker rules
//! are plain state machines, tested without a runtime.

use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerRole {
    Prefill,
    Decode,
}

impl WorkerRole {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }
}

/// What went wrong with a worker on one request. Each cause has its own breaker, so a worker
/// whose answers are malformed is not also counted as unreachable, and a decode failure never
/// counts against the prefill worker of the pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureCause {
    /// No connection, or the connection broke.
    Connect,
    /// No answer (or no next chunk) within its deadline.
    Timeout,
    /// An HTTP 5xx answer.
    ServerError,
    /// An answer that is not what the contract says (not JSON, a broken SSE line).
    Malformed,
}

impl FailureCause {
    pub const ALL: [FailureCause; 4] = [
        FailureCause::Connect,
        FailureCause::Timeout,
        FailureCause::ServerError,
        FailureCause::Malformed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailureCause::Connect => "connect",
            FailureCause::Timeout => "timeout",
            FailureCause::ServerError => "server_error",
            FailureCause::Malformed => "malformed",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A circuit breaker for one cause: opens after `threshold` consecutive failures, keeps the
/// worker out for `open_for`, then lets one trial request through (half-open): its success
/// closes the breaker, its failure opens it again. A trial whose outcome never comes (the request
/// ended before it reached the worker: the other side of its pair failed, the client left) lapses
/// after `open_for`, and the next caller gets a new trial: a lost trial never shuts a worker out
/// for good.
#[derive(Debug, Clone)]
pub struct Breaker {
    threshold: u32,
    open_for: Duration,
    consecutive: u32,
    open_until: Option<Instant>,
    /// When the trial in flight was taken.
    trial: Option<Instant>,
}

impl Breaker {
    pub fn new(threshold: u32, open_for: Duration) -> Self {
        Self {
            threshold: threshold.max(1),
            open_for,
            consecutive: 0,
            open_until: None,
            trial: None,
        }
    }

    /// Whether a request may go to the worker now; past the open time, the first caller gets
    /// the trial and later callers wait for its outcome (or for it to lapse).
    pub fn allows(&mut self, now: Instant) -> bool {
        match self.open_until {
            None => true,
            Some(until) if now < until => false,
            Some(_) if self.trial_in_flight(now) => false,
            Some(_) => {
                self.trial = Some(now);
                true
            }
        }
    }

    /// Read-only: whether the breaker is open (a trial in flight counts as open).
    pub fn is_open(&self, now: Instant) -> bool {
        match self.open_until {
            None => false,
            Some(until) => now < until || self.trial_in_flight(now),
        }
    }

    /// A trial taken less than `open_for` ago whose outcome has not come.
    fn trial_in_flight(&self, now: Instant) -> bool {
        matches!(self.trial, Some(at) if now < at + self.open_for)
    }

    pub fn success(&mut self) {
        self.consecutive = 0;
        self.open_until = None;
        self.trial = None;
    }

    /// Records a failure; true when it opened the breaker.
    pub fn failure(&mut self, now: Instant) -> bool {
        self.consecutive = self.consecutive.saturating_add(1);
        if self.trial.is_some() || self.consecutive >= self.threshold {
            self.trial = None;
            self.open_until = Some(now + self.open_for);
            return true;
        }
        false
    }
}

/// Health from periodic probes: `fail_threshold` failures in a row mark the worker
/// unhealthy, `ok_threshold` successes in a row mark it healthy again. A new worker is
/// unhealthy until its first good probe.
#[derive(Debug, Clone)]
pub struct Health {
    healthy: bool,
    ok_run: u32,
    fail_run: u32,
    fail_threshold: u32,
    ok_threshold: u32,
    seen: bool,
}

impl Health {
    pub fn new(fail_threshold: u32, ok_threshold: u32) -> Self {
        Self {
            healthy: false,
            ok_run: 0,
            fail_run: 0,
            fail_threshold: fail_threshold.max(1),
            ok_threshold: ok_threshold.max(1),
            seen: false,
        }
    }

    pub fn healthy(&self) -> bool {
        self.healthy
    }

    /// Records one probe; returns the new state when it changed.
    pub fn observe(&mut self, ok: bool) -> Option<bool> {
        let before = self.healthy;
        if ok {
            self.fail_run = 0;
            self.ok_run = self.ok_run.saturating_add(1);
            // The first probe that ever answers makes a new worker usable at once.
            if !self.seen || self.ok_run >= self.ok_threshold {
                self.healthy = true;
            }
            self.seen = true;
        } else {
            self.ok_run = 0;
            self.fail_run = self.fail_run.saturating_add(1);
            if self.fail_run >= self.fail_threshold {
                self.healthy = false;
            }
        }
        (self.healthy != before).then_some(self.healthy)
    }
}

/// What a worker said about itself (`GET /server_info`, `GET /model_info`).
#[derive(Debug, Clone, Default)]
pub struct WorkerInfo {
    pub server_info: Option<serde_json::Value>,
    pub model_info: Option<serde_json::Value>,
}

impl WorkerInfo {
    /// The model name clients use: `served_model_name`, else `model_path`.
    pub fn model_name(&self) -> Option<String> {
        let s = self.server_info.as_ref()?;
        ["served_model_name", "model_path"]
            .iter()
            .find_map(|k| s.get(k).and_then(|v| v.as_str()).map(str::to_string))
    }
}

struct WorkerState {
    health: Health,
    breakers: Vec<Breaker>,
    info: WorkerInfo,
}

/// One worker.
pub struct Worker {
    pub url: String,
    pub role: WorkerRole,
    /// Prefill workers: the host decode workers fetch KV from (the URL's host).
    pub bootstrap_host: String,
    pub bootstrap_port: Option<u16>,
    inflight: AtomicU32,
    retired: std::sync::atomic::AtomicBool,
    state: Mutex<WorkerState>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("url", &self.url)
            .field("role", &self.role)
            .finish()
    }
}

/// Thresholds of the health and breaker rules.
#[derive(Debug, Clone, Copy)]
pub struct WorkerRules {
    pub health_fail: u32,
    pub health_ok: u32,
    pub breaker_failures: u32,
    pub breaker_open_for: Duration,
}

impl Worker {
    pub fn new(
        url: &str,
        role: WorkerRole,
        bootstrap_host: String,
        bootstrap_port: Option<u16>,
        rules: WorkerRules,
    ) -> Arc<Self> {
        let breaker = Breaker::new(rules.breaker_failures, rules.breaker_open_for);
        Arc::new(Self {
            url: url.trim_end_matches('/').to_string(),
            role,
            bootstrap_host,
            bootstrap_port,
            inflight: AtomicU32::new(0),
            retired: std::sync::atomic::AtomicBool::new(false),
            state: Mutex::new(WorkerState {
                health: Health::new(rules.health_fail, rules.health_ok),
                breakers: vec![breaker; FailureCause::ALL.len()],
                info: WorkerInfo::default(),
            }),
        })
    }

    pub fn inflight(&self) -> u32 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// The worker left the router's list (its registry card went away): its probe loop stops;
    /// requests already on it finish.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    pub fn retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Books one request on the worker until the guard drops.
    pub fn book(self: &Arc<Self>) -> InflightGuard {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        InflightGuard(self.clone())
    }

    pub fn healthy(&self) -> bool {
        self.state.lock().health.healthy()
    }

    /// Healthy and no breaker open (read-only).
    pub fn usable(&self, now: Instant) -> bool {
        let s = self.state.lock();
        s.health.healthy() && !s.breakers.iter().any(|b| b.is_open(now))
    }

    /// Whether a request may go to the worker now (takes a half-open breaker's trial).
    pub fn admit(&self, now: Instant) -> bool {
        let mut s = self.state.lock();
        if !s.health.healthy() {
            return false;
        }
        // Every breaker must allow; check all first so a trial is not taken in vain.
        if s.breakers
            .iter()
            .any(|b| b.is_open(now) && !b.trial_due(now))
        {
            return false;
        }
        s.breakers.iter_mut().all(|b| b.allows(now))
    }

    pub fn observe_probe(&self, ok: bool) -> Option<bool> {
        self.state.lock().health.observe(ok)
    }

    pub fn success(&self) {
        for b in &mut self.state.lock().breakers {
            b.success();
        }
    }

    /// Records a failure of `cause`; true when it opened that breaker.
    pub fn failure(&self, cause: FailureCause, now: Instant) -> bool {
        self.state.lock().breakers[cause.index()].failure(now)
    }

    /// The causes whose breakers are open now.
    pub fn open_breakers(&self, now: Instant) -> Vec<FailureCause> {
        let s = self.state.lock();
        FailureCause::ALL
            .into_iter()
            .filter(|c| s.breakers[c.index()].is_open(now))
            .collect()
    }

    pub fn info(&self) -> WorkerInfo {
        self.state.lock().info.clone()
    }

    pub fn set_info(&self, info: WorkerInfo) {
        self.state.lock().info = info;
    }
}

impl Breaker {
    /// Open, past its open time, and no trial in flight.
    fn trial_due(&self, now: Instant) -> bool {
        matches!(self.open_until, Some(until) if now >= until) && !self.trial_in_flight(now)
    }
}

/// Keeps one request booked on a worker.
pub struct InflightGuard(Arc<Worker>);

impl InflightGuard {
    pub fn worker(&self) -> &Arc<Worker> {
        &self.0
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breaker_opens_after_threshold_then_one_trial() {
        let t0 = Instant::now();
        let mut b = Breaker::new(3, Duration::from_secs(10));
        assert!(b.allows(t0));
        assert!(!b.failure(t0));
        assert!(!b.failure(t0));
        b.success();
        assert!(!b.failure(t0), "a success resets the run");
        assert!(!b.failure(t0));
        assert!(b.failure(t0), "third in a row opens");
        assert!(!b.allows(t0 + Duration::from_secs(9)));
        let t1 = t0 + Duration::from_secs(10);
        assert!(b.allows(t1), "the trial");
        assert!(!b.allows(t1), "one trial at a time");
        assert!(b.failure(t1), "a failed trial opens again at once");
        assert!(!b.allows(t1 + Duration::from_secs(5)));
        let t2 = t1 + Duration::from_secs(10);
        assert!(b.allows(t2));
        b.success();
        assert!(b.allows(t2) && b.allows(t2), "closed after a good trial");
    }

    #[test]
    fn a_trial_whose_outcome_never_comes_lapses() {
        let t0 = Instant::now();
        let open = Duration::from_secs(10);
        let mut b = Breaker::new(1, open);
        assert!(b.failure(t0));
        let t1 = t0 + open;
        assert!(b.allows(t1), "the trial");
        // Its request ends before the worker answers: nothing is recorded.
        assert!(!b.allows(t1 + open - Duration::from_millis(1)) && b.is_open(t1 + open / 2));
        let t2 = t1 + open;
        assert!(!b.is_open(t2), "the lost trial lapsed");
        assert!(b.allows(t2), "a new trial");
        assert!(!b.allows(t2), "one at a time again");
        b.success();
        assert!(!b.is_open(t2) && b.allows(t2));
    }

    #[test]
    fn health_needs_runs_of_probes() {
        let mut h = Health::new(3, 2);
        assert!(!h.healthy(), "unknown until probed");
        assert_eq!(
            h.observe(true),
            Some(true),
            "the first answer makes it usable"
        );
        assert_eq!(h.observe(false), None);
        assert_eq!(h.observe(false), None);
        assert_eq!(h.observe(false), Some(false));
        assert_eq!(
            h.observe(true),
            None,
            "one success is not enough to come back"
        );
        assert_eq!(h.observe(true), Some(true));
    }

    #[test]
    fn causes_are_separate_and_admit_takes_one_trial() {
        let rules = WorkerRules {
            health_fail: 1,
            health_ok: 1,
            breaker_failures: 1,
            breaker_open_for: Duration::from_secs(5),
        };
        let w = Worker::new("http://h:1/", WorkerRole::Decode, "h".into(), None, rules);
        assert_eq!(w.url, "http://h:1");
        let t0 = Instant::now();
        assert!(!w.admit(t0), "not probed yet");
        w.observe_probe(true);
        assert!(w.admit(t0));
        assert!(w.failure(FailureCause::Malformed, t0));
        assert_eq!(w.open_breakers(t0), vec![FailureCause::Malformed]);
        assert!(!w.usable(t0) && !w.admit(t0));
        let t1 = t0 + Duration::from_secs(5);
        assert!(w.admit(t1));
        assert!(!w.admit(t1), "the trial is taken");
        w.success();
        assert!(w.admit(t1));
        let g = w.book();
        assert_eq!(w.inflight(), 1);
        drop(g);
        assert_eq!(w.inflight(), 0);
    }
}
