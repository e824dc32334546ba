// Shared helpers for every pdnode kernel. NVRTC compiles the concatenation of this file and the
// kernel files as one module (no headers, no include paths): bf16 is stored as its raw 16 bits
// and converted by hand (round to nearest even), all arithmetic is f32.

typedef unsigned short bf16_t;
typedef long long i64;
#define INFINITY __int_as_float(0x7f800000)

// Programmatic dependent launch (Hopper; the backend's `engine.cuda.pdl` switch). Every kernel starts
// with PD_GRID_WAIT() then PD_GRID_LAUNCH_DEPENDENTS(), before any global memory access. Launched
// with the programmatic-stream-serialization attribute, a kernel may become resident while the
// previous kernel of the stream still runs; the wait blocks until that kernel has completed and
// its memory is visible. The trigger lets the next kernel be scheduled once every block of this
// one has started (its own wait still holds it until this grid completes). Both are no-ops for a
// grid launched without the attribute, and compile to nothing before sm_90.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PD_GRID_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PD_GRID_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;")
#else
#define PD_GRID_WAIT() \
    do {               \
    } while (0)
#define PD_GRID_LAUNCH_DEPENDENTS() \
    do {                            \
    } while (0)
#endif

__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((unsigned int)x) << 16); }

__device__ __forceinline__ bf16_t f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Two bf16 (low, high) in one 32-bit word.
__device__ __forceinline__ unsigned int pack_bf16x2(float lo, float hi) {
    return (unsigned int)f2bf(lo) | ((unsigned int)f2bf(hi) << 16);
}

// float4 words of a row each thread of add_rmsnorm_v4 holds in registers: rows of up to
// 4 * RMS_V4_MAX * 512 floats (16384) fit one block (the wrapper caps blocks at 512 threads:
// the row lives in registers, 1024 threads of it exceed a block's register file).
#define RMS_V4_MAX 8

// add_rmsnorm_v4's per-thread arithmetic, shared with the streaming GEMV's norm inside its kernel
// (gemv_stream.cu), whose x must be the same bits: a thread's sum of squares over its
// RMS_V4_MAX float4 words, and one word's normalized bf16 values as two packed words.
__device__ __forceinline__ float rms_v4_sumsq(const float4* v) {
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < RMS_V4_MAX; ++j)
        ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
    return ss;
}
__device__ __forceinline__ unsigned int rms_v4_lo(float4 v, float inv, float4 w) {
    return pack_bf16x2(v.x * inv * w.x, v.y * inv * w.y);
}
__device__ __forceinline__ unsigned int rms_v4_hi(float4 v, float inv, float4 w) {
    return pack_bf16x2(v.z * inv * w.z, v.w * inv * w.w);
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). `sh` holds 33 floats.
__device__ float block_sum(float v, float* sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        float r = lane < nw ? sh[lane] : 0.f;
        r = warp_sum(r);
        if (lane == 0) sh[32] = r;
    }
    __syncthreads();
    return sh[32];
}

// Eight bf16 (one 16-byte word) to f32.
__device__ __forceinline__ void unpack8(uint4 u, float* f) {
    f[0] = __uint_as_float(u.x << 16); f[1] = __uint_as_float(u.x & 0xffff0000u);
    f[2] = __uint_as_float(u.y << 16); f[3] = __uint_as_float(u.y & 0xffff0000u);
    f[4] = __uint_as_float(u.z << 16); f[5] = __uint_as_float(u.z & 0xffff0000u);
    f[6] = __uint_as_float(u.w << 16); f[7] = __uint_as_float(u.w & 0xffff0000u);
}

