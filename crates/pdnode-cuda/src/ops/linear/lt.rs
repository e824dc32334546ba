//! `Auto`'s cuBLASLt choices: the shapes and token counts where one of the cuBLASLt heuristic's
//! candidates measured clearly faster than `cublasGemmEx`'s default, and which candidate.

use super::OutType;
use crate::blaslt::AlgoConfig;

/// The cuBLASLt candidate configuration [`super::linear`] under `Auto` runs for `tokens` rows
/// through an `out x inp` weight into `ty`, or `None` for `cublasGemmEx`. From issue 20's
/// `bench_linear_cublaslt_algos` (H200, cuBLAS 13, us per call, weights streamed from HBM;
/// o and down accumulate into the f32 residual, qkv and gate_up write bf16): every entry beat
/// GemmEx by more than 3 % there; nothing else did (GemmEx runs the heuristic's first choice,
/// which is never slower than 1 % behind the best at 8-32 tokens):
///
/// | layer (out x in) | t | GemmEx | chosen | config (tile id, split-K, cluster id, custom) |
/// |---|---|---|---|---|
/// | qkv 6144x4096 | 48 | 17.7 | 17.1 | 134, 1, 4, 0 |
/// | o 4096x4096 | 48 | 14.8 | 12.9 | 13, 1, 5, 3 (GemmEx's own choice at 64 tokens) |
/// | gate_up 28672x4096 | 48 | 62.7 | 60.3 | 397, 1, 3, 1 |
/// | gate_up | 64 | 63.4 | 60.5 | 18, 1, 4, 1 |
/// | gate_up | 128 | 68.6 | 65.2 | 165, 1, 3, 0 |
/// | down 4096x14336 | 64 | 37.9 | 36.0 | 15, 2 (reduction 2), 3, 1 |
///
/// Exact shapes only (the measured ones, one GPU; tensor-parallel shards keep GemmEx); a
/// candidate is used only if the heuristic still offers that exact configuration (else GemmEx:
/// another cuBLAS version needs a new measurement).
pub fn lt_pick(out: usize, tokens: usize, inp: usize, ty: OutType) -> Option<AlgoConfig> {
    use OutType::{Bf16, F32};
    // (tile, split_k, cluster, custom)
    let (tile, split_k, cluster, custom) = match (out, inp, ty, tokens) {
        (6144, 4096, Bf16, 48) => (134, 1, 4, 0),
        (4096, 4096, F32, 48) => (13, 1, 5, 3),
        (28672, 4096, Bf16, 48) => (397, 1, 3, 1),
        (28672, 4096, Bf16, 64) => (18, 1, 4, 1),
        (28672, 4096, Bf16, 128) => (165, 1, 3, 0),
        (4096, 14336, F32, 64) => (15, 2, 3, 1),
        _ => return None,
    };
    Some(AlgoConfig {
        id: 66,
        tile,
        split_k,
        // split-K sums in the output type's workspace (CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE)
        reduction: if split_k > 1 { 2 } else { 0 },
        swizzle: 0,
        stages: 35,
        custom,
        cluster,
    })
}
