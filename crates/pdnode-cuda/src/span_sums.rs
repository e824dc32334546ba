//! Which staging-arena spans are hashed by the copies that fill them (issue 15: verifying a
//! device hand-off at the cost of its copies). A prefill's KV reaches its span in many gathers
//! (one per prompt chunk after its step, one per layer group inside the step that ends the
//! prompt); each gather into a registered span runs `kv_gather_h64` and adds the KVH64 terms of
//! the words it writes to the span's device sum, at their span-relative word index, so the
//! seal reads one `u64` instead of reading the span again.
//!
//! The sum is the span's hash only if every byte of it was written by a hashed copy exactly
//! once. This bookkeeping (host side, no GPU) tracks what each span's copies covered: a copy
//! that overlaps what was hashed already, that reaches past the span, or a write that does not
//! hash (a record, a test's poke) **breaks** the span, and the seal then hashes the span in one
//! separate pass, as before. So a wrong sum can only come from a copy that skipped this
//! bookkeeping, which no path does.

/// Spans hashed at once per GPU (device sum words): more than any arena holds hand-offs in
/// flight in practice; past it the least recently begun registration goes (a request aborted
/// before its seal leaves one behind) and that span's seal falls back to the pass.
pub(crate) const SLOTS: usize = 64;

/// One registered span.
#[derive(Debug)]
struct Span {
    offset: usize,
    len: usize,
    slot: usize,
    /// Span-relative byte ranges hashed, sorted, disjoint.
    covered: Vec<(usize, usize)>,
    broken: bool,
    begun: u64,
}

impl Span {
    fn overlaps(&self, start: usize, end: usize) -> bool {
        start < self.offset + self.len && self.offset < end
    }

    /// Whether span-relative `a .. b` overlaps what was hashed: `covered` is sorted and
    /// disjoint, so only the last range starting before `b` can reach past `a` (a search, not
    /// a scan: a span gets one range per layer per chunk, hundreds by its last chunk).
    fn hashed_within(&self, a: usize, b: usize) -> bool {
        let i = self.covered.partition_point(|&(x, _)| x < b);
        i > 0 && self.covered[i - 1].1 > a
    }
}

/// The registered spans of one GPU's arena.
#[derive(Debug, Default)]
pub(crate) struct SpanSums {
    spans: Vec<Span>,
    clock: u64,
}

/// Where a copy into a registered span adds its terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HashedCopy {
    /// The span's sum word (index into the device slots).
    pub slot: usize,
    /// Span-relative index of the copy's first 16-byte word.
    pub word0: u64,
}

impl SpanSums {
    /// Registers `offset .. offset + len` and returns its slot, which the caller zeroes on the
    /// stream before any copy into the span. A registration that overlaps it goes (its span
    /// was freed and handed out again); with every slot taken the least recently begun goes.
    pub(crate) fn begin(&mut self, offset: usize, len: usize) -> usize {
        let end = offset.saturating_add(len);
        self.spans.retain(|s| !s.overlaps(offset, end));
        if self.spans.len() >= SLOTS
            && let Some(oldest) = (0..self.spans.len()).min_by_key(|&i| self.spans[i].begun)
        {
            self.spans.swap_remove(oldest);
        }
        let slot = (0..SLOTS)
            .find(|k| self.spans.iter().all(|s| s.slot != *k))
            .unwrap_or(0);
        self.clock += 1;
        self.spans.push(Span {
            offset,
            len,
            slot,
            covered: Vec::new(),
            broken: false,
            begun: self.clock,
        });
        slot
    }

    /// [`SpanSums::copy_strided`] of one range.
    #[cfg(test)]
    pub(crate) fn copy(&mut self, start: usize, len: usize) -> Option<HashedCopy> {
        self.copy_strided(start, len, len, 1)
    }

    /// A copy about to write `n` ranges of `len` bytes, the first at `start`, each `stride`
    /// after the one before (one launch over a span's layers): where it adds its terms (the
    /// span-relative index of its first word; the others follow at `stride`) when every range
    /// lies inside one registered span, clear of each other and of what was hashed there, and
    /// starts on a whole word of it (recorded as covered). `None` otherwise, and every span a
    /// range touches is broken (its seal hashes anew).
    pub(crate) fn copy_strided(
        &mut self,
        start: usize,
        len: usize,
        stride: usize,
        n: usize,
    ) -> Option<HashedCopy> {
        if len == 0 || n == 0 {
            return None;
        }
        let ranges: Vec<(usize, usize)> = (0..n)
            .map(|i| {
                let a = start.saturating_add(i.saturating_mul(stride));
                (a, a.saturating_add(len))
            })
            .collect();
        let (s0, e0) = ranges[0];
        let found = self.spans.iter().position(|s| s.overlaps(s0, e0));
        let fits = |s: &Span| {
            !s.broken
                && (n == 1 || stride >= len)
                && ranges.iter().all(|&(a, b)| {
                    a >= s.offset
                        && b <= s.offset + s.len
                        && !s.hashed_within(a - s.offset, b - s.offset)
                })
                && (start - s.offset).is_multiple_of(16)
        };
        let Some(i) = found.filter(|&i| fits(&self.spans[i])) else {
            for &(a, b) in &ranges {
                self.touch(a, b - a);
            }
            return None;
        };
        let s = &mut self.spans[i];
        for &(a, b) in &ranges {
            let (a, b) = (a - s.offset, b - s.offset);
            let at = s.covered.partition_point(|&(x, _)| x < a);
            s.covered.insert(at, (a, b));
        }
        Some(HashedCopy {
            slot: s.slot,
            word0: ((start - s.offset) / 16) as u64,
        })
    }

    /// A write of `start .. start + len` that does not hash: every span it touches is broken.
    pub(crate) fn touch(&mut self, start: usize, len: usize) {
        let end = start.saturating_add(len);
        for s in self.spans.iter_mut().filter(|s| s.overlaps(start, end)) {
            s.broken = true;
        }
    }

    /// At the seal of `offset .. offset + len`: its slot when exactly that span is registered,
    /// unbroken and covered once in full by hashed copies. The registration goes either way.
    pub(crate) fn finish(&mut self, offset: usize, len: usize) -> Option<usize> {
        let i = self
            .spans
            .iter()
            .position(|s| s.offset == offset && s.len == len)?;
        let s = self.spans.swap_remove(i);
        let mut at = 0;
        for &(a, b) in &s.covered {
            if a != at {
                return None;
            }
            at = b;
        }
        (!s.broken && at == len).then_some(s.slot)
    }

    /// Registrations held now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.spans.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_that_cover_a_span_once_give_its_slot_at_the_seal() {
        let mut s = SpanSums::default();
        let slot = s.begin(4096, 1024);
        // Out of order, as chunk gathers and layer groups land: [512, 1024), [0, 256), [256, 512).
        assert_eq!(
            s.copy(4096 + 512, 512),
            Some(HashedCopy { slot, word0: 32 })
        );
        assert_eq!(s.copy(4096, 256), Some(HashedCopy { slot, word0: 0 }));
        assert_eq!(
            s.copy(4096 + 256, 256),
            Some(HashedCopy { slot, word0: 16 })
        );
        // Outside every span: not hashed, nothing broken.
        assert_eq!(s.copy(0, 4096), None);
        assert_eq!(s.copy(4096 + 1024, 64), None);
        assert_eq!(s.finish(4096, 1024), Some(slot));
        assert_eq!(s.len(), 0, "the registration goes at the seal");
        assert_eq!(s.finish(4096, 1024), None, "sealed once");
    }

    #[test]
    fn a_gap_an_overlap_a_straddle_or_a_plain_write_sends_the_seal_to_the_pass() {
        // A gap: the sum lacks the words nobody hashed.
        let mut s = SpanSums::default();
        s.begin(0, 1024);
        assert!(s.copy(0, 512).is_some());
        assert!(s.copy(768, 256).is_some());
        assert_eq!(s.finish(0, 1024), None);
        // The same words twice: summed twice.
        s.begin(0, 1024);
        assert!(s.copy(0, 512).is_some());
        assert_eq!(s.copy(256, 512), None);
        assert!(s.copy(512, 512).is_none(), "broken: nothing more is hashed");
        assert_eq!(s.finish(0, 1024), None);
        // A copy reaching past the span.
        s.begin(0, 1024);
        assert!(s.copy(0, 512).is_some());
        assert_eq!(s.copy(512, 1024), None);
        assert_eq!(s.finish(0, 1024), None);
        // A write that does not hash (a record, a poke) inside the span.
        s.begin(0, 1024);
        assert!(s.copy(0, 1024).is_some());
        s.touch(100, 16);
        assert_eq!(s.finish(0, 1024), None);
        // A write behind the span (its fence record) breaks nothing.
        s.begin(0, 1024);
        assert!(s.copy(0, 1024).is_some());
        s.touch(1024, 64);
        assert!(s.finish(0, 1024).is_some());
        // A seal of another length than registered: the pass.
        s.begin(0, 1024);
        assert!(s.copy(0, 1024).is_some());
        assert_eq!(s.finish(0, 512), None);
        // A word-misaligned start inside the span cannot be keyed.
        s.begin(0, 1024);
        assert_eq!(s.copy(8, 16), None);
        assert_eq!(s.copy(16, 1008), None, "broken: nothing more is hashed");
        assert_eq!(s.finish(0, 1024), None);
    }

    #[test]
    fn spans_are_hashed_side_by_side_and_a_reused_place_starts_over() {
        let mut s = SpanSums::default();
        let a = s.begin(0, 1024);
        let b = s.begin(1024, 1024);
        assert_ne!(a, b, "each span its own sum word");
        assert_eq!(s.copy(1024, 1024), Some(HashedCopy { slot: b, word0: 0 }));
        assert_eq!(s.copy(0, 1024), Some(HashedCopy { slot: a, word0: 0 }));
        // A copy across both spans breaks both.
        let mut t = SpanSums::default();
        t.begin(0, 1024);
        t.begin(1024, 1024);
        assert_eq!(t.copy(512, 1024), None);
        assert_eq!(t.finish(0, 1024), None);
        assert_eq!(t.finish(1024, 1024), None);
        // An aborted request's span handed out again at an overlapping place: the old
        // registration goes, the new one starts empty.
        let c = s.begin(512, 1024);
        assert_eq!(s.len(), 1, "both overlapped registrations went");
        assert_eq!(s.copy(512, 1024), Some(HashedCopy { slot: c, word0: 0 }));
        assert_eq!(s.finish(0, 1024), None);
        assert_eq!(s.finish(512, 1024), Some(c));
    }

    #[test]
    fn one_launch_over_a_spans_layers_covers_its_strided_ranges() {
        // A span of 4 layers x 4 blocks of 64 bytes ([layer][block]), filled in two chunks of
        // 2 blocks: each chunk one launch over the 4 layers (256 bytes apart).
        let mut s = SpanSums::default();
        let slot = s.begin(1024, 1024);
        assert_eq!(
            s.copy_strided(1024 + 128, 128, 256, 4),
            Some(HashedCopy { slot, word0: 8 })
        );
        assert_eq!(
            s.copy_strided(1024, 128, 256, 4),
            Some(HashedCopy { slot, word0: 0 })
        );
        assert_eq!(s.finish(1024, 1024), Some(slot));
        // A chunk launched twice overlaps itself: the pass.
        s.begin(1024, 1024);
        assert!(s.copy_strided(1024, 128, 256, 4).is_some());
        assert_eq!(s.copy_strided(1024 + 64, 128, 256, 4), None);
        assert_eq!(s.finish(1024, 1024), None);
        // Layers closer than a layer's bytes overlap each other; the last layer past the span
        // straddles its end: the pass, in both cases.
        s.begin(1024, 1024);
        assert_eq!(s.copy_strided(1024, 128, 64, 4), None);
        assert_eq!(s.finish(1024, 1024), None);
        s.begin(1024, 1024);
        assert_eq!(s.copy_strided(1024 + 128, 128, 320, 4), None);
        assert_eq!(s.finish(1024, 1024), None);
        // Ranges entirely outside every span: not hashed and nothing broken.
        s.begin(1024, 1024);
        assert_eq!(s.copy_strided(4096, 128, 256, 4), None);
        assert!(s.copy_strided(1024, 256, 256, 4).is_some());
        assert!(s.finish(1024, 1024).is_some());
    }

    #[test]
    fn past_every_slot_the_oldest_registration_goes() {
        let mut s = SpanSums::default();
        for i in 0..SLOTS {
            s.begin(i * 1024, 1024);
        }
        assert_eq!(s.len(), SLOTS);
        let slot = s.begin(SLOTS * 1024, 1024);
        assert_eq!(s.len(), SLOTS);
        assert_eq!(slot, 0, "the oldest's slot is reused");
        assert_eq!(s.copy(0, 1024), None, "the oldest span is no longer hashed");
        assert_eq!(s.finish(0, 1024), None);
        assert_eq!(
            s.copy(SLOTS * 1024, 1024),
            Some(HashedCopy { slot, word0: 0 })
        );
        assert_eq!(s.finish(SLOTS * 1024, 1024), Some(slot));
    }
}
