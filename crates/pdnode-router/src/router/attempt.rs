//! One request's flow as a synchronous state machine: per attempt (one prefill/decode pair) the
//! phases Reserve -> Prefill -> Decode, and for every way a phase ends, what to abort on which
//! node and what comes next (go on, retry on another pair, fail, done). No I/O and no runtime:
//! [`super::flow`] performs the calls and the aborts this decides, and the transitions are
//! unit-tested below.
//!
//! The rules (docs/runtime-semantics.md, section 4):
//! - Before anything reached the client (reservation, prefill), a failure is retried once on
//!   another pair: the failed node is left out of the next pick. A node's verdict that the
//!   request itself is invalid is never retried.
//! - Once the first token went out, a failure ends the request with an error.
//! - The node that failed is aborted without waiting when it looks gone (`Unavailable`,
//!   `Timeout`: its Abort could only run into its deadline) and marked suspect for new picks;
//!   a node that answered with an error is aborted and waited for.
//! - The client going away (or not reading in time) aborts the request on both nodes.

use pdnode_core::ErrorKind;

/// Where an attempt is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// `D.ReserveKv` in flight.
    Reserve,
    /// `P.Prefill` in flight; D watched.
    Prefill,
    /// The first token is out; `D.Decode` streams the rest.
    Decode,
    /// The request ended (done, failed or the client left).
    Ended,
}

/// How a step of the current phase ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// D reserved the KV target.
    Reserved,
    ReserveFailed(ErrorKind),
    /// P answered with the first token; `finished`: the request ends with it (max_tokens 1,
    /// a stop string, or the engine's own finish).
    Prefilled {
        finished: bool,
    },
    PrefillFailed(ErrorKind),
    /// D's watch judged it gone while P prefilled.
    DecodeLost,
    /// Anything after the first token failed: the Decode call, the stream (error, stall, early
    /// end, an error chunk), or detokenizing the output.
    DecodeFailed(ErrorKind),
    /// A move of the stream failed at its new node (the reservation or the decode there): D
    /// holds the parked KV and is not at fault.
    MoveFailed,
    /// D's stream reported a finish.
    Finished,
    /// The router's detokenizer matched a stop string.
    StopMatched,
    /// The client went away or did not take an event in time.
    ClientGone,
}

/// What to do to one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Abort {
    No,
    /// Send `Abort` and wait for the answer (bounded).
    Wait,
    /// Send `Abort` without waiting: the node may be gone.
    Detach,
    /// As `Detach`, and new picks avoid the node for a while: it looks unreachable.
    DetachSuspect,
}

/// What comes after an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Then {
    /// On to the next phase of this attempt.
    Go,
    /// A new attempt, leaving out the prefill node and/or the decode node of this one.
    Retry { new_prefill: bool, new_decode: bool },
    /// The request fails with the error of this event (or the last one).
    Fail,
    /// The request ends normally.
    Done,
    /// The client left; nothing more to tell it.
    ClientGone,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Action {
    pub prefill: Abort,
    pub decode: Abort,
    pub then: Then,
}

impl Action {
    const fn new(prefill: Abort, decode: Abort, then: Then) -> Self {
        Self {
            prefill,
            decode,
            then,
        }
    }
}

/// The request's flow: attempts left and the phase of the current one.
#[derive(Debug)]
pub(crate) struct Flow {
    phase: Phase,
    attempts_left: u32,
    /// The current pair is one colocated worker (P == D): abort it once, as the decode node.
    colocated: bool,
}

/// A verdict about the request itself: another node would say the same.
fn invalid(kind: ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::InvalidRequest | ErrorKind::ContextLengthExceeded
    )
}

/// How to abort a node that failed with `kind`.
fn failed(kind: ErrorKind) -> Abort {
    if matches!(kind, ErrorKind::Unavailable | ErrorKind::Timeout) {
        Abort::DetachSuspect
    } else {
        Abort::Wait
    }
}

impl Flow {
    /// A flow of at most `attempts` attempts (the first and the retries).
    pub(crate) fn new(attempts: u32) -> Self {
        Self {
            phase: Phase::Ended,
            attempts_left: attempts,
            colocated: false,
        }
    }

    #[cfg(test)]
    pub(crate) fn phase(&self) -> Phase {
        self.phase
    }

    /// Starts an attempt on a new pair; false when none is left.
    pub(crate) fn begin(&mut self, colocated: bool) -> bool {
        if self.attempts_left == 0 {
            self.phase = Phase::Ended;
            return false;
        }
        self.attempts_left -= 1;
        self.colocated = colocated;
        self.phase = Phase::Reserve;
        true
    }

    /// Books `ev` and says what to do. An event that does not belong to the current phase (a
    /// bug in the caller) fails the request, aborting both nodes.
    pub(crate) fn on(&mut self, ev: Event) -> Action {
        use Abort::{Detach, No, Wait};
        let retry = |prefill: bool, decode: bool, left: u32| {
            if left > 0 {
                Then::Retry {
                    new_prefill: prefill,
                    new_decode: decode,
                }
            } else {
                Then::Fail
            }
        };
        let act = match (self.phase, ev) {
            (Phase::Ended, _) => return Action::new(No, No, Then::Fail),
            (_, Event::ClientGone) => Action::new(Wait, Wait, Then::ClientGone),
            (Phase::Reserve, Event::Reserved) => Action::new(No, No, Then::Go),
            (Phase::Reserve, Event::ReserveFailed(k)) => {
                let then = if invalid(k) {
                    Then::Fail
                } else {
                    retry(false, true, self.attempts_left)
                };
                Action::new(No, failed(k), then)
            }
            (Phase::Prefill, Event::Prefilled { finished: false }) => Action::new(No, No, Then::Go),
            (Phase::Prefill, Event::Prefilled { finished: true }) => {
                // D reserved blocks for a decode that will not come.
                Action::new(No, Wait, Then::Done)
            }
            (Phase::Prefill, Event::PrefillFailed(k)) => {
                let then = if invalid(k) {
                    Then::Fail
                } else {
                    // A colocated worker's decode side goes with it.
                    retry(true, self.colocated, self.attempts_left)
                };
                if self.colocated {
                    // The failed node is the decode node too.
                    Action::new(No, failed(k), then)
                } else {
                    Action::new(failed(k), Wait, then)
                }
            }
            (Phase::Prefill, Event::DecodeLost) => {
                // P is fine and holds the request's blocks: wait for its Abort. D may be dead.
                Action::new(Wait, Detach, retry(false, true, self.attempts_left))
            }
            (Phase::Decode, Event::DecodeFailed(k)) => Action::new(No, failed(k), Then::Fail),
            (Phase::Decode, Event::MoveFailed) => Action::new(No, Wait, Then::Fail),
            (Phase::Decode, Event::StopMatched) => Action::new(No, Wait, Then::Done),
            (Phase::Decode, Event::Finished) => Action::new(No, No, Then::Done),
            (_, _) => Action::new(Wait, Wait, Then::Fail),
        };
        self.phase = match act.then {
            Then::Go => match self.phase {
                Phase::Reserve => Phase::Prefill,
                Phase::Prefill => Phase::Decode,
                p => p,
            },
            Then::Retry { .. } | Then::Fail | Then::Done | Then::ClientGone => Phase::Ended,
        };
        if self.colocated && act.prefill != No {
            // One node, aborted once as the decode node.
            let decode = if act.decode == No {
                act.prefill
            } else {
                act.decode
            };
            return Action::new(No, decode, act.then);
        }
        act
    }
}

#[cfg(test)]
mod tests {
    use super::Abort::{Detach, DetachSuspect, No, Wait};
    use super::*;

    fn retry(p: bool, d: bool) -> Then {
        Then::Retry {
            new_prefill: p,
            new_decode: d,
        }
    }

    #[test]
    fn a_request_that_goes_well_aborts_nothing() {
        let mut f = Flow::new(2);
        assert!(f.begin(false));
        assert_eq!(f.on(Event::Reserved), Action::new(No, No, Then::Go));
        assert_eq!(f.phase(), Phase::Prefill);
        let a = f.on(Event::Prefilled { finished: false });
        assert_eq!(a, Action::new(No, No, Then::Go));
        assert_eq!(f.phase(), Phase::Decode);
        assert_eq!(f.on(Event::Finished), Action::new(No, No, Then::Done));
        assert_eq!(f.phase(), Phase::Ended);
    }

    #[test]
    fn failures_before_the_first_token_are_retried_once_on_another_pair() {
        let mut f = Flow::new(2);
        assert!(f.begin(false));
        // P frozen: its connection lost. Not waited for, suspect; D's reservation freed.
        f.on(Event::Reserved);
        let a = f.on(Event::PrefillFailed(ErrorKind::Unavailable));
        assert_eq!(a, Action::new(DetachSuspect, Wait, retry(true, false)));
        assert!(f.begin(false));
        f.on(Event::Reserved);
        // The second failure is the last: the error goes to the client.
        let a = f.on(Event::PrefillFailed(ErrorKind::Retryable));
        assert_eq!(a, Action::new(Wait, Wait, Then::Fail));
        assert!(!f.begin(false), "no third attempt");
    }

    #[test]
    fn a_failed_reservation_or_a_lost_decode_node_moves_to_another_decode_node() {
        let mut f = Flow::new(2);
        f.begin(false);
        let a = f.on(Event::ReserveFailed(ErrorKind::Timeout));
        assert_eq!(a, Action::new(No, DetachSuspect, retry(false, true)));
        f.begin(false);
        f.on(Event::Reserved);
        let a = f.on(Event::DecodeLost);
        assert_eq!(a, Action::new(Wait, Detach, Then::Fail));
        let mut f = Flow::new(2);
        f.begin(false);
        f.on(Event::Reserved);
        assert_eq!(
            f.on(Event::DecodeLost),
            Action::new(Wait, Detach, retry(false, true))
        );
    }

    #[test]
    fn a_move_failed_at_the_new_node_aborts_the_parked_one_and_suspects_nothing() {
        let mut f = Flow::new(2);
        f.begin(false);
        f.on(Event::Reserved);
        f.on(Event::Prefilled { finished: false });
        assert_eq!(f.on(Event::MoveFailed), Action::new(No, Wait, Then::Fail));
        let mut f = Flow::new(2);
        f.begin(false);
        f.on(Event::Reserved);
        f.on(Event::Prefilled { finished: false });
        assert_eq!(
            f.on(Event::DecodeFailed(ErrorKind::Unavailable)),
            Action::new(No, DetachSuspect, Then::Fail),
            "its own failure suspects the decode node"
        );
    }

    #[test]
    fn invalid_request_verdicts_are_not_retried() {
        for kind in [ErrorKind::InvalidRequest, ErrorKind::ContextLengthExceeded] {
            let mut f = Flow::new(2);
            f.begin(false);
            assert_eq!(f.on(Event::ReserveFailed(kind)).then, Then::Fail);
            let mut f = Flow::new(2);
            f.begin(false);
            f.on(Event::Reserved);
            assert_eq!(f.on(Event::PrefillFailed(kind)).then, Then::Fail);
        }
    }

    #[test]
    fn after_the_first_token_failures_end_the_request() {
        let mut f = Flow::new(2);
        f.begin(false);
        f.on(Event::Reserved);
        f.on(Event::Prefilled { finished: false });
        // D frozen mid-stream: not waited for.
        let a = f.on(Event::DecodeFailed(ErrorKind::Unavailable));
        assert_eq!(a, Action::new(No, DetachSuspect, Then::Fail));
        assert!(
            f.begin(false),
            "a new request could still start; this one ended"
        );

        let mut f = Flow::new(2);
        f.begin(false);
        f.on(Event::Reserved);
        f.on(Event::Prefilled { finished: false });
        let a = f.on(Event::DecodeFailed(ErrorKind::Internal));
        assert_eq!(a, Action::new(No, Wait, Then::Fail));
    }

    #[test]
    fn stops_and_first_token_finishes_abort_the_decode_node() {
        let mut f = Flow::new(2);
        f.begin(false);
        f.on(Event::Reserved);
        assert_eq!(
            f.on(Event::Prefilled { finished: true }),
            Action::new(No, Wait, Then::Done)
        );
        let mut f = Flow::new(2);
        f.begin(false);
        f.on(Event::Reserved);
        f.on(Event::Prefilled { finished: false });
        assert_eq!(f.on(Event::StopMatched), Action::new(No, Wait, Then::Done));
    }

    #[test]
    fn the_client_leaving_aborts_both_nodes_in_every_phase() {
        for steps in 0..3 {
            let mut f = Flow::new(2);
            f.begin(false);
            if steps > 0 {
                f.on(Event::Reserved);
            }
            if steps > 1 {
                f.on(Event::Prefilled { finished: false });
            }
            assert_eq!(
                f.on(Event::ClientGone),
                Action::new(Wait, Wait, Then::ClientGone)
            );
            assert_eq!(f.phase(), Phase::Ended);
        }
    }

    #[test]
    fn a_colocated_worker_is_aborted_once_and_leaves_with_its_decode_side() {
        let mut f = Flow::new(2);
        f.begin(true);
        f.on(Event::Reserved);
        let a = f.on(Event::PrefillFailed(ErrorKind::Unavailable));
        // The one node looked gone: not waited for, left out with its decode side.
        assert_eq!(a, Action::new(No, DetachSuspect, retry(true, true)));
        f.begin(true);
        assert_eq!(
            f.on(Event::ClientGone),
            Action::new(No, Wait, Then::ClientGone)
        );
    }

    #[test]
    fn events_out_of_place_fail_the_request() {
        let mut f = Flow::new(2);
        assert_eq!(f.on(Event::Reserved), Action::new(No, No, Then::Fail));
        f.begin(false);
        assert_eq!(f.on(Event::Finished), Action::new(Wait, Wait, Then::Fail));
        assert_eq!(f.phase(), Phase::Ended);
    }
}
