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
#define PD_GRID_WAIT_ONLY() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PD_GRID_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;")
#else
#define PD_GRID_WAIT_ONLY() \
    do {                    \
    } while (0)
#define PD_GRID_LAUNCH_DEPENDENTS() \
    do {                            \
    } while (0)
#endif

#ifdef PD_TRACE
// Timeline builds (`pdnode_kernels::ptx_traced`, for `bench_decode_trace` only; never what the
// backend runs otherwise): PD_GRID_WAIT() also declares a scope whose thread (0, 0, 0) of each
// block appends one record to this program's `pd_trace_buf` when the function that holds the
// wait returns: the grid's launch id (%gridid), FNV-1a of that function's name, the SM, the
// block, and %globaltimer (ns) when it reached the wait, when the wait returned (the previous
// kernel had completed) and when it returned. Records past PD_TRACE_CAP are dropped (counted).
#define PD_TRACE_CAP 262144
#define PD_TRACE_WORDS 5
__device__ unsigned long long pd_trace_buf[PD_TRACE_CAP * PD_TRACE_WORDS];
__device__ unsigned int pd_trace_n;

__device__ __forceinline__ unsigned long long pd_trace_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

struct PdTraceScope {
    const char* name;
    unsigned long long t0, tw;
    __device__ explicit PdTraceScope(const char* n) : name(n), t0(pd_trace_now()), tw(0) {}
    __device__ void waited() { tw = pd_trace_now(); }
    __device__ ~PdTraceScope() {
        if (threadIdx.x | threadIdx.y | threadIdx.z) return;
        const unsigned long long t1 = pd_trace_now();
        unsigned h = 2166136261u;
        for (const char* c = name; *c; c++) h = (h ^ (unsigned char)*c) * 16777619u;
        unsigned long long gid;
        unsigned sm;
        asm volatile("mov.u64 %0, %%gridid;" : "=l"(gid));
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        const unsigned blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        const unsigned slot = atomicAdd(&pd_trace_n, 1u);
        if (slot >= PD_TRACE_CAP) return;
        unsigned long long* r = pd_trace_buf + (unsigned long long)slot * PD_TRACE_WORDS;
        r[0] = gid;
        r[1] = ((unsigned long long)h << 32) | ((unsigned long long)(sm & 0xffffu) << 16) |
               (blk & 0xffffu);
        r[2] = t0;
        r[3] = tw;
        r[4] = t1;
    }
};
#define PD_GRID_WAIT()                               \
    PdTraceScope pd_trace_scope_(__func__);          \
    PD_GRID_WAIT_ONLY();                             \
    pd_trace_scope_.waited()
#else
#define PD_GRID_WAIT() PD_GRID_WAIT_ONLY()
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

