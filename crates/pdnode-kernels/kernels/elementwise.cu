// Embedding gather, RMSNorm, SwiGLU, dummy-weight fill.

// resid[t, :] = table[ids[t], :] (bf16 -> f32). grid: T, block: 256.
extern "C" __global__ void embed_gather(const bf16_t* __restrict__ table,
                                        const unsigned int* __restrict__ ids,
                                        float* __restrict__ resid, int hidden) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 t = blockIdx.x;
    const bf16_t* src = table + (i64)ids[t] * hidden;
    float* dst = resid + t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = bf2f(src[i]);
}

// For each output row r (source row s = rows ? rows[r] : r):
//   if delta: resid[s] += delta[s]   (f32; TP partial sums after an all-reduce)
//   out[r] = bf16(resid[s] * rsqrt(mean(resid[s]^2) + eps) * w)
// grid: R, block: 256 (multiple of 32).
extern "C" __global__ void add_rmsnorm(float* __restrict__ resid, const float* __restrict__ delta,
                                       const float* __restrict__ w, bf16_t* __restrict__ out,
                                       const int* __restrict__ rows, int hidden, float eps) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ float sh[33];
    const i64 r = blockIdx.x;
    const i64 s = rows ? (i64)rows[r] : r;
    float* x = resid + s * hidden;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = x[i];
        if (delta) {
            v += delta[s * hidden + i];
            x[i] = v;
        }
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, sh) / (float)hidden + eps);
    bf16_t* o = out + r * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = f2bf(x[i] * inv * w[i]);
}

// add_rmsnorm in one pass over memory: hidden % 4 == 0, resid, delta and w 16-byte aligned, out
// 8-byte aligned, hidden / 4 <= RMS_V4_MAX * blockDim.x (the wrapper checks all of it, else runs
// add_rmsnorm). Each thread loads its float4 words of the row (word j * blockDim.x + threadIdx.x,
// j < RMS_V4_MAX) into registers, all loads in flight at once; adds delta and writes resid back
// only when delta is given; then one block sum and the bf16 row as 8-byte stores. The norm
// weight's words are loaded with the row's (not after the sum): one memory round trip less on
// the way out. Same f32 math as add_rmsnorm (the order of the sum of squares differs).
// grid: R, block: a multiple of 32, at most 1024.
extern "C" __global__ void add_rmsnorm_v4(float* __restrict__ resid, const float* __restrict__ delta,
                                          const float* __restrict__ w, bf16_t* __restrict__ out,
                                          const int* __restrict__ rows, int hidden, float eps) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ float sh[33];
    const i64 r = blockIdx.x;
    const i64 s = rows ? (i64)rows[r] : r;
    const int n4 = hidden >> 2;
    float4* x = (float4*)(resid + s * hidden);
    const float4* w4 = (const float4*)w;
    float4 v[RMS_V4_MAX], wv[RMS_V4_MAX];
#pragma unroll
    for (int j = 0; j < RMS_V4_MAX; ++j) {
        const int c = j * blockDim.x + threadIdx.x;
        v[j] = c < n4 ? x[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        wv[j] = c < n4 ? w4[c] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (delta) {
        const float4* d = (const float4*)(delta + s * hidden);
        float4 dv[RMS_V4_MAX];
#pragma unroll
        for (int j = 0; j < RMS_V4_MAX; ++j) {
            const int c = j * blockDim.x + threadIdx.x;
            dv[j] = c < n4 ? d[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < RMS_V4_MAX; ++j) {
            const int c = j * blockDim.x + threadIdx.x;
            v[j].x += dv[j].x;
            v[j].y += dv[j].y;
            v[j].z += dv[j].z;
            v[j].w += dv[j].w;
            if (c < n4) x[c] = v[j];
        }
    }
    const float ss = rms_v4_sumsq(v);
    const float inv = rsqrtf(block_sum(ss, sh) / (float)hidden + eps);
    uint2* o = (uint2*)(out + r * hidden);
#pragma unroll
    for (int j = 0; j < RMS_V4_MAX; ++j) {
        const int c = j * blockDim.x + threadIdx.x;
        if (c < n4) {
            uint2 p;
            p.x = rms_v4_lo(v[j], inv, wv[j]);
            p.y = rms_v4_hi(v[j], inv, wv[j]);
            o[c] = p;
        }
    }
}

// silu(g) * u in f32, as every swiglu kernel computes it (one expression, so the scalar and the
// vectorized kernels give bit-identical bf16 outputs).
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + __expf(-g)) * u; }

// out[t, i] = silu(gu[t, i]) * gu[t, inter + i]; gu rows are [gate | up]. grid-stride. The
// fallback of swiglu_v8 (any inter, any alignment).
extern "C" __global__ void swiglu(const bf16_t* __restrict__ gu, bf16_t* __restrict__ out,
                                  int tokens, int inter) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 n = (i64)tokens * inter;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (i64)gridDim.x * blockDim.x) {
        const i64 t = k / inter, i = k - t * inter;
        const float g = bf2f(gu[t * 2 * inter + i]);
        const float u = bf2f(gu[t * 2 * inter + inter + i]);
        out[k] = f2bf(silu_mul(g, u));
    }
}

// 16-byte words (8 bf16) of gate and of up each thread of swiglu_v8 has in flight per row.
#define SWIGLU_V8_UNROLL 2

// swiglu with 16-byte loads and stores: inter % 8 == 0, gu and out 16-byte aligned (the wrapper
// checks both). Row t = blockIdx.y (+ k * gridDim.y), so no division per element; block b of a
// row covers the 16-byte words [b * blockDim.x * UNROLL, (b + 1) * blockDim.x * UNROLL) of it,
// word j * blockDim.x + threadIdx.x for j < UNROLL, all loads issued before the math.
// grid: (ceil(inter / 8 / (blockDim.x * UNROLL)), min(tokens, 65535)), block: any.
extern "C" __global__ void swiglu_v8(const bf16_t* __restrict__ gu, bf16_t* __restrict__ out,
                                     int tokens, int inter) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const int n8 = inter >> 3;
    const int c0 = blockIdx.x * blockDim.x * SWIGLU_V8_UNROLL + threadIdx.x;
    for (int t = blockIdx.y; t < tokens; t += gridDim.y) {
        const uint4* g8 = (const uint4*)(gu + (i64)t * 2 * inter);
        const uint4* u8 = g8 + n8;
        uint4* o8 = (uint4*)(out + (i64)t * inter);
        uint4 gv[SWIGLU_V8_UNROLL], uv[SWIGLU_V8_UNROLL];
#pragma unroll
        for (int j = 0; j < SWIGLU_V8_UNROLL; ++j) {
            const int c = c0 + j * blockDim.x;
            if (c < n8) {
                gv[j] = g8[c];
                uv[j] = u8[c];
            }
        }
#pragma unroll
        for (int j = 0; j < SWIGLU_V8_UNROLL; ++j) {
            const int c = c0 + j * blockDim.x;
            if (c < n8) {
                float g[8], u[8];
                unpack8(gv[j], g);
                unpack8(uv[j], u);
                uint4 o;
                o.x = pack_bf16x2(silu_mul(g[0], u[0]), silu_mul(g[1], u[1]));
                o.y = pack_bf16x2(silu_mul(g[2], u[2]), silu_mul(g[3], u[3]));
                o.z = pack_bf16x2(silu_mul(g[4], u[4]), silu_mul(g[5], u[5]));
                o.w = pack_bf16x2(silu_mul(g[6], u[6]), silu_mul(g[7], u[7]));
                o8[c] = o;
            }
        }
    }
}

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// p[i] = uniform(-scale, scale) from a hash of (seed, i): dummy weights generated on the device.
extern "C" __global__ void fill_uniform_bf16(bf16_t* __restrict__ p, i64 n, unsigned long long seed,
                                            float scale) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const unsigned long long h = splitmix64(seed ^ splitmix64((unsigned long long)i));
        const float u = (float)(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        p[i] = f2bf((2.f * u - 1.f) * scale);
    }
}

// A rows x cols block of a larger random matrix: p[r * cols + c] = the fill_uniform_bf16 value of
// global element src_off + r * src_ld + c (tensor-parallel shards of dummy weights: every rank
// generates exactly its slice of the tensor that TP = 1 would generate).
extern "C" __global__ void fill_uniform_bf16_2d(bf16_t* __restrict__ p, i64 rows, i64 cols, i64 src_ld,
                                               i64 src_off, unsigned long long seed, float scale) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 n = rows * cols;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / cols, c = i - r * cols;
        const i64 g = src_off + r * src_ld + c;
        const unsigned long long h = splitmix64(seed ^ splitmix64((unsigned long long)g));
        const float u = (float)(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        p[i] = f2bf((2.f * u - 1.f) * scale);
    }
}

extern "C" __global__ void fill_f32(float* __restrict__ p, i64 n, float v) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        p[i] = v;
}
