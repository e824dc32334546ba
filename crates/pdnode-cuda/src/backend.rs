//! [`CudaBackend`]: one GPU running one model over one paged KV pool.

use super::CudaError;
use super::blas::OutType;
use super::device::{DevBuf, Gpu, Pinned};
use super::ops::{self, AttnDims, AttnMeta, AttnVariant, AttnWorkspace};
use super::prefill::PrefillScratch;
use super::tp::NcclComm;
use super::weights::{DevWeights, Shard};
use pdnode_core::{DType, KvLayout};
use pdnode_engine::backend::{BackendError, ForwardBatch};
use pdnode_engine::loader::{LoadedModel, ModelWeights};
use pdnode_engine::spec::ModelSpec;
use pdnode_engine::weights::Weights;

mod graph;
mod knobs;
mod logits;
mod mla;
mod mla_prefill;
#[cfg(feature = "op-timing")]
mod opprof;
mod options;
mod plan;
#[path = "staging.rs"]
mod staging;
mod traits;
mod workspace;

pub use graph::{GraphStats, decode_bucket};
#[cfg(feature = "op-timing")]
pub use opprof::STEP_START;
pub use options::CudaOptions;
use workspace::Workspace;

pub struct CudaBackend {
    // Field order is drop order: graphs (which read the buffers) first, buffers before the Gpu
    // (context, cuBLAS handle).
    graphs: graph::DecodeGraphs,
    w: DevWeights,
    ws: Workspace,
    pool: DevBuf,
    /// The KV hand-off staging arena, once enabled (`staging.rs`).
    staging: Option<DevBuf>,
    /// The device word a KVH64 of the arena sums into (allocated with the arena: a hash per
    /// hand-off allocates nothing).
    staging_sum: Option<DevBuf>,
    /// The sum words of the spans hashed by the copies that fill them (`SLOTS` u64, allocated
    /// with the arena) and which span owns which (`span_sums.rs`; a mutex because the in-step
    /// gathers run through `&self`).
    span_slots: Option<DevBuf>,
    span_sums: std::sync::Mutex<crate::span_sums::SpanSums>,
    /// Block ids of the staging copies outside a step (reused, grown when outgrown).
    copy_ids: std::sync::Mutex<Option<DevBuf>>,
    /// Seals answered from the gathers' sum (no pass over the span), for tests and benches.
    fused_seals: std::sync::atomic::AtomicU64,
    /// The next prefill step's in-step staging plan, then that step's run (`staging.rs`).
    step_staging: Option<pdnode_engine::backend::StepStaging>,
    stage_run: Option<staging::StageRun>,
    /// Block ids of the in-step gathers (reused; it lives until the next such step, after the
    /// step that read it synchronized).
    stage_ids: Option<DevBuf>,
    num_blocks: usize,
    layout: KvLayout,
    spec: ModelSpec,
    opts: CudaOptions,
    dims: AttnDims,
    prefill: PrefillScratch,
    /// Page-locked landing buffer of the logits (`max_seqs x vocab`).
    logits_host: Pinned,
    /// This GPU's slice of the model (`Shard::WHOLE` without tensor parallelism).
    shard: Shard,
    /// Every step's launches are programmatic dependent launches (`engine.cuda.pdl`,
    /// [`Self::set_pdl`]); without it only decode steps of at most
    /// [`ops::Fusion::pdl_max_tokens`] rows are (one GPU).
    pdl_all: bool,
    /// The all-reduce group of the tensor-parallel ranks (None at TP = 1).
    comm: Option<NcclComm>,
    /// A latent-attention model's activations (`w.mla` is then set; `mla.rs`).
    mla_ws: Option<mla::MlaWorkspace>,
    /// Per-op event timing of eager steps (benchmarks only: the `op-timing` feature, which
    /// production builds leave off; `opprof.rs`).
    #[cfg(feature = "op-timing")]
    prof: Option<opprof::OpProfile>,
    gpu: Gpu,
}

impl CudaBackend {
    /// Uploads host weights and sizes the KV pool.
    pub fn new(
        spec: &ModelSpec,
        weights: &Weights,
        opts: &CudaOptions,
        model_fingerprint: String,
    ) -> Result<Self, CudaError> {
        Self::build(spec, opts, model_fingerprint, Shard::WHOLE, |gpu| {
            DevWeights::upload(gpu, spec, weights, Shard::WHOLE)
        })
    }

    /// Random bf16 weights generated on the device at `spec`'s shapes (benchmarks).
    pub fn new_dummy(
        spec: &ModelSpec,
        seed: u64,
        opts: &CudaOptions,
        model_fingerprint: String,
    ) -> Result<Self, CudaError> {
        Self::build(spec, opts, model_fingerprint, Shard::WHOLE, |gpu| {
            DevWeights::dummy(gpu, spec, seed, None, Shard::WHOLE)
        })
    }

    /// Builds from a loaded model: host weights are uploaded as bf16; dummy weights are
    /// generated on the device (uniform with the requested standard deviation).
    pub fn from_loaded(model: &LoadedModel, opts: &CudaOptions) -> Result<Self, CudaError> {
        Self::from_loaded_rank(model, opts, Shard::WHOLE)
    }

    /// One tensor-parallel rank of a loaded model on GPU `opts.gpus[shard.rank]` (the caller,
    /// [`super::tp::CudaTpBackend`], then joins the ranks with [`CudaBackend::attach_comm`]).
    pub(crate) fn from_loaded_rank(
        model: &LoadedModel,
        opts: &CudaOptions,
        shard: Shard,
    ) -> Result<Self, CudaError> {
        let fp = model.fingerprint.clone();
        let spec = &model.spec;
        match &model.weights {
            ModelWeights::Host(w) => Self::build(spec, opts, fp, shard, |gpu| {
                DevWeights::upload(gpu, spec, w, shard)
            }),
            ModelWeights::Dummy(d) => Self::build(spec, opts, fp, shard, |gpu| {
                DevWeights::dummy(gpu, spec, d.seed, Some(d.std), shard)
            }),
            ModelWeights::HostMla(w) => Self::build(spec, opts, fp, shard, |gpu| {
                DevWeights::upload_mla(gpu, spec, w, shard)
            }),
        }
    }

    /// One tensor-parallel rank with host weights (see [`CudaBackend::from_loaded_rank`]).
    pub(crate) fn new_rank(
        spec: &ModelSpec,
        weights: &Weights,
        opts: &CudaOptions,
        model_fingerprint: String,
        shard: Shard,
    ) -> Result<Self, CudaError> {
        Self::build(spec, opts, model_fingerprint, shard, |gpu| {
            DevWeights::upload(gpu, spec, weights, shard)
        })
    }

    /// One tensor-parallel rank with dummy weights generated on its device.
    pub(crate) fn dummy_rank(
        spec: &ModelSpec,
        seed: u64,
        std: Option<f32>,
        opts: &CudaOptions,
        model_fingerprint: String,
        shard: Shard,
    ) -> Result<Self, CudaError> {
        Self::build(spec, opts, model_fingerprint, shard, |gpu| {
            DevWeights::dummy(gpu, spec, seed, std, shard)
        })
    }

    /// `spec` is the whole model's; this backend runs `shard`'s slice of it.
    fn build(
        spec: &ModelSpec,
        opts: &CudaOptions,
        model_fingerprint: String,
        shard: Shard,
        load: impl FnOnce(&Gpu) -> Result<DevWeights, CudaError>,
    ) -> Result<Self, CudaError> {
        if spec.moe.is_some() && spec.mla.is_none() {
            return Err(CudaError::Unsupported {
                reason: format!(
                    "{:?}: mixture-of-experts layers run with latent attention only (DeepSeek)",
                    spec.arch
                ),
            });
        }
        if opts.tensor_parallel as usize != shard.size {
            return Err(CudaError::Unsupported {
                reason: format!(
                    "tensor_parallel = {}: CudaBackend runs one GPU; use CudaTpBackend for TP > 1",
                    opts.tensor_parallel
                ),
            });
        }
        shard.check(spec)?;
        super::tp::check_gpu_list(&opts.gpus, opts.tensor_parallel)?;
        let spec = &shard.rank_spec(spec);
        if opts.block_size == 0 || !(0.0..=1.0).contains(&opts.mem_fraction) {
            return Err(CudaError::Unsupported {
                reason: format!(
                    "block_size {} / mem_fraction {}",
                    opts.block_size, opts.mem_fraction
                ),
            });
        }
        let ordinal = *opts
            .gpus
            .get(shard.rank)
            .ok_or_else(|| CudaError::Unsupported {
                reason: format!(
                    "rank {} of {}: no GPU listed for it",
                    shard.rank, shard.size
                ),
            })?;
        let mut gpu = Gpu::new(ordinal)?;
        if opts.pdl && !gpu.set_pdl(true) {
            tracing::warn!(
                gpu = ordinal,
                cc = ?gpu.compute_capability,
                driver = super::launch::driver_version(),
                "engine.cuda.pdl: programmatic dependent launch needs sm_90 and a 12.3+ driver; off"
            );
        }
        let (free0, _) = gpu.mem_info()?;
        let w = load(&gpu)?;
        let ws = Workspace::new(&gpu, spec, opts.max_batch_tokens, opts.max_seqs)?;
        let mla_ws = match spec.mla {
            Some(_) => Some(mla::MlaWorkspace::new(&gpu, spec, opts.max_batch_tokens)?),
            None => None,
        };
        let (_, kv_heads, kv_dim) = spec.kv_cache_shape();
        let layout = KvLayout {
            dtype: DType::Bf16,
            num_layers: spec.num_layers as u32,
            block_size: opts.block_size,
            kv_heads_per_rank: kv_heads as u32,
            head_dim: kv_dim as u32,
            tp_size: shard.size as u32,
            model_fingerprint,
            kind: if spec.mla.is_some() {
                pdnode_core::KvKind::Latent
            } else {
                pdnode_core::KvKind::KeyValue
            },
        };
        let block_bytes = layout.block_bytes();
        let num_blocks = if opts.num_kv_blocks > 0 {
            opts.num_kv_blocks as usize
        } else {
            let budget = (free0 as f64 * opts.mem_fraction as f64) as usize;
            let used = w.bytes + ws.bytes() + mla_ws.as_ref().map_or(0, |m| m.bytes());
            let left = budget.saturating_sub(used);
            if left < block_bytes {
                return Err(CudaError::OutOfMemory {
                    what: "KV pool (mem_fraction of free memory after weights)",
                    need: used + block_bytes,
                    have: budget,
                });
            }
            left / block_bytes
        };
        let pool = gpu.alloc(num_blocks * block_bytes)?;
        gpu.memset(&pool, 0)?;
        gpu.sync()?;
        tracing::info!(
            gpu = gpu.ordinal,
            rank = shard.rank,
            tp = shard.size,
            weights_mib = w.bytes >> 20,
            kv_blocks = num_blocks,
            kv_mib = (num_blocks * block_bytes) >> 20,
            "CUDA backend ready"
        );
        let dims = AttnDims {
            num_heads: spec.num_heads,
            num_kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
            block_size: opts.block_size as usize,
            num_blocks,
        };
        let mut opts = opts.clone();
        let hd = spec.head_dim;
        let asked = opts.attention.variant;
        opts.attention.variant = match asked {
            AttnVariant::Auto => AttnVariant::Auto,
            v => {
                let runs = v.resolve(hd);
                if runs != v {
                    tracing::warn!(
                        asked = ?v,
                        runs = ?runs,
                        head_dim = hd,
                        "engine.cuda.attention: the kernel cannot run this head_dim; using auto's"
                    );
                }
                runs
            }
        };
        Ok(Self {
            graphs: graph::DecodeGraphs::new(opts.cuda_graphs),
            w,
            ws,
            pool,
            staging: None,
            staging_sum: None,
            span_slots: None,
            span_sums: Default::default(),
            copy_ids: Default::default(),
            fused_seals: Default::default(),
            step_staging: None,
            stage_run: None,
            stage_ids: None,
            num_blocks,
            layout,
            spec: spec.clone(),
            prefill: PrefillScratch::new(opts.prefill_attention),
            logits_host: gpu.alloc_pinned(opts.max_seqs * spec.vocab_size)?,
            opts,
            dims,
            shard,
            pdl_all: gpu.pdl(),
            comm: None,
            mla_ws,
            #[cfg(feature = "op-timing")]
            prof: None,
            gpu,
        })
    }

    /// Joins the all-reduce group of the tensor-parallel ranks (every rank must call this at the
    /// same time: NCCL's init waits for all of them).
    pub(crate) fn attach_comm(&mut self, id: &super::tp::NcclId) -> Result<(), CudaError> {
        self.comm = Some(NcclComm::init(
            &self.gpu,
            id,
            self.shard.rank,
            self.shard.size,
        )?);
        Ok(())
    }

    /// Re-lays the (zeroed) KV pool out for `num_blocks` blocks (tensor-parallel ranks agree on
    /// the smallest count any of them can hold).
    pub(crate) fn set_num_blocks(&mut self, num_blocks: usize) -> Result<(), CudaError> {
        if num_blocks == self.num_blocks {
            return Ok(());
        }
        self.gpu.sync()?;
        // Captured graphs point into the old pool.
        self.graphs.clear();
        let bytes = num_blocks * self.layout.block_bytes();
        self.pool = self.gpu.alloc(bytes.max(1))?;
        self.gpu.memset(&self.pool, 0)?;
        self.gpu.sync()?;
        self.num_blocks = num_blocks;
        self.dims.num_blocks = num_blocks;
        Ok(())
    }

    /// The smallest KV block count any rank holds (every rank must call this together).
    pub(crate) fn min_blocks(&mut self) -> Result<u64, CudaError> {
        match &self.comm {
            Some(c) => c.min_u64(&self.gpu, self.num_blocks as u64),
            None => Ok(self.num_blocks as u64),
        }
    }

    /// Mean seconds of one in-place f32 all-reduce of `elems` residual elements over the ranks
    /// (every rank must call this together; benchmarks).
    pub(crate) fn time_all_reduce(&mut self, elems: usize, iters: usize) -> Result<f64, CudaError> {
        let Some(c) = &self.comm else {
            return Err(CudaError::Unsupported {
                reason: "no tensor-parallel group to time".into(),
            });
        };
        if elems * 4 > self.ws.resid.bytes() || iters == 0 {
            return Err(CudaError::Shape {
                op: "time_all_reduce",
                reason: format!("{elems} elements x {iters} iterations"),
            });
        }
        self.gpu.bind()?;
        c.all_reduce_sum_f32(&self.gpu, self.ws.resid.ptr(), elems)?;
        self.gpu.sync()?;
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            c.all_reduce_sum_f32(&self.gpu, self.ws.resid.ptr(), elems)?;
        }
        self.gpu.sync()?;
        Ok(t0.elapsed().as_secs_f64() / iters as f64)
    }

    /// This GPU's slice of the model.
    pub fn shard(&self) -> Shard {
        self.shard
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Fills the whole KV pool with seeded random bf16 values (benchmarks: never time on zeros).
    pub fn fill_kv_random(&mut self, seed: u64) -> Result<(), CudaError> {
        self.gpu.bind()?;
        ops::fill_uniform_bf16(&self.gpu, &self.pool, self.pool.bytes() / 2, seed, 1.0)?;
        self.gpu.sync()
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.w.bytes
    }

    /// Runs a step on the device up to the logits (left in the device workspace, `rows x vocab`
    /// f32); returns the row count. Does not wait for the device.
    pub fn forward_device(&mut self, batch: &ForwardBatch<'_>) -> Result<usize, BackendError> {
        // Taken first: an armed plan belongs to this step, whether it runs or fails.
        let stage = self.step_staging.take();
        self.gpu.bind()?;
        let p = self.plan(batch)?;
        if p.tokens == 0 {
            return Ok(0);
        }
        // PDL for every step, or for small decode steps only (graphs of those buckets are
        // captured with it; it changes when kernels start, never what they compute), and not
        // where the step fuses the RMSNorm into the o/down GEMV: with that grid-wide ticket it
        // measured 0.84 ms slower at 1 x 2048 (Fusion::pdl_max_tokens)
        let f = self.opts.fusion;
        let small = self.comm.is_none()
            && graph::is_decode(batch)
            && p.tokens <= f.pdl_max_tokens.min(ops::GEMV_MAX_TOKENS)
            && p.tokens > f.norm_max_tokens;
        self.gpu.set_pdl(self.pdl_all || small);
        // A staged step runs eagerly (its gathers ride in the layer loop): a one-token last
        // chunk of a prompt looks like a decode step.
        if stage.is_none()
            && self.graphs.enabled()
            && graph::is_decode(batch)
            && self.replay_decode(batch, &p)?
        {
            return Ok(p.rows);
        }
        if self.ws.meta.bytes() < p.bytes.len() {
            self.gpu.sync()?;
            self.ws.meta = self.gpu.alloc(p.bytes.len().next_power_of_two())?;
        }
        self.gpu.upload(&self.ws.meta, 0, &p.bytes)?;
        let shape = plan::StepShape::of(&p);
        if let Some(plan) = stage {
            self.stage_run = Some(self.prepare_stage_run(plan)?);
        }
        let encoded = self.encode(self.ws.meta.ptr(), &shape);
        self.stage_run = None;
        encoded?;
        Ok(p.rows)
    }

    /// Enqueues every kernel of one step whose metadata (laid out as `p.off` says) starts at
    /// device address `meta`. Allocates nothing and never waits for the device when no sequence
    /// takes the prefill GEMM path (`p.long` empty), so decode steps can be captured into a
    /// CUDA graph.
    fn encode(&mut self, meta: u64, p: &plan::StepShape<'_>) -> Result<(), CudaError> {
        if self.w.mla.is_some() {
            return self.encode_mla(meta, p);
        }
        let m = |o: usize| meta + o as u64;
        let mut stage = self.stage_run.take();
        let s = &self.spec;
        let (g, w, ws, d) = (&self.gpu, &self.w, &self.ws, &self.dims);
        let (h, t) = (s.hidden_size, p.tokens);
        let (qd, kvd, inter) = (s.q_dim(), s.kv_dim(), s.intermediate_size);
        // Per-op events only in benchmark builds (`op-timing`); else a no-op the compiler drops.
        #[cfg(feature = "op-timing")]
        let mark = |name| self.prof.as_ref().map_or(Ok(()), |pr| pr.mark(g, name));
        #[cfg(not(feature = "op-timing"))]
        let mark = |_: &'static str| Ok::<(), CudaError>(());
        mark("(step start)")?;
        ops::embed_gather(g, &w.embed, s.vocab_size, m(p.off.ids), t, &ws.resid, h)?;
        mark("embed")?;
        let attn_ws = AttnWorkspace {
            part_ml: &ws.part_ml,
            part_acc: &ws.part_acc,
        };
        // the RMSNorm after o_proj / down rides in their launch where linear_rmsnorm can (not
        // with tensor parallelism: the norm must follow the all-reduce)
        let norm_of = |nw| {
            let (out, ticket, eps) = (&ws.normed, &ws.ticket, s.rms_norm_eps);
            self.comm.is_none().then_some(ops::NormFuse {
                w: nw,
                out,
                ticket,
                eps,
            })
        };
        let rmsnorm = |nw| {
            let eps = s.rms_norm_eps;
            ops::add_rmsnorm(g, &ws.resid, t, None, nw, &ws.normed, None, t, h, eps)
        };
        // engine.cuda.linear, per call: a GEMV choice takes cuBLAS where its kernel cannot run
        let lin = self.opts.linear;
        // small decode steps: the four linears stream their weights (gemv_stream), the norms
        // before qkv and gate_up inside them
        let stream = self.streams_step(t);
        let tune = self.opts.fusion.stream_tune();
        let norm_x = |nw| ops::StreamX::Norm {
            resid: &ws.resid,
            w: nw,
            eps: s.rms_norm_eps,
        };
        let mut normed = false;
        for (li, l) in w.layers.iter().enumerate() {
            if stream {
                let x = norm_x(&l.attn_norm);
                ops::gemv_stream(
                    g,
                    qd + 2 * kvd,
                    t,
                    h,
                    &l.wqkv,
                    x,
                    &ws.qkv,
                    ops::StreamOut::Bf16,
                    tune,
                )?;
                mark("attn_norm+qkv")?;
            } else {
                if !normed {
                    rmsnorm(&l.attn_norm)?;
                    mark("attn_norm")?;
                }
                ops::linear(
                    g,
                    qd + 2 * kvd,
                    t,
                    h,
                    &l.wqkv,
                    &ws.normed,
                    &ws.qkv,
                    OutType::Bf16,
                    false,
                    lin.for_call(t, h, &l.wqkv, &ws.normed),
                )?;
                mark("qkv")?;
            }
            ops::rope_qkv(
                g,
                d,
                &ws.qkv,
                l.bqkv.as_ref(),
                l.q_norm.as_ref(),
                l.k_norm.as_ref(),
                &w.inv_freq,
                m(p.off.pos),
                m(p.off.slots),
                t,
                &ws.q,
                &self.pool,
                li,
                s.rms_norm_eps,
            )?;
            mark("rope_kv_write")?;
            if let Some(run) = stage.as_mut() {
                // This layer's KV is final: at a group's end, its gather and the hand-off.
                self.stage_after_layer(run, li)?;
            }
            if p.short_len > 0 {
                let meta = AttnMeta {
                    tok_seq: m(p.off.tok_seq),
                    tok_pos: m(p.off.pos),
                    block_tables: m(p.off.tables),
                    max_blocks: p.max_blocks,
                    max_ctx: p.max_ctx,
                    window: s.attention_window(li).unwrap_or(0),
                };
                let list = (!p.long.is_empty()).then(|| (m(p.off.short), p.short_len));
                ops::paged_attention_ex(
                    g,
                    d,
                    &ws.q,
                    &self.pool,
                    li,
                    &meta,
                    t,
                    list,
                    &ws.attn,
                    &attn_ws,
                    self.opts.attention,
                )?;
                mark("attention")?;
            }
            if !p.long.is_empty() {
                self.prefill.run(
                    g,
                    d,
                    &self.pool,
                    li,
                    &ws.q,
                    &ws.attn,
                    t,
                    m(p.off.tables),
                    p.max_blocks,
                    p.long,
                    s.attention_window(li).unwrap_or(0),
                )?;
                mark("prefill_attention")?;
            }
            if stream {
                let acc = ops::StreamOut::F32Acc;
                ops::gemv_stream(
                    g,
                    h,
                    t,
                    qd,
                    &l.wo,
                    ops::StreamX::Bf16(&ws.attn),
                    &ws.resid,
                    acc,
                    tune,
                )?;
                mark("o_proj")?;
                let x = norm_x(&l.mlp_norm);
                let glu = ops::StreamOut::Glu;
                ops::gemv_stream(g, inter, t, h, &l.w_gate_up, x, &ws.act, glu, tune)?;
                mark("mlp_norm+gate_up+swiglu")?;
                ops::gemv_stream(
                    g,
                    h,
                    t,
                    inter,
                    &l.w_down,
                    ops::StreamX::Bf16(&ws.act),
                    &ws.resid,
                    acc,
                    tune,
                )?;
                mark("down")?;
                continue;
            }
            let nf = norm_of(&l.mlp_norm);
            let rank0 = self.shard.rank == 0;
            normed = ops::linear_rmsnorm(
                g,
                h,
                t,
                qd,
                &l.wo,
                &ws.attn,
                &ws.resid,
                rank0,
                lin.for_call(t, qd, &l.wo, &ws.attn),
                self.opts.fusion,
                nf.as_ref(),
            )?;
            mark(if normed { "o_proj+mlp_norm" } else { "o_proj" })?;
            self.all_reduce_resid(t * h)?;
            if !normed {
                rmsnorm(&l.mlp_norm)?;
                mark("mlp_norm")?;
            }
            // fused at up to 8 tokens by default (engine.cuda.fuse_swiglu_max_tokens), else gate_up, swiglu
            ops::gate_up_swiglu(
                g,
                inter,
                t,
                h,
                &l.w_gate_up,
                &ws.normed,
                &ws.gate_up,
                &ws.act,
                lin.for_call(t, h, &l.w_gate_up, &ws.normed),
                self.opts.fusion,
            )?;
            mark("gate_up+swiglu")?;
            let nf = w.layers.get(li + 1).and_then(|n| norm_of(&n.attn_norm));
            normed = ops::linear_rmsnorm(
                g,
                h,
                t,
                inter,
                &l.w_down,
                &ws.act,
                &ws.resid,
                rank0,
                lin.for_call(t, inter, &l.w_down, &ws.act),
                self.opts.fusion,
                nf.as_ref(),
            )?;
            mark(if normed { "down+attn_norm" } else { "down" })?;
            self.all_reduce_resid(t * h)?;
        }
        self.encode_logits(meta, p)
    }

    /// Whether a step of `tokens` rows runs its linears through [`ops::gemv_stream`]:
    /// [`ops::Fusion::stream_max_tokens`] allows it, the GPU has the kernel, one GPU (with
    /// tensor parallelism the norm must follow the all-reduce), `engine.cuda.linear` is `auto`,
    /// and every operand the kernel reads is 16-byte aligned with the norm's width in range.
    pub fn streams_step(&self, tokens: usize) -> bool {
        let (s, w, ws) = (&self.spec, &self.w, &self.ws);
        let h = s.hidden_size;
        let cap = self.opts.fusion.stream_smem_kib << 10;
        let fits = |units, inp, out| {
            ops::stream_plan(self.gpu.sm_count as usize, units, tokens, inp, out, cap).is_some()
        };
        let aligned = |b: &DevBuf| b.ptr().is_multiple_of(16);
        tokens >= 1
            && tokens <= self.opts.fusion.stream_max_tokens
            && self.comm.is_none()
            && self.opts.linear == ops::LinearImpl::Auto
            && ops::stream_available(&self.gpu)
            && ops::rmsnorm_vector_block(h, &[ws.resid.ptr()], 0).is_some_and(|b| b <= 256)
            && fits(s.q_dim() + 2 * s.kv_dim(), h, ops::StreamOut::Bf16)
            && fits(h, s.q_dim(), ops::StreamOut::F32Acc)
            && fits(s.intermediate_size, h, ops::StreamOut::Glu)
            && fits(h, s.intermediate_size, ops::StreamOut::F32Acc)
            && [&ws.attn, &ws.act].into_iter().all(aligned)
            && w.layers.iter().all(|l| {
                [
                    &l.wqkv,
                    &l.wo,
                    &l.w_gate_up,
                    &l.w_down,
                    &l.attn_norm,
                    &l.mlp_norm,
                ]
                .into_iter()
                .all(aligned)
            })
    }

    /// The final norm of the rows that want logits and the lm_head into `ws.logits`.
    fn encode_logits(&self, meta: u64, p: &plan::StepShape<'_>) -> Result<(), CudaError> {
        let m = |o: usize| meta + o as u64;
        let (s, g, w, ws) = (&self.spec, &self.gpu, &self.w, &self.ws);
        let (h, t) = (s.hidden_size, p.tokens);
        let lin = self.opts.linear;
        #[cfg(feature = "op-timing")]
        let mark = |name| self.prof.as_ref().map_or(Ok(()), |pr| pr.mark(g, name));
        #[cfg(not(feature = "op-timing"))]
        let mark = |_: &'static str| Ok::<(), CudaError>(());
        if p.rows > 0 {
            ops::add_rmsnorm(
                g,
                &ws.resid,
                t,
                None,
                &w.final_norm,
                &ws.normed,
                Some(m(p.off.rows)),
                p.rows,
                h,
                s.rms_norm_eps,
            )?;
            mark("final_norm")?;
            ops::linear(
                g,
                s.vocab_size,
                p.rows,
                h,
                w.output(),
                &ws.normed,
                &ws.logits,
                OutType::F32,
                false,
                lin.for_call(p.rows, h, w.output(), &ws.normed),
            )?;
            mark("lm_head")?;
        }
        Ok(())
    }

    /// With tensor parallelism, rank 0 added its partial projection to the residual and every
    /// other rank wrote its partial in place of it: the f32 sum over ranks is the next residual.
    fn all_reduce_resid(&self, elems: usize) -> Result<(), CudaError> {
        match &self.comm {
            Some(c) => c.all_reduce_sum_f32(&self.gpu, self.ws.resid.ptr(), elems),
            None => Ok(()),
        }
    }

    /// Waits for the device (surfaces asynchronous errors).
    pub fn synchronize(&self) -> Result<(), BackendError> {
        self.gpu.bind()?;
        Ok(self.gpu.sync()?)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Outstanding work may still use the buffers freed next.
        if self.gpu.bind().is_ok() {
            let _ = self.gpu.sync();
        }
    }
}
