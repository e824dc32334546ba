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
//! Records are written and read in host memory only: a decode node whose staging arena is device
//! memory does not ask for them (its spans are quarantined until the fence deadline).

use pdnode_transfer::checksum::crc32c;
use pdnode_transfer::{Completion, MemKind, Registration};
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Bytes of a fence record (a multiple of 8; the staging allocator aligns spans anyway).
pub const RECORD_LEN: usize = 64;
const MAGIC: [u8; 8] = *b"PDKVFNC1";
/// Flag: the record carries the CRC32C of the rank's bytes.
const HAS_CRC: u32 = 1;
/// Flag: the writer abandoned the push (its puts are over, the bytes are not the whole KV).
const ABORTED: u32 = 2;

/// What the prefill node writes behind one rank's KV in the decode node's staging span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceRecord {
    pub generation: u64,
    pub request: u64,
    /// Bytes of KV in front of the record.
    pub len: u64,
    /// CRC32C of those bytes, when the decode node asked for it.
    pub crc: Option<u32>,
    /// The writer gave the push up; its puts are all over (the span may be freed, never
    /// scattered).
    pub aborted: bool,
}

/// Why landed KV is not scattered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FenceError {
    #[error(
        "rank {rank}: no intact fence record (the writer never finished, or the record is torn)"
    )]
    Missing { rank: usize },
    #[error(
        "rank {rank}: fence record of generation {found}, the span's is {want} (a put of another reservation)"
    )]
    Generation { rank: usize, found: u64, want: u64 },
    #[error(
        "rank {rank}: fence record for request {found_request:x} with {found_len} bytes, expected {want_request:x} with {want_len}"
    )]
    Describes {
        rank: usize,
        found_request: u64,
        found_len: u64,
        want_request: u64,
        want_len: u64,
    },
    #[error("rank {rank}: the writer abandoned this push")]
    Aborted { rank: usize },
    #[error("rank {rank}: the fence record carries no checksum but transfer.verify is on")]
    NoChecksum { rank: usize },
    #[error("rank {rank}: CRC32C {found:08x} of the landed bytes, the sender's is {want:08x}")]
    Checksum { rank: usize, found: u32, want: u32 },
    #[error("staging of {len} bytes at {offset} is outside or not host memory ({what})")]
    NotHost {
        what: &'static str,
        offset: usize,
        len: usize,
    },
}

impl FenceError {
    /// Whether the bytes were there but wrong (counted as an integrity failure).
    pub fn is_checksum(&self) -> bool {
        matches!(self, FenceError::Checksum { .. })
    }
}

impl FenceRecord {
    pub fn encode(&self) -> [u8; RECORD_LEN] {
        let mut b = [0u8; RECORD_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b[16..24].copy_from_slice(&self.request.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        let (mut flags, crc) = match self.crc {
            Some(c) => (HAS_CRC, c),
            None => (0, 0),
        };
        if self.aborted {
            flags |= ABORTED;
        }
        b[32..36].copy_from_slice(&flags.to_le_bytes());
        b[36..40].copy_from_slice(&crc.to_le_bytes());
        let own = crc32c(&b[..RECORD_LEN - 4]);
        b[RECORD_LEN - 4..].copy_from_slice(&own.to_le_bytes());
        b
    }

    /// `None` when `b` is not an intact record (wrong magic, torn, or too short).
    pub fn decode(b: &[u8]) -> Option<Self> {
        let b: &[u8; RECORD_LEN] = b.get(..RECORD_LEN)?.try_into().ok()?;
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let u32_at = |i: usize| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&b[i..i + 4]);
            u32::from_le_bytes(w)
        };
        if b[0..8] != MAGIC || u32_at(RECORD_LEN - 4) != crc32c(&b[..RECORD_LEN - 4]) {
            return None;
        }
        Some(FenceRecord {
            generation: u64_at(8),
            request: u64_at(16),
            len: u64_at(24),
            crc: (u32_at(32) & HAS_CRC != 0).then(|| u32_at(36)),
            aborted: u32_at(32) & ABORTED != 0,
        })
    }

    /// Checks this record (of `rank`) against what the decode node handed out; `crc` is the
    /// checksum of the landed bytes when verification is on.
    pub fn check(
        &self,
        rank: usize,
        generation: u64,
        request: u64,
        len: u64,
        crc: Option<u32>,
    ) -> Result<(), FenceError> {
        if self.aborted {
            return Err(FenceError::Aborted { rank });
        }
        if self.generation != generation {
            return Err(FenceError::Generation {
                rank,
                found: self.generation,
                want: generation,
            });
        }
        if self.request != request || self.len != len {
            return Err(FenceError::Describes {
                rank,
                found_request: self.request,
                found_len: self.len,
                want_request: request,
                want_len: len,
            });
        }
        match (crc, self.crc) {
            (None, _) => Ok(()),
            (Some(_), None) => Err(FenceError::NoChecksum { rank }),
            (Some(found), Some(want)) if found != want => {
                Err(FenceError::Checksum { rank, found, want })
            }
            _ => Ok(()),
        }
    }
}

/// `len` bytes at `offset` of a registered host region, bounds-checked.
fn host_ptr(reg: &Registration, offset: usize, len: usize) -> Result<*mut u8, FenceError> {
    let r = reg.region();
    let end = offset.checked_add(len);
    if r.mem != MemKind::Host || end.is_none_or(|e| e > r.len) {
        return Err(FenceError::NotHost {
            what: "staging region",
            offset,
            len,
        });
    }
    Ok((r.addr + offset) as *mut u8)
}

/// CRC32C of `len` bytes at `offset` of a registered host region.
pub fn crc_at(reg: &Registration, offset: usize, len: usize) -> Result<u32, FenceError> {
    let p = host_ptr(reg, offset, len)?;
    // SAFETY: `host_ptr` checked that the range lies inside the registration's host memory,
    // which stays allocated while `reg` lives. A remote writer (a late put) may change these
    // bytes while they are read: any bit pattern is a valid `u8`, and a changed byte only
    // changes the checksum, which is what the check is for.
    let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
    Ok(crc32c(bytes))
}

/// The fence record at `offset` of a registered host region, if an intact one is there.
pub fn read_record(reg: &Registration, offset: usize) -> Result<Option<FenceRecord>, FenceError> {
    let p = host_ptr(reg, offset, RECORD_LEN)?;
    let mut b = [0u8; RECORD_LEN];
    // SAFETY: in bounds of the registration's host memory (checked by `host_ptr`); copied out
    // before it is parsed, so a concurrent remote write can only make the record torn, which
    // its own checksum detects.
    unsafe { std::ptr::copy_nonoverlapping(p as *const u8, b.as_mut_ptr(), RECORD_LEN) };
    Ok(FenceRecord::decode(&b))
}

/// Writes `record` at `offset` of a registered host region (the prefill node's put source).
pub fn write_record(
    reg: &Registration,
    offset: usize,
    record: &FenceRecord,
) -> Result<(), FenceError> {
    let p = host_ptr(reg, offset, RECORD_LEN)?;
    let b = record.encode();
    // SAFETY: in bounds of the registration's host memory (checked by `host_ptr`); this range
    // belongs to the caller's span (or fresh region) and no put reads it yet.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), p, RECORD_LEN) };
    Ok(())
}

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
    /// Run once every put is over, when the push was abandoned (see [`SourceHold::on_abandon`]).
    abandon: Option<Box<dyn FnOnce() + Send>>,
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
            until,
            counters,
        }
    }

    /// A put that reads the held source.
    pub fn push(&mut self, put: Completion) {
        self.puts.push(put);
    }

    pub fn puts(&self) -> &[Completion] {
        &self.puts
    }

    /// `f` runs on the hold's thread once every put finished or failed (never when one is
    /// still in flight at the hold deadline), before the source is freed: the prefill node's
    /// "abandoned" fence record, which ends the decode node's quarantine early.
    pub fn on_abandon(&mut self, f: Box<dyn FnOnce() + Send>) {
        self.abandon = Some(f);
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
                    f();
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

    #[test]
    fn record_round_trip_and_torn_records() {
        let r = FenceRecord {
            generation: 7,
            request: 0xabc,
            len: 4096,
            crc: Some(0xdead_beef),
            aborted: false,
        };
        let b = r.encode();
        assert_eq!(FenceRecord::decode(&b), Some(r));
        let gone = FenceRecord { aborted: true, ..r };
        assert_eq!(FenceRecord::decode(&gone.encode()), Some(gone));
        assert!(matches!(
            gone.check(0, 7, 0xabc, 4096, None),
            Err(FenceError::Aborted { rank: 0 })
        ));
        for i in [0, 9, 20, 33, 37, 63] {
            let mut t = b;
            t[i] ^= 1;
            assert_eq!(FenceRecord::decode(&t), None, "byte {i} flipped");
        }
        assert_eq!(FenceRecord::decode(&b[..10]), None);
        assert_eq!(FenceRecord::decode(&[0u8; RECORD_LEN]), None);
        let plain = FenceRecord { crc: None, ..r };
        assert_eq!(FenceRecord::decode(&plain.encode()), Some(plain));
    }

    #[test]
    fn checks_name_what_differs() {
        let r = FenceRecord {
            generation: 3,
            request: 9,
            len: 100,
            crc: Some(5),
            aborted: false,
        };
        assert_eq!(r.check(0, 3, 9, 100, Some(5)), Ok(()));
        assert_eq!(r.check(0, 3, 9, 100, None), Ok(()));
        assert!(matches!(
            r.check(1, 4, 9, 100, None),
            Err(FenceError::Generation {
                rank: 1,
                found: 3,
                want: 4
            })
        ));
        assert!(matches!(
            r.check(0, 3, 8, 100, None),
            Err(FenceError::Describes { .. })
        ));
        assert!(matches!(
            r.check(0, 3, 9, 100, Some(6)),
            Err(FenceError::Checksum { .. })
        ));
        let plain = FenceRecord { crc: None, ..r };
        assert!(matches!(
            plain.check(0, 3, 9, 100, Some(6)),
            Err(FenceError::NoChecksum { .. })
        ));
    }

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
}
