//! The CPU backend: f32 compute over host weights and an f32 paged KV pool, multi-threaded with
//! its own rayon pool. It is the reference the CUDA backend is checked against.
//!
//! One forward step runs every new token of every sequence of the batch through the layers
//! together (GEMMs over all tokens), with causal attention per sequence over its cached
//! positions plus its new ones; logits are computed only for the sequences that want them.

mod attention;
mod mla;
mod moe;
pub mod ops;
mod staging;

pub use moe::{group_scores as moe_group_scores, route as route_experts, route_in_groups};
pub use staging::HostArena;

use super::{
    Backend, BackendError, ForwardBatch, KvMemory, KvRegion, Logits, MemKind, StepStaging,
    check_kv_io, layer_block_offset,
};
use crate::loader::{LoadedModel, ModelWeights, dummy};
use crate::spec::{ModelSpec, rope_attention_factor, rope_inv_freqs};
use crate::weights::{MlaWeights, Weights};
use attention::{PoolDims, SeqView};
use pdnode_core::{BlockId, DType, KvLayout};
use std::ops::Range;

/// How to build a [`CpuBackend`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuBackendConfig {
    /// Token positions per KV block.
    pub block_size: u32,
    /// Blocks in the KV pool.
    pub num_blocks: u32,
    /// Worker threads; 0 = all cores.
    pub threads: u32,
}

impl Default for CpuBackendConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 256,
            threads: 0,
        }
    }
}

/// The weights a [`CpuBackend`] computes with.
enum CpuWeights {
    /// Llama family: q/k/v projections, a dense MLP.
    Dense(Weights),
    /// DeepSeek family: latent attention, MoE layers.
    Mla(MlaWeights),
}

pub struct CpuBackend {
    spec: ModelSpec,
    w: CpuWeights,
    layout: KvLayout,
    dims: PoolDims,
    /// The KV pool; never resized after construction (its address is published by `KvMemory`).
    pool: Vec<f32>,
    inv_freq: Vec<f32>,
    /// RoPE's cos/sin factor (YaRN's attention factor; 1 otherwise).
    rope_factor: f32,
    threads: std::sync::Arc<rayon::ThreadPool>,
    /// The hand-off staging arena, when the node lent one (`attach_staging`).
    staging: Option<HostArena>,
    /// The next forward's in-step staging plan ([`KvStaging::stage_next_step`]).
    step_staging: Option<StepStaging>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("arch", &self.spec.arch)
            .field("layout", &self.layout)
            .field("threads", &self.threads.current_num_threads())
            .finish()
    }
}

impl CpuBackend {
    /// Builds a backend over host weights (checked against `spec`).
    pub fn new(
        spec: ModelSpec,
        weights: Weights,
        fingerprint: String,
        cfg: CpuBackendConfig,
    ) -> Result<Self, BackendError> {
        weights
            .check_shapes(&spec)
            .map_err(|e| BackendError::InvalidBatch {
                reason: e.to_string(),
            })?;
        if spec.mla.is_some() {
            return Err(BackendError::InvalidBatch {
                reason: "a latent-attention spec needs latent-attention weights (new_mla)".into(),
            });
        }
        Self::build(spec, CpuWeights::Dense(weights), fingerprint, cfg)
    }

    /// Builds a backend over the host weights of a latent-attention (DeepSeek) model.
    pub fn new_mla(
        spec: ModelSpec,
        weights: MlaWeights,
        fingerprint: String,
        cfg: CpuBackendConfig,
    ) -> Result<Self, BackendError> {
        weights
            .check_shapes(&spec)
            .map_err(|e| BackendError::InvalidBatch {
                reason: e.to_string(),
            })?;
        Self::build(spec, CpuWeights::Mla(weights), fingerprint, cfg)
    }

    fn build(
        spec: ModelSpec,
        w: CpuWeights,
        fingerprint: String,
        cfg: CpuBackendConfig,
    ) -> Result<Self, BackendError> {
        if cfg.block_size == 0 || cfg.num_blocks == 0 {
            return Err(BackendError::InvalidBatch {
                reason: format!(
                    "block_size {} and num_blocks {} must be positive",
                    cfg.block_size, cfg.num_blocks
                ),
            });
        }
        let (planes, kv_heads, head_dim) = spec.kv_cache_shape();
        let dims = PoolDims {
            num_blocks: cfg.num_blocks as usize,
            block_size: cfg.block_size as usize,
            planes,
            kv_heads,
            head_dim,
        };
        let elems = spec
            .num_layers
            .checked_mul(dims.num_blocks)
            .and_then(|x| x.checked_mul(dims.layer_block()))
            .ok_or_else(|| BackendError::Device("KV pool size overflows".into()))?;
        let pool = zeroed_pool(elems).ok_or_else(|| {
            BackendError::Device(format!("cannot allocate a KV pool of {} bytes", elems * 4))
        })?;
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads as usize)
            .thread_name(|i| format!("pdnode-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::Device(format!("cannot start CPU worker threads: {e}")))?;
        let layout = KvLayout {
            dtype: DType::F32,
            num_layers: spec.num_layers as u32,
            block_size: cfg.block_size,
            kv_heads_per_rank: kv_heads as u32,
            head_dim: head_dim as u32,
            tp_size: 1,
            model_fingerprint: fingerprint,
            kind: if spec.mla.is_some() {
                pdnode_core::KvKind::Latent
            } else {
                pdnode_core::KvKind::KeyValue
            },
        };
        let threads = std::sync::Arc::new(threads);
        // RoPE turns the whole head (Llama family) or the RoPE part of it (latent attention).
        let rope_dim = spec
            .mla
            .as_ref()
            .map_or(spec.head_dim, |m| m.qk_rope_head_dim);
        let inv_freq = rope_inv_freqs(rope_dim, spec.rope_theta, spec.rope_scaling.as_ref());
        let rope_factor = rope_attention_factor(spec.rope_scaling.as_ref());
        Ok(Self {
            spec,
            w,
            layout,
            dims,
            pool,
            inv_freq,
            rope_factor,
            threads,
            staging: None,
            step_staging: None,
        })
    }

    /// Builds a backend from a loaded model, materializing dummy weights on the host.
    pub fn from_loaded(model: LoadedModel, cfg: CpuBackendConfig) -> Result<Self, BackendError> {
        if let ModelWeights::Dummy(_) = model.weights {
            // Materialized at f32 on the host: refuse what cannot fit rather than abort on it.
            let need = model.spec.num_params() as u64 * 4;
            if let Some(avail) = host_memory_available().filter(|&a| need > a) {
                return Err(BackendError::Device(format!(
                    "dummy `{}` weights need {:.1} GB of host memory at f32, {:.1} GB are \
                     available: too large for the CPU backend",
                    model.name,
                    need as f64 / 1e9,
                    avail as f64 / 1e9
                )));
            }
        }
        match model.weights {
            ModelWeights::Host(w) => Self::new(model.spec, w, model.fingerprint, cfg),
            ModelWeights::HostMla(w) => Self::new_mla(model.spec, w, model.fingerprint, cfg),
            ModelWeights::Dummy(d) if model.spec.mla.is_some() => {
                let w = dummy::materialize_mla(&model.spec, d).ok_or_else(|| {
                    BackendError::Device("the dummy spec has no latent attention".into())
                })?;
                Self::new_mla(model.spec, w, model.fingerprint, cfg)
            }
            ModelWeights::Dummy(d) => {
                let w = dummy::materialize(&model.spec, d);
                Self::new(model.spec, w, model.fingerprint, cfg)
            }
        }
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn pool_bytes(&self) -> &[u8] {
        // SAFETY: f32 has no padding and any byte pattern is a valid u8; the view covers exactly
        // the pool's initialized elements and borrows it immutably.
        unsafe { std::slice::from_raw_parts(self.pool.as_ptr().cast::<u8>(), self.pool.len() * 4) }
    }

    fn pool_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `pool_bytes`; every byte pattern is also a valid f32 (possibly NaN), so
        // writes through the byte view cannot create an invalid value.
        unsafe {
            std::slice::from_raw_parts_mut(self.pool.as_mut_ptr().cast::<u8>(), self.pool.len() * 4)
        }
    }

    fn validate(&self, batch: &ForwardBatch<'_>) -> Result<Vec<Vec<usize>>, BackendError> {
        let bs = self.dims.block_size;
        let mut tables: Vec<Vec<usize>> = Vec::with_capacity(batch.seqs.len());
        for (i, s) in batch.seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(BackendError::InvalidBatch {
                    reason: format!("sequence {i} has no tokens"),
                });
            }
            if let Some(t) = s
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.spec.vocab_size)
            {
                return Err(BackendError::InvalidBatch {
                    reason: format!(
                        "sequence {i}: token id {t} outside the vocabulary of {}",
                        self.spec.vocab_size
                    ),
                });
            }
            let end = s.start_pos.checked_add(s.tokens.len()).ok_or_else(|| {
                BackendError::InvalidBatch {
                    reason: format!("sequence {i}: start position {} overflows", s.start_pos),
                }
            })?;
            let need = end.div_ceil(bs);
            if s.block_table.len() < need {
                return Err(BackendError::InvalidBatch {
                    reason: format!(
                        "sequence {i}: {} blocks cover {} positions, {end} needed",
                        s.block_table.len(),
                        s.block_table.len() * bs
                    ),
                });
            }
            let table = &s.block_table[..need];
            if let Some(b) = table.iter().find(|b| b.0 as usize >= self.dims.num_blocks) {
                return Err(BackendError::BlockOutOfRange {
                    block: *b,
                    num_blocks: self.dims.num_blocks,
                });
            }
            tables.push(table.iter().map(|b| b.0 as usize).collect());
        }
        // No two new tokens of the step may write the same KV slot.
        let mut slots = std::collections::HashSet::new();
        for (i, (s, table)) in batch.seqs.iter().zip(&tables).enumerate() {
            for p in s.start_pos..s.start_pos + s.tokens.len() {
                if !slots.insert((table[p / bs], p % bs)) {
                    return Err(BackendError::InvalidBatch {
                        reason: format!(
                            "sequence {i} writes KV slot {} of block {} that another token of this step also writes",
                            p % bs,
                            table[p / bs]
                        ),
                    });
                }
            }
        }
        Ok(tables)
    }

    fn forward_inner(
        &mut self,
        batch: &ForwardBatch<'_>,
        tables: &[Vec<usize>],
        stage: Option<StepStaging>,
    ) -> Logits {
        match self.w {
            CpuWeights::Dense(_) => self.forward_dense(batch, tables, stage),
            CpuWeights::Mla(_) => self.forward_mla(batch, tables, stage),
        }
    }

    fn forward_dense(
        &mut self,
        batch: &ForwardBatch<'_>,
        tables: &[Vec<usize>],
        mut stage: Option<StepStaging>,
    ) -> Logits {
        let CpuWeights::Dense(w) = &self.w else {
            unreachable!("forward_inner dispatches on the weights");
        };
        let s = &self.spec;
        let (h, qd, kvd, inter) = (s.hidden_size, s.q_dim(), s.kv_dim(), s.intermediate_size);
        let (nh, nkv, hd, eps) = (s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps);
        let (seqs, positions, mut x) = step_rows(batch, tables, &w.embed.data, h);
        let t = positions.len();
        let (cos, sin) = ops::rope_tables(&positions, &self.inv_freq);
        let mut xn = vec![0f32; t * h];
        let mut q = vec![0f32; t * qd];
        let mut k = vec![0f32; t * kvd];
        let mut v = vec![0f32; t * kvd];
        let mut att = vec![0f32; t * qd];
        let mut gate = vec![0f32; t * inter];
        let mut up = vec![0f32; t * inter];
        let num_layers = w.layers.len() as u32;
        let mut group_start = 0u32;
        for (li, l) in w.layers.iter().enumerate() {
            ops::rms_norm(&mut xn, &x, &l.attn_norm.data, h, eps);
            ops::matmul_wt(&mut q, &xn, &l.wq.data, t, qd, h, false);
            ops::matmul_wt(&mut k, &xn, &l.wk.data, t, kvd, h, false);
            ops::matmul_wt(&mut v, &xn, &l.wv.data, t, kvd, h, false);
            if let (Some(bq), Some(bk), Some(bv)) = (&l.bq, &l.bk, &l.bv) {
                ops::add_bias(&mut q, &bq.data);
                ops::add_bias(&mut k, &bk.data);
                ops::add_bias(&mut v, &bv.data);
            }
            if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                ops::rms_norm_inplace(&mut q, &qn.data, hd, eps);
                ops::rms_norm_inplace(&mut k, &kn.data, hd, eps);
            }
            ops::rope(&mut q, nh, hd, &cos, &sin);
            ops::rope(&mut k, nkv, hd, &cos, &sin);
            attention::write_kv(&mut self.pool, self.dims, li, &seqs, &k, &v);
            if let Some(plan) = stage.as_mut() {
                let done = li as u32 + 1;
                if done.is_multiple_of(plan.group.max(1)) || done == num_layers {
                    self.stage_layers(plan, group_start..done);
                    group_start = done;
                }
            }
            let window = self.spec.attention_window(li);
            attention::attention(&mut att, &self.pool, self.dims, li, &seqs, &q, nh, window);
            ops::matmul_wt(&mut x, &att, &l.wo.data, t, h, qd, true);
            ops::rms_norm(&mut xn, &x, &l.mlp_norm.data, h, eps);
            ops::matmul_wt(&mut gate, &xn, &l.w_gate.data, t, inter, h, false);
            ops::matmul_wt(&mut up, &xn, &l.w_up.data, t, inter, h, false);
            ops::silu_mul(&mut gate, &up);
            ops::matmul_wt(&mut x, &gate, &l.w_down.data, t, h, inter, true);
        }
        output_logits(batch, &seqs, &x, s, &w.final_norm.data, &w.output().data)
    }
}

/// The batch's new tokens as rows: each sequence's view (its first row, blocks), every row's
/// position, and the rows' embeddings (`[tokens][hidden]`).
fn step_rows<'a>(
    batch: &ForwardBatch<'_>,
    tables: &'a [Vec<usize>],
    embed: &[f32],
    h: usize,
) -> (Vec<SeqView<'a>>, Vec<usize>, Vec<f32>) {
    let mut seqs = Vec::with_capacity(batch.seqs.len());
    let mut positions = Vec::new();
    let mut x = Vec::with_capacity(batch.num_tokens() * h);
    for (st, table) in batch.seqs.iter().zip(tables) {
        seqs.push(SeqView {
            row: positions.len(),
            len: st.tokens.len(),
            start_pos: st.start_pos,
            blocks: table,
        });
        positions.extend(st.start_pos..st.start_pos + st.tokens.len());
        for &tok in st.tokens {
            let tok = tok as usize;
            x.extend_from_slice(&embed[tok * h..(tok + 1) * h]);
        }
    }
    (seqs, positions, x)
}

/// The final norm and the output projection, only for the last row of each sequence that wants
/// logits.
fn output_logits(
    batch: &ForwardBatch<'_>,
    seqs: &[SeqView<'_>],
    x: &[f32],
    s: &ModelSpec,
    final_norm: &[f32],
    output: &[f32],
) -> Logits {
    let h = s.hidden_size;
    let rows: Vec<usize> = batch
        .seqs
        .iter()
        .zip(seqs)
        .filter(|(st, _)| st.want_logits)
        .map(|(_, sv)| sv.row + sv.len - 1)
        .collect();
    let r = rows.len();
    let mut last = vec![0f32; r * h];
    for (dst, &row) in last.chunks_mut(h).zip(&rows) {
        dst.copy_from_slice(&x[row * h..(row + 1) * h]);
    }
    let mut normed = vec![0f32; r * h];
    ops::rms_norm(&mut normed, &last, final_norm, h, s.rms_norm_eps);
    let vocab = s.vocab_size;
    let mut logits = vec![0f32; r * vocab];
    ops::matmul_wt(&mut logits, &normed, output, r, vocab, h, false);
    Logits {
        vocab,
        data: logits,
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn kv_layout(&self) -> &KvLayout {
        &self.layout
    }

    fn num_kv_blocks(&self) -> usize {
        self.dims.num_blocks
    }

    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Logits, BackendError> {
        // Taken first: an armed plan belongs to this step, whether it runs or fails.
        let stage = self.step_staging.take();
        let tables = self.validate(batch)?;
        if batch.seqs.is_empty() {
            return Ok(Logits {
                vocab: self.spec.vocab_size,
                data: Vec::new(),
            });
        }
        let threads = std::sync::Arc::clone(&self.threads);
        let out = threads.install(|| self.forward_inner(batch, &tables, stage));
        Ok(out)
    }

    fn read_kv(
        &self,
        layers: Range<u32>,
        blocks: &[BlockId],
        out: &mut [u8],
    ) -> Result<(), BackendError> {
        let per = check_kv_io(
            &self.layout,
            self.dims.num_blocks,
            &layers,
            blocks,
            out.len(),
            1,
        )?;
        let lb = self.layout.block_layer_bytes();
        let bytes = self.pool_bytes();
        let mut o = 0;
        for layer in layers {
            for &b in blocks {
                let off = layer_block_offset(&self.layout, self.dims.num_blocks, layer, b);
                out[o..o + lb].copy_from_slice(&bytes[off..off + lb]);
                o += lb;
            }
        }
        debug_assert_eq!(o, per);
        Ok(())
    }

    fn write_kv(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        data: &[u8],
    ) -> Result<(), BackendError> {
        check_kv_io(
            &self.layout,
            self.dims.num_blocks,
            &layers,
            blocks,
            data.len(),
            1,
        )?;
        let lb = self.layout.block_layer_bytes();
        let (layout, nb) = (self.layout.clone(), self.dims.num_blocks);
        let bytes = self.pool_bytes_mut();
        let mut o = 0;
        for layer in layers {
            for &b in blocks {
                let off = layer_block_offset(&layout, nb, layer, b);
                bytes[off..off + lb].copy_from_slice(&data[o..o + lb]);
                o += lb;
            }
        }
        Ok(())
    }

    fn kv_staging(&mut self) -> Option<&mut dyn super::KvStaging> {
        if self.staging.is_some() {
            Some(self)
        } else {
            None
        }
    }
}

impl KvMemory for CpuBackend {
    fn kv_regions(&self) -> Vec<KvRegion> {
        vec![KvRegion {
            ptr: self.pool.as_ptr() as u64,
            len: self.pool.len() * 4,
            mem: MemKind::Host,
        }]
    }
}

/// `MemAvailable` of `/proc/meminfo` in bytes; `None` where it cannot be read.
fn host_memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `n` zeroed f32s, or `None` when the allocation fails. Zeroed by the allocator
/// (`alloc_zeroed`: fresh pages from the OS for a pool this size), not written here: writing
/// 1 GiB of zeros at start cost seconds of a node's start-up on a busy machine (the cluster's
/// prefill-join), and the pages now fault in as the pool is used.
fn zeroed_pool(n: usize) -> Option<Vec<f32>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<f32>(n).ok()?;
    // SAFETY: the layout has a non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) } as *mut f32;
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` comes from the global allocator with the layout of `n` f32s (capacity `n`),
    // and all-zero bytes are a valid f32 (0.0) for each of the `n` elements.
    Some(unsafe { Vec::from_raw_parts(p, n, n) })
}

#[cfg(test)]
mod pool_tests {
    use super::zeroed_pool;

    /// DeepSeek-V3's dummy weights at f32 (2.7 TB) are refused with a clear error, not an
    /// abort (no host has that much).
    #[test]
    fn dummy_weights_larger_than_the_host_are_an_error() {
        let model = crate::loader::load_dummy(
            "deepseek-v3",
            crate::loader::DummySpec { seed: 0, std: 0.02 },
            None,
        )
        .unwrap();
        let err = super::CpuBackend::from_loaded(model, super::CpuBackendConfig::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("GB of host memory"), "{err}");
        assert!(super::host_memory_available().is_some_and(|a| a > 0));
    }

    #[test]
    fn the_pool_is_zeroed_and_an_impossible_one_is_an_error_not_an_abort() {
        let p = zeroed_pool(1 << 20).expect("4 MiB");
        assert_eq!(p.len(), 1 << 20);
        assert!(p.iter().all(|&x| x == 0.0));
        assert!(zeroed_pool(usize::MAX / 2).is_none());
        assert!(zeroed_pool(0).is_some_and(|p| p.is_empty()));
    }
}
