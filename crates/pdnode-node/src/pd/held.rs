//! The KV capabilities of the requests a node runs, for `Abort` to check (docs/protocol.md,
//! "Capabilities"): a prefill node holds its target's capability while `Prefill` runs, a decode
//! node a claimed reservation's while the request decodes, a colocated node a reservation's for
//! the request's whole life. An entry lives as long as its [`Hold`]: whatever way the call or
//! the stream ends (answer, error, dropped by the router), the entry goes with it.

use pdnode_core::RequestId;
use pdnode_transfer::Secret;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What an `Abort` presenting a capability for a request finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Presented {
    /// No capability is held for the request here.
    Unknown,
    /// The capability matches (constant-time comparison).
    Matches,
    /// A capability is held and the presented one is not it.
    Wrong,
}

/// One held capability: the hold's serial, the capability, and whether an `Abort` presenting
/// it has stopped the request (`HeldCaps::stop`).
struct Entry {
    serial: u64,
    cap: Secret,
    stopped: Arc<AtomicBool>,
}

#[derive(Default)]
struct Inner {
    held: Mutex<HashMap<RequestId, Entry>>,
    serial: AtomicU64,
}

/// Capabilities by request; cheap to clone (shared).
#[derive(Clone, Default)]
pub(crate) struct HeldCaps(Arc<Inner>);

/// Keeps one request's capability in its [`HeldCaps`] until dropped.
#[must_use = "the capability is held only as long as this guard"]
pub(crate) struct Hold {
    caps: HeldCaps,
    id: RequestId,
    serial: u64,
    stopped: Arc<AtomicBool>,
}

impl HeldCaps {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<RequestId, Entry>> {
        self.0.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holds `cap` for `id` until the returned guard drops; `None` when a capability is held
    /// for `id` already (one request per id: a second call with the same id never takes the
    /// first one's place).
    pub(crate) fn try_hold(&self, id: RequestId, cap: Secret) -> Option<Hold> {
        let mut m = self.map();
        if m.contains_key(&id) {
            return None;
        }
        let serial = self.0.serial.fetch_add(1, Ordering::Relaxed);
        let stopped = Arc::new(AtomicBool::new(false));
        m.insert(
            id,
            Entry {
                serial,
                cap,
                stopped: stopped.clone(),
            },
        );
        Some(Hold {
            caps: self.clone(),
            id,
            serial,
            stopped,
        })
    }

    /// Whether `presented` is the capability held for `id`.
    pub(crate) fn check(&self, id: RequestId, presented: &[u8]) -> Presented {
        match self.map().get(&id) {
            None => Presented::Unknown,
            Some(e) if e.cap.matches(presented) => Presented::Matches,
            Some(_) => Presented::Wrong,
        }
    }

    /// [`HeldCaps::check`], and on a match marks the hold stopped ([`Hold::stopped`]): an
    /// `Abort` that is answered `true` must end the call even where the engine is done with
    /// the request already (a prefill handing its KV off).
    pub(crate) fn stop(&self, id: RequestId, presented: &[u8]) -> Presented {
        match self.map().get(&id) {
            None => Presented::Unknown,
            Some(e) if e.cap.matches(presented) => {
                e.stopped.store(true, Ordering::SeqCst);
                Presented::Matches
            }
            Some(_) => Presented::Wrong,
        }
    }

    /// Whether a capability is held for `id`.
    pub(crate) fn contains(&self, id: RequestId) -> bool {
        self.map().contains_key(&id)
    }

    /// How many capabilities are held.
    pub(crate) fn len(&self) -> usize {
        self.map().len()
    }
}

impl Hold {
    /// Whether an `Abort` presenting this capability stopped the request.
    pub(crate) fn stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut m = self.caps.map();
        if m.get(&self.id).is_some_and(|e| e.serial == self.serial) {
            m.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capability_is_held_as_long_as_its_guard_and_compared_exactly() {
        let caps = HeldCaps::default();
        let (a, b) = (Secret::random(), Secret::random());
        let id = RequestId(7);
        assert_eq!(caps.check(id, a.as_bytes()), Presented::Unknown);
        let g = caps.try_hold(id, a).unwrap();
        assert!(caps.contains(id));
        assert_eq!(caps.check(id, a.as_bytes()), Presented::Matches);
        assert_eq!(caps.check(id, b.as_bytes()), Presented::Wrong);
        assert_eq!(caps.check(id, &[]), Presented::Wrong);
        assert_eq!(caps.check(id, &a.as_bytes()[..15]), Presented::Wrong);
        assert_eq!(caps.check(RequestId(8), a.as_bytes()), Presented::Unknown);
        // One hold per id: a second one is refused and leaves the first in place.
        assert!(caps.try_hold(id, b).is_none());
        assert_eq!(caps.check(id, a.as_bytes()), Presented::Matches);
        // Checking stops nothing; a wrong capability stops nothing; the right one does.
        assert!(!g.stopped());
        assert_eq!(caps.stop(id, b.as_bytes()), Presented::Wrong);
        assert!(!g.stopped());
        assert_eq!(caps.stop(RequestId(8), a.as_bytes()), Presented::Unknown);
        assert_eq!(caps.stop(id, a.as_bytes()), Presented::Matches);
        assert!(g.stopped());
        drop(g);
        assert_eq!(caps.check(id, a.as_bytes()), Presented::Unknown);
        assert!(caps.map().is_empty());
        // Held again after the first went.
        let g2 = caps.try_hold(id, b).unwrap();
        assert!(!g2.stopped(), "a new hold starts unstopped");
        assert_eq!(caps.check(id, b.as_bytes()), Presented::Matches);
        drop(g2);
        assert!(!caps.contains(id));
    }
}
