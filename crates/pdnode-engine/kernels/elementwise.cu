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

// out[t, i] = silu(gu[t, i]) * gu[t, inter + i]; gu rows are [gate | up]. grid-stride.
extern "C" __global__ void swiglu(const bf16_t* __restrict__ gu, bf16_t* __restrict__ out,
                                  int tokens, int inter) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 n = (i64)tokens * inter;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (i64)gridDim.x * blockDim.x) {
        const i64 t = k / inter, i = k - t * inter;
        const float g = bf2f(gu[t * 2 * inter + i]);
        const float u = bf2f(gu[t * 2 * inter + inter + i]);
        out[k] = f2bf(g / (1.f + __expf(-g)) * u);
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
