//! The decode node's staging: where a reservation's KV lands (an arena span or a per-request
//! host region within `transfer.host_staging_bytes`), and its fencing (docs/protocol.md,
//! "Fencing and verification"): quarantine of released spans, the check of what landed before
//! the scatter, and the counts of spans by state.

use super::*;
use pdnode_engine::backend::KvStaging;

/// A per-request host staging region, counted in the node's host staging budget
/// (`transfer.host_staging_bytes`) until it is dropped.
pub(super) struct HostStage {
    pub(super) reg: Registration,
    pub(super) bytes: u64,
    pub(super) used: Arc<AtomicU64>,
}

impl Drop for HostStage {
    fn drop(&mut self) {
        self.used.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// How the KV of a fenced staging span is laid out: rank `r`'s bytes at its data offset
/// (arena: the span's offset in rank `r`'s arena; host: `r * stride`), its fence record right
/// behind them.
#[derive(Debug, Clone, Copy)]
pub(super) struct FenceSpec {
    pub(super) per_rank: usize,
    pub(super) stride: usize,
    pub(super) ranks: usize,
    pub(super) verify: bool,
    /// The span is device memory (a GPU node's arena): its records and checksum (KVH64) are
    /// read through the engine, and only the fence deadline ends its quarantine.
    pub(super) device: bool,
}

/// A span released by an abort, a lease end or a failed check while its writer may still be
/// putting into it: freed when the writer's record shows it finished, or at `until`.
pub(super) struct Quarantined {
    /// The decision part (`super::super::handoff::Quarantine`).
    pub(super) q: Quarantine,
    pub(super) staging: Staging,
    pub(super) fence: Option<FenceSpec>,
    /// The reservation's capability: only records tagged with it end the quarantine.
    pub(super) capability: Secret,
}

/// Staging spans of a decode node by state (the arena's and per-request host regions alike).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StagingStats {
    /// Held by a reservation waiting for its `decode` call.
    pub owned: usize,
    /// Released but fenced (a late put may still land).
    pub quarantined: usize,
    /// Bytes of the arena free for the next reservation (0 without an arena).
    pub arena_free_bytes: usize,
    pub arena_bytes: usize,
    /// Bytes of per-request host staging held (owned and quarantined).
    pub host_bytes: u64,
}

/// Where rank `r`'s bytes of a fenced staging span start, in which registration.
pub(super) fn rank_data<'a>(
    staging: &'a Staging,
    spec: &FenceSpec,
    r: usize,
) -> Option<(&'a Registration, usize)> {
    match staging {
        Staging::None => None,
        Staging::Arena(slice) => slice
            .arena()
            .registration(r)
            .map(|reg| (reg, slice.offset())),
        Staging::Host(h) => r.checked_mul(spec.stride).map(|at| (&h.reg, at)),
    }
}

/// Whether every rank of the span carries an intact fence record of `generation`, tagged
/// under the reservation's `capability`.
pub(super) fn records_present(
    staging: &Staging,
    spec: &FenceSpec,
    generation: u64,
    capability: &Secret,
) -> bool {
    // Device records are read through the engine, not from the sweep: the deadline ends those.
    !spec.device
        && (0..spec.ranks).all(|r| {
            rank_data(staging, spec, r)
                .and_then(|(reg, at)| at.checked_add(spec.per_rank).map(|o| (reg, o)))
                .and_then(|(reg, o)| fence::read_record(reg, o, capability).ok())
                .and_then(fence::Landed::record)
                .is_some_and(|rec| rec.generation == generation)
        })
}

/// Why a staged span was not scattered.
pub(super) enum Landing {
    /// What landed failed its check: the request fails, its span is quarantined.
    Refused(FenceError),
    /// The scatter itself failed.
    Failed(NodeError),
}

/// On the engine thread: every rank's record of a device span (behind its `per_rank` bytes at
/// `at`) and, with `verify`, every rank's KVH64 of those bytes, checked as host records are.
fn check_device_span(
    st: &mut dyn KvStaging,
    at: usize,
    spec: &FenceSpec,
    (generation, request): (u64, u64),
    hashed: Option<&[u64]>,
    cap: &Secret,
) -> Result<(), FenceError> {
    let failed = |what: &'static str, e: &dyn std::fmt::Display| FenceError::Device {
        what,
        message: e.to_string(),
    };
    let rec_at = at
        .checked_add(spec.per_rank)
        .ok_or_else(|| failed("record offset", &"overflows"))?;
    // With verify the scatter hashed what it moved (`kv_scatter_h64`): the sums are given.
    let sums = match (spec.verify, hashed) {
        (false, _) => None,
        (true, Some(s)) if s.len() == spec.ranks => Some(s),
        (true, s) => {
            let m = format!("{:?} sums for {} ranks", s.map(<[u64]>::len), spec.ranks);
            return Err(failed("KVH64 per rank", &m));
        }
    };
    for r in 0..spec.ranks {
        let mut b = [0u8; RECORD_LEN];
        st.staging_read(r, rec_at, &mut b)
            .map_err(|e| failed("fence record read", &e))?;
        let rec = match fence::FenceRecord::decode(&b, cap) {
            fence::Landed::Record(rec) => rec,
            fence::Landed::Nothing => return Err(FenceError::Missing { rank: r }),
            fence::Landed::Forged => return Err(FenceError::Forged { rank: r }),
        };
        let sum = sums.as_ref().map(|s| fence::Sum::Kvh64(s[r]));
        rec.check(r, generation, request, spec.per_rank as u64, sum)?;
    }
    Ok(())
}

impl PdNode {
    /// `transfer.verify`: whether this decode node asks for and checks a CRC32C of the KV that
    /// lands in its host staging.
    pub fn set_verify(&self, on: bool) {
        self.verify.store(on, Ordering::Relaxed);
    }

    /// `transfer.host_staging_bytes`: the most bytes of per-request host staging this decode
    /// node holds at once; a reservation that would need more is refused (Unavailable).
    pub fn set_host_staging_bytes(&self, cap: u64) {
        self.host_cap.store(cap, Ordering::Relaxed);
    }

    /// The hand-off settings in force (`engine.kv_push_layer_group`, `transfer.verify`,
    /// `transfer.host_staging_bytes`, `transfer.stall_ms`, `transfer.stall_min_rate_mibps`).
    pub fn handoff_settings(&self) -> HandoffSettings {
        HandoffSettings {
            push_layer_group: self.push_layer_group.load(Ordering::Relaxed),
            verify: self.verify.load(Ordering::Relaxed),
            host_staging_bytes: self.host_cap.load(Ordering::Relaxed),
            stall_ms: self.stall_ms.load(Ordering::Relaxed),
            stall_bytes_per_s: self.stall_rate.load(Ordering::Relaxed),
        }
    }

    /// `transfer.stall_ms` and `transfer.stall_min_rate_mibps`: when this prefill node's
    /// hand-off counts as stalled ([`crate::pd::handoff::PushWait`]).
    pub fn set_stall(&self, stall_ms: u64, min_rate_mibps: u64) {
        self.stall_ms.store(stall_ms, Ordering::Relaxed);
        self.stall_rate
            .store(min_rate_mibps.saturating_mul(1 << 20), Ordering::Relaxed);
    }

    /// Fills the staging and fence part of `a` ([`PdNode::staging_stats`], [`PdNode::fence_stats`]).
    pub fn staging_accounting(&self, a: &mut pdnode_core::Accounting) {
        let s = self.staging_stats();
        let f = self.fence_stats();
        a.staging_spans_owned = s.owned as u64;
        a.staging_spans_quarantined = s.quarantined as u64;
        a.staging_arena_free_bytes = s.arena_free_bytes as u64;
        a.staging_arena_bytes = s.arena_bytes as u64;
        a.staging_host_bytes = s.host_bytes;
        a.fence_quarantines_total = f.quarantined;
        a.fence_released_by_record_total = f.released_by_record;
        a.fence_released_at_deadline_total = f.released_at_deadline;
        a.fence_checksum_failures_total = f.checksum_failures;
        a.fence_record_failures_total = f.record_failures;
        a.fence_sources_leaked_total = f.sources_leaked;
    }

    /// Fencing counters, with the number of spans in quarantine now.
    pub fn fence_stats(&self) -> FenceStats {
        self.fence.snapshot(self.quarantined().len() as u64)
    }

    /// Staging spans by state: owned by a reservation, quarantined, and the arena's free bytes.
    pub fn staging_stats(&self) -> StagingStats {
        let owned = self
            .slots()
            .values()
            .filter(|s| !matches!(s.staging, Staging::None))
            .count();
        let quarantined = self.quarantined().len();
        StagingStats {
            owned,
            quarantined,
            arena_free_bytes: self.arena.as_ref().map(|a| a.free_bytes()).unwrap_or(0),
            arena_bytes: self.arena.as_ref().map(|a| a.len()).unwrap_or(0),
            host_bytes: self.host_used.load(Ordering::Relaxed),
        }
    }

    pub(super) fn quarantined(&self) -> std::sync::MutexGuard<'_, Vec<Quarantined>> {
        self.quarantine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Releases a reservation's staging as its state machine decides
    /// ([`Reservation::release`]): at once when nothing can write it any more (no staging, the
    /// span was scattered, or every rank carries its writer's record, which is put only after
    /// that writer's KV puts were flushed), else into quarantine until the fence deadline.
    pub(super) fn release_staging(&self, id: RequestId, mut slot: DecodeSlot, cause: ReleaseCause) {
        let staged = !matches!(slot.staging, Staging::None);
        let generation = slot.fsm.generation();
        // Read only where the record can end it (after a refused check it is not trusted).
        let present = staged
            && matches!(cause, ReleaseCause::Abort | ReleaseCause::LeaseEnd)
            && slot.fence.is_some_and(|f| {
                records_present(&slot.staging, &f, generation, slot.fsm.capability())
            });
        let Some(Release::Quarantine(q)) = slot.fsm.release(cause, staged, present, Instant::now())
        else {
            return; // freed with the slot
        };
        self.fence.quarantined.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(request = %id, generation, ?cause, "staging span quarantined");
        self.quarantined().push(Quarantined {
            q,
            capability: *slot.fsm.capability(),
            staging: slot.staging,
            fence: slot.fence,
        });
    }

    /// Frees quarantined spans whose writer finished (its record is there) or whose fence
    /// deadline passed ([`Quarantine::poll`]).
    pub(super) fn sweep_quarantine(&self, now: Instant) {
        let mut q = self.quarantined();
        // Freed after the lock is let go (a host region's deregistration waits for UCX).
        let mut freed = Vec::new();
        let mut keep = Vec::new();
        for e in q.drain(..) {
            let present = e.q.trust_record
                && e.fence.is_some_and(|f| {
                    records_present(&e.staging, &f, e.q.generation, &e.capability)
                });
            match e.q.poll(now, present) {
                Some(QuarantineEnd::ByRecord) => {
                    self.fence
                        .released_by_record
                        .fetch_add(1, Ordering::Relaxed);
                    freed.push(e);
                }
                Some(QuarantineEnd::AtDeadline) => {
                    self.fence
                        .released_at_deadline
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(request = %e.q.request, generation = e.q.generation,
                        "quarantined staging span freed at its fence deadline");
                    freed.push(e);
                }
                None => keep.push(e),
            }
        }
        *q = keep;
        drop(q);
        drop(freed);
    }

    /// Checks what landed in a fenced span before the scatter: every rank's record of this
    /// reservation's generation, request and length, and (with `verify`) the checksum.
    pub(super) async fn check_landed(
        &self,
        id: RequestId,
        slot: &DecodeSlot,
    ) -> Result<(), FenceError> {
        let Some(spec) = slot.fence else {
            return Ok(());
        };
        if spec.device {
            return Ok(()); // checked with its scatter (`scatter_checked`)
        }
        for r in 0..spec.ranks {
            let (reg, at) = rank_data(&slot.staging, &spec, r).ok_or(FenceError::NotHost {
                what: "rank region",
                offset: 0,
                len: spec.per_rank,
            })?;
            let rec_at = at.checked_add(spec.per_rank).ok_or(FenceError::NotHost {
                what: "record offset",
                offset: at,
                len: spec.per_rank,
            })?;
            let rec = match fence::read_record(reg, rec_at, slot.fsm.capability())? {
                fence::Landed::Record(rec) => rec,
                fence::Landed::Nothing => return Err(FenceError::Missing { rank: r }),
                fence::Landed::Forged => return Err(FenceError::Forged { rank: r }),
            };
            let sum = if spec.verify {
                Some(fence::Sum::Crc32c(fence::crc_at(reg, at, spec.per_rank)?))
            } else {
                None
            };
            rec.check(r, slot.fsm.generation(), id.0, spec.per_rank as u64, sum)?;
        }
        Ok(())
    }

    /// Refuses what landed for `id` (`e`): counted, logged, the reservation's blocks released at
    /// once and its span quarantined (a refused check is not trusted to end it early).
    pub(super) async fn refuse_landed(
        &self,
        id: RequestId,
        slot: DecodeSlot,
        e: FenceError,
    ) -> NodeError {
        let counter = if e.is_checksum() {
            &self.fence.checksum_failures
        } else {
            &self.fence.record_failures
        };
        counter.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(request = %id, generation = slot.fsm.generation(), error = %e,
            "landed KV refused before the scatter; the request fails and frees its blocks");
        let _ = self.engine.release_transfer(id).await;
        self.release_staging(id, slot, ReleaseCause::Refused);
        nerr(
            ErrorKind::Retryable,
            format!("KV hand-off of {id} refused before the scatter: {e}"),
        )
    }

    /// A device arena span's scatter and check in one visit of the engine loop (which owns the
    /// GPU, and answers between steps): each rank's record copied out of device memory and,
    /// with `verify`, each rank's KVH64 of the landed bytes, checked like host records. With
    /// `verify` the scatter hashes what it moves (`kv_scatter_h64`, no second read of the span),
    /// so the request's own reserved blocks hold the bytes before the check: a refusal releases
    /// them unused (the request never runs; they never reach the prefix cache). Without it,
    /// nothing is scattered unless the records pass.
    pub(super) async fn scatter_checked(
        &self,
        id: RequestId,
        slot: &DecodeSlot,
        spec: FenceSpec,
        offset: usize,
        layers: u32,
    ) -> Result<(), Landing> {
        let verdict = Arc::new(std::sync::Mutex::new(None::<FenceError>));
        let v = verdict.clone();
        let (generation, cap) = (slot.fsm.generation(), *slot.fsm.capability());
        let t0 = Instant::now();
        let check: ScatterCheck = Box::new(move |st, hashed| {
            match check_device_span(st, offset, &spec, (generation, id.0), hashed, &cap) {
                Ok(()) => {
                    tracing::debug!(request = %id, bytes = spec.per_rank * spec.ranks,
                        verify = spec.verify, scatter_check_us = t0.elapsed().as_micros() as u64,
                        "device KV scattered and checked (fence records, KVH64)");
                    true
                }
                Err(e) => {
                    *v.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    false
                }
            }
        });
        match self
            .engine
            .scatter_kv_checked(id, 0..layers, offset, spec.verify, check)
            .await
        {
            Ok(true) => Ok(()),
            Ok(false) => Err(Landing::Refused(
                verdict
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take()
                    .unwrap_or(FenceError::Device {
                        what: "check",
                        message: "refused without a reason".into(),
                    }),
            )),
            Err(e) => Err(Landing::Failed(eerr(&e))),
        }
    }

    /// Decode side: where a reservation of `per_rank` bytes per TP rank lands, the rank regions
    /// of its KV target, the target's `staging_offset`, and how its fence records lie (host
    /// memory only: each rank's span has room for one behind its KV).
    /// A full arena is waited on (until [`PdNode::room_deadline`]) before host staging.
    pub(super) async fn receive_staging(
        &self,
        id: RequestId,
        per_rank: usize,
    ) -> Result<(Staging, Vec<RankTarget>, u64, Option<FenceSpec>), NodeError> {
        if matches!(self.mover, KvMover::InProcess(_)) {
            return Ok((Staging::None, Vec::new(), 0, None));
        }
        let ranks = self.tp_ranks();
        let verify = self.verify.load(Ordering::Relaxed);
        let overflow = || nerr(ErrorKind::InvalidRequest, "the KV of this prompt overflows");
        let with_record = per_rank.checked_add(RECORD_LEN).ok_or_else(overflow)?;
        let slice = match self.arena.as_ref().filter(|a| a.ranks() == ranks) {
            Some(a) => {
                let t0 = Instant::now();
                let want = with_record;
                let s = a
                    .reserve_wait(want, self.room_deadline(t0 + self.lease))
                    .await;
                let waited = t0.elapsed();
                if waited > Duration::from_millis(1) {
                    let (waits, gave_up) = a.wait_counts();
                    tracing::debug!(request = %id, bytes = per_rank * ranks,
                        waited_ms = waited.as_millis() as u64, got = s.is_some(),
                        arena_waits = waits, arena_wait_timeouts = gave_up,
                        "KV reservation waited for staging arena room");
                }
                s
            }
            None => None,
        };
        if let Some(slice) = slice {
            let arena = slice.arena().clone();
            let targets = (0..ranks)
                .filter_map(|r| arena.registration(r).map(|reg| (r, reg.descriptor())))
                .map(|(r, d)| RankTarget {
                    rank: r as u32,
                    rkey: d.rkey.clone(),
                    base_addr: d.base_addr,
                    region_len: d.len,
                    worker_address: Vec::new(),
                    device_memory: arena.is_device(),
                })
                .collect();
            let offset = slice.offset() as u64;
            let fence = Some(FenceSpec {
                per_rank,
                stride: 0,
                ranks,
                verify,
                device: arena.is_device(),
            });
            self.via_arena.fetch_add(1, Ordering::Relaxed);
            return Ok((Staging::Arena(slice), targets, offset, fence));
        }
        // Rank `r`'s KV at `r * stride`, its fence record right behind it.
        let stride = with_record;
        let total = stride.checked_mul(ranks).ok_or_else(overflow)?;
        // Host staging is capped: past the cap the reservation is refused (the router tries
        // another decode node or answers 503), never an allocation without bound.
        let cap = self.host_cap.load(Ordering::Relaxed);
        let taken = self
            .host_used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(total as u64).filter(|n| *n <= cap)
            });
        if let Err(in_use) = taken {
            return Err(nerr(
                ErrorKind::Unavailable,
                format!(
                    "decode node {}: no staging arena room for {id} and host staging is full                      ({in_use} of transfer.host_staging_bytes = {cap} bytes in use, {total} more needed)",
                    self.id
                ),
            ));
        }
        let budget = HostStage {
            reg: match self.mover.receive_staging(total) {
                Ok(Some(reg)) => reg,
                other => {
                    self.host_used.fetch_sub(total as u64, Ordering::Relaxed);
                    return match other {
                        Err(e) => Err(nerr(e.kind(), e.to_string())),
                        _ => Ok((Staging::None, Vec::new(), 0, None)),
                    };
                }
            },
            bytes: total as u64,
            used: self.host_used.clone(),
        };
        self.note_fallback("decode", total);
        let reg = &budget.reg;
        let d = reg.descriptor();
        let targets = (0..ranks)
            .map(|r| {
                let base_addr = (r as u64)
                    .checked_mul(stride as u64)
                    .and_then(|at| d.base_addr.checked_add(at))
                    .ok_or_else(overflow)?;
                Ok(RankTarget {
                    rank: r as u32,
                    rkey: d.rkey.clone(),
                    base_addr,
                    region_len: stride as u64,
                    worker_address: Vec::new(),
                    device_memory: false,
                })
            })
            .collect::<Result<Vec<_>, NodeError>>()?;
        let fence = FenceSpec {
            per_rank,
            stride,
            ranks,
            verify,
            device: false,
        };
        Ok((Staging::Host(budget), targets, 0, Some(fence)))
    }
}

/// What [`PdNode::handoff_settings`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandoffSettings {
    pub push_layer_group: u32,
    pub verify: bool,
    pub host_staging_bytes: u64,
    pub stall_ms: u64,
    pub stall_bytes_per_s: u64,
}
