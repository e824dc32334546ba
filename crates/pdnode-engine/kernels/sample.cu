// Greedy tokens on the device: the arg-max of each logits row, so a greedy step copies one id per
// row to the host instead of the whole row.

// True for a value the host arg-max skips: NaN or -inf (bit tests, independent of fast-math).
__device__ __forceinline__ bool argmax_skip(float v) {
    const unsigned u = __float_as_uint(v);
    return (u & 0x7fffffffu) > 0x7f800000u || u == 0xff800000u;
}

// (value, index) pair order of the arg-max: a larger value wins, the lower index on equal values;
// index -1 is "none yet" and loses to anything.
__device__ __forceinline__ void argmax_merge(float& best, int& idx, float v, int i) {
    if (i < 0) return;
    if (idx < 0 || v > best || (v == best && i < idx)) {
        best = v;
        idx = i;
    }
}

// One block per row (blockIdx.x), blockDim.x a multiple of 32 up to 1024: out[row] = the id of
// the largest value of logits[row * vocab .. + vocab) that is neither NaN nor -inf, the lowest id
// on ties (exactly sampling::argmax on the host); -1 when the row has no such value.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab,
                                       int* __restrict__ out) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const float* row = logits + (size_t)blockIdx.x * (size_t)vocab;
    float best = 0.0f;
    int idx = -1;
    // Each thread visits increasing ids: a strict > keeps its lowest id among equal values.
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (argmax_skip(v)) continue;
        if (idx < 0 || v > best) {
            best = v;
            idx = i;
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, best, off);
        const int oi = __shfl_down_sync(0xffffffffu, idx, off);
        argmax_merge(best, idx, ov, oi);
    }
    __shared__ float s_best[32];
    __shared__ int s_idx[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        s_best[warp] = best;
        s_idx[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        const int nwarps = (blockDim.x + 31) >> 5;
        best = lane < nwarps ? s_best[lane] : 0.0f;
        idx = lane < nwarps ? s_idx[lane] : -1;
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_down_sync(0xffffffffu, best, off);
            const int oi = __shfl_down_sync(0xffffffffu, idx, off);
            argmax_merge(best, idx, ov, oi);
        }
        if (lane == 0) out[blockIdx.x] = idx;
    }
}
