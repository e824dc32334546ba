//! Tensor parallelism inside one node's GPU group: [`CudaTpBackend`] runs one [`CudaBackend`]
//! rank per GPU, each on its own OS thread (a CUDA context is bound to the thread using it),
//! joined by an NCCL communicator ([`NcclComm`]) for the all-reduces of the residual stream.
//!
//! The engine sees one [`Backend`]: each call is fanned out to every rank over channels and
//! waited for with a deadline; `forward` returns rank 0's logits (every rank computes the same
//! ones), `read_kv`/`write_kv` move all ranks' bytes back to back, rank-major.
//!
//! A rank that fails or misses a deadline leaves the group unusable (the others may be waiting
//! inside an NCCL collective): the backend then refuses every later call with a typed error.

use super::CudaError;
use super::backend::{CudaBackend, CudaOptions, GraphStats};
use super::weights::Shard;
use pdnode_core::{BlockId, KvLayout};
use pdnode_engine::backend::{
    Backend, BackendError, ForwardBatch, KvMemory, KvRegion, Logits, LogitsWant, SeqStep,
    StepLogits, check_kv_io, check_logits_wants,
};
use pdnode_engine::loader::LoadedModel;
use pdnode_engine::spec::ModelSpec;
use pdnode_engine::weights::Weights;
use std::ops::Range;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Duration;

mod gpus;
mod nccl;
pub use gpus::{check_gpu_list, check_present, device_label, gpus_from_config};
pub use nccl::{NcclComm, NcclId};

/// Longest wait for one step or KV copy on every rank.
const STEP_DEADLINE: Duration = Duration::from_secs(300);
/// Longest wait for a rank thread to finish after being told to stop.
const EXIT_DEADLINE: Duration = Duration::from_secs(30);

/// One sequence of a step, owned (sent to every rank thread).
struct OwnedSeq {
    tokens: Vec<u32>,
    start_pos: usize,
    block_table: Vec<BlockId>,
    want_logits: bool,
}

/// The step a rank runs: `seqs` borrowed as a [`ForwardBatch`].
fn borrowed(seqs: &[OwnedSeq]) -> ForwardBatch<'_> {
    ForwardBatch {
        seqs: seqs
            .iter()
            .map(|s| SeqStep {
                tokens: &s.tokens,
                start_pos: s.start_pos,
                block_table: &s.block_table,
                want_logits: s.want_logits,
            })
            .collect(),
    }
}

enum Cmd {
    /// Runs a step; `download`: rank 0 copies its logits back (else the step is only enqueued).
    Forward {
        batch: Arc<Vec<OwnedSeq>>,
        download: bool,
        reply: Sender<Result<Option<Logits>, BackendError>>,
    },
    /// Runs a step; rank 0 lands its logits rows into `out` as `want` says
    /// ([`Backend::forward_select`]) and sends `out` back; the other ranks reply `None`.
    ForwardSelect {
        batch: Arc<Vec<OwnedSeq>>,
        want: Arc<Vec<LogitsWant>>,
        out: Option<StepLogits>,
        reply: Sender<Result<Option<StepLogits>, BackendError>>,
    },
    Sync {
        reply: Sender<Result<Option<Logits>, BackendError>>,
    },
    /// Turns the rank's decode CUDA graphs on or off; replies with its graph counters.
    Graphs {
        on: Option<bool>,
        reply: Sender<Result<GraphStats, BackendError>>,
    },
    TimeAllReduce {
        elems: usize,
        iters: usize,
        reply: Sender<Result<f64, BackendError>>,
    },
    FillKv {
        seed: u64,
        reply: Sender<Result<Option<Logits>, BackendError>>,
    },
    ReadKv {
        layers: Range<u32>,
        blocks: Arc<Vec<BlockId>>,
        bytes: usize,
        reply: Sender<Result<Vec<u8>, BackendError>>,
    },
    WriteKv {
        layers: Range<u32>,
        blocks: Arc<Vec<BlockId>>,
        data: Arc<Vec<u8>>,
        range: Range<usize>,
        reply: Sender<Result<Option<Logits>, BackendError>>,
    },
    /// Runs a closure on the rank's backend (the KV staging arena: `staging.rs`).
    Run(Box<dyn FnOnce(&mut CudaBackend) + Send>),
}

fn rank_loop(mut be: CudaBackend, rx: Receiver<Cmd>) {
    let rank = be.shard().rank;
    for cmd in rx {
        match cmd {
            Cmd::Forward {
                batch,
                download,
                reply,
            } => {
                let fb = borrowed(&batch);
                let r = if download && rank == 0 {
                    be.forward(&fb).map(Some)
                } else if download {
                    be.forward_device(&fb)
                        .and_then(|_| be.synchronize())
                        .map(|_| None)
                } else {
                    be.forward_device(&fb).map(|_| None)
                };
                let _ = reply.send(r);
            }
            Cmd::ForwardSelect {
                batch,
                want,
                out,
                reply,
            } => {
                let fb = borrowed(&batch);
                let r = if rank == 0 {
                    let mut out = out.unwrap_or_default();
                    be.forward_select(&fb, &want, &mut out).map(|_| Some(out))
                } else {
                    be.forward_device(&fb)
                        .and_then(|_| be.synchronize())
                        .map(|_| None)
                };
                let _ = reply.send(r);
            }
            Cmd::Sync { reply } => {
                let _ = reply.send(be.synchronize().map(|_| None));
            }
            Cmd::Graphs { on, reply } => {
                if let Some(on) = on {
                    be.set_cuda_graphs(on);
                }
                let _ = reply.send(Ok(be.graph_stats()));
            }
            Cmd::TimeAllReduce {
                elems,
                iters,
                reply,
            } => {
                let r = be.time_all_reduce(elems, iters);
                let _ = reply.send(r.map_err(BackendError::from));
            }
            Cmd::FillKv { seed, reply } => {
                let r = be.fill_kv_random(seed.wrapping_add(rank as u64));
                let _ = reply.send(r.map(|_| None).map_err(BackendError::from));
            }
            Cmd::ReadKv {
                layers,
                blocks,
                bytes,
                reply,
            } => {
                let mut out = vec![0u8; bytes];
                let r = be.read_kv(layers, &blocks, &mut out).map(|_| out);
                let _ = reply.send(r);
            }
            Cmd::WriteKv {
                layers,
                blocks,
                data,
                range,
                reply,
            } => {
                let r = be.write_kv(layers, &blocks, &data[range]).map(|_| None);
                let _ = reply.send(r);
            }
            Cmd::Run(f) => f(&mut be),
        }
    }
    // `be` drops here, on its own thread (its Drop synchronizes the stream first).
}

struct RankThread {
    tx: Option<Sender<Cmd>>,
    handle: Option<JoinHandle<()>>,
    done: Receiver<()>,
}

/// Tensor-parallel CUDA backend: the `tensor_parallel` GPUs of `CudaOptions::gpus` (rank `r` on
/// `gpus[r]`), one thread each.
pub struct CudaTpBackend {
    ranks: Vec<RankThread>,
    layout: KvLayout,
    num_blocks: usize,
    regions: Vec<KvRegion>,
    /// Device ordinal of each rank, in rank order.
    gpus: Vec<u32>,
    /// Rank 0 samples `Sample` rows on its GPU (`CudaOptions::gpu_sampling`).
    gpu_sampling: bool,
    /// What [`Backend::warm_up`] runs (`CudaOptions::warm_up_plan`).
    warm_up: pdnode_engine::backend::WarmUpPlan,
    weight_bytes: usize,
    /// Set once a rank failed or missed a deadline: the group may be stuck in a collective.
    broken: Option<String>,
    /// Each rank's KV staging arena, once enabled (`staging.rs`).
    pub(super) staging: Vec<KvRegion>,
}

impl CudaTpBackend {
    /// Host weights, sharded and uploaded to each rank's GPU.
    pub fn new(
        spec: &ModelSpec,
        weights: &Weights,
        opts: &CudaOptions,
        model_fingerprint: String,
    ) -> Result<Self, CudaError> {
        Self::build(spec, opts, |o, shard| {
            CudaBackend::new_rank(spec, weights, o, model_fingerprint.clone(), shard)
        })
    }

    /// Dummy weights generated on each device: rank `r` holds exactly its slice of what
    /// [`CudaBackend::new_dummy`] generates with the same seed (`std` as the loader's dummy).
    pub fn new_dummy(
        spec: &ModelSpec,
        seed: u64,
        std: Option<f32>,
        opts: &CudaOptions,
        model_fingerprint: String,
    ) -> Result<Self, CudaError> {
        Self::build(spec, opts, |o, shard| {
            CudaBackend::dummy_rank(spec, seed, std, o, model_fingerprint.clone(), shard)
        })
    }

    pub fn from_loaded(model: &LoadedModel, opts: &CudaOptions) -> Result<Self, CudaError> {
        Self::build(&model.spec, opts, |o, shard| {
            CudaBackend::from_loaded_rank(model, o, shard)
        })
    }

    /// Builds every rank on the calling thread (weights one GPU after the other), joins them in
    /// one NCCL communicator, agrees on the KV block count, then moves each rank to its thread.
    fn build(
        spec: &ModelSpec,
        opts: &CudaOptions,
        mut make: impl FnMut(&CudaOptions, Shard) -> Result<CudaBackend, CudaError>,
    ) -> Result<Self, CudaError> {
        let tp = opts.tensor_parallel.max(1) as usize;
        Shard { rank: 0, size: tp }.check(spec)?;
        check_gpu_list(&opts.gpus, opts.tensor_parallel)?;
        let probe = super::probe::probe()?;
        check_present(&opts.gpus, probe.device_count)?;
        let id = if tp > 1 { Some(NcclId::new()?) } else { None };
        let mut bes = Vec::with_capacity(tp);
        for rank in 0..tp {
            bes.push(make(opts, Shard { rank, size: tp })?);
        }
        if let Some(id) = &id {
            // NCCL's init returns only once every rank joined: one thread per rank.
            let results: Vec<Result<(), CudaError>> = std::thread::scope(|sc| {
                let hs: Vec<_> = bes
                    .iter_mut()
                    .map(|be| sc.spawn(move || be.attach_comm(id)))
                    .collect();
                hs.into_iter()
                    .enumerate()
                    .map(|(rank, h)| {
                        h.join().unwrap_or_else(|_| {
                            Err(CudaError::Rank {
                                rank,
                                msg: "NCCL init thread panicked".into(),
                            })
                        })
                    })
                    .collect()
            });
            results.into_iter().collect::<Result<Vec<()>, _>>()?;
            if opts.num_kv_blocks == 0 {
                let counts: Vec<Result<u64, CudaError>> = std::thread::scope(|sc| {
                    let hs: Vec<_> = bes
                        .iter_mut()
                        .map(|be| sc.spawn(move || be.min_blocks()))
                        .collect();
                    hs.into_iter()
                        .enumerate()
                        .map(|(rank, h)| {
                            h.join().unwrap_or_else(|_| {
                                Err(CudaError::Rank {
                                    rank,
                                    msg: "thread panicked".into(),
                                })
                            })
                        })
                        .collect()
                });
                let n = counts.into_iter().collect::<Result<Vec<u64>, _>>()?;
                let n = n.into_iter().min().unwrap_or(0) as usize;
                for be in &mut bes {
                    be.set_num_blocks(n)?;
                }
            }
        }
        let layout = bes[0].kv_layout().clone();
        let num_blocks = bes[0].num_kv_blocks();
        let regions = bes.iter().flat_map(|b| b.kv_regions()).collect();
        let weight_bytes = bes[0].weight_bytes();
        let mut ranks = Vec::with_capacity(tp);
        for (rank, be) in bes.into_iter().enumerate() {
            let (tx, rx) = channel();
            let (done_tx, done) = channel();
            let handle = std::thread::Builder::new()
                .name(format!("cuda{}-tp{rank}", be.gpu().ordinal))
                .spawn(move || {
                    rank_loop(be, rx);
                    let _ = done_tx.send(());
                })
                .map_err(|e| CudaError::Rank {
                    rank,
                    msg: format!("spawning its thread: {e}"),
                })?;
            ranks.push(RankThread {
                tx: Some(tx),
                handle: Some(handle),
                done,
            });
        }
        Ok(Self {
            ranks,
            layout,
            num_blocks,
            regions,
            gpus: opts.gpus.clone(),
            gpu_sampling: opts.gpu_sampling,
            warm_up: opts.warm_up_plan(),
            weight_bytes,
            broken: None,
            staging: Vec::new(),
        })
    }

    /// Runs `f` on every rank's backend, on the rank's thread, within the step deadline.
    pub(super) fn on_each_rank<T: Send + 'static>(
        &mut self,
        f: impl Fn(&mut CudaBackend) -> Result<T, BackendError> + Send + Sync + 'static,
    ) -> Result<Vec<T>, BackendError> {
        let f = Arc::new(f);
        self.fan_out(|_, reply| {
            let f = f.clone();
            Cmd::Run(Box::new(move |be| {
                let _ = reply.send(f(be));
            }))
        })
    }

    /// As [`CudaTpBackend::on_each_rank`], `f` also given the rank's index.
    pub(super) fn on_each_rank_at<T: Send + 'static>(
        &mut self,
        f: impl Fn(usize, &mut CudaBackend) -> Result<T, BackendError> + Send + Sync + 'static,
    ) -> Result<Vec<T>, BackendError> {
        let f = Arc::new(f);
        self.fan_out(|rank, reply| {
            let f = f.clone();
            Cmd::Run(Box::new(move |be| {
                let _ = reply.send(f(rank, be));
            }))
        })
    }

    pub fn tensor_parallel(&self) -> usize {
        self.ranks.len()
    }

    /// Device ordinal of each rank, in rank order (`CudaOptions::gpus`).
    pub fn gpus(&self) -> &[u32] {
        &self.gpus
    }

    /// Bytes of weights on each GPU.
    pub fn weight_bytes_per_rank(&self) -> usize {
        self.weight_bytes
    }

    /// Sends one command per rank (`make(rank)`), then waits for every reply with the deadline.
    fn fan_out<T>(
        &mut self,
        mut make: impl FnMut(usize, Sender<Result<T, BackendError>>) -> Cmd,
    ) -> Result<Vec<T>, BackendError> {
        if let Some(why) = &self.broken {
            return Err(BackendError::Device(format!(
                "tensor-parallel group unusable: {why}"
            )));
        }
        let mut rxs = Vec::with_capacity(self.ranks.len());
        for (rank, r) in self.ranks.iter().enumerate() {
            let (tx, rx) = channel();
            let sent = r.tx.as_ref().map(|t| t.send(make(rank, tx)).is_ok());
            if sent != Some(true) {
                let why = format!("rank {rank} thread is gone");
                self.broken = Some(why.clone());
                return Err(BackendError::Device(why));
            }
            rxs.push(rx);
        }
        let deadline = std::time::Instant::now() + STEP_DEADLINE;
        let mut out = Vec::with_capacity(rxs.len());
        let mut first_err = None;
        for (rank, rx) in rxs.into_iter().enumerate() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok(Ok(v)) => out.push(v),
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    let why = format!("rank {rank} gave no answer within {STEP_DEADLINE:?}");
                    self.broken = Some(why.clone());
                    return Err(BackendError::Device(why));
                }
            }
        }
        match first_err {
            // A rank refusing a batch before any collective refuses it on every rank (same
            // checks, same inputs); a device error on one rank leaves the group unusable.
            Some(e @ (BackendError::Device(_) | BackendError::DeviceFailure { .. })) => {
                self.broken = Some(e.to_string());
                Err(e)
            }
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    fn owned(batch: &ForwardBatch<'_>) -> Arc<Vec<OwnedSeq>> {
        Arc::new(
            batch
                .seqs
                .iter()
                .map(|s| OwnedSeq {
                    tokens: s.tokens.to_vec(),
                    start_pos: s.start_pos,
                    block_table: s.block_table.to_vec(),
                    want_logits: s.want_logits,
                })
                .collect(),
        )
    }

    /// Enqueues a step on every rank without waiting for the devices (benchmarks; pair with
    /// [`CudaTpBackend::synchronize`]).
    pub fn forward_device(&mut self, batch: &ForwardBatch<'_>) -> Result<(), BackendError> {
        let b = Self::owned(batch);
        self.fan_out(|_, reply| Cmd::Forward {
            batch: b.clone(),
            download: false,
            reply,
        })
        .map(|_| ())
    }

    /// Fills every rank's KV pool with seeded random values (benchmarks: never time on zeros).
    pub fn fill_kv_random(&mut self, seed: u64) -> Result<(), BackendError> {
        self.fan_out(|_, reply| Cmd::FillKv { seed, reply })
            .map(|_| ())
    }

    /// Mean seconds of one f32 all-reduce of `elems` elements of the residual stream (what each
    /// step does twice per layer), timed on rank 0 over `iters` back-to-back calls.
    pub fn time_all_reduce(&mut self, elems: usize, iters: usize) -> Result<f64, BackendError> {
        let t = self.fan_out(|_, reply| Cmd::TimeAllReduce {
            elems,
            iters,
            reply,
        })?;
        Ok(t[0])
    }

    /// Waits for every rank's device.
    pub fn synchronize(&mut self) -> Result<(), BackendError> {
        self.fan_out(|_, reply| Cmd::Sync { reply }).map(|_| ())
    }

    /// Turns decode-step CUDA graphs on or off on every rank (each rank captures and replays
    /// its own, NCCL all-reduces included); see [`CudaBackend::set_cuda_graphs`].
    pub fn set_cuda_graphs(&mut self, on: bool) -> Result<(), BackendError> {
        self.fan_out(|_, reply| Cmd::Graphs {
            on: Some(on),
            reply,
        })
        .map(|_| ())
    }

    /// Each rank's decode-graph counters, in rank order.
    pub fn graph_stats(&mut self) -> Result<Vec<GraphStats>, BackendError> {
        self.fan_out(|_, reply| Cmd::Graphs { on: None, reply })
    }
}

impl Backend for CudaTpBackend {
    fn kv_staging(&mut self) -> Option<&mut dyn pdnode_engine::backend::KvStaging> {
        if self.staging.is_empty() {
            None
        } else {
            Some(self)
        }
    }

    fn name(&self) -> String {
        device_label(&self.gpus)
    }

    /// The same warm-up as one GPU's (`CudaOptions::warm_up_plan`), every step on every rank.
    fn warm_up(&mut self) -> Result<usize, BackendError> {
        let plan = self.warm_up.clone();
        pdnode_engine::backend::run_warm_up(self, &plan)
    }

    /// Rank 0's logits go through [`CudaBackend::forward_select`]: sampled rows are drawn on
    /// its GPU as on one GPU (`cuda_graphs::tp2_sampled_rows_in_decode_steps`).
    fn samples_on_device(&self) -> bool {
        self.gpu_sampling
    }

    fn kv_layout(&self) -> &KvLayout {
        &self.layout
    }

    fn num_kv_blocks(&self) -> usize {
        self.num_blocks
    }

    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Logits, BackendError> {
        let b = Self::owned(batch);
        let mut out = self.fan_out(|_, reply| Cmd::Forward {
            batch: b.clone(),
            download: true,
            reply,
        })?;
        out.swap_remove(0)
            .ok_or_else(|| BackendError::Device("rank 0 returned no logits".into()))
    }

    fn forward_select(
        &mut self,
        batch: &ForwardBatch<'_>,
        want: &[LogitsWant],
        out: &mut StepLogits,
    ) -> Result<(), BackendError> {
        check_logits_wants(want, batch.logits_rows())?;
        let b = Self::owned(batch);
        let w = Arc::new(want.to_vec());
        // Rank 0 fills the caller's buffer and hands it back (lost on an error: the next step
        // starts a fresh one).
        let mut buf = Some(std::mem::take(out));
        let mut res = self.fan_out(|rank, reply| Cmd::ForwardSelect {
            batch: b.clone(),
            want: w.clone(),
            out: if rank == 0 { buf.take() } else { None },
            reply,
        })?;
        *out = res
            .swap_remove(0)
            .ok_or_else(|| BackendError::Device("rank 0 returned no logits".into()))?;
        Ok(())
    }

    fn read_kv(
        &self,
        layers: Range<u32>,
        blocks: &[BlockId],
        out: &mut [u8],
    ) -> Result<(), BackendError> {
        let tp = self.ranks.len();
        let per_rank = check_kv_io(
            &self.layout,
            self.num_blocks,
            &layers,
            blocks,
            out.len(),
            tp,
        )?;
        if let Some(why) = &self.broken {
            return Err(BackendError::Device(format!(
                "tensor-parallel group unusable: {why}"
            )));
        }
        // `&self`: no broken-flag update here; a failure is reported to the caller.
        let blocks = Arc::new(blocks.to_vec());
        let mut rxs = Vec::with_capacity(tp);
        for (rank, r) in self.ranks.iter().enumerate() {
            let (tx, rx) = channel();
            let cmd = Cmd::ReadKv {
                layers: layers.clone(),
                blocks: blocks.clone(),
                bytes: per_rank,
                reply: tx,
            };
            if r.tx.as_ref().map(|t| t.send(cmd).is_ok()) != Some(true) {
                return Err(BackendError::Device(format!("rank {rank} thread is gone")));
            }
            rxs.push(rx);
        }
        let deadline = std::time::Instant::now() + STEP_DEADLINE;
        for (rank, rx) in rxs.into_iter().enumerate() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let bytes = rx.recv_timeout(left).map_err(|_| {
                BackendError::Device(format!("rank {rank}: no KV read within {STEP_DEADLINE:?}"))
            })??;
            out[rank * per_rank..(rank + 1) * per_rank].copy_from_slice(&bytes);
        }
        Ok(())
    }

    fn write_kv(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        data: &[u8],
    ) -> Result<(), BackendError> {
        let tp = self.ranks.len();
        let per_rank = check_kv_io(
            &self.layout,
            self.num_blocks,
            &layers,
            blocks,
            data.len(),
            tp,
        )?;
        let blocks = Arc::new(blocks.to_vec());
        let data = Arc::new(data.to_vec());
        self.fan_out(|rank, reply| Cmd::WriteKv {
            layers: layers.clone(),
            blocks: blocks.clone(),
            data: data.clone(),
            range: rank * per_rank..(rank + 1) * per_rank,
            reply,
        })
        .map(|_| ())
    }
}

impl KvMemory for CudaTpBackend {
    fn kv_regions(&self) -> Vec<KvRegion> {
        self.regions.clone()
    }
}

impl Drop for CudaTpBackend {
    fn drop(&mut self) {
        // Closing the channels ends each rank's loop; its backend is dropped on its thread.
        for r in &mut self.ranks {
            r.tx = None;
        }
        for r in &mut self.ranks {
            if r.done.recv_timeout(EXIT_DEADLINE).is_ok()
                && let Some(h) = r.handle.take()
            {
                let _ = h.join();
            }
            // Else the thread is left detached (stuck in a device call); the process exit
            // reclaims it.
        }
    }
}

#[cfg(test)]
mod tests;
