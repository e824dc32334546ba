//! The KV staging arenas of a prefill or decode node: one region per TP rank, allocated by the
//! engine's backend once (device memory on CUDA; UCX-allocated host memory lent to the CPU
//! backend) and registered once with the node's UCX transport, then sub-allocated per request
//! by a first-fit [`RangeAllocator`]. An [`ArenaSlice`] is one request's span (the same offset
//! in every rank's arena); dropping it frees the span, so every exit path frees it.

use pdnode_engine::backend::{KvRegion, MemKind as EngineMem, STAGING_ALIGN};
use pdnode_transfer::{KvTransport, LocalRegion, MemKind, Registration, UcxTransport};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::Notify;

/// First fit over `0..len` in multiples of [`STAGING_ALIGN`]; free ranges kept sorted and
/// coalesced.
#[derive(Debug)]
pub struct RangeAllocator {
    len: usize,
    free: Vec<Range<usize>>,
}

fn round_up(n: usize) -> Option<usize> {
    n.checked_next_multiple_of(STAGING_ALIGN)
}

impl RangeAllocator {
    /// An allocator over `len` bytes (rounded down to the alignment).
    pub fn new(len: usize) -> Self {
        let len = len - len % STAGING_ALIGN;
        Self {
            len,
            free: std::iter::once(0..len).filter(|r| !r.is_empty()).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn free_bytes(&self) -> usize {
        self.free.iter().map(|r| r.end - r.start).sum()
    }

    /// The first free span of at least `n` bytes (rounded up to the alignment): its offset and
    /// length. `None` when none fits (or `n` is 0).
    pub fn alloc(&mut self, n: usize) -> Option<(usize, usize)> {
        let n = round_up(n).filter(|n| *n > 0)?;
        let i = self.free.iter().position(|r| r.end - r.start >= n)?;
        let start = self.free[i].start;
        if self.free[i].end - start == n {
            self.free.remove(i);
        } else {
            self.free[i].start += n;
        }
        Some((start, n))
    }

    /// Returns a span from [`RangeAllocator::alloc`]. A span that overlaps a free one (a double
    /// free) or lies outside the arena is ignored and reported as `false`.
    pub fn free(&mut self, offset: usize, n: usize) -> bool {
        let Some(end) = offset.checked_add(n).filter(|e| *e <= self.len && n > 0) else {
            return false;
        };
        let i = self.free.partition_point(|r| r.start < offset);
        let overlaps_prev = i > 0 && self.free[i - 1].end > offset;
        let overlaps_next = i < self.free.len() && self.free[i].start < end;
        if overlaps_prev || overlaps_next {
            return false;
        }
        let merge_prev = i > 0 && self.free[i - 1].end == offset;
        let merge_next = i < self.free.len() && self.free[i].start == end;
        match (merge_prev, merge_next) {
            (true, true) => {
                self.free[i - 1].end = self.free[i].end;
                self.free.remove(i);
            }
            (true, false) => self.free[i - 1].end = end,
            (false, true) => self.free[i].start = offset,
            (false, false) => self.free.insert(i, offset..end),
        }
        true
    }
}

/// Every TP rank's registered staging arena, and the allocator over their common offsets.
pub struct StagingArena {
    regs: Vec<Arc<Registration>>,
    device: bool,
    alloc: Mutex<RangeAllocator>,
    /// Woken (every waiter) whenever a slice is freed.
    freed: Notify,
    /// Reservations that found the arena full and waited ([`StagingArena::reserve_wait`]),
    /// and those of them that gave up at their deadline.
    waits: AtomicU64,
    wait_timeouts: AtomicU64,
}

impl std::fmt::Debug for StagingArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingArena")
            .field("ranks", &self.regs.len())
            .field("device", &self.device)
            .field("alloc", &self.alloc)
            .field("waits", &self.waits)
            .field("wait_timeouts", &self.wait_timeouts)
            .finish()
    }
}

impl StagingArena {
    /// Over `regs` (one per rank, in rank order); the usable length is the shortest one.
    pub fn new(regs: Vec<Arc<Registration>>) -> Option<Arc<Self>> {
        let len = regs.iter().map(|r| r.region().len).min()?;
        let device = regs
            .iter()
            .all(|r| r.region().mem != pdnode_transfer::MemKind::Host);
        Some(Arc::new(Self {
            regs,
            device,
            alloc: Mutex::new(RangeAllocator::new(len)),
            freed: Notify::new(),
            waits: AtomicU64::new(0),
            wait_timeouts: AtomicU64::new(0),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RangeAllocator> {
        self.alloc.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn ranks(&self) -> usize {
        self.regs.len()
    }

    /// Rank `r`'s registration (put source on prefill, rkey owner on decode).
    pub fn registration(&self, rank: usize) -> Option<&Registration> {
        self.regs.get(rank).map(|r| r.as_ref())
    }

    /// Whether the arenas are device memory.
    pub fn is_device(&self) -> bool {
        self.device
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn free_bytes(&self) -> usize {
        self.lock().free_bytes()
    }

    /// Whether no slice is out.
    pub fn all_free(&self) -> bool {
        let a = self.lock();
        a.free_bytes() == a.len()
    }

    /// A span of `n` bytes at one offset of every rank's arena; `None` when the arena is full.
    pub fn reserve(self: &Arc<Self>, n: usize) -> Option<ArenaSlice> {
        let (offset, len) = self.lock().alloc(n)?;
        Some(ArenaSlice {
            arena: self.clone(),
            offset,
            len,
        })
    }

    /// As [`StagingArena::reserve`], but when the arena is momentarily full, waits (woken each
    /// time a slice is freed) until a span fits or `deadline` passes. `None` at once when `n`
    /// can never fit (0 or larger than the arena), or at the deadline (counted in
    /// [`StagingArena::wait_counts`]).
    pub async fn reserve_wait(self: &Arc<Self>, n: usize, deadline: Instant) -> Option<ArenaSlice> {
        if n == 0 || n > self.len() {
            return None;
        }
        if let Some(s) = self.reserve(n) {
            return Some(s);
        }
        self.waits.fetch_add(1, Ordering::Relaxed);
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Registered before the re-check, so a free between the two is not missed.
            freed.as_mut().enable();
            if let Some(s) = self.reserve(n) {
                return Some(s);
            }
            if tokio::time::timeout_at(deadline.into(), freed)
                .await
                .is_err()
            {
                // One last look: a free may have raced the timer.
                let last = self.reserve(n);
                if last.is_none() {
                    self.wait_timeouts.fetch_add(1, Ordering::Relaxed);
                }
                return last;
            }
        }
    }

    /// Reservations that waited for room, and those that gave up at their deadline.
    pub fn wait_counts(&self) -> (u64, u64) {
        (
            self.waits.load(Ordering::Relaxed),
            self.wait_timeouts.load(Ordering::Relaxed),
        )
    }
}

/// One request's span of the arenas; freed on drop.
#[derive(Debug)]
pub struct ArenaSlice {
    arena: Arc<StagingArena>,
    offset: usize,
    len: usize,
}

impl ArenaSlice {
    pub fn offset(&self) -> usize {
        self.offset
    }

    pub fn arena(&self) -> &Arc<StagingArena> {
        &self.arena
    }
}

impl Drop for ArenaSlice {
    fn drop(&mut self) {
        let freed = self.arena.lock().free(self.offset, self.len);
        debug_assert!(
            freed,
            "staging slice {}+{} freed twice",
            self.offset, self.len
        );
        self.arena.freed.notify_waiters();
    }
}

/// Registers the engine's staging regions (`EngineInfo::staging_regions`) with `t`, once: a
/// host region the node lent the engine (`host`, registered when it was allocated) is reused,
/// any other is registered here (device memory through UCX's CUDA transports). `None` when the
/// engine has no arena or a registration fails (logged: the node then stages through the host).
pub fn register(
    t: &UcxTransport,
    regions: &[KvRegion],
    host: Option<Arc<Registration>>,
) -> Option<Arc<StagingArena>> {
    let mut regs = Vec::with_capacity(regions.len());
    for (rank, region) in regions.iter().enumerate() {
        if let Some(h) = host
            .as_ref()
            .filter(|h| h.region().addr as u64 == region.ptr && h.region().len >= region.len)
        {
            regs.push(h.clone());
            continue;
        }
        let mem = match region.mem {
            EngineMem::Host => MemKind::Host,
            EngineMem::Cuda(ordinal) => MemKind::Cuda(ordinal),
        };
        let local = LocalRegion {
            addr: region.ptr as usize,
            len: region.len,
            mem,
        };
        // SAFETY: the engine's backend allocated this arena once and keeps it for its whole
        // life (`KvStaging`); the node (its `PdNode`, which holds these registrations) is
        // dropped before its engine (`ServingNode` field order). Peers write only the span a
        // reservation handed them, which nothing else uses until it is freed.
        match unsafe { t.register(local) } {
            Ok(r) => regs.push(Arc::new(r)),
            Err(e) => {
                tracing::warn!(rank, mem = %mem, len = region.len, error = %e,
                    "cannot register the KV staging arena: the hand-off stages through the host");
                return None;
            }
        }
    }
    let arena = StagingArena::new(regs)?;
    tracing::info!(
        ranks = arena.ranks(),
        bytes = arena.len(),
        device = arena.is_device(),
        "KV staging arena registered"
    );
    Some(arena)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: usize = STAGING_ALIGN;

    #[test]
    fn first_fit_rounds_and_fills_up() {
        let mut a = RangeAllocator::new(4 * A + 7);
        assert_eq!(a.len(), 4 * A);
        assert_eq!(a.alloc(0), None);
        assert_eq!(a.alloc(1), Some((0, A)));
        assert_eq!(a.alloc(A + 1), Some((A, 2 * A)));
        assert_eq!(a.alloc(2 * A), None, "only one span left");
        assert_eq!(a.alloc(A), Some((3 * A, A)));
        assert_eq!(a.free_bytes(), 0);
        assert_eq!(a.alloc(1), None, "full");
        assert_eq!(a.alloc(usize::MAX), None);
    }

    #[test]
    fn fragmentation_and_coalescing() {
        let mut a = RangeAllocator::new(4 * A);
        let s: Vec<_> = (0..4).map(|_| a.alloc(A).unwrap()).collect();
        assert!(a.free(s[0].0, s[0].1));
        assert!(a.free(s[2].0, s[2].1));
        assert_eq!(a.free_bytes(), 2 * A);
        assert_eq!(a.alloc(2 * A), None, "two holes of one span each");
        assert!(a.free(s[1].0, s[1].1), "merges with both neighbours");
        assert_eq!(a.alloc(3 * A), Some((0, 3 * A)));
        assert!(a.free(0, 3 * A));
        assert!(a.free(s[3].0, s[3].1));
        assert_eq!((a.free.len(), a.free_bytes()), (1, 4 * A));
    }

    #[test]
    fn double_free_and_out_of_range_are_refused() {
        let mut a = RangeAllocator::new(2 * A);
        let (o, n) = a.alloc(A).unwrap();
        assert!(a.free(o, n));
        assert!(!a.free(o, n), "double free");
        assert!(!a.free(A, 2 * A), "past the end");
        assert!(!a.free(usize::MAX, 2), "overflow");
        assert_eq!((a.free.len(), a.free_bytes()), (1, 2 * A));
    }

    #[test]
    fn empty_arena_allocates_nothing() {
        let mut a = RangeAllocator::new(A - 1);
        assert!(a.is_empty());
        assert_eq!(a.alloc(1), None);
    }
}
