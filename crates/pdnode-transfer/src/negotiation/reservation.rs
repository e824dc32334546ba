//! Decode side: one reservation of KV blocks for an incoming hand-off.
//!
//! ```text
//! Reserved --target_sent--> TargetSent --data_landing--> Landing --done(Ok)--> Done (admit)
//!     |                        |                           |
//!     +--abort / lease end-----+---------------------------+--> Aborted | Expired (quarantine)
//!                              +--done(Failed|Aborted)-----+--> Failed (free now)
//! ```
//! Once the target was sent, prefill may be writing: an abort or a lease end keeps the blocks
//! *quarantined* for a grace period (prefill stops at the lease deadline, see `Push`) unless
//! prefill confirms it stopped (an authentic KvDone). Blocks are handed back exactly once, by
//! [`Reservation::poll`].

use super::{DoneStatus, Secret};
use crate::TransferError;
use pdnode_core::{BlockId, NodeId, RequestId};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationState {
    Reserved,
    TargetSent,
    Landing,
    /// KvDone(Ok) arrived: the blocks hold the prompt's KV.
    Done,
    Aborted,
    Expired,
    Failed,
}

impl ReservationState {
    pub fn name(self) -> &'static str {
        match self {
            ReservationState::Reserved => "reserved",
            ReservationState::TargetSent => "target_sent",
            ReservationState::Landing => "landing",
            ReservationState::Done => "done",
            ReservationState::Aborted => "aborted",
            ReservationState::Expired => "expired",
            ReservationState::Failed => "failed",
        }
    }

    fn is_open(self) -> bool {
        matches!(
            self,
            ReservationState::Reserved | ReservationState::TargetSent | ReservationState::Landing
        )
    }
}

/// What the owner does with the blocks when the reservation ends (returned once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReservationEnd {
    /// The KV is in place: the request joins decode's batch with these blocks.
    Admit(Vec<BlockId>),
    /// Give the blocks back to the pool.
    Free(Vec<BlockId>),
}

#[derive(Debug)]
pub struct Reservation {
    request: RequestId,
    blocks: Vec<BlockId>,
    secret: Secret,
    expected_peer: Option<NodeId>,
    lease_deadline: Instant,
    grace: Duration,
    state: ReservationState,
    /// When quarantined blocks may be freed.
    free_at: Option<Instant>,
    ended: bool,
}

impl Reservation {
    /// A reservation of `blocks` until `now + lease`; `grace` is the quarantine after an abort
    /// or lease end while prefill may still write. `expected_peer`: the prefill node the router
    /// paired (None: any node presenting the secret).
    pub fn new(
        request: RequestId,
        blocks: Vec<BlockId>,
        expected_peer: Option<NodeId>,
        lease: Duration,
        grace: Duration,
        now: Instant,
    ) -> Self {
        Reservation {
            request,
            blocks,
            secret: Secret::random(),
            expected_peer,
            lease_deadline: now + lease,
            grace,
            state: ReservationState::Reserved,
            free_at: None,
            ended: false,
        }
    }

    pub fn request(&self) -> RequestId {
        self.request
    }
    pub fn secret(&self) -> &Secret {
        &self.secret
    }
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }
    pub fn state(&self) -> ReservationState {
        self.state
    }
    pub fn lease_deadline(&self) -> Instant {
        self.lease_deadline
    }

    fn authenticate(&self, peer: &NodeId, secret: &[u8]) -> Result<(), TransferError> {
        if let Some(expected) = &self.expected_peer
            && expected != peer
        {
            return Err(TransferError::UnknownPeer {
                request: self.request,
                peer: peer.clone(),
                expected: expected.clone(),
            });
        }
        if !self.secret.matches(secret) {
            return Err(TransferError::WrongSecret {
                request: self.request,
            });
        }
        Ok(())
    }

    fn late(&self, event: &'static str) -> TransferError {
        TransferError::LateEvent {
            request: self.request,
            event,
            state: self.state.name(),
        }
    }

    /// The target went out to prefill.
    pub fn target_sent(&mut self, now: Instant) -> Result<(), TransferError> {
        self.poll_expiry(now);
        match self.state {
            ReservationState::Reserved => {
                self.state = ReservationState::TargetSent;
                Ok(())
            }
            s if s.is_open() => Err(TransferError::BadTransition {
                request: self.request,
                event: "target_sent",
                state: s.name(),
            }),
            _ => Err(self.late("target_sent")),
        }
    }

    /// Prefill reports it is writing (first layers flushed).
    pub fn data_landing(
        &mut self,
        peer: &NodeId,
        secret: &[u8],
        now: Instant,
    ) -> Result<(), TransferError> {
        self.authenticate(peer, secret)?;
        self.poll_expiry(now);
        match self.state {
            ReservationState::TargetSent | ReservationState::Landing => {
                self.state = ReservationState::Landing;
                Ok(())
            }
            ReservationState::Reserved => Err(TransferError::BadTransition {
                request: self.request,
                event: "data_landing",
                state: self.state.name(),
            }),
            _ => Err(self.late("data_landing")),
        }
    }

    /// Prefill's KvDone. An authentic KvDone always means prefill stopped writing, so a
    /// quarantine ends with it.
    pub fn done(
        &mut self,
        peer: &NodeId,
        secret: &[u8],
        status: &DoneStatus,
        now: Instant,
    ) -> Result<(), TransferError> {
        self.authenticate(peer, secret)?;
        self.poll_expiry(now);
        match (self.state, status) {
            (ReservationState::TargetSent | ReservationState::Landing, DoneStatus::Ok) => {
                self.state = ReservationState::Done;
                Ok(())
            }
            (ReservationState::TargetSent | ReservationState::Landing, _) => {
                self.state = ReservationState::Failed;
                self.free_at = Some(now);
                Ok(())
            }
            (ReservationState::Reserved, _) => Err(TransferError::BadTransition {
                request: self.request,
                event: "done",
                state: self.state.name(),
            }),
            (ReservationState::Done, _) => Err(TransferError::DuplicateDone {
                request: self.request,
            }),
            (ReservationState::Failed, _) => Err(TransferError::DuplicateDone {
                request: self.request,
            }),
            (ReservationState::Aborted | ReservationState::Expired, _) => {
                // Prefill has stopped writing: the quarantine can end now.
                self.free_at = Some(now);
                Err(self.late("done"))
            }
        }
    }

    /// Abort from either side (client cancel, router, prefill lost). Idempotent.
    pub fn abort(&mut self, now: Instant) -> Result<(), TransferError> {
        match self.state {
            ReservationState::Reserved => {
                // Nobody knows where to write: free at once.
                self.state = ReservationState::Aborted;
                self.free_at = Some(now);
                Ok(())
            }
            ReservationState::TargetSent | ReservationState::Landing => {
                self.state = ReservationState::Aborted;
                self.free_at = Some(now + self.grace);
                Ok(())
            }
            ReservationState::Aborted | ReservationState::Expired | ReservationState::Failed => {
                Ok(())
            }
            ReservationState::Done => Err(self.late("abort")),
        }
    }

    fn poll_expiry(&mut self, now: Instant) {
        if self.state.is_open() && now >= self.lease_deadline {
            self.free_at = Some(if self.state == ReservationState::Reserved {
                now
            } else {
                now + self.grace
            });
            self.state = ReservationState::Expired;
        }
    }

    /// Applies the lease and the quarantine at `now`; returns how the reservation ended, once.
    pub fn poll(&mut self, now: Instant) -> Option<ReservationEnd> {
        self.poll_expiry(now);
        if self.ended {
            return None;
        }
        let end = match self.state {
            ReservationState::Done => ReservationEnd::Admit(std::mem::take(&mut self.blocks)),
            ReservationState::Aborted | ReservationState::Expired | ReservationState::Failed
                if self.free_at.is_some_and(|t| now >= t) =>
            {
                ReservationEnd::Free(std::mem::take(&mut self.blocks))
            }
            _ => return None,
        };
        self.ended = true;
        Some(end)
    }

    /// When [`Reservation::poll`] next has something to do (lease end or quarantine end).
    pub fn next_deadline(&self) -> Option<Instant> {
        if self.ended {
            return None;
        }
        if self.state.is_open() {
            return Some(self.lease_deadline);
        }
        self.free_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(10);
    const GRACE: Duration = Duration::from_secs(2);

    fn peer() -> NodeId {
        NodeId::new("prefill-0")
    }

    fn res(now: Instant) -> Reservation {
        Reservation::new(
            RequestId(7),
            vec![BlockId(3), BlockId(9)],
            Some(peer()),
            LEASE,
            GRACE,
            now,
        )
    }

    fn sent(now: Instant) -> (Reservation, Vec<u8>) {
        let mut r = res(now);
        r.target_sent(now).unwrap();
        let s = r.secret().as_bytes().to_vec();
        (r, s)
    }

    #[test]
    fn happy_path_admits_the_blocks_once() {
        let t = Instant::now();
        let (mut r, s) = sent(t);
        assert_eq!(r.state(), ReservationState::TargetSent);
        assert_eq!(r.poll(t), None);
        r.data_landing(&peer(), &s, t).unwrap();
        assert_eq!(r.state(), ReservationState::Landing);
        r.done(&peer(), &s, &DoneStatus::Ok, t).unwrap();
        assert_eq!(
            r.poll(t),
            Some(ReservationEnd::Admit(vec![BlockId(3), BlockId(9)]))
        );
        assert_eq!(r.poll(t), None);
    }

    #[test]
    fn done_without_landing_notice_is_fine() {
        let t = Instant::now();
        let (mut r, s) = sent(t);
        r.done(&peer(), &s, &DoneStatus::Ok, t).unwrap();
        assert_eq!(r.state(), ReservationState::Done);
    }

    #[test]
    fn wrong_secret_and_unknown_peer_are_refused_without_changing_state() {
        let t = Instant::now();
        let (mut r, s) = sent(t);
        let other = Secret::random();
        assert!(matches!(
            r.done(&peer(), other.as_bytes(), &DoneStatus::Ok, t),
            Err(TransferError::WrongSecret { .. })
        ));
        assert!(matches!(
            r.data_landing(&NodeId::new("evil"), &s, t),
            Err(TransferError::UnknownPeer { .. })
        ));
        assert!(matches!(
            r.done(&peer(), &s[..8], &DoneStatus::Ok, t),
            Err(TransferError::WrongSecret { .. })
        ));
        assert_eq!(r.state(), ReservationState::TargetSent);
        // With no expected peer, any peer with the secret is accepted.
        let mut any = Reservation::new(RequestId(1), vec![], None, LEASE, GRACE, t);
        any.target_sent(t).unwrap();
        let s2 = any.secret().as_bytes().to_vec();
        any.done(&NodeId::new("whoever"), &s2, &DoneStatus::Ok, t)
            .unwrap();
    }

    #[test]
    fn duplicate_done_is_refused() {
        let t = Instant::now();
        let (mut r, s) = sent(t);
        r.done(&peer(), &s, &DoneStatus::Ok, t).unwrap();
        assert!(matches!(
            r.done(&peer(), &s, &DoneStatus::Ok, t),
            Err(TransferError::DuplicateDone { .. })
        ));
        let (mut f, s) = sent(t);
        f.done(&peer(), &s, &DoneStatus::Failed("x".into()), t)
            .unwrap();
        assert!(matches!(
            f.done(&peer(), &s, &DoneStatus::Ok, t),
            Err(TransferError::DuplicateDone { .. })
        ));
    }

    #[test]
    fn failed_done_frees_at_once() {
        let t = Instant::now();
        let (mut r, s) = sent(t);
        r.done(&peer(), &s, &DoneStatus::Failed("peer gone".into()), t)
            .unwrap();
        assert_eq!(r.state(), ReservationState::Failed);
        assert_eq!(
            r.poll(t),
            Some(ReservationEnd::Free(vec![BlockId(3), BlockId(9)]))
        );
    }

    #[test]
    fn lease_expiry_before_target_frees_at_once() {
        let t = Instant::now();
        let mut r = res(t);
        assert_eq!(r.next_deadline(), Some(t + LEASE));
        assert_eq!(r.poll(t + LEASE - Duration::from_millis(1)), None);
        assert!(matches!(r.poll(t + LEASE), Some(ReservationEnd::Free(_))));
        assert_eq!(r.state(), ReservationState::Expired);
        assert!(matches!(
            r.target_sent(t + LEASE),
            Err(TransferError::LateEvent { .. })
        ));
    }

    #[test]
    fn lease_expiry_after_target_quarantines_then_frees() {
        let t = Instant::now();
        let (mut r, s) = sent(t);
        let end = t + LEASE;
        assert_eq!(r.poll(end), None);
        assert_eq!(r.state(), ReservationState::Expired);
        assert_eq!(r.next_deadline(), Some(end + GRACE));
        assert_eq!(r.poll(end + GRACE - Duration::from_millis(1)), None);
        assert!(matches!(r.poll(end + GRACE), Some(ReservationEnd::Free(_))));
        // Late data after expiry is refused.
        assert!(matches!(
            r.data_landing(&peer(), &s, end + GRACE),
            Err(TransferError::LateEvent { .. })
        ));
    }

    #[test]
    fn done_after_lease_end_is_late_but_ends_the_quarantine() {
        let t = Instant::now();
        let (mut r, s) = sent(t);
        let late = t + LEASE + Duration::from_millis(5);
        assert!(matches!(
            r.done(&peer(), &s, &DoneStatus::Ok, late),
            Err(TransferError::LateEvent { .. })
        ));
        assert!(matches!(r.poll(late), Some(ReservationEnd::Free(_))));
    }

    #[test]
    fn abort_before_target_frees_at_once_and_is_idempotent() {
        let t = Instant::now();
        let mut r = res(t);
        r.abort(t).unwrap();
        r.abort(t).unwrap();
        assert!(matches!(r.poll(t), Some(ReservationEnd::Free(_))));
        assert_eq!(r.poll(t), None);
    }

    #[test]
    fn abort_while_landing_quarantines_and_late_data_is_refused() {
        let t = Instant::now();
        let (mut r, s) = sent(t);
        r.data_landing(&peer(), &s, t).unwrap();
        r.abort(t).unwrap();
        assert_eq!(r.state(), ReservationState::Aborted);
        assert_eq!(r.poll(t), None, "prefill may still write: quarantined");
        assert!(matches!(
            r.data_landing(&peer(), &s, t),
            Err(TransferError::LateEvent { .. })
        ));
        // Prefill's KvDone(Aborted) confirms it stopped: free now.
        assert!(
            r.done(&peer(), &s, &DoneStatus::Aborted("cancel".into()), t)
                .is_err()
        );
        assert!(matches!(r.poll(t), Some(ReservationEnd::Free(_))));
    }

    #[test]
    fn abort_after_done_is_refused() {
        let t = Instant::now();
        let (mut r, s) = sent(t);
        r.done(&peer(), &s, &DoneStatus::Ok, t).unwrap();
        assert!(matches!(r.abort(t), Err(TransferError::LateEvent { .. })));
    }

    #[test]
    fn events_before_the_target_went_out_are_bad_transitions() {
        let t = Instant::now();
        let mut r = res(t);
        let s = r.secret().as_bytes().to_vec();
        assert!(matches!(
            r.data_landing(&peer(), &s, t),
            Err(TransferError::BadTransition { .. })
        ));
        assert!(matches!(
            r.done(&peer(), &s, &DoneStatus::Ok, t),
            Err(TransferError::BadTransition { .. })
        ));
        r.target_sent(t).unwrap();
        assert!(matches!(
            r.target_sent(t),
            Err(TransferError::BadTransition { .. })
        ));
    }
}
