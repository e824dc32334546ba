// ---- gemv_stream: decode GEMV whose weights stream through shared memory (sm_90) --------------
// y[t, u] (+)= sum_i w[u, i] * x[t, i] for T <= MT token rows, w bf16 [units, in] (GS_GLU:
// [2 units, in], gate rows then up rows), in % 8 == 0, w 16-byte aligned.
//
// One block an SM (grid <= units), each owning a contiguous range of units (a unit: one weight
// row, or for GS_GLU the gate row and the up row of one output), so a block's weights are one or
// two contiguous spans. Warp GS_CONSUMERS (the producer, its lane 0) copies unit k of the block
// into stage k % stages with one bulk copy a row (cp.async.bulk, completing on the stage's full
// mbarrier); consumer warp c takes units c, c + nc, ... (nc = min(stages, GS_CONSUMERS)), each
// a whole row dot product (16-byte shared loads, f32 sums in a fixed order, warp_sum), then
// releases the stage (its empty mbarrier). The producer issues the first `stages` copies before anything waits on the
// previous kernel (the weights are no kernel's output): under programmatic dependent launch they
// stream while that kernel drains, and the ramp of a launch (the first bytes' latency) hides
// behind it. What the previous kernel writes (x, the residual, y) is read only after the
// consumers' grid-dependency wait.
//
// x: bf16 [T, in] copied into shared memory, or (norm_w != 0) the RMSNorm of the f32 residual
// rows resid[t] computed into shared memory as add_rmsnorm_v4 computes it with `norm_threads`
// threads (its launch's block for this width, <= 256): the same float4 words a thread, the same
// sums, the same expressions (common.cuh's rms_v4_* helpers, which both use), so x is bit for
// bit add_rmsnorm_v4's output and the separate norm launch goes away. GS_F32_ACC reads the
// block's y values into shared memory up front, so no row waits on a global load before its
// store.
//
// ahead > 0: the producer also prefetches into L2 the rows `ahead` units before their copy
// (cp.async.bulk.prefetch.L2), more bytes in flight than the shared-memory ring holds.
//
// mode: GS_BF16 y bf16 [T, units]; GS_F32 y f32 = sum; GS_F32_ACC y f32 += sum; GS_GLU y bf16
// [T, units] = silu(g) * u with g, u rounded to bf16 first (as the unfused gate_up output is).
// Shared memory (dynamic, from wg_smem_aligned): GS_HEAD bytes of barriers and norm partials,
// x (T * in bf16), for GS_F32_ACC the y values (T * ceil(units / grid) f32), each rounded up to
// 128 bytes, then `stages` stages of a unit each: 1 <=
// stages <= GS_MAX_STAGES, a multiple of GS_CONSUMERS from GS_CONSUMERS on (a stage's units all
// go to one consumer warp).
#define GS_CONSUMERS 8
#define GS_THREADS (32 * GS_CONSUMERS + 32)
#define GS_MAX_STAGES 32
#define GS_HEAD 1024
#define GS_BF16 0
#define GS_F32 1
#define GS_F32_ACC 2
#define GS_GLU 3

// PTX-BEGIN: the bulk copy

// `bytes` (a multiple of 16) from global `src` to shared address `dst` (both 16-byte aligned),
// counted as complete_tx bytes on mbarrier `bar`.
__device__ __forceinline__ void gs_bulk_load(unsigned dst, const void* src, unsigned bytes,
                                             unsigned bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
        ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}

// An L2 prefetch of `bytes` (a multiple of 16) at global `src`: rows beyond the ring, in flight
// without shared memory.
__device__ __forceinline__ void gs_prefetch_l2(const void* src, unsigned bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}

// PTX-END

template <int MT>
__device__ __forceinline__ void gemv_stream_impl(const bf16_t* __restrict__ w,
                                                 const bf16_t* __restrict__ x,
                                                 const float* __restrict__ resid,
                                                 const float* __restrict__ norm_w, float eps,
                                                 int norm_threads, void* __restrict__ y, int T,
                                                 int units, int in, int mode, int stages,
                                                 int ahead, unsigned char* smem) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const bool glu = mode == GS_GLU;
    const unsigned row_bytes = (unsigned)in * 2u;
    const unsigned unit_bytes = glu ? 2u * row_bytes : row_bytes;
    const int u0 = (int)((i64)blockIdx.x * units / gridDim.x);
    const int n = (int)((i64)(blockIdx.x + 1) * units / gridDim.x) - u0;
    const unsigned base = fp_smem_addr(smem);
    const unsigned full0 = base, empty0 = base + 8 * GS_MAX_STAGES;
    float* red = (float*)(smem + 16 * GS_MAX_STAGES);  // [32] norm partials
    bf16_t* xs = (bf16_t*)(smem + GS_HEAD);
    const unsigned xbytes = ((unsigned)(T * in * 2) + 127u) & ~127u;
    const int per_block = (units + (int)gridDim.x - 1) / (int)gridDim.x;
    float* ys = (float*)(smem + GS_HEAD + xbytes);  // GS_F32_ACC: [T][per_block]
    const unsigned ybytes =
        mode == GS_F32_ACC ? (((unsigned)(T * per_block * 4) + 127u) & ~127u) : 0u;
    unsigned char* st0 = smem + GS_HEAD + xbytes + ybytes;
    if (tid == 0) {
        for (int s = 0; s < stages; s++) {
            ws_mbar_init(full0 + 8 * s, 1);
            ws_mbar_init(empty0 + 8 * s, 1);
        }
        ws_mbar_init_fence();
    }
    __syncthreads();
    if (warp == GS_CONSUMERS) {
        // the producer: no wait on the previous kernel (it reads only weights)
        PD_GRID_LAUNCH_DEPENDENTS();
        if (lane == 0) {
            // units past the ring's first fill, `ahead` of their copy, into L2 (ahead 0: none)
            auto prefetch = [&](int k) {
                gs_prefetch_l2(w + (i64)(u0 + k) * in, row_bytes);
                if (glu) gs_prefetch_l2(w + (i64)(u0 + k + units) * in, row_bytes);
            };
            for (int k = stages; k < n && k < stages + ahead; k++) prefetch(k);
            for (int k = 0; k < n; k++) {
                if (k >= stages && k + ahead < n && ahead > 0) prefetch(k + ahead);
                const int s = k % stages;
                if (k >= stages) ws_mbar_wait(empty0 + 8 * s, (unsigned)((k / stages) - 1) & 1u);
                const unsigned bar = full0 + 8 * s, dst = fp_smem_addr(st0) + s * unit_bytes;
                ws_mbar_expect_tx(bar, unit_bytes);
                gs_bulk_load(dst, w + (i64)(u0 + k) * in, row_bytes, bar);
                if (glu) gs_bulk_load(dst + row_bytes, w + (i64)(u0 + k + units) * in, row_bytes, bar);
                ws_mbar_arrive(bar);
            }
        }
        return;
    }
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    if (norm_w) {
        // add_rmsnorm_v4 (no delta) with norm_threads threads, a token at a time; the norm
        // weight's words loaded once, with the first row's
        const int n4 = in >> 2, nwn = norm_threads >> 5;
        const float4* w4 = (const float4*)norm_w;
        float4 wv[RMS_V4_MAX];
#pragma unroll
        for (int j = 0; j < RMS_V4_MAX; ++j) {
            const int c = j * norm_threads + tid;
            wv[j] = tid < norm_threads && c < n4 ? w4[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        for (int t = 0; t < T; t++) {
            const float4* xr = (const float4*)(resid + (i64)t * in);
            float4 v[RMS_V4_MAX];
            float ss = 0.f;
            if (tid < norm_threads) {
#pragma unroll
                for (int j = 0; j < RMS_V4_MAX; ++j) {
                    const int c = j * norm_threads + tid;
                    v[j] = c < n4 ? xr[c] : make_float4(0.f, 0.f, 0.f, 0.f);
                }
                ss = warp_sum(rms_v4_sumsq(v));
                if (lane == 0) red[warp] = ss;
            }
            ws_turn_wait(0);  // the 256 consumer threads
            if (tid < norm_threads) {
                float r = lane < nwn ? red[lane] : 0.f;
                r = warp_sum(r);
                const float inv = rsqrtf(r / (float)in + eps);
                uint2* o = (uint2*)(xs + (i64)t * in);
#pragma unroll
                for (int j = 0; j < RMS_V4_MAX; ++j) {
                    const int c = j * norm_threads + tid;
                    if (c < n4) {
                        uint2 p;
                        p.x = rms_v4_lo(v[j], inv, wv[j]);
                        p.y = rms_v4_hi(v[j], inv, wv[j]);
                        o[c] = p;
                    }
                }
            }
            ws_turn_wait(0);  // red free again
        }
    } else {
        const int nx = (T * in) >> 3;
        for (int i = tid; i < nx; i += 32 * GS_CONSUMERS) ((uint4*)xs)[i] = ((const uint4*)x)[i];
    }
    if (mode == GS_F32_ACC) {
        const float* yf = (const float*)y;
        for (int i = tid; i < T * n; i += 32 * GS_CONSUMERS) {
            const int t = i / n, k = i - t * n;
            ys[t * per_block + k] = yf[(i64)t * units + u0 + k];
        }
    }
    ws_turn_wait(0);  // x (and ys) complete
    // Consumer warp c < nc takes the units of stages c, c + nc, ...: each stage has one consumer,
    // which waits for every fill of it in order (a phase parity is only safe one phase ahead).
    const int nc = stages < GS_CONSUMERS ? stages : GS_CONSUMERS;
    const int nv = in >> 3;
    for (int k = warp; warp < nc && k < n; k += nc) {
        const int s = k % stages;
        ws_mbar_wait(full0 + 8 * s, (unsigned)(k / stages) & 1u);
        const uint4* wr = (const uint4*)(st0 + (size_t)s * unit_bytes);
        // four partial sums a token (element j of a vector into sum j & 3), added at the end:
        // four FMA chains a quarter as long (the last row of a block is latency-bound)
        float ag[MT][4], au[MT][4];
#pragma unroll
        for (int t = 0; t < MT; t++) {
#pragma unroll
            for (int q = 0; q < 4; q++) ag[t][q] = au[t][q] = 0.f;
        }
#pragma unroll 4
        for (int v = lane; v < nv; v += 32) {
            float wf[8], uf[8];
            unpack8(wr[v], wf);
            if (glu) unpack8(wr[nv + v], uf);
#pragma unroll
            for (int t = 0; t < MT; t++) {
                if (t < T) {
                    float xf[8];
                    unpack8(((const uint4*)(xs + (i64)t * in))[v], xf);
#pragma unroll
                    for (int j = 0; j < 8; j++) ag[t][j & 3] += wf[j] * xf[j];
                    if (glu) {
#pragma unroll
                        for (int j = 0; j < 8; j++) au[t][j & 3] += uf[j] * xf[j];
                    }
                }
            }
        }
        __syncwarp();
        if (lane == 0) ws_mbar_arrive(empty0 + 8 * s);
        const int u = u0 + k;
#pragma unroll
        for (int t = 0; t < MT; t++) {
            if (t < T) {
                const float sg = warp_sum((ag[t][0] + ag[t][1]) + (ag[t][2] + ag[t][3]));
                const float su = glu ? warp_sum((au[t][0] + au[t][1]) + (au[t][2] + au[t][3])) : 0.f;
                if (lane == 0) {
                    const i64 o = (i64)t * units + u;
                    if (mode == GS_BF16) {
                        ((bf16_t*)y)[o] = f2bf(sg);
                    } else if (mode == GS_GLU) {
                        const float gg = bf2f(f2bf(sg)), uu = bf2f(f2bf(su));
                        ((bf16_t*)y)[o] = f2bf(gg / (1.f + __expf(-gg)) * uu);
                    } else {
                        float* yf = (float*)y;
                        yf[o] = mode == GS_F32_ACC ? ys[t * per_block + k] + sg : sg;
                    }
                }
            }
        }
    }
}

#define GEMV_STREAM_KERNEL(NAME, MT)                                                              \
    extern "C" __global__ void __launch_bounds__(GS_THREADS, 1)                                  \
        NAME(const bf16_t* w, const bf16_t* x, const float* resid, const float* norm_w,           \
             float eps, int norm_threads, void* y, int T, int units, int in, int mode,            \
             int stages, int ahead) {                                                            \
        WG_BODY(gemv_stream_impl<MT>(w, x, resid, norm_w, eps, norm_threads, y, T, units, in,    \
                                     mode, stages, ahead, wg_smem_aligned()))                    \
    }

GEMV_STREAM_KERNEL(gemv_stream_t1, 1)
GEMV_STREAM_KERNEL(gemv_stream_t2, 2)
GEMV_STREAM_KERNEL(gemv_stream_t4, 4)
