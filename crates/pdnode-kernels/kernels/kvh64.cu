// KVH64 (pdnode_transfer::kvh64): the hash of a KV hand-off's bytes as 16-byte words, word j of
// a span contributing term(lo, hi, j) to a sum mod 2^64 (the host applies the finish). Terms are
// independent, so each thread sums its words in any order, each thread block adds its
// threads' sums to *out (zeroed by the caller) and launches over parts of one span add up
// (`word0` is the index of the launch's first word in the span). `kv_gather_h64` / `kv_scatter_h64` are
// `kv_gather` / `kv_scatter` (kv_copy.cu) that also hash the staging words they write / read:
// the check rides on a copy the hand-off runs anyway.

#define KVH_P1 0x9E3779B185EBCA87ull
#define KVH_P2 0xC2B2AE3D27D4EB4Full
#define KVH_P3 0x165667B19E3779F9ull

__device__ __forceinline__ unsigned long long kvh_fmix(unsigned long long x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

__device__ __forceinline__ unsigned long long kvh_term(uint4 w, unsigned long long j) {
    const unsigned long long lo = (unsigned long long)w.y << 32 | w.x;
    const unsigned long long hi = (unsigned long long)w.w << 32 | w.z;
    const unsigned long long x = (lo ^ (j * KVH_P1)) * KVH_P2;
    const unsigned long long y = hi ^ (j * KVH_P3);
    return kvh_fmix(x + ((y << 31) | (y >> 33)));
}

// Adds the thread block's sums to *out with one atomic: a burst of one atomic per warp on one
// word at the end of a small launch (a prefill chunk's gather) serializes in L2 and showed as
// +24 % on the H200. Every thread of the block calls it (blockDim a multiple of 32, <= 1024).
__device__ __forceinline__ void kvh_add(unsigned long long s, unsigned long long* out) {
    __shared__ unsigned long long part[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const unsigned w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) part[w] = s;
    __syncthreads();
    if (w == 0) {
        s = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0ull;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (threadIdx.x == 0 && s) atomicAdd(out, s);
    }
}

// grid: any, block: a multiple of 32.
extern "C" __global__ void kvh64_words(const uint4* __restrict__ data, i64 nwords, i64 word0,
                                       unsigned long long* __restrict__ out) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    unsigned long long s = 0;
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < nwords; i += step)
        s += kvh_term(data[i], (unsigned long long)(word0 + i));
    kvh_add(s, out);
}

// grid: nlayers * nblocks, block: 256 (as kv_gather).
extern "C" __global__ void kv_gather_h64(const uint4* __restrict__ pool,
                                         uint4* __restrict__ staging,
                                         const int* __restrict__ blocks, int nblocks, int layer0,
                                         int num_blocks, i64 lb_vec, i64 stride_vec,
                                         i64 word0, unsigned long long* __restrict__ out) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 idx = blockIdx.x;
    const i64 l = idx / nblocks, b = idx % nblocks;
    const uint4* src = pool + ((i64)(layer0 + l) * num_blocks + blocks[b]) * lb_vec;
    const i64 at = l * stride_vec + b * lb_vec;
    uint4* dst = staging + at;
    const i64 j0 = word0 + at;
    unsigned long long s = 0;
    for (i64 i = threadIdx.x; i < lb_vec; i += blockDim.x) {
        const uint4 v = src[i];
        dst[i] = v;
        s += kvh_term(v, (unsigned long long)(j0 + i));
    }
    kvh_add(s, out);
}

extern "C" __global__ void kv_scatter_h64(uint4* __restrict__ pool,
                                          const uint4* __restrict__ staging,
                                          const int* __restrict__ blocks, int nblocks, int layer0,
                                          int num_blocks, i64 lb_vec, i64 stride_vec,
                                          i64 word0, unsigned long long* __restrict__ out) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 idx = blockIdx.x;
    const i64 l = idx / nblocks, b = idx % nblocks;
    uint4* dst = pool + ((i64)(layer0 + l) * num_blocks + blocks[b]) * lb_vec;
    const i64 at = l * stride_vec + b * lb_vec;
    const uint4* src = staging + at;
    const i64 j0 = word0 + at;
    unsigned long long s = 0;
    for (i64 i = threadIdx.x; i < lb_vec; i += blockDim.x) {
        const uint4 v = src[i];
        dst[i] = v;
        s += kvh_term(v, (unsigned long long)(j0 + i));
    }
    kvh_add(s, out);
}
