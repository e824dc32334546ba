//! `Auto`'s cuBLASLt choices: the shapes and token counts where one of the cuBLASLt heuristic's
//! candidates measured clearly faster than `cublasGemmEx`'s default, and which candidate.

use super::OutType;
use crate::blaslt::AlgoConfig;

/// The cuBLASLt candidate configuration [`super::linear`] under `Auto` runs for `tokens` rows
/// through an `out x inp` weight into `ty`, or `None` for `cublasGemmEx`. From issue 20's
/// `bench_linear_cublaslt_algos` (H200, the device's libcublasLt, us per call in two device calls, weights
/// streamed from HBM; o and down accumulate into the f32 residual, qkv and gate_up write bf16):
/// every entry beat GemmEx by about 3 % or more in both calls (o at 96 rows: measured in the
/// second only); nothing else did (GemmEx runs the heuristic's first choice, within 1 % of the
/// best at 8-32 tokens):
///
/// | layer (out x in) | t | GemmEx | chosen | config (tile id, split-K, cluster id, custom) |
/// |---|---|---|---|---|
/// | qkv 6144x4096 | 48 | 17.7, 17.4 | 17.1, 16.9 | 134, 1, 4, 0 |
/// | o 4096x4096 | 48 | 14.8, 14.8 | 12.9, 12.8 | 13, 1, 5, 3 (GemmEx's own choice at 64) |
/// | o | 96 | 16.1 | 14.2 | 27, 1, 7, 2 |
/// | gate_up 28672x4096 | 48 | 62.7, 61.0 | 60.3, 59.3 | 397, 1, 3, 1 |
/// | gate_up | 64 | 63.4, 61.9 | 60.5, 59.3 | 18, 1, 4, 1 |
/// | gate_up | 128 | 68.6, 66.7 | 65.2, 64.0 | 165, 1, 3, 0 |
/// | down 4096x14336 | 64 | 37.9, 37.1 | 36.0, 35.5 | 15, 2 (reduction 2), 3, 1 |
///
/// Whole graph steps (`bench_llama31_8b_shapes`, `auto/auto` against `auto/cublas`): 5.917 vs
/// 6.008 ms at 48 x 512, 6.156 vs 6.215 at 64 x 512, 9.226 vs 9.303 at 64 x 2048, 32 x 512
/// unchanged (no entry).
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
        (4096, 4096, F32, 96) => (27, 1, 7, 2),
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
