//! The switches benchmarks and tests flip on one backend between steps (kernel choices, fusion
//! limits, PDL, CUDA graphs); `engine.cuda.*` sets them at start.

use super::CudaBackend;
use super::graph::GraphStats;
use crate::ops::{self, AttnChoice, AttnVariant};
use crate::prefill::PrefillAttn;

impl CudaBackend {
    /// Drops the captured decode graphs (they hold the launches of the old settings), after
    /// waiting for any replay; where the device cannot be waited for, graphs are turned off.
    fn drop_graphs(&mut self) {
        if self.gpu.bind().is_ok() && self.gpu.sync().is_ok() {
            self.graphs.clear();
        } else {
            self.graphs.disable();
        }
    }

    /// Switches the kernels later steps use (benchmarks compare variants on one backend; the v4
    /// tuning stays as configured).
    pub fn set_kernels(&mut self, attention: AttnVariant, linear: ops::LinearImpl) {
        let choice = ops::AttnChoice {
            variant: attention,
            ..self.opts.attention
        };
        self.set_attention(choice, linear);
    }

    /// [`Self::set_kernels`] with the v4 partition tuning too (`engine.cuda.attention_v4_waves`,
    /// `attention_v4_max_part`): benchmarks compare the settings on one backend.
    pub fn set_attention(&mut self, attention: ops::AttnChoice, linear: ops::LinearImpl) {
        if (attention, linear) != (self.opts.attention, self.opts.linear) {
            self.drop_graphs();
        }
        self.opts.attention = attention;
        self.opts.linear = linear;
    }

    /// Switches the prefill attention of later steps (benchmarks compare the implementations on
    /// one backend). Prefill steps are never captured into graphs, so none is dropped.
    pub fn set_prefill_attn(&mut self, attn: PrefillAttn) {
        self.opts.prefill_attention = attn;
        self.prefill.attn = attn;
    }

    /// Whether `Wgmma` prefill attention runs its plain kernel where the warp-specialized one
    /// fits ([`crate::prefill::PrefillScratch::wg_plain`]; benchmarks compare the two).
    pub fn set_wg_plain(&mut self, on: bool) {
        self.prefill.wg_plain = on;
    }

    /// The kernels later steps use: paged attention (with the v4 tuning), linear layers,
    /// prefill attention.
    pub fn kernels(&self) -> (AttnChoice, ops::LinearImpl, PrefillAttn) {
        (
            self.opts.attention,
            self.opts.linear,
            self.opts.prefill_attention,
        )
    }

    /// Switches what later steps fuse into the GEMVs (benchmarks compare fused and unfused on
    /// one backend); captured graphs are dropped on a change (they hold the other launches).
    pub fn set_fusion(&mut self, fusion: ops::Fusion) {
        if fusion != self.opts.fusion {
            self.drop_graphs();
        }
        self.opts.fusion = fusion;
    }

    /// The fusion limits later steps use ([`Self::set_fusion`]).
    pub fn fusion(&self) -> ops::Fusion {
        self.opts.fusion
    }

    /// Switches programmatic dependent launch of our kernels for later steps (`engine.cuda.pdl` sets
    /// it at start; tests and benchmarks compare both on one backend); returns what it is now
    /// (false where the GPU cannot: [`Gpu::set_pdl`]). Captured graphs are dropped on a change:
    /// they hold launches of the other kind.
    pub fn set_pdl(&mut self, on: bool) -> bool {
        let before = self.pdl_all;
        let now = self.gpu.set_pdl(on);
        self.pdl_all = now;
        if now != before {
            self.drop_graphs();
        }
        now
    }

    /// Whether every step's launches are programmatic dependent launches ([`Self::set_pdl`];
    /// small decode steps may be without it: [`ops::Fusion::pdl_max_tokens`]).
    pub fn pdl(&self) -> bool {
        self.pdl_all
    }

    /// Turns decode-step CUDA graphs on or off for later steps (benchmarks and tests compare
    /// both on one backend); graphs captured so far are kept for when they are turned back on.
    pub fn set_cuda_graphs(&mut self, on: bool) {
        #[cfg(feature = "op-timing")]
        if on {
            self.prof = None; // never an event inside a capture
        }
        self.opts.cuda_graphs = on;
        self.graphs.set_enabled(on);
    }

    /// Counters of the decode-step graphs (captures, replays, eager fall-backs).
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats()
    }
}
