//! Prefill side: pushing one request's KV to a decode target.
//!
//! ```text
//! Received --check_layout--> Checked --layers_ready--> Pushing --(all puts done)--> Flushing
//!   --flushed--> Flushed --done_signalled--> Done
//! any open state --abort--> Aborted; --peer_gone / put or flush error / deadline--> Failed
//! ```
//! The source blocks are released exactly once, by [`Push::poll`], when the push is over *and*
//! no put is still reading them (an abort while puts are in flight waits for them).

use super::{DoneStatus, KvTarget, Placement};
use crate::TransferError;
use crate::region::{PoolGeometry, Span, direct_spans, staging_spans};
use pdnode_core::{BlockId, KvLayout};
use std::ops::Range;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushState {
    Received,
    Checked,
    Pushing,
    Flushing,
    Flushed,
    Done,
    Failed,
    Aborted,
}

impl PushState {
    pub fn name(self) -> &'static str {
        match self {
            PushState::Received => "received",
            PushState::Checked => "checked",
            PushState::Pushing => "pushing",
            PushState::Flushing => "flushing",
            PushState::Flushed => "flushed",
            PushState::Done => "done",
            PushState::Failed => "failed",
            PushState::Aborted => "aborted",
        }
    }

    fn is_terminal(self) -> bool {
        matches!(
            self,
            PushState::Done | PushState::Failed | PushState::Aborted
        )
    }
}

/// One put: layers `layers`, gathered into local staging first when `staged`, as `spans`
/// (local offsets into the staging region when staged, else into the local pool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutPlan {
    pub layers: Range<u32>,
    pub staged: bool,
    pub spans: Vec<Span>,
}

/// How the push ended: what to tell decode (KvDone) and that the source blocks may go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushRelease {
    pub status: DoneStatus,
    /// Whether decode still needs a KvDone with `status` (it was not signalled yet).
    pub notify_decode: bool,
}

#[derive(Debug)]
pub struct Push {
    target: KvTarget,
    src: Vec<BlockId>,
    src_geo: PoolGeometry,
    layers_per_put: u32,
    deadline: Instant,
    state: PushState,
    next_layer: u32,
    in_flight: u32,
    end: Option<PushRelease>,
    released: bool,
}

impl Push {
    /// A push of `src` blocks (prompt order) of the local pool `src_geo` to `target`, one put
    /// per `layers_per_put` layers, to finish before `deadline` (before decode's lease ends).
    pub fn received(
        target: KvTarget,
        src: Vec<BlockId>,
        src_geo: PoolGeometry,
        layers_per_put: u32,
        deadline: Instant,
    ) -> Self {
        Push {
            target,
            src,
            src_geo,
            layers_per_put: layers_per_put.max(1),
            deadline,
            state: PushState::Received,
            next_layer: 0,
            in_flight: 0,
            end: None,
            released: false,
        }
    }

    pub fn state(&self) -> PushState {
        self.state
    }
    pub fn target(&self) -> &KvTarget {
        &self.target
    }
    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    fn bad(&self, event: &'static str) -> TransferError {
        if self.state.is_terminal() {
            TransferError::LateEvent {
                request: self.target.request,
                event,
                state: self.state.name(),
            }
        } else {
            TransferError::BadTransition {
                request: self.target.request,
                event,
                state: self.state.name(),
            }
        }
    }

    fn fail(&mut self, e: TransferError, notify_decode: bool) -> TransferError {
        if !self.state.is_terminal() {
            self.state = PushState::Failed;
            self.end = Some(PushRelease {
                status: DoneStatus::Failed(e.to_string()),
                notify_decode,
            });
        }
        e
    }

    /// Compares the target's layout with ours (fails fast naming the field) and the block
    /// counts.
    pub fn check_layout(&mut self, ours: &KvLayout) -> Result<(), TransferError> {
        if self.state != PushState::Received {
            return Err(self.bad("check_layout"));
        }
        if let Err(mismatch) = ours.check_compatible(&self.target.layout) {
            let e = TransferError::LayoutMismatch {
                request: self.target.request,
                mismatch,
            };
            return Err(self.fail(e, true));
        }
        let blb = ours.block_layer_bytes() as u64;
        if self.src.len() != self.target.blocks.len() || self.src_geo.block_layer_bytes != blb {
            let e = TransferError::Geometry {
                reason: format!(
                    "{} source blocks for {} destination blocks",
                    self.src.len(),
                    self.target.blocks.len()
                ),
            };
            return Err(self.fail(e, true));
        }
        self.state = PushState::Checked;
        Ok(())
    }

    /// Layers `0..upto` are computed: returns the puts to issue now (whole groups, and the
    /// last partial group once every layer is ready). The caller issues each and reports it
    /// with [`Push::put_finished`].
    pub fn layers_ready(&mut self, upto: u32, now: Instant) -> Result<Vec<PutPlan>, TransferError> {
        if !matches!(self.state, PushState::Checked | PushState::Pushing) {
            return Err(self.bad("layers_ready"));
        }
        if now >= self.deadline {
            let e = TransferError::Timeout {
                what: format!("push of {}", self.target.request),
            };
            return Err(self.fail(e, true));
        }
        let num_layers = self.target.layout.num_layers;
        let upto = upto.min(num_layers);
        self.state = PushState::Pushing;
        let mut plans = Vec::new();
        while self.next_layer < upto {
            let end = (self.next_layer + self.layers_per_put).min(num_layers);
            if end > upto {
                break;
            }
            let layers = self.next_layer..end;
            let plan = match self.target.placement {
                Placement::Staging { offset } => PutPlan {
                    layers: layers.clone(),
                    staged: true,
                    spans: vec![staging_spans(&self.src_geo, self.src.len(), layers, offset)],
                },
                Placement::Pool { .. } => {
                    let dst_geo = self.target.pool_geometry().ok_or(TransferError::Geometry {
                        reason: "pool placement without geometry".into(),
                    })?;
                    let spans = direct_spans(
                        &self.src_geo,
                        &self.src,
                        &dst_geo,
                        &self.target.blocks,
                        layers.clone(),
                    )
                    .map_err(|e| self.fail(e, true))?;
                    PutPlan {
                        layers,
                        staged: false,
                        spans,
                    }
                }
            };
            plans.push(plan);
            self.next_layer = end;
        }
        self.in_flight += plans.len() as u32;
        Ok(plans)
    }

    /// One put of a plan finished (successfully or not).
    pub fn put_finished(&mut self, result: Result<(), TransferError>) -> Result<(), TransferError> {
        if self.in_flight == 0 {
            return Err(TransferError::BadTransition {
                request: self.target.request,
                event: "put_finished",
                state: self.state.name(),
            });
        }
        self.in_flight -= 1;
        match result {
            Ok(()) => Ok(()),
            Err(e) => {
                let gone = matches!(e, TransferError::PeerGone { .. });
                Err(self.fail(e, !gone))
            }
        }
    }

    /// Every layer was put and every put finished.
    pub fn ready_to_flush(&self) -> bool {
        self.state == PushState::Pushing
            && self.next_layer == self.target.layout.num_layers
            && self.in_flight == 0
    }

    pub fn flush_started(&mut self) -> Result<(), TransferError> {
        if !self.ready_to_flush() {
            return Err(self.bad("flush_started"));
        }
        self.state = PushState::Flushing;
        Ok(())
    }

    pub fn flushed(&mut self, result: Result<(), TransferError>) -> Result<(), TransferError> {
        if self.state != PushState::Flushing {
            return Err(self.bad("flushed"));
        }
        match result {
            Ok(()) => {
                self.state = PushState::Flushed;
                Ok(())
            }
            Err(e) => {
                let gone = matches!(e, TransferError::PeerGone { .. });
                Err(self.fail(e, !gone))
            }
        }
    }

    /// KvDone(Ok) was sent; `ack` is decode's answer.
    pub fn done_signalled(&mut self, ack: Result<(), TransferError>) -> Result<(), TransferError> {
        if self.state != PushState::Flushed {
            return Err(self.bad("done_signalled"));
        }
        match ack {
            Ok(()) => {
                self.state = PushState::Done;
                self.end = Some(PushRelease {
                    status: DoneStatus::Ok,
                    notify_decode: false,
                });
                Ok(())
            }
            // Decode refused or is unreachable: it frees its side itself.
            Err(e) => Err(self.fail(e, false)),
        }
    }

    /// Abort (client cancel, router, decode lost). Idempotent on a failed or aborted push.
    pub fn abort(&mut self, reason: &str) -> Result<(), TransferError> {
        match self.state {
            PushState::Done => Err(self.bad("abort")),
            PushState::Failed | PushState::Aborted => Ok(()),
            _ => {
                self.state = PushState::Aborted;
                self.end = Some(PushRelease {
                    status: DoneStatus::Aborted(reason.to_string()),
                    notify_decode: true,
                });
                Ok(())
            }
        }
    }

    /// The decode node is gone (connection lost, registry lease lost).
    pub fn peer_gone(&mut self, reason: &str) {
        let e = TransferError::PeerGone {
            peer: self.target.decode_node.to_string(),
            reason: reason.to_string(),
        };
        let _ = self.fail(e, false);
    }

    /// Applies the deadline at `now`; returns the end of the push once, when no put is still
    /// reading the source blocks.
    pub fn poll(&mut self, now: Instant) -> Option<PushRelease> {
        if !self.state.is_terminal() && now >= self.deadline {
            let e = TransferError::Timeout {
                what: format!("push of {}", self.target.request),
            };
            let _ = self.fail(e, true);
        }
        if self.released || !self.state.is_terminal() || self.in_flight > 0 {
            return None;
        }
        self.released = true;
        self.end.clone()
    }
}

#[cfg(test)]
#[path = "push_tests.rs"]
mod tests;
