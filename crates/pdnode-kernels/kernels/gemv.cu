// Skinny GEMM for decode (T <= 8 token rows), bandwidth-bound on the weights:
// y[t, o] (+)= sum_i w[o, i] * x[t, i]. One warp per output row o (grid-stride), 16-byte loads
// of w and x, f32 accumulation. w: bf16 [out, in]; x: bf16 [T, in], in % 8 == 0.
// y: f32 (accumulate != 0: y += result) or bf16 (y_f32 == 0). block: 256.

template <int MT>
__device__ void gemv_impl(const bf16_t* __restrict__ w, const bf16_t* __restrict__ x,
                          void* __restrict__ y, int T, int out, int in, int y_f32,
                          int accumulate) {
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int nwarps = (gridDim.x * blockDim.x) >> 5;
    const int nv = in >> 3;
    for (int o = warp; o < out; o += nwarps) {
        float acc[MT];
#pragma unroll
        for (int t = 0; t < MT; t++) acc[t] = 0.f;
        const uint4* wr = (const uint4*)(w + (i64)o * in);
#pragma unroll 4
        for (int v = lane; v < nv; v += 32) {
            float wf[8];
            unpack8(wr[v], wf);
#pragma unroll
            for (int t = 0; t < MT; t++) {
                if (t < T) {
                    float xf[8];
                    unpack8(((const uint4*)(x + (i64)t * in))[v], xf);
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[t] += wf[j] * xf[j];
                }
            }
        }
#pragma unroll
        for (int t = 0; t < MT; t++) {
            if (t < T) {
                const float s = warp_sum(acc[t]);
                if (lane == 0) {
                    const i64 k = (i64)t * out + o;
                    if (y_f32) {
                        float* yf = (float*)y;
                        yf[k] = accumulate ? yf[k] + s : s;
                    } else {
                        ((bf16_t*)y)[k] = f2bf(s);
                    }
                }
            }
        }
    }
}

#define GEMV_KERNEL(NAME, MT)                                                                    \
    extern "C" __global__ void __launch_bounds__(256) NAME(const bf16_t* w, const bf16_t* x,      \
                                                           void* y, int T, int out, int in,       \
                                                           int y_f32, int accumulate) {           \
        PD_GRID_WAIT();  PD_GRID_LAUNCH_DEPENDENTS();                                            \
        gemv_impl<MT>(w, x, y, T, out, in, y_f32, accumulate);                                   \
    }

GEMV_KERNEL(gemv_t1, 1)
GEMV_KERNEL(gemv_t2, 2)
GEMV_KERNEL(gemv_t4, 4)
GEMV_KERNEL(gemv_t8, 8)

// ---- gemv_mma: tensor-core skinny GEMM for decode (T <= 8 token rows) ----------------------------
// Same contract as gemv_t*: y[t, o] (+)= sum_i w[o, i] * x[t, i], w bf16 [out, in], x bf16 [T, in],
// in % 8 == 0, w and x 16-byte aligned; y f32 (accumulate != 0: y += result) or bf16.
// One mma.sync m16n8k16 (bf16, f32 accumulate) multiplies 16 weight rows by the T (<= 8) tokens
// (zero columns past T). The k order inside an mma is free as long as A and B agree, so each lane
// reads whole 16-byte segments: lane (g = lane >> 2, c = lane & 3) loads segment c (elements
// 8c .. 8c+7) of a 32-element chunk from rows g and g+8, and the same segment of x[token g]; the
// first half of each uint4 feeds one mma, the second half a second mma (per PTX fragment layout:
// a0 = (row g, k 2c,2c+1), a1 = (row g+8, ...), a2 = (row g, k 2c+8,+9), a3 = (row g+8, ...);
// b0 = (k 2c,2c+1; n g), b1 = (k 2c+8,+9; n g); c0,c1 = (row g, n 2c,2c+1), c2,c3 = (row g+8, ...)).
// PF: weight loads carry .L2::256B. A block owns 16*MT rows and its nw warps (blockDim.x = 32*nw, nw <= 16) split the chunks
// (interleaved); each warp keeps U chunks of loads in flight (weights streamed past L1), then
// the warps' partial sums are added in warp order through shared memory (deterministic).
// No allocation, no host sync: capture-safe.

// 16-byte load from an always-valid address (the caller clamps it), zeroed when `!ok` by a select
// after the load, not a branch, so every load of an unrolled batch is issued before the first mma
// waits. `stream`: weights, read once, not kept in L1.
#define GM_LD(NAME, QUAL)                                                                         \
    __device__ __forceinline__ uint4 NAME(const uint4* p, bool ok) {                              \
        uint4 r;                                                                                  \
        asm volatile("ld.global.nc" QUAL ".v4.u32 {%0, %1, %2, %3}, [%4];\n"                              \
            : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)                                          \
            : "l"(p));                                                                            \
        r.x = ok ? r.x : 0u;                                                                      \
        r.y = ok ? r.y : 0u;                                                                      \
        r.z = ok ? r.z : 0u;                                                                      \
        r.w = ok ? r.w : 0u;                                                                      \
        return r;                                                                                 \
    }
GM_LD(gm_ld_stream, ".L1::no_allocate")
GM_LD(gm_ld_stream_pf, ".L1::no_allocate.L2::256B")
GM_LD(gm_ld, "")

// f32 load from L2 (not L1) that the compiler keeps after the barrier and fence before it: the
// fused norm reads rows other blocks wrote.
__device__ __forceinline__ float gm_ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void gm_mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                       unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#define GM_MAX_WARPS 16

// GLU = 1 (gemv_mma_glu_*): w is the [2 * out, in] gate|up weight (rows 0..out gate, out..2out up)
// and y the bf16 [T, out] SwiGLU activation. Each 16-row mma tile takes 8 gate rows (A rows g) and
// the 8 up rows of the same outputs (A rows g + 8), so c0/c1 hold gate and c2/c3 up of one output:
// the epilogue rounds both to bf16 (as the unfused gate_up output is) and writes
// bf16(silu(gate) * up) with the swiglu kernel's formula. With the launch of the unfused m1 call
// on the gate_up weight (same blocks, same warps) every sum is the same, so the result is the
// unfused gemv_mma + swiglu one, bit for bit; one launch and the gate_up round trip less.
// NORM = 1 (gemv_mma_m1*_norm; f32 y, the residual): after its outputs are written each block
// takes a ticket; the last block (every other block's y visible: threadfence before the ticket,
// L2 loads after it) writes normed[t] = bf16(rmsnorm(y[t]) * nw) for every token, exactly as
// add_rmsnorm does (256 threads' strided sums, block_sum, the same expressions), then puts the
// ticket counter back to 0 for the next launch (graph replays included).
template <int MT, int U, int PF, int GLU, int NORM>
__device__ void gemv_mma_impl(const bf16_t* __restrict__ w, const bf16_t* __restrict__ x,
                              void* __restrict__ y, int T, int out, int in, int y_f32,
                              int accumulate, const float* __restrict__ nw_,
                              bf16_t* __restrict__ normed, unsigned int* ticket, float eps) {
    __shared__ float red[GM_MAX_WARPS][MT * 4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nw = min((int)(blockDim.x >> 5), GM_MAX_WARPS);
    const int g = lane >> 2, c = lane & 3;
    const int row0 = blockIdx.x * (16 * MT);
    const int nseg = in >> 3;          // 16-byte segments per row
    const int nc = (nseg + 3) >> 2;    // 32-element chunks per row
    const uint4* wp[MT][2];
    bool wv[MT][2];
#pragma unroll
    for (int m = 0; m < MT; m++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int o = GLU ? blockIdx.x * (8 * MT) + m * 8 + g : row0 + m * 16 + g + 8 * h;
            const int r = GLU ? o + h * out : o;
            wv[m][h] = o < out;
            wp[m][h] = (const uint4*)(w + (i64)(o < out ? r : 0) * in);
        }
    }
    const bool xv = g < T;
    const uint4* xp = (const uint4*)(x + (i64)(xv ? g : 0) * in);
    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; m++) {
#pragma unroll
        for (int r = 0; r < 4; r++) acc[m][r] = 0.f;
    }
    if (warp < nw) {
        for (int base = warp; base < nc; base += nw * U) {
            uint4 a[U][MT][2];
            uint4 b[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int s = (base + u * nw) * 4 + c;
                const bool ok = s < nseg;
#pragma unroll
                for (int m = 0; m < MT; m++) {
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        a[u][m][h] = PF ? gm_ld_stream_pf(wp[m][h] + (ok ? s : 0), ok && wv[m][h])
                                        : gm_ld_stream(wp[m][h] + (ok ? s : 0), ok && wv[m][h]);
                }
                b[u] = gm_ld(xp + (ok ? s : 0), ok && xv);
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    gm_mma(acc[m], a[u][m][0].x, a[u][m][1].x, a[u][m][0].y, a[u][m][1].y, b[u].x,
                           b[u].y);
                    gm_mma(acc[m], a[u][m][0].z, a[u][m][1].z, a[u][m][0].w, a[u][m][1].w, b[u].z,
                           b[u].w);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < MT; m++) {
#pragma unroll
            for (int r = 0; r < 4; r++) red[warp][m * 4 + r][lane] = acc[m][r];
        }
    }
    __syncthreads();
    if (GLU) {
        for (int e = threadIdx.x; e < MT * 2 * 32; e += blockDim.x) {
            const int q = e >> 5, l = e & 31;
            const int m = q >> 1, r = q & 1;
            float sg = 0.f, su = 0.f;
            for (int k = 0; k < nw; k++) {
                sg += red[k][m * 4 + r][l];
                su += red[k][m * 4 + 2 + r][l];
            }
            const int o = blockIdx.x * (8 * MT) + m * 8 + (l >> 2);
            const int col = 2 * (l & 3) + r;
            if (o < out && col < T) {
                const float gg = bf2f(f2bf(sg)), uu = bf2f(f2bf(su));
                ((bf16_t*)y)[(i64)col * out + o] = f2bf(gg / (1.f + __expf(-gg)) * uu);
            }
        }
    } else {
        for (int e = threadIdx.x; e < MT * 4 * 32; e += blockDim.x) {
            const int q = e >> 5, l = e & 31;
            float s = 0.f;
            for (int k = 0; k < nw; k++) s += red[k][q][l];
            const int m = q >> 2, r = q & 3;
            const int row = row0 + m * 16 + (l >> 2) + ((r & 2) ? 8 : 0);
            const int col = 2 * (l & 3) + (r & 1);
            if (row < out && col < T) {
                const i64 k = (i64)col * out + row;
                if (y_f32) {
                    float* yf = (float*)y;
                    yf[k] = accumulate ? yf[k] + s : s;
                } else {
                    ((bf16_t*)y)[k] = f2bf(s);
                }
            }
        }
        if (NORM) {
            __shared__ unsigned int last;
            __shared__ float sh[33];
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1 ? 1u : 0u;
            __syncthreads();
            if (!last) return;
            __threadfence();
            const float* yf = (const float*)y;
            for (int t = 0; t < T; t++) {
                const float* row = yf + (i64)t * out;
                float ss = 0.f;
                // At most 256 summing threads (a fixed order for any launch of >= 256 threads),
                // but never more than the block has: a 1-warp launch must still cover every
                // element (the H200 run of session 2 caught 32 threads striding by 256).
                const int nsum = blockDim.x < 256 ? (int)blockDim.x : 256;
                if ((int)threadIdx.x < nsum) {
                    // unrolled: 8 L2 loads in flight, the same sequential sum per thread
#pragma unroll 8
                    for (int i = threadIdx.x; i < out; i += nsum) {
                        const float v = gm_ld_cg(row + i);
                        ss += v * v;
                    }
                }
                const float inv = rsqrtf(block_sum(ss, sh) / (float)out + eps);
                bf16_t* o = normed + (i64)t * out;
#pragma unroll 4
                for (int i = threadIdx.x; i < out; i += blockDim.x) o[i] = f2bf(gm_ld_cg(row + i) * inv * nw_[i]);
            }
            if (threadIdx.x == 0) *ticket = 0u;
        }
    }
}

#define GEMV_MMA_KERNEL(NAME, MT, U, PF)                                                            \
    extern "C" __global__ void __launch_bounds__(512, 1) NAME(const bf16_t* w, const bf16_t* x,      \
                                                           void* y, int T, int out, int in,       \
                                                           int y_f32, int accumulate) {           \
        PD_GRID_WAIT();  PD_GRID_LAUNCH_DEPENDENTS();                                                \
        gemv_mma_impl<MT, U, PF, 0, 0>(w, x, y, T, out, in, y_f32, accumulate, nullptr, nullptr,     \
                                       nullptr, 0.f);                                               \
    }

GEMV_MMA_KERNEL(gemv_mma_m1, 1, 4, 0)
GEMV_MMA_KERNEL(gemv_mma_m2, 2, 2, 0)
// the same with an L2 prefetch hint of 256 bytes on the weight loads (the 4 chunks around each
// 64-byte row piece, read by neighbouring warps): fewer, larger DRAM requests
GEMV_MMA_KERNEL(gemv_mma_m1_pf, 1, 4, 1)
GEMV_MMA_KERNEL(gemv_mma_m2_pf, 2, 2, 1)

// Fused gate_up + SwiGLU (GLU = 1 above): w bf16 [2 * out, in] (gate rows then up rows), x bf16
// [T, in], y bf16 [T, out] = silu(x w_gate^T) * (x w_up^T); blocks of 8 outputs (16 weight rows).
#define GEMV_MMA_GLU_KERNEL(NAME, PF)                                                               \
    extern "C" __global__ void __launch_bounds__(512, 1) NAME(const bf16_t* w, const bf16_t* x,      \
                                                           bf16_t* y, int T, int out, int in) {   \
        PD_GRID_WAIT();  PD_GRID_LAUNCH_DEPENDENTS();                                              \
        gemv_mma_impl<1, 4, PF, 1, 0>(w, x, y, T, out, in, 0, 0, nullptr, nullptr, nullptr, 0.f);  \
    }

GEMV_MMA_GLU_KERNEL(gemv_mma_glu_m1, 0)
GEMV_MMA_GLU_KERNEL(gemv_mma_glu_m1_pf, 1)

// Linear into the f32 residual, then the RMSNorm of the next op's input in the same launch
// (NORM = 1 above): y f32 [T, out] (accumulate != 0: y += result), nw f32 [out], normed bf16
// [T, out], ticket: a device u32 that is 0 before the launch (and is again after it). At most 12
// warps a block, 2 blocks an SM (the bounds keep it at the plain kernels' 80 registers: the o and
// down launches, 12 warps x 2 blocks, stay one wave).
#define GEMV_MMA_NORM_KERNEL(NAME, PF)                                                              \
    extern "C" __global__ void __launch_bounds__(384, 2) NAME(                                      \
        const bf16_t* w, const bf16_t* x, float* y, int T, int out, int in, int accumulate,        \
        const float* nw, bf16_t* normed, unsigned int* ticket, float eps) {                         \
        PD_GRID_WAIT();  PD_GRID_LAUNCH_DEPENDENTS();                                               \
        gemv_mma_impl<1, 4, PF, 0, 1>(w, x, y, T, out, in, 1, accumulate, nw, normed, ticket, eps); \
    }

GEMV_MMA_NORM_KERNEL(gemv_mma_m1_norm, 0)
GEMV_MMA_NORM_KERNEL(gemv_mma_m1_pf_norm, 1)
