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
// x (aux.nsplit > 0): the attention's split-K partials combined in the block, exactly as
// attention_combine computes them (the same expressions, partitions in the same order):
// x[t, h * hd + d] = bf16(A / L) over partitions z of token t, head h, with part_ml [T nh
// nsplit][2] (max in natural log, sum) and part_acc [T nh nsplit][hd]; in = nh * hd, hd % 4 ==
// 0. The combine launch (and its release) goes away: the o projection's weights stream while
// its blocks combine.
//
// mode: GS_BF16 y bf16 [T, units]; GS_F32 y f32 = sum; GS_F32_ACC y f32 += sum; GS_GLU y bf16
// [T, units] = silu(g) * u with g, u rounded to bf16 first (as the unfused gate_up output is);
// GS_ROPE: w is the fused [(nh + 2 nkv) hd, in] qkv weight and unit k the row pair (j hd + i,
// j hd + i + hd / 2) of head j = k / (hd / 2), i = k % (hd / 2); both sums rounded to bf16
// (the unfused qkv output), then rope_qkv's RoPE (no bias, no q/k norm; its expressions) for q
// and k heads: q to y bf16 [T, nh, hd], k and v to the paged pool (aux.layer_kv at aux.slots[t],
// rope_qkv's layout). The RoPE launch goes away.
// Shared memory (dynamic, from wg_smem_aligned): GS_HEAD bytes of barriers and norm partials,
// x (T * in bf16), for GS_F32_ACC the y values (T * ceil(units / grid) f32), each rounded up to
// 128 bytes, then `stages` stages of a unit each: 1 <= stages <= GS_MAX_STAGES. Consumer warps:
// nc = the largest count <= GS_CONSUMERS that divides `stages` (a stage's units all go to one
// consumer warp); the host keeps nc >= 6 from 8 stages on.
#define GS_CONSUMERS 8
#define GS_THREADS (32 * GS_CONSUMERS + 32)
#define GS_MAX_STAGES 32
#define GS_HEAD 1024
#define GS_BF16 0
#define GS_F32 1
#define GS_F32_ACC 2
#define GS_GLU 3
#define GS_ROPE 4

// The operands of GS_ROPE and of the combined x (zero where unused), passed by value.
struct GsAux {
    const float* inv_freq;  // [hd / 2], rope scaling applied
    const int* pos;         // [T]
    const i64* slots;       // [T]: block * block_size + slot
    bf16_t* layer_kv;       // this layer's pool, [num_blocks][2][block_size][nkv][hd]
    const float* part_ml;   // [T nh nsplit][2]
    const float* part_acc;  // [T nh nsplit][hd]
    int nh, nkv, hd, block_size;
    int nsplit;             // > 0: x is the attention combine of the partials
    int pad;
};

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
                                                 int ahead, const GsAux& aux,
                                                 unsigned char* smem) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const bool glu = mode == GS_GLU;
    const bool rope = mode == GS_ROPE;
    const bool pair = glu || rope;  // a unit is two weight rows
    const int half = aux.hd >> 1;
    // the weight rows of unit k: ra, and rb where it is a pair
    auto row_a = [&](int k) -> i64 { return rope ? (i64)(k / half) * aux.hd + k % half : k; };
    auto row_b = [&](int k) -> i64 { return rope ? row_a(k) + half : (i64)k + units; };
    const unsigned row_bytes = (unsigned)in * 2u;
    const unsigned unit_bytes = pair ? 2u * row_bytes : row_bytes;
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
                gs_prefetch_l2(w + row_a(u0 + k) * in, row_bytes);
                if (pair) gs_prefetch_l2(w + row_b(u0 + k) * in, row_bytes);
            };
            for (int k = stages; k < n && k < stages + ahead; k++) prefetch(k);
            for (int k = 0; k < n; k++) {
                if (k >= stages && k + ahead < n && ahead > 0) prefetch(k + ahead);
                const int s = k % stages;
                if (k >= stages) ws_mbar_wait(empty0 + 8 * s, (unsigned)((k / stages) - 1) & 1u);
                const unsigned bar = full0 + 8 * s, dst = fp_smem_addr(st0) + s * unit_bytes;
                ws_mbar_expect_tx(bar, unit_bytes);
                gs_bulk_load(dst, w + row_a(u0 + k) * in, row_bytes, bar);
                if (pair) gs_bulk_load(dst + row_bytes, w + row_b(u0 + k) * in, row_bytes, bar);
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
    } else if (aux.nsplit > 0) {
        // attention_combine, four elements (one head, dims d .. d + 3) a step
        const int ns = aux.nsplit, hd = aux.hd;
        const int n4 = (T * in) >> 2;
        for (int i = tid; i < n4; i += 32 * GS_CONSUMERS) {
            const int e = i << 2;
            const int t = e / in, r = e - t * in;
            const int h = r / hd, d = r - h * hd;
            const i64 th = (i64)t * aux.nh + h;
            const float* ml = aux.part_ml + th * ns * 2;
            float M = -INFINITY;
            for (int z = 0; z < ns; z++) M = fmaxf(M, ml[2 * z]);
            float L = 0.f;
            float4 A = make_float4(0.f, 0.f, 0.f, 0.f);
            for (int z = 0; z < ns; z++) {
                const float mz = ml[2 * z];
                if (mz == -INFINITY) continue;
                const float wz = __expf(mz - M);
                L += ml[2 * z + 1] * wz;
                const float4 a = *(const float4*)(aux.part_acc + (th * ns + z) * hd + d);
                A.x += a.x * wz;
                A.y += a.y * wz;
                A.z += a.z * wz;
                A.w += a.w * wz;
            }
            uint2 p;
            p.x = (unsigned)f2bf(L > 0.f ? A.x / L : 0.f) | ((unsigned)f2bf(L > 0.f ? A.y / L : 0.f) << 16);
            p.y = (unsigned)f2bf(L > 0.f ? A.z / L : 0.f) | ((unsigned)f2bf(L > 0.f ? A.w / L : 0.f) << 16);
            *(uint2*)(xs + e) = p;
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
    int nc = GS_CONSUMERS;
    while (stages % nc != 0) nc--;
    // GS_ROPE: the tokens' positions and slots, read once
    int rpos[MT];
    i64 rslot[MT];
#pragma unroll
    for (int t = 0; t < MT; t++) {
        rpos[t] = rope && t < T ? aux.pos[t] : 0;
        rslot[t] = rope && t < T ? aux.slots[t] : 0;
    }
    const int nv = in >> 3;
    for (int k = warp; warp < nc && k < n; k += nc) {
        const int s = k % stages;
        ws_mbar_wait(full0 + 8 * s, (unsigned)(k / stages) & 1u);
        const uint4* wr = (const uint4*)(st0 + (size_t)s * unit_bytes);
        const int u = u0 + k;
        const float freq = rope ? aux.inv_freq[u % half] : 0.f;  // in flight with the sums
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
            if (pair) unpack8(wr[nv + v], uf);
#pragma unroll
            for (int t = 0; t < MT; t++) {
                if (t < T) {
                    float xf[8];
                    unpack8(((const uint4*)(xs + (i64)t * in))[v], xf);
#pragma unroll
                    for (int j = 0; j < 8; j++) ag[t][j & 3] += wf[j] * xf[j];
                    if (pair) {
#pragma unroll
                        for (int j = 0; j < 8; j++) au[t][j & 3] += uf[j] * xf[j];
                    }
                }
            }
        }
        __syncwarp();
        if (lane == 0) ws_mbar_arrive(empty0 + 8 * s);
#pragma unroll
        for (int t = 0; t < MT; t++) {
            if (t < T) {
                const float sg = warp_sum((ag[t][0] + ag[t][1]) + (ag[t][2] + ag[t][3]));
                const float su = pair ? warp_sum((au[t][0] + au[t][1]) + (au[t][2] + au[t][3])) : 0.f;
                if (lane == 0 && rope) {
                    // rope_qkv (no bias, no q/k norm) on the bf16 qkv outputs
                    const int j = u / half, i = u - j * half;
                    const float x1 = bf2f(f2bf(sg)), x2 = bf2f(f2bf(su));
                    float o1 = x1, o2 = x2;
                    if (j < aux.nh + aux.nkv) {
                        float sn, cs;
                        sincosf((float)rpos[t] * freq, &sn, &cs);
                        o1 = x1 * cs - x2 * sn;
                        o2 = x2 * cs + x1 * sn;
                    }
                    bf16_t* dst;
                    if (j < aux.nh) {
                        dst = (bf16_t*)y + ((i64)t * aux.nh + j) * aux.hd;
                    } else {
                        const bool is_v = j >= aux.nh + aux.nkv;
                        const int kh = j - aux.nh - (is_v ? aux.nkv : 0);
                        const i64 bs = aux.block_size, row = (i64)aux.nkv * aux.hd;
                        const i64 blk = rslot[t] / bs, sl = rslot[t] % bs;
                        dst = aux.layer_kv + (blk * 2 * bs + sl) * row + (i64)kh * aux.hd +
                              (is_v ? bs * row : 0);
                    }
                    dst[i] = f2bf(o1);
                    dst[i + half] = f2bf(o2);
                } else if (lane == 0) {
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
             int stages, int ahead, const __grid_constant__ GsAux aux) {                         \
        WG_BODY(gemv_stream_impl<MT>(w, x, resid, norm_w, eps, norm_threads, y, T, units, in,    \
                                     mode, stages, ahead, aux, wg_smem_aligned()))               \
    }

GEMV_STREAM_KERNEL(gemv_stream_t1, 1)
GEMV_STREAM_KERNEL(gemv_stream_t2, 2)
GEMV_STREAM_KERNEL(gemv_stream_t4, 4)
