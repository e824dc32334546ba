//! The loop itself (see the module docs of [`crate::engine`]).

use super::handle::{COMMAND_QUEUE, Command, EngineHandle, EventTx, StagedGather};
use super::{EngineError, EngineEvent, EngineInfo, EngineLoopConfig, EngineStats};
use crate::backend::{Backend, KvMemory, KvRegion, LogitsWant, RowOut, StepLogits};
use crate::sampling::{OutputAssembler, SamplerState, SamplingError, SequenceSampler};
use crate::scheduler::{Mode, Scheduler, SchedulerConfig, SeqOutput};
use crate::text::Tokenizer;
use pdnode_core::error::Classify;
use pdnode_core::request::{GenerateRequest, TokenLogprob};
use pdnode_core::{ErrorKind, RequestId, SamplingParams};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

mod commands;
mod staged;

/// As [`spawn`], for a backend whose pool memory can be registered with a transport: the
/// regions are published in [`EngineInfo::kv_regions`].
pub fn spawn_with_memory<B: Backend + KvMemory + 'static>(
    backend: B,
    cfg: EngineLoopConfig,
    tokenizer: Option<Arc<Tokenizer>>,
) -> Result<EngineHandle, EngineError> {
    let regions = backend.kv_regions();
    start(Box::new(backend), regions, cfg, tokenizer)
}

/// As [`spawn_with_memory`], for a boxed backend and the regions of its pool (what
/// `pdnode_cuda::build_backend` answers).
pub fn spawn_with_regions(
    backend: Box<dyn Backend>,
    kv_regions: Vec<KvRegion>,
    cfg: EngineLoopConfig,
    tokenizer: Option<Arc<Tokenizer>>,
) -> Result<EngineHandle, EngineError> {
    start(backend, kv_regions, cfg, tokenizer)
}

/// Starts an engine loop on its own OS thread, owning `backend`.
pub fn spawn(
    backend: Box<dyn Backend>,
    cfg: EngineLoopConfig,
    tokenizer: Option<Arc<Tokenizer>>,
) -> Result<EngineHandle, EngineError> {
    start(backend, Vec::new(), cfg, tokenizer)
}

fn start(
    mut backend: Box<dyn Backend>,
    kv_regions: Vec<KvRegion>,
    cfg: EngineLoopConfig,
    tokenizer: Option<Arc<Tokenizer>>,
) -> Result<EngineHandle, EngineError> {
    let bad = |reason: String| Err(EngineError::Config { reason });
    if cfg.vocab_size == 0 {
        return bad("vocab_size is 0".into());
    }
    if backend.num_kv_blocks() == 0 || backend.kv_layout().block_size == 0 {
        return bad(format!("backend {} has an empty KV pool", backend.name()));
    }
    if cfg.max_batch_tokens == 0 || cfg.max_running_requests == 0 {
        return bad("max_batch_tokens and max_running_requests must be at least 1".into());
    }
    let num_blocks = u32::try_from(backend.num_kv_blocks()).map_err(|_| EngineError::Config {
        reason: "more than 2^32 KV blocks".into(),
    })?;
    // Before the engine takes a request (and so before the node registers): a CUDA backend
    // loads its kernels and captures its decode graphs here, not in the first requests.
    let t = std::time::Instant::now();
    let steps = backend.warm_up().map_err(|e| EngineError::Config {
        reason: format!("backend {} failed its warm-up: {e}", backend.name()),
    })?;
    if steps > 0 {
        tracing::info!(backend = %backend.name(), steps, ms = t.elapsed().as_millis() as u64, "backend warmed up");
    }
    let staging_regions = backend
        .kv_staging()
        .map(|s| s.staging_regions())
        .unwrap_or_default();
    let info = EngineInfo {
        backend_name: backend.name(),
        kv_layout: backend.kv_layout().clone(),
        num_kv_blocks: backend.num_kv_blocks(),
        mode: cfg.mode,
        context_length: cfg.context_length,
        vocab_size: cfg.vocab_size,
        // As the scheduler clamps it.
        max_running_requests: cfg.max_running_requests.min(cfg.max_batch_tokens),
        kv_regions,
        staging_regions,
    };
    let sched = Scheduler::new(SchedulerConfig {
        mode: cfg.mode,
        num_blocks,
        block_size: info.kv_layout.block_size,
        max_batch_tokens: cfg.max_batch_tokens,
        max_running_requests: cfg.max_running_requests,
        prefix_cache: cfg.prefix_cache,
        lease: cfg.lease,
    });
    let (tx, rx) = mpsc::sync_channel(COMMAND_QUEUE);
    let aborts: Arc<Mutex<Vec<RequestId>>> = Arc::default();
    let loop_aborts = aborts.clone();
    let timeout = cfg.call_timeout;
    let name = format!("pdnode-engine-{}", info.backend_name);
    let mut lp = Loop {
        backend,
        sched,
        cfg,
        tokenizer,
        active: HashMap::new(),
        stats: EngineStats::default(),
        logits: StepLogits::default(),
        want: Vec::new(),
    };
    let thread = std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            let r =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lp.run(rx, &loop_aborts)));
            if r.is_err() {
                // A bug (or a backend panic): end every stream with an error instead of silence.
                tracing::error!("engine loop panicked; failing its requests");
                for (_, a) in lp.active.drain() {
                    let _ = a.tx.send(EngineEvent::Error {
                        error: EngineError::Stopped,
                    });
                }
            }
        })
        .map_err(|e| EngineError::Config {
            reason: format!("cannot start the engine thread: {e}"),
        })?;
    tracing::info!(backend = %info.backend_name, mode = ?info.mode, blocks = info.num_kv_blocks, "engine loop started");
    Ok(EngineHandle::new(tx, aborts, info, timeout, thread))
}

struct Active {
    tx: EventTx,
    sampler: SequenceSampler,
    out: OutputAssembler,
    prompt_len: usize,
    generated: usize,
    /// Prompt tokens the prefix cache served at the first admission (the first chunk's start);
    /// `None` until the request is first scheduled.
    cached_tokens: Option<usize>,
    /// Prefill-only: the staging span its KV goes to as it becomes final, and how many leading
    /// blocks are in it.
    staged: Option<(StagedGather, usize)>,
}

struct Loop {
    backend: Box<dyn Backend>,
    sched: Scheduler,
    cfg: EngineLoopConfig,
    tokenizer: Option<Arc<Tokenizer>>,
    active: HashMap<RequestId, Active>,
    stats: EngineStats,
    /// The last step's logits, handed back to the backend to reuse its buffers.
    logits: StepLogits,
    /// Per logits row of the step: the full row, or only its arg-max (plain greedy sequences).
    want: Vec<LogitsWant>,
}

fn sampling_error(id: RequestId, e: SamplingError) -> EngineError {
    if e.kind() == ErrorKind::InvalidRequest {
        EngineError::InvalidRequest {
            id,
            reason: e.to_string(),
        }
    } else {
        EngineError::Sampling {
            id,
            message: e.to_string(),
        }
    }
}

impl Loop {
    fn run(&mut self, rx: mpsc::Receiver<Command>, aborts: &Mutex<Vec<RequestId>>) {
        let mut idle = true;
        let mut disconnected = false;
        'outer: loop {
            if (idle || !self.sched.has_work()) && !disconnected {
                let now = Instant::now();
                let wait = self.sched.next_deadline().map_or(self.cfg.idle_wait, |d| {
                    d.saturating_duration_since(now).min(self.cfg.idle_wait)
                });
                match rx.recv_timeout(wait) {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            break 'outer;
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => disconnected = true,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            break 'outer;
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        disconnected = true;
                        break;
                    }
                }
            }
            // Aborts that found the command queue full.
            let late: Vec<RequestId> = aborts
                .lock()
                .map(|mut a| std::mem::take(&mut *a))
                .unwrap_or_default();
            for id in late {
                self.handle(Command::Abort { id });
            }
            self.expire_and_prune();
            if disconnected && !self.sched.has_work() && self.sched.next_deadline().is_none() {
                break;
            }
            idle = !self.step();
            if idle && disconnected {
                // Nobody can send anything any more; wait for leases without spinning.
                std::thread::sleep(self.cfg.idle_wait);
            }
        }
        for (id, a) in self.active.drain() {
            let _ = a.tx.send(EngineEvent::Error {
                error: EngineError::Stopped,
            });
            self.sched.abort(id);
        }
        tracing::info!("engine loop stopped");
    }

    fn expire_and_prune(&mut self) {
        for id in self.sched.expire(Instant::now()) {
            tracing::debug!(%id, "transfer lease expired");
            if let Some(a) = self.active.remove(&id) {
                let _ = a.tx.send(EngineEvent::Error {
                    error: EngineError::LeaseExpired { id },
                });
            }
        }
        let closed: Vec<RequestId> = self
            .active
            .iter()
            .filter(|(_, a)| a.tx.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in closed {
            tracing::debug!(%id, "stream dropped; aborting");
            self.active.remove(&id);
            self.sched.abort(id);
        }
    }

    fn fail(&mut self, id: RequestId, error: EngineError) {
        self.sched.abort(id);
        if let Some(a) = self.active.remove(&id) {
            let _ = a.tx.send(EngineEvent::Error { error });
        }
    }

    fn params(&self, p: &SamplingParams) -> SamplingParams {
        let mut p = p.clone();
        if let Some(cap) = self.cfg.max_output_tokens {
            p.max_tokens = p.max_tokens.min(cap.max(1));
        }
        p
    }

    fn new_request(
        &self,
        req: &GenerateRequest,
        tx: &EventTx,
        resume: Option<(u32, Option<SamplerState>)>,
    ) -> Result<Active, EngineError> {
        let id = req.id;
        if self.active.contains_key(&id) {
            return Err(crate::scheduler::SchedulerError::DuplicateRequest { id }.into());
        }
        let params = self.params(&req.sampling);
        let prompt = &req.prompt_token_ids;
        let v = self.cfg.vocab_size;
        let sampler = match resume {
            Some((first, Some(state))) => {
                SequenceSampler::restore(&params, v, prompt, &[first], state)
            }
            Some((first, None)) => SequenceSampler::new(&params, v, prompt).and_then(|mut s| {
                s.accept(first)?;
                Ok(s)
            }),
            None => SequenceSampler::new(&params, v, prompt),
        }
        .map_err(|e| sampling_error(id, e))?;
        let out = OutputAssembler::new(
            self.tokenizer.clone(),
            &params,
            &self.cfg.eos_token_ids,
            prompt,
            self.cfg.context_length,
        )
        .map_err(|e| sampling_error(id, e))?;
        Ok(Active {
            tx: tx.clone(),
            sampler,
            out,
            prompt_len: prompt.len(),
            generated: 0,
            cached_tokens: None,
            staged: None,
        })
    }

    /// The blocks under `id`'s hand-off lease and the staging arena, for a copy between them.
    fn lease_and_arena(
        &mut self,
        id: RequestId,
    ) -> Result<(&[pdnode_core::BlockId], &mut dyn crate::backend::KvStaging), EngineError> {
        let blocks = self
            .sched
            .transfer_blocks(id)
            .ok_or(EngineError::NoLease { id })?;
        let arena = self
            .backend
            .kv_staging()
            .ok_or(EngineError::from(crate::backend::BackendError::NoStaging))?;
        Ok((blocks, arena))
    }

    fn read_kv(&self, id: RequestId, layers: Range<u32>) -> Result<Vec<u8>, EngineError> {
        let blocks = self
            .sched
            .transfer_blocks(id)
            .ok_or(EngineError::NoLease { id })?;
        let layout = self.backend.kv_layout();
        if layers.start > layers.end || layers.end > layout.num_layers {
            return Err(EngineError::KvIo {
                message: format!("layers {layers:?} outside 0..{}", layout.num_layers),
            });
        }
        let len = (layers.end - layers.start) as usize
            * blocks.len()
            * layout.block_layer_bytes()
            * layout.tp_size.max(1) as usize;
        let mut buf = vec![0u8; len];
        self.backend.read_kv(layers, blocks, &mut buf)?;
        Ok(buf)
    }

    fn admit(
        &mut self,
        req: GenerateRequest,
        first_token: u32,
        sampler: Option<SamplerState>,
        tx: EventTx,
    ) {
        let id = req.id;
        let mut a = match self.new_request(&req, &tx, Some((first_token, sampler))) {
            Ok(a) => a,
            Err(error) => {
                self.sched.abort(id);
                let _ = tx.send(EngineEvent::Error { error });
                return;
            }
        };
        // The first token was streamed by the prefill side; account for it without sending it.
        a.generated = 1;
        match a.out.push(first_token) {
            Ok(step) => {
                if let Some(c) = step.finish {
                    self.sched.abort(id);
                    let _ = tx.send(EngineEvent::Finished {
                        reason: c.finish_reason(),
                        prompt_tokens: a.prompt_len,
                        output_tokens: 1,
                    });
                    return;
                }
            }
            Err(e) => {
                self.sched.abort(id);
                let _ = tx.send(EngineEvent::Error {
                    error: sampling_error(id, e),
                });
                return;
            }
        }
        match self
            .sched
            .admit_transferred(id, req.prompt_token_ids, first_token)
        {
            Ok(()) => {
                self.active.insert(id, a);
            }
            Err(e) => {
                self.sched.abort(id);
                let _ = tx.send(EngineEvent::Error { error: e.into() });
            }
        }
    }

    /// Runs one step; false when there was nothing to run.
    fn step(&mut self) -> bool {
        if !self.sched.has_work() {
            return false;
        }
        let plan = self.sched.next_step();
        for &(id, reason) in &plan.finished {
            if let Some(a) = self.active.remove(&id) {
                let _ = a.tx.send(EngineEvent::Finished {
                    reason,
                    prompt_tokens: a.prompt_len,
                    output_tokens: a.generated,
                });
            }
        }
        if plan.is_empty() {
            return false;
        }
        // A request's first chunk starts after the positions its prefix-cache hit covers.
        for s in &plan.seqs {
            if let Some(a) = self.active.get_mut(&s.id)
                && a.cached_tokens.is_none()
            {
                a.cached_tokens = Some(if s.is_decode() { 0 } else { s.start_pos });
            }
        }
        if self.cfg.mode == Mode::PrefillOnly {
            self.arm_step_staging(&plan);
            for s in &plan.seqs {
                if let Some(a) = self.active.get(&s.id) {
                    a.tx.note(EngineEvent::Prefilling {
                        start_pos: s.start_pos,
                        tokens: s.tokens.len(),
                    });
                }
            }
        }
        // A plain greedy sequence needs only the arg-max of its row (computed on the device by a
        // device backend): exactly what its sampler would pick from the full row. A sampled one
        // without penalties or logprobs, on a backend that samples on the device, needs only the
        // token the device draws with the uniform its sampler draws now (the host's draw).
        let device_sampling = self.backend.samples_on_device();
        self.want.clear();
        for s in plan.seqs.iter().filter(|s| s.want_logits) {
            let want = match self.active.get_mut(&s.id) {
                None => LogitsWant::Argmax,
                Some(a) if a.sampler.is_plain_greedy() => LogitsWant::Argmax,
                Some(a) if device_sampling => a
                    .sampler
                    .device_draw()
                    .map_or(LogitsWant::Full, LogitsWant::Sample),
                Some(_) => LogitsWant::Full,
            };
            self.want.push(want);
        }
        let want = self.want.len();
        let forward = Instant::now();
        let r = self
            .backend
            .forward_select(&plan.forward_batch(), &self.want, &mut self.logits);
        let took = forward.elapsed();
        let logits = &self.logits;
        match r {
            Ok(())
                if logits.rows().len() == want
                    && logits.vocab() == self.cfg.vocab_size
                    && self
                        .want
                        .iter()
                        .zip(logits.rows())
                        .all(|(w, r)| r.answers(w)) => {}
            Ok(()) => {
                let m = format!(
                    "backend returned {} rows of {} logits, expected {want} of {}",
                    logits.rows().len(),
                    logits.vocab(),
                    self.cfg.vocab_size
                );
                self.fail_all(&plan, &m);
                return true;
            }
            Err(e) => {
                self.fail_all(&plan, &e.to_string());
                return true;
            }
        };
        self.stats.steps_total += 1;
        if plan.seqs.iter().all(|s| s.is_decode()) {
            self.stats.step_decode.observe(took);
        } else {
            self.stats.step_prefill.observe(took);
        }
        let prefill_only = self.cfg.mode == Mode::PrefillOnly;
        if prefill_only {
            self.gather_staged(&plan);
        }
        let mut outputs = Vec::with_capacity(want);
        let mut pending: HashMap<RequestId, (Option<TokenLogprob>, String)> = HashMap::new();
        for (row, s) in plan.seqs.iter().filter(|s| s.want_logits).enumerate() {
            let id = s.id;
            let Some(a) = self.active.get_mut(&id) else {
                // Not ours any more (a race with abort is impossible on this thread): drop it.
                self.sched.abort(id);
                continue;
            };
            let picked = match self.logits.rows()[row] {
                RowOut::Argmax(token) => a.sampler.accept_argmax(token),
                RowOut::Sampled(token) => a.sampler.accept_sampled(token),
                RowOut::Full(i) => match self.logits.full_row(i) {
                    Some(r) => a.sampler.sample(r),
                    None => Err(crate::sampling::SamplingError::LogitsSize {
                        got: 0,
                        vocab_size: self.cfg.vocab_size,
                    }),
                },
            };
            let sampled = picked.and_then(|o| a.out.push(o.token).map(|step| (o, step)));
            let (o, step) = match sampled {
                Ok(x) => x,
                Err(e) => {
                    self.fail(id, sampling_error(id, e));
                    continue;
                }
            };
            a.generated += 1;
            self.stats.output_tokens_total += 1;
            let finish = step.finish.map(|c| c.finish_reason());
            let (sent, finished) = if prefill_only {
                if finish.is_some() {
                    let ev = EngineEvent::PrefillDone {
                        first_token: o.token,
                        logprob: o.logprob,
                        delta: step.delta,
                        finish,
                        blocks: Vec::new(),
                        sampler: a.sampler.state(),
                        prompt_tokens: a.prompt_len,
                        cached_tokens: a.cached_tokens.unwrap_or(0),
                    };
                    (a.tx.send(ev).is_ok(), true)
                } else {
                    pending.insert(id, (o.logprob, step.delta));
                    (true, false)
                }
            } else {
                let mut ok =
                    a.tx.send(EngineEvent::Token {
                        token: o.token,
                        logprob: o.logprob,
                        delta: step.delta,
                    })
                    .is_ok();
                if let Some(reason) = finish {
                    ok &=
                        a.tx.send(EngineEvent::Finished {
                            reason,
                            prompt_tokens: a.prompt_len,
                            output_tokens: a.generated,
                        })
                        .is_ok();
                }
                (ok, finish.is_some())
            };
            if !sent && !finished {
                self.active.remove(&id);
                self.sched.abort(id);
                continue;
            }
            if finished {
                self.active.remove(&id);
            }
            outputs.push(SeqOutput {
                id,
                token: o.token,
                finished,
            });
        }
        for h in self.sched.on_step_done(&outputs, Instant::now()) {
            let (Some(a), Some((logprob, delta))) =
                (self.active.remove(&h.id), pending.remove(&h.id))
            else {
                self.sched.abort(h.id);
                continue;
            };
            let ev = EngineEvent::PrefillDone {
                first_token: h.first_token,
                logprob,
                delta,
                finish: None,
                blocks: h.blocks,
                sampler: a.sampler.state(),
                prompt_tokens: a.prompt_len,
                cached_tokens: a.cached_tokens.unwrap_or(0),
            };
            if a.tx.send(ev).is_err() {
                self.sched.abort(h.id);
            }
        }
        true
    }

    fn fail_all(&mut self, plan: &crate::scheduler::StepPlan, message: &str) {
        tracing::error!(error = message, "forward step failed; failing its requests");
        for s in &plan.seqs {
            self.fail(
                s.id,
                EngineError::Backend {
                    id: s.id,
                    message: message.to_string(),
                },
            );
        }
    }
}
