//! Shared, lock-free facts several parts of a node read: the current load (written by the
//! EngineActor, read by the Registrar and the gRPC Stats call) and the node's health flags.

use pdnode_core::card::NodeCapacity;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::watch;

/// The latest load of the node's engine.
#[derive(Debug, Clone)]
pub struct LoadBoard {
    tx: Arc<watch::Sender<NodeCapacity>>,
}

impl LoadBoard {
    pub fn new(initial: NodeCapacity) -> Self {
        Self {
            tx: Arc::new(watch::channel(initial).0),
        }
    }

    pub fn publish(&self, cap: NodeCapacity) {
        self.tx.send_if_modified(|cur| {
            if *cur == cap {
                false
            } else {
                *cur = cap;
                true
            }
        });
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
}

impl HealthBoard {
    pub fn new() -> Self {
        Self {
            draining: Arc::new(AtomicBool::new(false)),
            failed: Arc::new(watch::channel(None).0),
        }
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
