//! [`CudaOptions`]: how a [`super::CudaBackend`] is sized and which kernels it runs, from
//! `[engine]` (`engine.cuda.*` for the kernel choices).

use super::super::ops::{self, AttnChoice, AttnVariant};
use super::super::prefill::PrefillAttn;

/// Sizing of a [`super::CudaBackend`] and the kernels it runs.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaOptions {
    /// Device ordinals, one per tensor-parallel rank: rank `r` runs on `gpus[r]` (any order,
    /// gaps allowed). Exactly `tensor_parallel` distinct ordinals (checked at build).
    pub gpus: Vec<u32>,
    /// Tensor-parallel degree: 1 for [`super::CudaBackend`]; more through
    /// [`super::super::tp::CudaTpBackend`] (one thread and GPU per rank).
    pub tensor_parallel: u32,
    /// Fraction of the device's free memory (at start) for weights + workspace + KV pool.
    pub mem_fraction: f32,
    /// KV blocks; 0 = as many as `mem_fraction` leaves.
    pub num_kv_blocks: u32,
    pub block_size: u32,
    /// Most tokens in one forward step.
    pub max_batch_tokens: usize,
    /// Most sequences (logits rows) in one forward step.
    pub max_seqs: usize,
    /// Sequences with at least this many new tokens in a step take the cuBLAS prefill
    /// attention path; the others the paged-attention kernel.
    pub prefill_gemm_min_tokens: usize,
    /// Linear layers (`engine.cuda.linear`): `Auto` is the measured per-shape table; a GEMV
    /// choice runs where that GEMV can take the call, cuBLAS elsewhere
    /// ([`ops::LinearImpl::for_call`]).
    pub linear: ops::LinearImpl,
    /// Paged-attention kernel for decode and short chunks, and the v4 partition tuning
    /// (`engine.cuda.attention`, `attention_v4_*`). A kernel the model's head_dim rules out
    /// is replaced by `Auto`'s choice at build, with a warning.
    pub attention: AttnChoice,
    /// Attention of the sequences that take the prefill path (`engine.cuda.prefill_attention`).
    pub prefill_attention: PrefillAttn,
    /// Replay decode steps (one new token per sequence, all wanting logits) from CUDA graphs
    /// captured per (batch-size bucket, context bucket); false: eager launches only.
    pub cuda_graphs: bool,
    /// Sample `LogitsWant::Sample` rows on the device (`engine.cuda.gpu_sampling`).
    pub gpu_sampling: bool,
    /// Programmatic dependent launch of our kernels where the GPU takes it (`engine.cuda.pdl`).
    pub pdl: bool,
    /// What the decode step fuses into the GEMVs (`engine.cuda.fuse_*_max_tokens`).
    pub fusion: ops::Fusion,
    /// Longest context a warm-up at start captures decode graphs for
    /// (`engine.cuda.warm_up_context`); 0: no warm-up.
    pub warm_up_context: usize,
}

impl CudaOptions {
    pub fn from_config(e: &pdnode_core::config::EngineConfig) -> Self {
        Self {
            gpus: super::super::tp::gpus_from_config(&e.gpus, e.tensor_parallel),
            tensor_parallel: e.tensor_parallel.max(1),
            mem_fraction: e.mem_fraction,
            num_kv_blocks: e.num_kv_blocks,
            block_size: e.block_size,
            max_batch_tokens: e.max_batch_tokens.max(1) as usize,
            max_seqs: e.max_running_requests.max(1) as usize,
            prefill_gemm_min_tokens: 64,
            linear: linear_of(e.cuda.linear),
            attention: AttnChoice {
                variant: attention_of(e.cuda.attention),
                v4_waves: e.cuda.attention_v4_waves as usize,
                v4_max_part: e.cuda.attention_v4_max_part as usize,
            },
            prefill_attention: prefill_attention_of(e.cuda.prefill_attention),
            cuda_graphs: e.cuda_graphs,
            gpu_sampling: e.cuda.gpu_sampling,
            pdl: e.cuda.pdl,
            fusion: ops::Fusion {
                swiglu_max_tokens: e.cuda.fuse_swiglu_max_tokens as usize,
                norm_max_tokens: e.cuda.fuse_norm_max_tokens as usize,
                // a launch shape and launch / kernel choices, not config keys: the measured
                // defaults
                glu_warps: ops::Fusion::default().glu_warps,
                pdl_max_tokens: ops::Fusion::default().pdl_max_tokens,
                stream_max_tokens: ops::Fusion::default().stream_max_tokens,
                stream_smem_kib: ops::Fusion::default().stream_smem_kib,
                stream_l2_ahead: ops::Fusion::default().stream_l2_ahead,
            },
            warm_up_context: e.cuda.warm_up_context as usize,
        }
    }

    /// What a backend with these options runs before it serves: prefill steps of 256, 512, ...
    /// tokens up to `max_batch_tokens` (at most `warm_up_context`), then a decode step at every graph
    /// batch bucket (one bucket, eager, without graphs) at contexts 256, 512, ... up to
    /// `warm_up_context`, at most [`graph::MAX_GRAPHS`] of them (the longest contexts go
    /// first). Empty when `warm_up_context` is 0.
    pub fn warm_up_plan(&self) -> pdnode_engine::backend::WarmUpPlan {
        if self.warm_up_context == 0 {
            return Default::default();
        }
        let cap = self.max_seqs.min(self.max_batch_tokens).max(1);
        let mut batches: Vec<usize> = if self.cuda_graphs {
            (1..=cap)
                .filter_map(|n| super::graph::decode_bucket(n, cap))
                .collect()
        } else {
            vec![1]
        };
        batches.dedup();
        let per_ctx = batches.len().max(1);
        let most = if self.cuda_graphs {
            (super::graph::MAX_GRAPHS / per_ctx).max(1)
        } else {
            usize::MAX
        };
        let contexts: Vec<usize> = std::iter::successors(Some(256usize), |c| c.checked_mul(2))
            .take_while(|&c| c <= self.warm_up_context.max(256))
            .take(most)
            .collect();
        pdnode_engine::backend::WarmUpPlan {
            prefill_lengths: std::iter::successors(Some(256usize), |n| n.checked_mul(2))
                .take_while(|&n| n < self.max_batch_tokens.min(self.warm_up_context))
                .chain(std::iter::once(
                    self.max_batch_tokens.min(self.warm_up_context),
                ))
                .collect(),
            decode_batches: batches,
            decode_contexts: contexts,
        }
    }
}

/// `engine.cuda.linear` as the backend's [`ops::LinearImpl`].
fn linear_of(k: pdnode_core::config::LinearKernel) -> ops::LinearImpl {
    use pdnode_core::config::LinearKernel as K;
    match k {
        K::Table => ops::LinearImpl::Auto,
        K::Mma => ops::LinearImpl::GemvMma,
        K::Gemv => ops::LinearImpl::Gemv,
        K::Cublas => ops::LinearImpl::Cublas,
    }
}

/// `engine.cuda.attention` as an [`AttnVariant`].
fn attention_of(k: pdnode_core::config::AttentionKernel) -> AttnVariant {
    use pdnode_core::config::AttentionKernel as K;
    match k {
        K::Auto => AttnVariant::Auto,
        K::V1 => AttnVariant::V1,
        K::V2 => AttnVariant::V2,
        K::V2narrow => AttnVariant::V2Narrow,
        K::V4 => AttnVariant::V4,
    }
}

/// `engine.cuda.prefill_attention` as a [`PrefillAttn`].
fn prefill_attention_of(k: pdnode_core::config::PrefillAttention) -> PrefillAttn {
    use pdnode_core::config::PrefillAttention as K;
    match k {
        K::Flashv3 => PrefillAttn::FlashV3,
        K::Wgmma => PrefillAttn::Wgmma,
        K::Flash8 => PrefillAttn::Flash8,
        K::Gemm => PrefillAttn::Gemm,
    }
}

#[cfg(test)]
mod warm_up_tests {
    use super::CudaOptions;

    fn opts(max_seqs: usize, graphs: bool, ctx: usize) -> CudaOptions {
        let e = pdnode_core::config::EngineConfig {
            max_running_requests: max_seqs as u32,
            max_batch_tokens: 8192,
            cuda_graphs: graphs,
            cuda: pdnode_core::config::CudaEngineConfig {
                warm_up_context: ctx as u32,
                ..Default::default()
            },
            ..Default::default()
        };
        CudaOptions::from_config(&e)
    }

    #[test]
    fn the_plan_covers_every_graph_bucket_at_doubling_contexts() {
        let p = opts(64, true, 4096).warm_up_plan();
        assert_eq!(p.decode_batches, [1, 2, 4, 8, 16, 32, 48, 64]);
        assert_eq!(p.decode_contexts, [256, 512, 1024, 2048, 4096]);
        assert_eq!(p.prefill_lengths, [256, 512, 1024, 2048, 4096]);
        // Without graphs: the kernels only (one batch size).
        let p = opts(64, false, 1024).warm_up_plan();
        assert_eq!(p.decode_batches, [1]);
        assert_eq!(p.decode_contexts, [256, 512, 1024]);
        // 0: nothing at all.
        assert_eq!(opts(64, true, 0).warm_up_plan(), Default::default());
        // Never more graphs than the cache keeps: 14 buckets x 9 contexts <= 128.
        let p = opts(256, true, 1 << 20).warm_up_plan();
        assert_eq!(p.decode_batches.len(), 14);
        assert!(p.decode_batches.len() * p.decode_contexts.len() <= 128);
        assert_eq!(p.decode_contexts.first(), Some(&256));
    }
}
