// ---- gemm_skinny: decode GEMM for 9-64 token rows on wgmma, stream-K over the SMs (sm_90a) ----
// y[t, u] (+)= sum_i w[u, i] * x[t, i] for T <= N token rows (gemm_skinny_n16 / _n32 / _n64),
// w bf16 [out, in] and x bf16 [T, in] as TMA tensor maps (in % 8 == 0, 16-byte aligned; see
// WsTmap: dims (in, rows, 1, 1, 1), boxes (64, 128) for w and (64, N) for x, 128-byte swizzle).
//
// Why (issue 20, docs/benchmarks.md session 26): at 16-64 rows cuBLAS streams the small decode
// linears at 0.53-0.68 of the copy rate, and the register-fed tensor-core GEMV (gemv_mma) loses
// more past 16 rows: each of its blocks re-reads all of x from L2 (at 32 rows 100 MB of x
// against qkv's 50 MB of weights). Here a CTA reads each x chunk once for 128 weight rows.
//
// Work: tiles = ceil(out / 128) row tiles times kc = ceil(in / 64) k-chunks, linearized tile by
// tile; CTA b of G takes iterations [b * total / G, (b + 1) * total / G) (stream-K: every CTA the
// same weight bytes, whatever the tile count). Per iteration the producer (warp SK_CONSUMERS,
// lane 0) loads by TMA the tile's 128 weight rows x 64 inputs (16 KB; rows past `out` and inputs
// past `in` zero-filled) and the N token rows x 64 inputs of x (rows past T zero) into a stage of
// the ring, 128-byte swizzled; consumer warpgroup c (warps 4c .. 4c + 3) multiplies rows 64 c ..
// 64 c + 63 by x with four wgmma m64nNk16 (f32 accumulators in registers) and releases the stage.
//
// A CTA's range starts and ends inside tiles. A tile it covers entirely it writes itself;
// otherwise its partial sums go to `part` (slot 2 b + (b is the tile's first CTA): at most one
// head and one tail segment a CTA; a warp's stores contiguous), and once its range is done it
// takes a ticket on each such tile (tickets[tile], 0 before the launch). The last of a tile's
// CTAs to take one adds the partials in CTA order (the same sums whichever CTA comes last:
// deterministic), writes the tile and puts the ticket back to 0 (graph replays included). No CTA
// waits on another, so any residency works. (Measured on the H200, session 26: the first
// version's fixup, one dependent L2 load after another, cost 18 us of o's 39 at 64 tokens.)
//
// mode: SK_BF16 y bf16 [T, out]; SK_F32 y f32 = sum; SK_F32_ACC y f32 += sum. Accumulator element
// 4 i + e of lane (g, t) of warp w of a warpgroup: row 16 w + g + 8 (e >> 1) of its 64, column
// (token) 8 i + 2 t + (e & 1). Shared memory (dynamic, 1024-aligned): SK_HEAD bytes of barriers
// and the tickets' verdicts, then `stages` (1 ..= SK_MAX_STAGES) stages of kb boxes of weights
// (16384 bytes each) and kb of x (128 N bytes each).
#define SK_BM 128
#define SK_BK 64
#define SK_CONSUMERS 8
#define SK_THREADS (32 * SK_CONSUMERS + 32)
#define SK_MAX_STAGES 16
#define SK_HEAD 1024
#define SK_W_BYTES (SK_BM * 128)
#define SK_BF16 0
#define SK_F32 1
#define SK_F32_ACC 2

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// PTX-BEGIN: wgmma m64nNk16, L2 loads, the ticket

// d[N / 2] (+)= A (64 x 16, smem descriptor) * B (16 x N, smem descriptor), both K-major.
template <int N>
__device__ __forceinline__ void sk_mma(float* d, unsigned long long da, unsigned long long db,
                                       int scale_d);
template <>
__device__ __forceinline__ void sk_mma<16>(float* d, unsigned long long da, unsigned long long db,
                                            int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void sk_mma<32>(float* d, unsigned long long da, unsigned long long db,
                                            int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(scale_d));
}

template <>
__device__ __forceinline__ void sk_mma<64>(float* d, unsigned long long da, unsigned long long db,
                                            int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(scale_d));
}

// Four f32 from L2 (not L1: other CTAs wrote them, maybe after this SM cached an older launch's).
__device__ __forceinline__ float4 sk_ld_cg4(const float* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}
// The ticket on a tile: this thread's partials visible device-wide first.
__device__ __forceinline__ unsigned sk_ticket(unsigned* t) {
    __threadfence();
    return atomicAdd(t, 1u);
}
__device__ __forceinline__ void sk_fence() { __threadfence(); }

// PTX-END

// The CTA (of G) whose range holds iteration i, and where CTA b's range starts.
__device__ __forceinline__ int sk_owner(long long i, int G, long long total) {
    return (int)(((i + 1) * G - 1) / total);
}
__device__ __forceinline__ long long sk_start(int b, int G, long long total) {
    return (long long)b * total / G;
}

// A consumer thread's values of row tile `tile` into y (bf16, f32, or added to f32): element q is
// row 64 wgi + 16 w4 + g + 8 ((q & 3) >> 1) of the tile, token 8 (q >> 2) + 2 t4 + (q & 1).
// Adding: every old value loaded before the first store (the compiler cannot tell the stores
// from the loads apart, and one load, add and store after another cost o 20 us at 64 tokens).
template <int N>
__device__ __forceinline__ void sk_store(void* __restrict__ y, const float* v, int tile, int out,
                                         int T, int mode, int wgi, int w4, int g, int t4) {
    const int row0 = tile * SK_BM + 64 * wgi + 16 * w4 + g;
    auto at = [&](int q, bool& ok) {
        const int row = row0 + 8 * ((q & 3) >> 1), col = 8 * (q >> 2) + 2 * t4 + (q & 1);
        ok = row < out && col < T;
        return (i64)col * out + row;
    };
    float old[N / 2];
#pragma unroll
    for (int q = 0; q < N / 2; q++) {
        bool ok;
        const i64 o = at(q, ok);
        old[q] = mode == SK_F32_ACC && ok ? ((const float*)y)[o] : 0.f;
    }
#pragma unroll
    for (int q = 0; q < N / 2; q++) {
        bool ok;
        const i64 o = at(q, ok);
        if (!ok) continue;
        if (mode == SK_BF16) {
            ((bf16_t*)y)[o] = f2bf(v[q]);
        } else {
            ((float*)y)[o] = mode == SK_F32_ACC ? old[q] + v[q] : v[q];
        }
    }
}

template <int N>
__device__ __forceinline__ void gemm_skinny_impl(const WsTmap& wmap, const WsTmap& xmap,
                                                 void* __restrict__ y, float* __restrict__ part,
                                                 unsigned* __restrict__ tickets, int T, int out,
                                                 int in, int mode, int stages, int kb,
                                                 unsigned char* smem) {
    const int STAGE = kb * (SK_W_BYTES + N * 128);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int G = gridDim.x, b = blockIdx.x;
    const int kc = (in + SK_BK * kb - 1) / (SK_BK * kb);
    const long long total = (long long)((out + SK_BM - 1) / SK_BM) * kc;
    const long long it0 = sk_start(b, G, total), it1 = sk_start(b + 1, G, total);
    const unsigned base = fp_smem_addr(smem);
    const unsigned full0 = base, empty0 = base + 8 * SK_MAX_STAGES;
    volatile unsigned* verdict = (volatile unsigned*)(smem + 16 * SK_MAX_STAGES);  // [2]
    const unsigned st0 = base + SK_HEAD;
    if (tid == 0) {
        for (int s = 0; s < stages; s++) {
            ws_mbar_init(full0 + 8 * s, 1);
            ws_mbar_init(empty0 + 8 * s, 32 * SK_CONSUMERS);
        }
        ws_mbar_init_fence();
    }
    __syncthreads();
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    if (warp == SK_CONSUMERS) {
        if (lane == 0) {
            const unsigned long long wm = (unsigned long long)&wmap;
            const unsigned long long xm = (unsigned long long)&xmap;
            for (long long it = it0; it < it1; it++) {
                const int j = (int)(it - it0), s = j % stages;
                if (j >= stages) ws_mbar_wait(empty0 + 8 * s, (unsigned)((j / stages) - 1) & 1u);
                const int tile = (int)(it / kc), k = (int)(it - (long long)tile * kc);
                const unsigned bar = full0 + 8 * s, dst = st0 + s * STAGE;
                ws_mbar_expect_tx(bar, STAGE);
                for (int i = 0; i < kb; i++)
                    ws_tma_load5(dst + i * SK_W_BYTES, wm, (k * kb + i) * SK_BK, tile * SK_BM, 0, 0, 0, bar);
                for (int i = 0; i < kb; i++)
                    ws_tma_load5(dst + kb * SK_W_BYTES + i * N * 128, xm, (k * kb + i) * SK_BK, 0, 0, 0, 0, bar);
                ws_mbar_arrive(bar);
            }
        }
        return;
    }
    const int wgi = warp >> 2, w4 = warp & 3, g = lane >> 2, t4 = lane & 3;
    int split[2], nsplit = 0;  // the split tiles of this CTA's range (its head and its tail)
    float acc[N / 2];
    long long it = it0;
    int j = 0;
    while (it < it1) {
        const int tile = (int)(it / kc);
        const long long tbeg = (long long)tile * kc, tend = tbeg + kc;
        const long long send = tend < it1 ? tend : it1;
#pragma unroll
        for (int q = 0; q < N / 2; q++) acc[q] = 0.f;
        for (; it < send; it++, j++) {
            const int s = j % stages;
            ws_mbar_wait(full0 + 8 * s, (unsigned)(j / stages) & 1u);
            const unsigned a = st0 + s * STAGE + wgi * 64 * 128;
            const unsigned xs = st0 + s * STAGE + kb * SK_W_BYTES;
            wg_fence();
            for (int i = 0; i < kb; i++) {
#pragma unroll
                for (int kk = 0; kk < SK_BK / 16; kk++)
                    sk_mma<N>(acc, wg_desc(a + i * SK_W_BYTES + kk * 32, 16, 1024),
                              wg_desc(xs + i * N * 128 + kk * 32, 16, 1024), 1);
            }
            wg_commit();
            wg_wait<0>();
            ws_mbar_arrive(empty0 + 8 * s);
        }
        if (tbeg >= it0 && tend <= it1) {
            sk_store<N>(y, acc, tile, out, T, mode, wgi, w4, g, t4);
            continue;
        }
        // a split tile: the partials to this CTA's slot for it (float4 q of thread tid at
        // (slot * N / 8 + q) * 256 + tid: a warp's stores contiguous); its ticket at the end
        const int first = sk_owner(tbeg, G, total);
        float4* mine = (float4*)part + (i64)(2 * b + (b == first)) * (N / 8) * (32 * SK_CONSUMERS) + tid;
#pragma unroll
        for (int q = 0; q < N / 8; q++)
            mine[q * 32 * SK_CONSUMERS] =
                make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
        split[nsplit++] = tile;
    }
    if (nsplit == 0) return;
    // The tickets of the (at most two) split tiles, taken only now: a ticket taken mid-range
    // would hold the consumers (and so the ring) for its round trip; the partials of both are
    // visible before either ticket.
    sk_fence();
    ws_turn_wait(0);  // every consumer thread's partials written
    if (tid == 0) {
        for (int k = 0; k < nsplit; k++) {
            const long long tb = (long long)split[k] * kc;
            const int n = sk_owner(tb + kc - 1, G, total) - sk_owner(tb, G, total);
            verdict[k] = sk_ticket(tickets + split[k]) == (unsigned)n ? 1u : 0u;
        }
    }
    ws_turn_wait(0);
    for (int k = 0; k < nsplit; k++) {
        if (!verdict[k]) continue;
        sk_fence();
        const int tile = split[k];
        const long long tb = (long long)tile * kc;
        const int first = sk_owner(tb, G, total), last = sk_owner(tb + kc - 1, G, total);
        // the partials in CTA order (the same sums whichever CTA is last), two CTAs' loads all
        // issued before their adds
        float sum[N / 2];
#pragma unroll
        for (int q = 0; q < N / 2; q++) sum[q] = 0.f;
        auto slot = [&](int c) {
            return part + ((i64)(2 * c + (c == first)) * (N / 8) * (32 * SK_CONSUMERS) + tid) * 4;
        };
        for (int c = first; c <= last; c += 2) {
            const float* p0 = slot(c);
            const float* p1 = slot(c + 1 <= last ? c + 1 : c);
            float4 v0[N / 8], v1[N / 8];
#pragma unroll
            for (int q = 0; q < N / 8; q++) {
                v0[q] = sk_ld_cg4(p0 + (i64)q * 32 * SK_CONSUMERS * 4);
                v1[q] = sk_ld_cg4(p1 + (i64)q * 32 * SK_CONSUMERS * 4);
            }
            const bool two = c + 1 <= last;
#pragma unroll
            for (int q = 0; q < N / 8; q++) {
                sum[4 * q] += v0[q].x, sum[4 * q + 1] += v0[q].y, sum[4 * q + 2] += v0[q].z, sum[4 * q + 3] += v0[q].w;
                if (two) {
                    sum[4 * q] += v1[q].x, sum[4 * q + 1] += v1[q].y, sum[4 * q + 2] += v1[q].z, sum[4 * q + 3] += v1[q].w;
                }
            }
        }
        sk_store<N>(y, sum, tile, out, T, mode, wgi, w4, g, t4);
        if (tid == 0) tickets[tile] = 0u;
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// grid: min(SMs, tiles * kc) CTAs, block SK_THREADS, dynamic shared memory 1024 (alignment) +
// SK_HEAD + stages * kb * (16384 + 128 N); part: f32 [2 G][N / 8][256][4]; tickets: u32 [tiles],
// zero; kb: 64-input boxes a stage (an iteration covers 64 kb inputs of its tile).
#define GEMM_SKINNY_KERNEL(NAME, N)                                                               \
    extern "C" __global__ void __launch_bounds__(SK_THREADS, 1)                                  \
        NAME(const __grid_constant__ WsTmap wmap, const __grid_constant__ WsTmap xmap, void* y,  \
             float* part, unsigned* tickets, int T, int out, int in, int mode, int stages,      \
             int kb) {                                                                           \
        WG_BODY(gemm_skinny_impl<N>(wmap, xmap, y, part, tickets, T, out, in, mode, stages, kb,  \
                                    wg_smem_aligned()))                                          \
    }

GEMM_SKINNY_KERNEL(gemm_skinny_n16, 16)
GEMM_SKINNY_KERNEL(gemm_skinny_n32, 32)
GEMM_SKINNY_KERNEL(gemm_skinny_n64, 64)
