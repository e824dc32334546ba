//! What a request holds while it runs: its booking on a node (the load the policies see), and
//! its prefill call's share of the `cost` policy's estimates. Both are released on drop, so
//! every way a request ends gives them back.

use super::Router;
use crate::membership::Worker;
use pdnode_core::NodeId;
use std::time::Instant;

/// A prefill call's share of the `cost` policy's estimates: its tokens in flight on P until it
/// ends, and its measured duration and hand-off when it answered ([`CostTicket::done`]).
pub(super) struct CostTicket<'a> {
    router: &'a Router,
    ticket: Option<super::cost::Ticket>,
}

impl<'a> CostTicket<'a> {
    pub(super) fn new(router: &'a Router, p: &Worker, tokens: usize) -> Self {
        let t = router.state.lock().cost.begin(p, tokens, Instant::now());
        Self {
            router,
            ticket: Some(t),
        }
    }

    /// No share: a prefill on the decode node itself is not a prefill node's work.
    pub(super) fn none(router: &'a Router) -> Self {
        Self {
            router,
            ticket: None,
        }
    }

    /// The prefill call starts now: its duration is measured from here.
    pub(super) fn prefill_starts(&mut self) {
        if let Some(t) = self.ticket.as_mut() {
            t.started = Instant::now();
        }
    }

    /// The call answered: `bytes` handed off to `d`, `us` after the prefill.
    pub(super) fn done(mut self, d: &Worker, bytes: u64, us: u64) {
        if let Some(t) = self.ticket.take() {
            let now = Instant::now();
            self.router
                .state
                .lock()
                .cost
                .end(t, Some((d, bytes, us)), now);
        }
    }
}

impl Drop for CostTicket<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.router.state.lock().cost.end(t, None, Instant::now());
        }
    }
}

/// Releases a booking on drop.
pub(super) struct Booking<'a> {
    router: &'a Router,
    node: std::sync::Mutex<NodeId>,
}

impl<'a> Booking<'a> {
    pub(super) fn new(router: &'a Router, node: &NodeId) -> Self {
        router.state.lock().book(node);
        Self {
            router,
            node: std::sync::Mutex::new(node.clone()),
        }
    }

    /// The booked request moved to `to` (a migrated stream).
    pub(super) fn move_to(&self, to: &NodeId) {
        let mut node = self.node.lock().unwrap_or_else(|p| p.into_inner());
        let mut st = self.router.state.lock();
        st.release(&node);
        st.book(to);
        *node = to.clone();
    }
}

impl Drop for Booking<'_> {
    fn drop(&mut self) {
        let node = self.node.get_mut().unwrap_or_else(|p| p.into_inner());
        self.router.state.lock().release(node);
    }
}
