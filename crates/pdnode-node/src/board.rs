//! Shared, lock-free facts several parts of a node read: the current load (written by the
//! EngineActor, read by the Registrar and the gRPC Stats call) and the node's health flags.

use pdnode_core::Accounting;
use pdnode_core::card::NodeCapacity;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The latest load of the node's engine, and when the engine last reported it.
///
/// The EngineActor publishes after every load read that round-trips the engine thread; a read
/// that never comes back (the engine thread wedged) stops the publishing, and
/// [`LoadBoard::since_report`] grows: `Stats` and health go by it instead of trusting the last
/// load forever.
#[derive(Debug, Clone)]
pub struct LoadBoard {
    tx: Arc<watch::Sender<NodeCapacity>>,
    born: Instant,
    /// Milliseconds after `born` of the last report; `NEVER` before the first.
    reported_ms: Arc<AtomicU64>,
    /// Who holds the KV blocks and staging spans, as last read with the load.
    accounting: Arc<watch::Sender<Option<Accounting>>>,
}

const NEVER: u64 = u64::MAX;

impl LoadBoard {
    pub fn new(initial: NodeCapacity) -> Self {
        Self {
            tx: Arc::new(watch::channel(initial).0),
            born: Instant::now(),
            reported_ms: Arc::new(AtomicU64::new(NEVER)),
            accounting: Arc::new(watch::channel(None).0),
        }
    }

    /// The accounting read with the load (publish it before [`LoadBoard::publish`]).
    pub fn publish_accounting(&self, a: Option<Accounting>) {
        self.accounting.send_if_modified(|cur| {
            let changed = *cur != a;
            *cur = a;
            changed
        });
    }

    /// The last accounting read; `None` before the first or when the engine does not report it.
    pub fn accounting(&self) -> Option<Accounting> {
        *self.accounting.borrow()
    }

    /// The engine's load as just read (changed or not).
    pub fn publish(&self, cap: NodeCapacity) {
        let ms = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(NEVER - 1);
        self.reported_ms.store(ms, Ordering::Release);
        self.tx.send_if_modified(|cur| {
            if *cur == cap {
                false
            } else {
                *cur = cap;
                true
            }
        });
    }

    /// How long since the engine last reported; `None` before its first report (or on a node
    /// without an engine).
    pub fn since_report(&self) -> Option<Duration> {
        let ms = self.reported_ms.load(Ordering::Acquire);
        (ms != NEVER).then(|| {
            self.born
                .elapsed()
                .saturating_sub(Duration::from_millis(ms))
        })
    }

    /// Whether the engine reported once and then not for longer than `limit`.
    pub fn stalled(&self, limit: Duration) -> Option<Duration> {
        self.since_report().filter(|&age| age > limit)
    }

    pub fn current(&self) -> NodeCapacity {
        self.tx.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<NodeCapacity> {
        self.tx.subscribe()
    }
}

/// Health flags: draining (shutdown began) and failed (the supervisor gave up).
#[derive(Debug, Clone, Default)]
pub struct HealthBoard {
    draining: Arc<AtomicBool>,
    failed: Arc<watch::Sender<Option<String>>>,
    /// A drain asked over the node API (`Drain`, `pdnode drain`): `Some(migrate)`.
    drain_asked: Arc<watch::Sender<Option<bool>>>,
}

impl HealthBoard {
    pub fn new() -> Self {
        Self {
            draining: Arc::new(AtomicBool::new(false)),
            failed: Arc::new(watch::channel(None).0),
            drain_asked: Arc::new(watch::channel(None).0),
        }
    }

    /// `Drain` over the node API: the node shuts down gracefully (`migrate`: moving its
    /// decodes first). A second ask can only add `migrate`.
    pub fn ask_drain(&self, migrate: bool) {
        self.drain_asked
            .send_modify(|a| *a = Some(a.unwrap_or(false) || migrate));
    }

    /// Whether a drain was asked over the node API, and with `migrate`.
    pub fn drain_asked(&self) -> Option<bool> {
        *self.drain_asked.borrow()
    }

    /// Resolves once a drain was asked over the node API.
    pub async fn wait_drain_asked(&self) {
        let mut rx = self.drain_asked.subscribe();
        let _ = rx.wait_for(Option::is_some).await;
    }

    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    pub fn set_failed(&self, reason: String) {
        self.failed.send_replace(Some(reason));
    }

    pub fn failure(&self) -> Option<String> {
        self.failed.borrow().clone()
    }

    /// Resolves with the reason once the node failed.
    pub async fn wait_failed(&self) -> String {
        let mut rx = self.failed.subscribe();
        loop {
            if let Some(r) = rx.borrow_and_update().clone() {
                return r;
            }
            if rx.changed().await.is_err() {
                return "the health board was dropped".into();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_board_is_stalled_only_after_a_report_and_a_silence() {
        let b = LoadBoard::new(NodeCapacity::default());
        assert_eq!(b.since_report(), None);
        assert_eq!(b.stalled(Duration::ZERO), None, "no engine report yet");
        b.publish(NodeCapacity::default());
        let age = b.since_report().expect("reported");
        assert!(age < Duration::from_secs(1));
        assert_eq!(b.stalled(Duration::from_secs(60)), None);
        std::thread::sleep(Duration::from_millis(30));
        assert!(b.stalled(Duration::from_millis(10)).is_some());
        // An unchanged load still counts as a report.
        b.publish(NodeCapacity::default());
        assert!(b.since_report().expect("reported") < Duration::from_millis(30));
    }
}
