//! Fencing and verification of the KV hand-off's staging (docs/protocol.md, "Fencing and
//! verification").
//!
//! - Decode side: every staging span a reservation hands out has a *generation* (unique per span
//!   handed out by the node). Behind each rank's KV the prefill node writes a [`FenceRecord`]
//!   (generation, request, length, CRC32C of the rank's bytes) with a put issued only after the
//!   KV puts were flushed, so a record of the span's generation proves that writer's KV puts
//!   all landed. Decode scatters nothing without the record of the span's own generation (a put
//!   of an older reservation never reaches a scatter) and, with `transfer.verify`, nothing whose
//!   bytes do not match the sender's checksum. A span released by an abort, a lease end or a
//!   failed check is *quarantined* until its record shows up or the fence deadline passes.
//! - Prefill side: [`SourceHold`] keeps what a put reads (an arena span, a host staging region)
//!   until every put reading it has finished or failed, whatever happened to the push.
//!
//! Records in host memory are written and read in place; in a GPU node's device arena they go
//! through the engine (a 64-byte copy to or from the rank's GPU), and the checksum of device
//! bytes is KVH64, computed by a kernel. The quarantine sweep reads host records only: a device
//! span's quarantine ends at its fence deadline.

use pdnode_transfer::Completion;
pub use pdnode_transfer::fence::{
    FenceError, FenceRecord, Landed, RECORD_LEN, Sum, SumKind, crc_at, read_record, sum_at,
    write_record,
};
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// What an abandoned push still owes its decode node, run with the hold deadline
/// ([`SourceHold::on_abandon`]).
pub type Abandon = Box<dyn FnOnce(Instant) + Send>;

/// Fencing counters of a node.
#[derive(Debug, Default)]
pub struct FenceCounters {
    /// Spans put in quarantine (abort, lease end, failed check).
    pub quarantined: AtomicU64,
    /// Quarantined spans freed because their writer's record showed it finished.
    pub released_by_record: AtomicU64,
    /// Quarantined spans freed at the fence deadline.
    pub released_at_deadline: AtomicU64,
    /// Hand-offs refused before the scatter because a checksum did not match.
    pub checksum_failures: AtomicU64,
    /// Hand-offs refused before the scatter for a missing, foreign or wrong fence record.
    pub record_failures: AtomicU64,
    /// Prefill: pushes that ended with puts still reading their source (kept until done).
    pub sources_held: AtomicU64,
    /// Prefill: sources whose puts never finished by the hold deadline (kept forever).
    pub sources_leaked: AtomicU64,
}

/// A snapshot of [`FenceCounters`] plus the quarantine's current size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FenceStats {
    pub quarantined_now: u64,
    pub quarantined: u64,
    pub released_by_record: u64,
    pub released_at_deadline: u64,
    pub checksum_failures: u64,
    pub record_failures: u64,
    pub sources_held: u64,
    pub sources_leaked: u64,
}

impl FenceCounters {
    pub fn snapshot(&self, quarantined_now: u64) -> FenceStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FenceStats {
            quarantined_now,
            quarantined: l(&self.quarantined),
            released_by_record: l(&self.released_by_record),
            released_at_deadline: l(&self.released_at_deadline),
            checksum_failures: l(&self.checksum_failures),
            record_failures: l(&self.record_failures),
            sources_held: l(&self.sources_held),
            sources_leaked: l(&self.sources_leaked),
        }
    }
}

/// Prefill side: what the puts of one push read (an arena span, a host staging region), kept
/// until every put has finished or failed. Dropped with puts still in flight (a timed-out or
/// failed push, a dropped call), it hands them to a thread that waits for them until `until`;
/// a source whose puts never finish by then is never freed (logged, counted): a put still
/// reading it must not read another request's bytes, nor may the next owner's gather race it.
pub struct SourceHold {
    puts: Vec<Completion>,
    keep: Option<Box<dyn Any + Send>>,
    /// A share of the arena span `keep` holds, for the engine commands that write into it
    /// ([`SourceHold::span`]); `None` for a source that is not an arena span.
    span: Option<pdnode_engine::engine::SpanHold>,
    /// Run once every put is over, when the push was abandoned (see [`SourceHold::on_abandon`]).
    abandon: Option<Abandon>,
    until: Instant,
    counters: std::sync::Arc<FenceCounters>,
}

impl SourceHold {
    pub fn new(
        keep: Box<dyn Any + Send>,
        until: Instant,
        counters: std::sync::Arc<FenceCounters>,
    ) -> Self {
        Self {
            puts: Vec::new(),
            abandon: None,
            keep: Some(keep),
            span: None,
            until,
            counters,
        }
    }

    /// A hold of an arena span the engine writes into (its gathers, its fence records): the
    /// span is freed once this hold and every engine command given [`SourceHold::span`] are
    /// done with it.
    pub fn of_span(
        span: pdnode_engine::engine::SpanHold,
        until: Instant,
        counters: std::sync::Arc<FenceCounters>,
    ) -> Self {
        let mut hold = Self::new(Box::new(span.clone()), until, counters);
        hold.span = Some(span);
        hold
    }

    /// A share of the held arena span, for an engine command that writes into it.
    pub fn span(&self) -> Option<pdnode_engine::engine::SpanHold> {
        self.span.clone()
    }

    /// A put that reads the held source.
    pub fn push(&mut self, put: Completion) {
        self.puts.push(put);
    }

    pub fn puts(&self) -> &[Completion] {
        &self.puts
    }

    /// `f` runs on the hold's thread once every put finished or failed (never when one is
    /// still in flight at the hold deadline), before the source is freed, given the hold
    /// deadline: the prefill node's "abandoned" fence record, which ends the decode node's
    /// quarantine early. Armed when the puts start; [`SourceHold::settled`] disarms it.
    pub fn on_abandon(&mut self, f: Abandon) {
        self.abandon = Some(f);
    }

    /// The push finished (its records are out): nothing is owed when the hold ends.
    pub fn settled(&mut self) {
        self.abandon = None;
    }

    fn in_flight(&self) -> bool {
        self.puts.iter().any(|p| p.try_result().is_none())
    }
}

impl Drop for SourceHold {
    fn drop(&mut self) {
        let abandon = self.abandon.take();
        if !self.in_flight() && abandon.is_none() {
            return;
        }
        let in_flight = self.in_flight();
        let puts = std::mem::take(&mut self.puts);
        // Shared with the waiting thread: if that thread cannot start, the reference kept here
        // is forgotten, so the source is never freed under its puts.
        let keep = std::sync::Arc::new(std::sync::Mutex::new(self.keep.take()));
        let theirs = keep.clone();
        let until = self.until;
        let counters = self.counters.clone();
        if in_flight {
            counters.sources_held.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                puts = puts.len(),
                "KV push ended with puts in flight: their source is kept until they finish"
            );
        }
        let wait = move || {
            for p in &puts {
                let _ = p.wait(until);
            }
            if puts.iter().all(|p| p.try_result().is_some()) {
                if let Some(f) = abandon {
                    f(until);
                }
                drop(theirs);
            } else {
                counters.sources_leaked.fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    "KV puts never finished: their source staging is never reused (leaked)"
                );
                std::mem::forget(theirs);
            }
        };
        match std::thread::Builder::new()
            .name("kv-source-hold".into())
            .spawn(wait)
        {
            Ok(_) => drop(keep),
            Err(e) => {
                tracing::error!(error = %e,
                    "cannot start the thread that keeps a KV source for its puts: never reused");
                std::mem::forget(keep);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drops when its flag's owner checks.
    struct Flag(std::sync::Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn wait_for(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out: {what}");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }

    #[test]
    fn a_source_outlives_the_puts_that_read_it() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicBool;
        let counters = Arc::new(FenceCounters::default());
        let until = Instant::now() + std::time::Duration::from_secs(5);

        // Every put done: freed with the hold.
        let freed = Arc::new(AtomicBool::new(false));
        let mut hold = SourceHold::new(Box::new(Flag(freed.clone())), until, counters.clone());
        hold.push(Completion::ready("put", Ok(())));
        drop(hold);
        assert!(freed.load(Ordering::SeqCst));

        // A put still in flight (the push timed out or its call was dropped): kept until the
        // put finishes, even with an error.
        let freed = Arc::new(AtomicBool::new(false));
        let (put, completer) = Completion::pending("put", "test");
        let mut hold = SourceHold::new(Box::new(Flag(freed.clone())), until, counters.clone());
        hold.push(put);
        drop(hold);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!freed.load(Ordering::SeqCst), "freed under a put in flight");
        completer.complete(Err(pdnode_transfer::TransferError::Timeout {
            what: "test".into(),
        }));
        wait_for("source freed after its put", || {
            freed.load(Ordering::SeqCst)
        });
        assert_eq!(counters.snapshot(0).sources_held, 1);

        // A put that never finishes by the hold deadline: never freed, counted.
        let freed = Arc::new(AtomicBool::new(false));
        let (put, _completer) = Completion::pending("put", "test");
        let soon = Instant::now() + std::time::Duration::from_millis(30);
        let mut hold = SourceHold::new(Box::new(Flag(freed.clone())), soon, counters.clone());
        hold.push(put);
        drop(hold);
        wait_for("leak counted", || counters.snapshot(0).sources_leaked == 1);
        assert!(!freed.load(Ordering::SeqCst));
    }

    #[test]
    fn an_armed_hold_sends_what_it_owes_after_its_puts_and_a_settled_one_does_not() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicBool;
        let counters = Arc::new(FenceCounters::default());
        let until = Instant::now() + std::time::Duration::from_secs(5);
        let sent = Arc::new(std::sync::Mutex::new(None::<Instant>));

        // Armed, a put still in flight: the abandoned record goes only once the put is over,
        // given the hold deadline, and before the source is freed.
        let freed = Arc::new(AtomicBool::new(false));
        let (put, completer) = Completion::pending("put", "test");
        let mut hold = SourceHold::new(Box::new(Flag(freed.clone())), until, counters.clone());
        hold.push(put);
        let (s, f) = (sent.clone(), freed.clone());
        hold.on_abandon(Box::new(move |at| {
            assert!(
                !f.load(Ordering::SeqCst),
                "source freed before the record went"
            );
            *s.lock().unwrap() = Some(at);
        }));
        drop(hold);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(
            sent.lock().unwrap().is_none(),
            "record sent under a put in flight"
        );
        completer.complete(Ok(()));
        wait_for("source freed", || freed.load(Ordering::SeqCst));
        assert_eq!(*sent.lock().unwrap(), Some(until));

        // Settled (the push finished): nothing is owed.
        *sent.lock().unwrap() = None;
        let mut hold = SourceHold::new(Box::new(Flag(freed.clone())), until, counters.clone());
        hold.push(Completion::ready("put", Ok(())));
        let s = sent.clone();
        hold.on_abandon(Box::new(move |at| *s.lock().unwrap() = Some(at)));
        hold.settled();
        drop(hold);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(
            sent.lock().unwrap().is_none(),
            "a settled push sent an abandoned record"
        );
    }
}
