//! The hand-off as plain state machines (docs/protocol.md, section 3), decided here without a
//! runtime or any I/O and unit-tested on every transition:
//! - decode: [`Reservation`] (what a reservation may do next, what becomes of its staging span)
//!   and [`Quarantine`] (when a fenced span comes back);
//! - prefill: [`PushProgress`] (which blocks of an overlapped push go out next, that none goes
//!   out after the push deadline, and whether a dropped push owes the decode node an abandoned
//!   record).
//!
//! The node path drives them: `PdNode` holds one [`Reservation`] per `ReserveKv` and one
//! [`Quarantine`] per fenced span, `OverlapPush` one [`PushProgress`]; they do the I/O (engine
//! calls, puts, reading fence records) around them. The fence record's own check is
//! `pdnode_transfer::fence::FenceRecord::check`.

use pdnode_core::RequestId;
use pdnode_transfer::Secret;
use std::ops::Range;
use std::time::{Duration, Instant};

/// Where a reservation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationState {
    /// The target went out; a prefill node may be writing the span.
    Reserved,
    /// `Decode` presented the secret: the request is being admitted.
    Claimed,
    /// The span left the reservation (freed or quarantined).
    Released(ReleaseCause),
}

/// Why a reservation's span is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseCause {
    /// `Abort` (client gone, router gave up): the writer may still put.
    Abort,
    /// Nobody claimed it within its lease plus one lease (the sweep).
    LeaseEnd,
    /// `Decode` refused what landed (record missing or wrong, checksum mismatch): some writer
    /// touched the span, so its record is not trusted to prove the puts are over.
    Refused,
    /// `Decode` scattered the span into the pool: nothing writes it any more.
    Scattered,
}

/// Why `Decode` may not claim a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimError {
    /// The secret does not match; the reservation stays for its rightful caller.
    WrongSecret,
    /// Claimed or released already.
    Ended,
    /// The capability is genuine but past its expiry (the lease deadline in the target).
    Expired,
}

/// What becomes of a released span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// No writer can touch it any more: free it now.
    Free,
    /// A writer may still put into it: keep it out of use until the quarantine ends.
    Quarantine(Quarantine),
}

/// A decode reservation: its secret, staging generation, lease and fence deadline.
#[derive(Debug)]
pub struct Reservation {
    request: RequestId,
    generation: u64,
    secret: Secret,
    /// One lease past the lease (the engine frees the blocks at the lease end): the prefill
    /// node's push deadline is never past the lease, so by then every put it issued has ended
    /// (completed or failed).
    fence_deadline: Instant,
    /// When the engine frees the reserved blocks (the lease's end): from then on nobody may
    /// claim the reservation, and the sweep releases its span (free at once when its writer's
    /// record shows the writer is done, else quarantined until the fence deadline).
    lease_end: Instant,
    /// Unix ms after which the capability is refused (the target's lease deadline).
    expires_ms: u64,
    state: ReservationState,
}

impl Reservation {
    pub fn new(
        request: RequestId,
        generation: u64,
        secret: Secret,
        now: Instant,
        lease: Duration,
    ) -> Self {
        Self {
            request,
            generation,
            secret,
            fence_deadline: now + lease + lease,
            lease_end: now + lease,
            expires_ms: u64::MAX,
            state: ReservationState::Reserved,
        }
    }

    /// The capability is refused after `expires_ms` (Unix ms).
    pub fn with_expiry(mut self, expires_ms: u64) -> Self {
        self.expires_ms = expires_ms;
        self
    }

    pub fn request(&self) -> RequestId {
        self.request
    }

    /// The reservation's capability (its `KvTarget.secret`): fence records are tagged with it.
    pub fn capability(&self) -> &Secret {
        &self.secret
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn state(&self) -> ReservationState {
        self.state
    }

    /// `Decode` with `presented` at `now_ms` (Unix ms): Reserved -> Claimed. A wrong or
    /// expired capability changes nothing (the sweep ends an expired reservation).
    pub fn claim(&mut self, presented: &[u8], now_ms: u64) -> Result<(), ClaimError> {
        if self.state != ReservationState::Reserved {
            return Err(ClaimError::Ended);
        }
        if !self.secret.matches(presented) {
            return Err(ClaimError::WrongSecret);
        }
        if now_ms > self.expires_ms {
            return Err(ClaimError::Expired);
        }
        self.state = ReservationState::Claimed;
        Ok(())
    }

    /// Whether the sweep may drop the reservation: unclaimed past its lease end (its blocks
    /// went back to the engine then). Its span is released as [`Reservation::release`] with
    /// [`ReleaseCause::LeaseEnd`] decides: a writer's record (of a finished or an abandoned
    /// push) frees it at once, else it waits out the fence deadline in quarantine.
    pub fn sweepable(&self, now: Instant) -> bool {
        self.state == ReservationState::Reserved && now >= self.lease_end
    }

    /// Releases the span, once: `None` when it was released already. `staged`: the
    /// reservation has a staging span at all (in-process hand-offs have none);
    /// `records_present`: every rank carries an intact fence record of this generation (read
    /// by the caller; the writer puts it only after its KV puts were flushed).
    pub fn release(
        &mut self,
        cause: ReleaseCause,
        staged: bool,
        records_present: bool,
        now: Instant,
    ) -> Option<Release> {
        if matches!(self.state, ReservationState::Released(_)) {
            return None;
        }
        self.state = ReservationState::Released(cause);
        let trust_record = cause != ReleaseCause::Refused;
        let writer_done = match cause {
            ReleaseCause::Scattered => true,
            // Past the fence deadline every put the writer issued has ended.
            ReleaseCause::LeaseEnd => now >= self.fence_deadline || records_present,
            ReleaseCause::Abort => records_present,
            ReleaseCause::Refused => false,
        };
        Some(if !staged || writer_done {
            Release::Free
        } else {
            Release::Quarantine(Quarantine {
                request: self.request,
                generation: self.generation,
                trust_record,
                until: self.fence_deadline,
            })
        })
    }
}

/// How a quarantine ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuarantineEnd {
    /// The writer's record of the span's generation (or its abandoned record) is there.
    ByRecord,
    /// The fence deadline passed.
    AtDeadline,
}

/// A span kept out of use while its writer may still put into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quarantine {
    pub request: RequestId,
    pub generation: u64,
    /// Whether an intact record of the generation ends it early (not after a refused check).
    pub trust_record: bool,
    pub until: Instant,
}

impl Quarantine {
    /// `records_present`: every rank carries an intact record of `generation` (read by the
    /// caller only when [`Quarantine::trust_record`]).
    pub fn poll(&self, now: Instant, records_present: bool) -> Option<QuarantineEnd> {
        if self.trust_record && records_present {
            Some(QuarantineEnd::ByRecord)
        } else if now >= self.until {
            Some(QuarantineEnd::AtDeadline)
        } else {
            None
        }
    }
}

/// When the prefill node stops issuing puts for a hand-off that started at `started`: its start
/// plus one lease (at least a second from `now`), and never past the lease deadline the decode
/// node put in the target (`lease_deadline_ms`, Unix ms; 0: none). After it the decode node
/// may give the span away; puts still in flight then are fenced there. A deadline from the
/// wire far in the future cannot overflow the clock.
pub fn push_deadline(
    started: Instant,
    lease: Duration,
    now: Instant,
    now_ms: u64,
    lease_deadline_ms: u64,
) -> Instant {
    let ours = started
        .checked_add(lease)
        .unwrap_or(now)
        .max(now + Duration::from_secs(1));
    if lease_deadline_ms == 0 {
        return ours;
    }
    let left = Duration::from_millis(lease_deadline_ms.saturating_sub(now_ms));
    now.checked_add(left)
        .map_or(ours, |theirs| ours.min(theirs))
}

/// How long a push waits on its puts and flushes. `deadline` is the push deadline
/// ([`push_deadline`]); before it, a wait for `bytes` that began at `from` is over at `from`
/// plus the time the bytes need at `min_bytes_per_s` plus `stall` (`transfer.stall_ms`,
/// `transfer.stall_min_rate_mibps`): past that the link or the peer counts as stalled and the
/// hand-off fails (retryable) instead of waiting out the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushWait {
    pub deadline: Instant,
    pub stall: Duration,
    pub min_bytes_per_s: u64,
}

impl PushWait {
    /// A wait bounded by `deadline` alone (no stall allowance): in-process moves and tests.
    pub fn until(deadline: Instant) -> Self {
        Self {
            deadline,
            stall: Duration::MAX,
            min_bytes_per_s: 1,
        }
    }

    /// When a wait for `bytes` that began at `from` gives up, and whether that is a stall
    /// (before the push deadline) rather than the deadline itself.
    pub fn give_up(&self, from: Instant, bytes: u64) -> (Instant, bool) {
        let need = Duration::from_secs(bytes / self.min_bytes_per_s.max(1)).saturating_add(
            Duration::from_nanos(
                ((bytes % self.min_bytes_per_s.max(1)) as u128 * 1_000_000_000
                    / self.min_bytes_per_s.max(1) as u128) as u64,
            ),
        );
        match from.checked_add(self.stall.saturating_add(need)) {
            Some(at) if at < self.deadline => (at, true),
            _ => (self.deadline, false),
        }
    }
}

/// Why a push may not put what the engine reported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    #[error("the push deadline passed: no put is issued after it")]
    PastDeadline,
    #[error("the push ended already")]
    Ended,
    #[error(
        "layers {layers:?} of blocks {blocks:?} do not follow the {sent} blocks sent of {total} ({num_layers} layers)"
    )]
    OutOfOrder {
        blocks: Range<usize>,
        layers: Range<u32>,
        sent: usize,
        total: usize,
        num_layers: u32,
    },
}

/// How a push ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushEnd {
    /// Every block went out, was flushed, and its fence records (if asked) followed.
    Done,
    /// Another push (after prefill) took the hand-off over; this one put nothing.
    HandedOver,
}

/// The prefill side of an overlapped push: blocks `0..sent` of `blocks` have gone out (every
/// layer), in order, none after `deadline`.
#[derive(Debug, Clone)]
pub struct PushProgress {
    blocks: usize,
    layers: u32,
    sent: usize,
    sent_early: usize,
    deadline: Instant,
    end: Option<PushEnd>,
}

impl PushProgress {
    pub fn new(blocks: usize, layers: u32, deadline: Instant) -> Self {
        Self {
            blocks,
            layers,
            sent: 0,
            sent_early: 0,
            deadline,
            end: None,
        }
    }

    fn may_put(&self, now: Instant) -> Result<(), PushError> {
        if self.end.is_some() {
            Err(PushError::Ended)
        } else if now >= self.deadline {
            Err(PushError::PastDeadline)
        } else {
            Ok(())
        }
    }

    /// The engine reports leading blocks `0..upto` in the span: the blocks to put now, every
    /// layer (`None`: nothing new).
    pub fn blocks_ready(
        &mut self,
        upto: usize,
        now: Instant,
    ) -> Result<Option<Range<usize>>, PushError> {
        let upto = upto.min(self.blocks);
        if upto <= self.sent {
            return Ok(None);
        }
        self.may_put(now)?;
        if upto == self.blocks {
            self.sent_early = self.sent;
        }
        let put = self.sent..upto;
        self.sent = upto;
        Ok(Some(put))
    }

    /// Layers `layers` of blocks `blocks` are gathered inside the prompt's last step: they
    /// must follow the blocks sent; the blocks count as sent with the last layer group.
    pub fn layers_ready(
        &mut self,
        blocks: &Range<usize>,
        layers: &Range<u32>,
        now: Instant,
    ) -> Result<(), PushError> {
        if blocks.start != self.sent
            || blocks.end > self.blocks
            || blocks.start >= blocks.end
            || layers.end > self.layers
            || layers.start >= layers.end
        {
            return Err(PushError::OutOfOrder {
                blocks: blocks.clone(),
                layers: layers.clone(),
                sent: self.sent,
                total: self.blocks,
                num_layers: self.layers,
            });
        }
        self.may_put(now)?;
        if layers.end == self.layers {
            if blocks.end == self.blocks {
                self.sent_early = self.sent;
            }
            self.sent = blocks.end;
        }
        Ok(())
    }

    /// After `PrefillDone`, when the engine's staged gather stopped short: the whole span is
    /// gathered again and every block goes out (`0..blocks`).
    pub fn resend_all(&mut self, now: Instant) -> Result<Range<usize>, PushError> {
        self.may_put(now)?;
        self.sent = self.blocks;
        Ok(0..self.blocks)
    }

    /// Whether every block went out.
    pub fn complete(&self) -> bool {
        self.sent == self.blocks
    }

    /// Blocks sent before the last report (the part hidden behind the forward pass).
    pub fn sent_early(&self) -> usize {
        self.sent_early
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    pub fn settle(&mut self, end: PushEnd) {
        self.end.get_or_insert(end);
    }

    /// A push dropped without settling (it failed, or its call was dropped) owes the decode
    /// node an abandoned record once its puts are over.
    pub fn abandoned(&self) -> bool {
        self.end.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(10);

    fn reservation(now: Instant) -> (Reservation, Vec<u8>) {
        let secret = Secret::random();
        let bytes = secret.as_bytes().to_vec();
        (Reservation::new(RequestId(7), 3, secret, now, LEASE), bytes)
    }

    #[test]
    fn a_wrong_secret_changes_nothing_and_a_claim_happens_once() {
        let now = Instant::now();
        let (mut r, secret) = reservation(now);
        assert_eq!(r.claim(b"not the secret", 0), Err(ClaimError::WrongSecret));
        // Past its expiry even the right capability is refused, and nothing changes.
        let (expiring, own) = reservation(now);
        let mut expiring = expiring.with_expiry(1_000);
        assert_eq!(expiring.claim(&own, 1_001), Err(ClaimError::Expired));
        assert_eq!(expiring.state(), ReservationState::Reserved);
        assert_eq!(expiring.claim(b"forged", 0), Err(ClaimError::WrongSecret));
        assert_eq!(r.claim(&[0u8; 16], 0), Err(ClaimError::WrongSecret));
        assert_eq!(r.state(), ReservationState::Reserved);
        assert_eq!(r.claim(&secret, 0), Ok(()));
        assert_eq!(r.state(), ReservationState::Claimed);
        assert_eq!(r.claim(&secret, 0), Err(ClaimError::Ended));
        // A claimed reservation is never swept.
        assert!(!r.sweepable(now + 3 * LEASE));
        assert_eq!(
            r.release(ReleaseCause::Scattered, true, false, now),
            Some(Release::Free)
        );
        assert_eq!(r.claim(&secret, 0), Err(ClaimError::Ended));
    }

    #[test]
    fn an_abort_frees_only_once_the_writer_is_done() {
        let now = Instant::now();
        let (mut r, _) = reservation(now);
        // No record yet: quarantined until one lease past the lease; the record may end it.
        let q = match r.release(ReleaseCause::Abort, true, false, now) {
            Some(Release::Quarantine(q)) => q,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            (q.request, q.generation, q.trust_record, q.until),
            (RequestId(7), 3, true, now + 2 * LEASE)
        );
        assert_eq!(r.state(), ReservationState::Released(ReleaseCause::Abort));
        // Released exactly once.
        assert_eq!(r.release(ReleaseCause::Abort, true, true, now), None);
        // The writer's record was there: free at once.
        let (mut r, _) = reservation(now);
        assert_eq!(
            r.release(ReleaseCause::Abort, true, true, now),
            Some(Release::Free)
        );
        // Nothing staged (in process): free at once.
        let (mut r, _) = reservation(now);
        assert_eq!(
            r.release(ReleaseCause::Abort, false, false, now),
            Some(Release::Free)
        );
    }

    #[test]
    fn a_refused_span_ignores_its_record_and_waits_out_the_deadline() {
        let now = Instant::now();
        let (mut r, _) = reservation(now);
        let q = match r.release(ReleaseCause::Refused, true, true, now) {
            Some(Release::Quarantine(q)) => q,
            other => panic!("{other:?}"),
        };
        assert!(!q.trust_record);
        assert_eq!(q.poll(now, true), None, "a record does not end it");
        assert_eq!(
            q.poll(now + 2 * LEASE, true),
            Some(QuarantineEnd::AtDeadline)
        );
    }

    #[test]
    fn the_sweep_takes_unclaimed_reservations_at_their_lease_end() {
        let now = Instant::now();
        let (mut r, _) = reservation(now);
        assert!(!r.sweepable(now + LEASE - Duration::from_millis(1)));
        assert!(r.sweepable(now + LEASE));
        // The writer's record is there (it finished, or abandoned the push): free at once.
        assert_eq!(
            r.release(ReleaseCause::LeaseEnd, true, true, now + LEASE),
            Some(Release::Free)
        );
        assert!(!r.sweepable(now + 3 * LEASE), "released: not swept again");
        // No record at the lease end: quarantined until the fence deadline.
        let (mut r, _) = reservation(now);
        match r.release(ReleaseCause::LeaseEnd, true, false, now + LEASE) {
            Some(Release::Quarantine(q)) => assert_eq!(q.until, now + 2 * LEASE),
            other => panic!("not quarantined: {other:?}"),
        }
        // Swept late, past the fence deadline: every put the writer issued has ended.
        let (mut r, _) = reservation(now);
        assert_eq!(
            r.release(ReleaseCause::LeaseEnd, true, false, now + 2 * LEASE),
            Some(Release::Free)
        );
    }

    #[test]
    fn a_quarantine_ends_by_record_or_at_its_deadline() {
        let now = Instant::now();
        let q = Quarantine {
            request: RequestId(1),
            generation: 9,
            trust_record: true,
            until: now + LEASE,
        };
        assert_eq!(q.poll(now, false), None);
        assert_eq!(q.poll(now, true), Some(QuarantineEnd::ByRecord));
        assert_eq!(q.poll(now + LEASE, false), Some(QuarantineEnd::AtDeadline));
    }

    #[test]
    fn a_push_puts_each_block_once_in_order_and_never_after_its_deadline() {
        let now = Instant::now();
        let mut p = PushProgress::new(8, 4, now + LEASE);
        assert_eq!(p.blocks_ready(3, now), Ok(Some(0..3)));
        assert_eq!(p.blocks_ready(3, now), Ok(None), "no block twice");
        assert_eq!(p.blocks_ready(2, now), Ok(None));
        // In-step layer groups of the last blocks: counted with the last group.
        assert_eq!(p.layers_ready(&(3..8), &(0..2), now), Ok(()));
        assert!(!p.complete());
        assert!(matches!(
            p.layers_ready(&(4..8), &(2..4), now),
            Err(PushError::OutOfOrder { sent: 3, .. })
        ));
        assert!(matches!(
            p.layers_ready(&(3..8), &(2..5), now),
            Err(PushError::OutOfOrder { .. })
        ));
        assert_eq!(p.layers_ready(&(3..8), &(2..4), now), Ok(()));
        assert!(p.complete());
        assert_eq!(p.sent_early(), 3);
        assert!(p.abandoned(), "not settled yet");
        p.settle(PushEnd::Done);
        assert!(!p.abandoned());
        assert_eq!(p.blocks_ready(8, now), Ok(None));
        assert_eq!(p.resend_all(now), Err(PushError::Ended));

        let mut late = PushProgress::new(8, 4, now + LEASE);
        assert_eq!(
            late.blocks_ready(2, now + LEASE),
            Err(PushError::PastDeadline)
        );
        assert_eq!(
            late.layers_ready(&(0..8), &(0..4), now + LEASE),
            Err(PushError::PastDeadline)
        );
        assert_eq!(late.resend_all(now + LEASE), Err(PushError::PastDeadline));
        assert!(late.abandoned(), "a failed push owes an abandoned record");
    }

    #[test]
    fn a_short_staged_gather_resends_everything_and_a_hand_over_owes_nothing() {
        let now = Instant::now();
        let mut p = PushProgress::new(5, 2, now + LEASE);
        assert_eq!(p.blocks_ready(2, now), Ok(Some(0..2)));
        assert_eq!(p.resend_all(now), Ok(0..5));
        assert!(p.complete());
        let mut h = PushProgress::new(5, 2, now + LEASE);
        h.settle(PushEnd::HandedOver);
        assert!(!h.abandoned());
        // The first end stays.
        h.settle(PushEnd::Done);
        assert_eq!(h.end, Some(PushEnd::HandedOver));
    }

    #[test]
    fn the_push_deadline_never_passes_the_targets_lease_and_never_overflows() {
        let now = Instant::now();
        let at_ms = 1_000_000;
        // Our own bound: start + lease.
        assert_eq!(push_deadline(now, LEASE, now, at_ms, 0), now + LEASE);
        // The target's lease ends first: its deadline.
        assert_eq!(
            push_deadline(now, LEASE, now, at_ms, at_ms + 2_000),
            now + Duration::from_secs(2)
        );
        // A deadline already past: now (no put is issued).
        assert_eq!(push_deadline(now, LEASE, now, at_ms, 1), now);
        // Far in the future, even u64::MAX ms: our bound, no panic.
        assert_eq!(push_deadline(now, LEASE, now, at_ms, u64::MAX), now + LEASE);
        // A start long ago still leaves a second.
        let later = now + 3 * LEASE;
        assert_eq!(
            push_deadline(now, LEASE, later, at_ms, 0),
            later + Duration::from_secs(1)
        );
    }

    #[test]
    fn a_push_wait_allows_stall_plus_the_bytes_time_and_never_passes_the_deadline() {
        let now = Instant::now();
        let w = PushWait {
            deadline: now + LEASE,
            stall: Duration::from_secs(1),
            min_bytes_per_s: 100 << 20,
        };
        // Nothing to move: the stall allowance alone, a stall.
        assert_eq!(w.give_up(now, 0), (now + Duration::from_secs(1), true));
        // 250 MiB at 100 MiB/s: 2.5 s more.
        assert_eq!(
            w.give_up(now, 250 << 20),
            (now + Duration::from_millis(3500), true)
        );
        // So many bytes that the allowance passes the push deadline: the deadline, not a stall.
        assert_eq!(w.give_up(now, 1 << 50), (now + LEASE, false));
        assert_eq!(w.give_up(now, u64::MAX), (now + LEASE, false));
        // Without a stall allowance only the deadline bounds the wait.
        let plain = PushWait::until(now + LEASE);
        assert_eq!(plain.give_up(now, 0), (now + LEASE, false));
    }
}
