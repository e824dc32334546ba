//! [`Scheduler`]: the state and decisions described in the module docs.

use super::{
    Handoff, Mode, ScheduledSeq, SchedulerConfig, SchedulerError, SchedulerStats, SeqOutput,
    StepPlan, lease_id,
};
use pdnode_core::{BlockId, FinishReason, RequestId};
use pdnode_kvcache::{KvCache, KvError, Owner};
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

#[derive(Debug)]
struct Seq {
    id: RequestId,
    tokens: Vec<u32>,
    /// Leading positions whose KV is in the cache.
    computed: usize,
}

impl Seq {
    fn owner(&self) -> Owner {
        Owner::Request(self.id)
    }
}

#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvCache,
    waiting: VecDeque<Seq>,
    /// Decode-only: requests whose KV arrived, owning their blocks, waiting for a slot.
    transferred: VecDeque<Seq>,
    /// In admission order.
    running: Vec<Seq>,
    /// The last plan: (request, tokens it ran).
    inflight: Vec<(RequestId, usize)>,
    preemptions: u64,
}

impl Scheduler {
    /// A scheduler over a fresh KV pool. `max_running_requests` is clamped to
    /// `max_batch_tokens` (and both to at least 1), so every running decode fits each step and
    /// none starves.
    pub fn new(mut cfg: SchedulerConfig) -> Self {
        cfg.max_batch_tokens = cfg.max_batch_tokens.max(1);
        cfg.max_running_requests = cfg.max_running_requests.clamp(1, cfg.max_batch_tokens);
        let kv = KvCache::new(cfg.num_blocks, cfg.block_size, cfg.prefix_cache);
        Self {
            cfg,
            kv,
            waiting: VecDeque::new(),
            transferred: VecDeque::new(),
            running: Vec::new(),
            inflight: Vec::new(),
            preemptions: 0,
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The KV bookkeeping (read-only), e.g. for `check_accounting` in tests.
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            transferred: self.transferred.len(),
            preemptions_total: self.preemptions,
            kv: self.kv.stats(),
        }
    }

    /// Whether a step would do anything.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.transferred.is_empty()
    }

    /// Whether the scheduler knows the request (queued, running, or holding blocks).
    pub fn contains(&self, id: RequestId) -> bool {
        self.find(id).is_some()
            || self.kv.holds(Owner::Request(id))
            || self.kv.holds(Owner::TransferLease(lease_id(id)))
    }

    fn find(&self, id: RequestId) -> Option<&Seq> {
        self.running
            .iter()
            .chain(self.waiting.iter())
            .chain(self.transferred.iter())
            .find(|s| s.id == id)
    }

    fn check_new(&self, id: RequestId, len: usize) -> Result<(), SchedulerError> {
        if self.contains(id) {
            return Err(SchedulerError::DuplicateRequest { id });
        }
        if len == 0 {
            return Err(SchedulerError::EmptyPrompt { id });
        }
        // The prompt plus the first decode position must fit the whole pool.
        let needed = self.kv.blocks_for(len + 1);
        if needed > self.kv.total() {
            return Err(SchedulerError::TooLarge {
                id,
                needed,
                total: self.kv.total(),
            });
        }
        Ok(())
    }

    /// Queues a prompt (FIFO).
    pub fn add_request(&mut self, id: RequestId, prompt: Vec<u32>) -> Result<(), SchedulerError> {
        self.check_new(id, prompt.len())?;
        self.waiting.push_back(Seq {
            id,
            tokens: prompt,
            computed: 0,
        });
        Ok(())
    }

    /// Decode side: reserves blocks for a prompt of `prompt_len` tokens under the request's
    /// transfer lease, until `now + lease`. Returns the blocks the transport fills, in order.
    /// Refused (`WaitingFirst`, Unavailable: the router tries another node) while the blocks
    /// left after it would not hold the head of the waiting queue: a preempted request resumes
    /// before new work takes its room, so a stream of reservations cannot starve it.
    pub fn reserve_for_transfer(
        &mut self,
        id: RequestId,
        prompt_len: usize,
        now: Instant,
    ) -> Result<Vec<BlockId>, SchedulerError> {
        self.check_new(id, prompt_len)?;
        let n = self.kv.blocks_for(prompt_len);
        if let Some(head) = self.waiting.front() {
            let head_needs = self.kv.blocks_for(head.tokens.len());
            let available = self.kv.available();
            if available < head_needs + n {
                return Err(SchedulerError::WaitingFirst {
                    id,
                    waiting: head.id,
                    needed: n,
                    available,
                });
            }
        }
        self.kv
            .reserve(lease_id(id), n, now + self.cfg.lease)
            .map(<[BlockId]>::to_vec)
            .map_err(|source| SchedulerError::Kv { id, source })
    }

    /// Decode side: the KV of `prompt` arrived in the reserved blocks; `first_token` was sampled
    /// by the prefill side. The request joins the batch at its next slot.
    pub fn admit_transferred(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        first_token: u32,
    ) -> Result<(), SchedulerError> {
        let lease = lease_id(id);
        let reserved = self
            .kv
            .table(Owner::TransferLease(lease))
            .map(<[BlockId]>::len)
            .ok_or(SchedulerError::Kv {
                id,
                source: KvError::UnknownLease { lease },
            })?;
        let needed = self.kv.blocks_for(prompt.len());
        if reserved != needed || prompt.is_empty() {
            return Err(SchedulerError::ReservationMismatch {
                id,
                reserved,
                needed,
            });
        }
        self.kv
            .commit_lease(lease, id)
            .map_err(|source| SchedulerError::Kv { id, source })?;
        // The transferred KV is as good as a local prefill: publish its full blocks.
        self.kv
            .cache_full_blocks(Owner::Request(id), &prompt)
            .map_err(|source| SchedulerError::Kv { id, source })?;
        let computed = prompt.len();
        let mut tokens = prompt;
        tokens.push(first_token);
        self.transferred.push_back(Seq {
            id,
            tokens,
            computed,
        });
        Ok(())
    }

    /// Ends a hand-off lease (prefill side: the KV was sent or the hand-off failed; decode side:
    /// the transfer failed before admission). Returns the blocks freed.
    pub fn release_transfer(&mut self, id: RequestId) -> Result<usize, SchedulerError> {
        self.kv
            .release_lease(lease_id(id))
            .map_err(|source| SchedulerError::Kv { id, source })
    }

    /// A running request, between two decode steps (every token but the last sampled one
    /// computed), leaves the batch; its blocks go under its transfer lease until `now + lease`,
    /// to be pushed to another node. Returns its tokens (prompt and output), how many leading
    /// positions the blocks hold, and the blocks.
    pub fn park(
        &mut self,
        id: RequestId,
        now: Instant,
    ) -> Result<(Vec<u32>, usize, Vec<BlockId>), SchedulerError> {
        let not = |why| SchedulerError::NotDecoding { id, why };
        if self.inflight.iter().any(|(r, _)| *r == id) {
            return Err(not("in a step"));
        }
        let i = self
            .running
            .iter()
            .position(|s| s.id == id)
            .ok_or(not("not in the batch"))?;
        let s = &self.running[i];
        if s.computed + 1 != s.tokens.len() {
            return Err(not("its prompt is still being computed"));
        }
        let need = self.kv.blocks_for(s.computed);
        let have = self.kv.table(s.owner()).map_or(0, <[BlockId]>::len);
        if have != need {
            return Err(not("its next block is already allocated"));
        }
        let s = self.running.remove(i);
        let owner = s.owner();
        let _ = self.kv.cache_full_blocks(owner, &s.tokens[..s.computed]);
        match self
            .kv
            .lease_request(id, lease_id(id), now + self.cfg.lease)
        {
            Ok(blocks) => Ok((s.tokens, s.computed, blocks.to_vec())),
            Err(source) => {
                let _ = self.kv.free(owner);
                Err(SchedulerError::Kv { id, source })
            }
        }
    }

    /// The blocks a request's hand-off lease holds (what the transport reads or writes).
    pub fn transfer_blocks(&self, id: RequestId) -> Option<&[BlockId]> {
        self.kv.table(Owner::TransferLease(lease_id(id)))
    }

    /// The earliest lease deadline, so an idle loop can wake up for it.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.kv.next_deadline()
    }

    /// Frees expired leases; returns the requests whose hand-off (or reservation) expired.
    pub fn expire(&mut self, now: Instant) -> Vec<RequestId> {
        self.kv
            .expire(now)
            .into_iter()
            .map(|l| RequestId(l.0))
            .collect()
    }

    /// Removes a request wherever it is and frees everything it owns. Returns whether it was known.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let mut found = false;
        for q in [&mut self.waiting, &mut self.transferred] {
            if let Some(i) = q.iter().position(|s| s.id == id) {
                q.remove(i);
                found = true;
            }
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i);
            found = true;
        }
        self.inflight.retain(|(r, _)| *r != id);
        found |= self.kv.free(Owner::Request(id)).is_ok();
        found |= self.kv.release_lease(lease_id(id)).is_ok();
        found
    }

    fn preempt(&mut self, idx: usize) -> RequestId {
        let mut s = self.running.remove(idx);
        let owner = s.owner();
        // Keep what was computed reachable through the prefix cache, then drop the table.
        let _ = self.kv.cache_full_blocks(owner, &s.tokens[..s.computed]);
        let _ = self.kv.free(owner);
        s.computed = 0;
        self.preemptions += 1;
        let id = s.id;
        self.waiting.push_front(s);
        id
    }

    fn schedule(&self, s: &Seq, n: usize) -> Result<ScheduledSeq, KvError> {
        let table = self
            .kv
            .table(s.owner())
            .ok_or(KvError::UnknownOwner { owner: s.owner() })?;
        let end = s.computed + n;
        let need = self.kv.blocks_for(end);
        if table.len() < need || end > s.tokens.len() {
            return Err(KvError::OutOfBlocks {
                needed: need,
                available: table.len(),
            });
        }
        Ok(ScheduledSeq {
            id: s.id,
            tokens: s.tokens[s.computed..end].to_vec(),
            start_pos: s.computed,
            block_table: table[..need].to_vec(),
            want_logits: end == s.tokens.len(),
        })
    }

    /// Plans the next step (see the module docs for the policy).
    pub fn next_step(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.cfg.max_batch_tokens;
        let mut scheduled: Vec<RequestId> = Vec::new();

        // 1. decodes, with preemption when a new block is needed and none is free.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            if s.tokens.len() - s.computed != 1 {
                i += 1;
                continue;
            }
            let (id, owner, len) = (s.id, s.owner(), s.tokens.len());
            let need = self.kv.blocks_for(len);
            if need > self.kv.total() {
                // Can never fit: end it (the context is effectively full).
                self.running.remove(i);
                let _ = self.kv.free(owner);
                plan.finished.push((id, FinishReason::Length));
                continue;
            }
            let have = self.kv.table(owner).map_or(0, <[BlockId]>::len);
            let mut self_preempted = false;
            if have < need {
                loop {
                    if self.kv.grow(owner, need - have).is_ok() {
                        break;
                    }
                    // The latest admitted sequence not scheduled in this step, else this one.
                    let victim = (i + 1..self.running.len())
                        .rev()
                        .find(|&j| !scheduled.contains(&self.running[j].id))
                        .unwrap_or(i);
                    plan.preempted.push(self.preempt(victim));
                    if victim == i {
                        self_preempted = true;
                        break;
                    }
                }
            }
            if self_preempted {
                continue;
            }
            match self.schedule(&self.running[i], 1) {
                Ok(step) => {
                    plan.seqs.push(step);
                    scheduled.push(id);
                    budget -= 1;
                }
                Err(_) => {
                    self.running.remove(i);
                    plan.finished.push((id, FinishReason::Error));
                    continue;
                }
            }
            i += 1;
        }

        // 2. ongoing chunked prefills.
        for s in &self.running {
            if budget == 0 {
                break;
            }
            let left = s.tokens.len() - s.computed;
            if left <= 1 || scheduled.contains(&s.id) {
                continue;
            }
            let n = left.min(budget);
            if let Ok(step) = self.schedule(s, n) {
                plan.seqs.push(step);
                scheduled.push(s.id);
                budget -= n;
            }
        }

        // 3. admission: transferred first, then the waiting queue (FIFO, head of line).
        while budget > 0 && self.running.len() < self.cfg.max_running_requests {
            let Some(s) = self.transferred.pop_front() else {
                break;
            };
            // The first decode position may need one more block than the transfer filled.
            let have = self.kv.table(s.owner()).map_or(0, <[BlockId]>::len);
            let need = self.kv.blocks_for(s.tokens.len());
            if have < need && self.kv.grow(s.owner(), need - have).is_err() {
                self.transferred.push_front(s);
                break;
            }
            if let Ok(step) = self.schedule(&s, 1) {
                plan.seqs.push(step);
                budget -= 1;
            }
            self.running.push(s);
        }
        while budget > 0 && self.running.len() < self.cfg.max_running_requests {
            let Some(s) = self.waiting.front() else {
                break;
            };
            let len = s.tokens.len();
            if self.kv.blocks_for(len) > self.kv.total() {
                // Grew past the pool while preempted: it can never run again.
                if let Some(s) = self.waiting.pop_front() {
                    plan.finished.push((s.id, FinishReason::Length));
                }
                continue;
            }
            let hit = self.kv.match_prefix(&s.tokens, len - 1);
            let need = self.kv.blocks_for(len) - hit.len();
            let bs = self.kv.block_size();
            let crossing = self
                .running
                .iter()
                .filter(|r| r.tokens.len() - r.computed == 1 && r.tokens.len().is_multiple_of(bs))
                .count();
            if self.kv.available() < need + crossing {
                break;
            }
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            if let Err(e) = self.kv.allocate(s.owner(), &hit, need) {
                tracing::debug!(id = %s.id, error = %e, "admission failed");
                self.waiting.push_front(s);
                break;
            }
            s.computed = hit.len() * bs;
            let n = (len - s.computed).min(budget);
            if let Ok(step) = self.schedule(&s, n) {
                plan.seqs.push(step);
                budget -= n;
            }
            self.running.push(s);
        }

        self.inflight = plan.seqs.iter().map(|s| (s.id, s.tokens.len())).collect();
        plan
    }

    /// Applies the results of the last plan: advances each sequence, appends sampled tokens,
    /// frees finished requests, and (prefill-only) hands finished prompts to transfer leases.
    pub fn on_step_done(&mut self, outputs: &[SeqOutput], now: Instant) -> Vec<Handoff> {
        let by_id: HashMap<RequestId, &SeqOutput> = outputs.iter().map(|o| (o.id, o)).collect();
        let mut handoffs = Vec::new();
        for (id, n) in std::mem::take(&mut self.inflight) {
            let Some(i) = self.running.iter().position(|s| s.id == id) else {
                continue; // aborted meanwhile
            };
            let s = &mut self.running[i];
            s.computed = (s.computed + n).min(s.tokens.len());
            let owner = s.owner();
            let _ = self.kv.cache_full_blocks(owner, &s.tokens[..s.computed]);
            if s.computed < s.tokens.len() {
                continue;
            }
            let Some(out) = by_id.get(&id) else {
                continue; // the engine dropped this row (error path); it runs again next step
            };
            if out.finished {
                self.running.remove(i);
                let _ = self.kv.free(owner);
                continue;
            }
            s.tokens.push(out.token);
            if self.cfg.mode == Mode::PrefillOnly {
                self.running.remove(i);
                let lease = lease_id(id);
                match self.kv.lease_request(id, lease, now + self.cfg.lease) {
                    Ok(blocks) => handoffs.push(Handoff {
                        id,
                        first_token: out.token,
                        lease,
                        blocks: blocks.to_vec(),
                    }),
                    Err(e) => {
                        tracing::warn!(%id, error = %e, "hand-off lease failed; freeing");
                        let _ = self.kv.free(owner);
                    }
                }
            }
        }
        handoffs
    }
}
