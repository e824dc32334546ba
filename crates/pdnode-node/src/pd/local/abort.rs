//! `Abort` on a prefill or decode node: it needs the request's KV capability wherever the
//! node holds one (docs/protocol.md, "Capabilities").

use super::*;
use crate::pd::held::Presented;

/// What an abort found to stop (`PdNode::abort_checked`).
enum Aborting {
    /// Nothing of the request here.
    Unknown,
    /// `ReserveKv` still running: cancelled.
    Reserving,
    /// A reservation not claimed yet, taken out of the slots.
    Reserved(Box<DecodeSlot>),
    /// Prefilling or decoding under a matching capability.
    Running,
}

/// Aborts a request in the engine when dropped while armed (a call dropped midway).
pub(super) struct EngineAbortOnDrop<'a> {
    pub(super) engine: &'a EngineHandle,
    pub(super) id: RequestId,
    pub(super) armed: bool,
}

impl Drop for EngineAbortOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.engine.abort(self.id);
        }
    }
}

impl PdNode {
    /// What an abort of `id` presenting `capability` stops, checked under the locks that
    /// order a request's states (being reserved, reserved, running): a reservation or running
    /// request whose capability is not `capability` is refused (`PermissionDenied`) and goes
    /// on; a reservation is taken out of `slots` here.
    fn abort_checked(&self, id: RequestId, capability: &[u8]) -> Result<Aborting, NodeError> {
        let mut reserving = self.reserving.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = reserving.remove(&id) {
            // Under the lock: `ReserveKv` checks it under the same lock before it hands out
            // the reservation.
            t.cancel();
            return Ok(Aborting::Reserving);
        }
        let mut slots = self.slots();
        let presented = match slots.get(&id) {
            Some(s) if s.fsm.capability().matches(capability) => {
                return Ok(slots
                    .remove(&id)
                    .map_or(Aborting::Unknown, |s| Aborting::Reserved(Box::new(s))));
            }
            Some(_) => Presented::Wrong,
            None => self.held.stop(id, capability),
        };
        match presented {
            Presented::Unknown => Ok(Aborting::Unknown),
            Presented::Matches => Ok(Aborting::Running),
            Presented::Wrong => {
                tracing::warn!(request = %id, node = %self.id,
                    presented_len = capability.len(),
                    "abort refused: not the request's KV capability; the request goes on");
                Err(nerr(
                    ErrorKind::PermissionDenied,
                    format!(
                        "Abort of {id} on {}: not the request's KV capability (the request goes on)",
                        self.id
                    ),
                ))
            }
        }
    }

    /// Stops `id` if `capability` allows it (`NodeClient::abort`).
    pub(super) async fn do_abort(
        &self,
        id: RequestId,
        capability: Vec<u8>,
        reason: String,
    ) -> Result<bool, NodeError> {
        tracing::debug!(request = %id, %reason, node = %self.id, "abort");
        match self.abort_checked(id, &capability)? {
            Aborting::Unknown => return Ok(false),
            // No capability exists yet: only the router that sent this ReserveKv knows the
            // id (random, minted per attempt; the prefill node learns it with the target).
            // The wait ends at once, ReserveKv answers Cancelled and gives the blocks back.
            Aborting::Reserving => {}
            // A prefill node may still be putting into it: fenced until its writer's
            // record shows up or the fence deadline passes.
            Aborting::Reserved(slot) => self.release_staging(id, *slot, ReleaseCause::Abort),
            // Prefilling or decoding: the engine ends it, which ends the call or stream
            // (and the capability's hold with it).
            Aborting::Running => {}
        }
        // The engine frees whatever the request holds (queued, running, lease).
        self.engine.abort(id);
        Ok(true)
    }
}
