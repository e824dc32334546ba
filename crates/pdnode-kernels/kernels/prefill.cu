// Prefill attention through cuBLAS: helpers around two strided-batched GEMMs per query chunk
// (S = Q K^T in f32, O = P V), for sequences with many new tokens.

// Copies rows [row0, row0 + n) of x [T, nh, hd] to head-major y [nh, n, hd] (to_head_major),
// or head-major y back into those rows of x. grid: (n, nh), block: 64.
extern "C" __global__ void transpose_heads(bf16_t* __restrict__ x, bf16_t* __restrict__ y,
                                           int row0, int n, int nh, int hd, int to_head_major) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 t = blockIdx.x, h = blockIdx.y;
    bf16_t* a = x + ((row0 + t) * nh + h) * hd;
    bf16_t* b = y + (h * n + t) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        if (to_head_major) b[d] = a[d];
        else a[d] = b[d];
    }
}

// K and V of positions [0, len) of one sequence (block table `table`) from one layer of the pool
// into kc, vc [nkv, len_cap, hd]. grid: (len, nkv), block: 64.
extern "C" __global__ void kv_gather_seq(const bf16_t* __restrict__ layer_kv,
                                         const int* __restrict__ table, int nkv, int hd,
                                         int block_size, int len_cap, bf16_t* __restrict__ kc,
                                         bf16_t* __restrict__ vc) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 p = blockIdx.x, h = blockIdx.y;
    const i64 row = (i64)nkv * hd;
    const i64 blk = table[p / block_size];
    const bf16_t* ks = layer_kv + (blk * 2 * block_size + p % block_size) * row + h * hd;
    const bf16_t* vs = ks + (i64)block_size * row;
    bf16_t* kd = kc + (h * len_cap + p) * hd;
    bf16_t* vd = vc + (h * len_cap + p) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        kd[d] = ks[d];
        vd[d] = vs[d];
    }
}

// Row r = (h, t) of s [nh, tq, tk] (f32 scores): p = softmax(scale * s) over keys lo..=q0 + t,
// zeros elsewhere (causal; lo = max(0, q0 + t + 1 - window) with a sliding window, 0 when window
// is 0). Key indices are relative to the first key column of s (q0 likewise). One pass for the
// running max and sum, one to write. grid: nh * tq, block: 256.
extern "C" __global__ void causal_softmax(const float* __restrict__ s, bf16_t* __restrict__ p,
                                          int tq, int tk, int q0, float scale, int window) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ float sh_m[32], sh_l[32];
    const i64 r = blockIdx.x;
    const int t = (int)(r % tq);
    const int lim = min(tk, q0 + t + 1);
    const int lo = window > 0 ? max(0, q0 + t + 1 - window) : 0;
    const float* x = s + r * tk;
    bf16_t* y = p + r * tk;
    float m = -INFINITY, l = 0.f;
    for (int k = lo + threadIdx.x; k < lim; k += blockDim.x) {
        const float v = x[k] * scale;
        if (v > m) {
            l = l * __expf(m - v) + 1.f;
            m = v;
        } else {
            l += __expf(v - m);
        }
    }
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float mo = __shfl_xor_sync(0xffffffffu, m, o);
        const float lo = __shfl_xor_sync(0xffffffffu, l, o);
        const float mn = fmaxf(m, mo);
        l = (m == -INFINITY ? 0.f : l * __expf(m - mn)) + (mo == -INFINITY ? 0.f : lo * __expf(mo - mn));
        m = mn;
    }
    if (lane == 0) {
        sh_m[wi] = m;
        sh_l[wi] = l;
    }
    __syncthreads();
    float M = -INFINITY;
    for (int i = 0; i < nw; i++) M = fmaxf(M, sh_m[i]);
    float L = 0.f;
    for (int i = 0; i < nw; i++)
        if (sh_m[i] != -INFINITY) L += sh_l[i] * __expf(sh_m[i] - M);
    const float inv = 1.f / L;
    for (int k = threadIdx.x; k < tk; k += blockDim.x)
        y[k] = (unsigned)(k - lo) < (unsigned)(lim - lo) ? f2bf(__expf(x[k] * scale - M) * inv)
                                                           : (bf16_t)0;  // lo <= k < lim
}
