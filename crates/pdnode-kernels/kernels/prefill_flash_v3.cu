// Causal flash prefill attention v3 (appended to kernels/prefill_flash.cu in one NVRTC program:
// it uses that file's fp_* helpers; see its header for the fragment layouts). Restructured from
// the w8 kernel for throughput (the intermediate v2, a 3-stage ring without the overlap below,
// was retired after losing its benchmark: docs/benchmarks.md):
// - K and V of a tile travel together through a ring of shared buffers filled by cp.async, one
//   __syncthreads per tile both publishing a tile and freeing the buffer the next load fills.
// - Paged addressing for power-of-two block sizes only (shift and mask, no division); a thread
//   loads the same 16-byte column of RPT key rows, one table lookup per row serving K and V, and
//   those lookups are fetched one tile ahead into registers so no load waits on the table.
// - Softmax on raw scores: p = 2^(s * scale_log2 - m * scale_log2) as one FFMA and one MUFU ex2;
//   the causal mask only on tiles that reach past a warp's first query.
// Plus software pipelining inside each warp:
// - the scores of tile j + 1 (S = Q K^T, 64 mma) are issued in the same basic block as the
//   softmax of tile j and its P V (64 mma), so ptxas interleaves the FFMA / MUFU / FMNMX work of
//   the softmax with tensor-core work of the same warp instead of leaving the tensor pipe idle
//   while both warps of a scheduler are in their softmax (one barrier per tile keeps the warps
//   in phase);
// - so K of tile j + 1 and V of tile j are read in one iteration: a 4-stage ring (tile j + 3 loads
//   while j, j + 1 are read and j + 2 is in flight), one __syncthreads per tile;
// - the loop is unrolled by two so the two score arrays swap roles without register moves; the
//   scores of a tile past the warp's last query (or past the end) are computed and dropped, so
//   the block has no branch (one wasted S per warp and CTA).
// Sliding window (window > 0): query position p sees keys p + 1 - window ..= p; the CTA's tiles
// start at its first query's window (the ring and the tile loop offset by jt0), and the mask runs
// on the tiles that reach before a warp's last query's window as well.
// 8 warps x 16 query rows, BM = 128, 64-key tiles, grid (nh, query tiles) heaviest tiles first.
// Dynamic shared memory: FP3_STAGES * 2 * 64 * (HD + 8) bf16 (139264 bytes at hd 128).
#define FP3_STAGES 4

template <int HD, int NW>
__device__ __forceinline__ void flash_prefill_v3_impl(const bf16_t* __restrict__ q,
                                                      bf16_t* __restrict__ out,
                                                      const bf16_t* __restrict__ layer_kv,
                                                      const int* __restrict__ table, int row0,
                                                      int n, int start, int nh, int nkv,
                                                      int block_size, float scale_log2,
                                                      int window, bf16_t* smem) {
    constexpr int BN = FP_BN, BM = 16 * NW, LD = HD + 8, KS = HD / 16, NT = HD / 8;
    constexpr int CPR = HD / 8, STEP = NW * 32 / CPR, RPT = BN / STEP, TILE = 2 * BN * LD;
    static_assert(NW * 32 % CPR == 0 && BN % STEP == 0, "tile rows split evenly over the threads");
    const int h = blockIdx.x;
    const int m0 = (gridDim.y - 1 - blockIdx.y) * BM;
    const int kvh = h / (nh / nkv);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = m0 + w * 16 + g, r1 = r0 + 8;
    const int kv_end = start + min(m0 + BM, n);
    const int ntiles = (kv_end + BN - 1) / BN;
    const i64 qstride = (i64)nh * HD;
    const int qpos0 = start + r0, qpos1 = start + r1;
    const int wfirst = start + m0 + w * 16, wlast = wfirst + 15;
    // tiles this warp computes: those with a key at or before its last query
    const int wtiles = min(ntiles, wlast / BN + 1);
    // Query p keeps key j iff 0 <= p - j < wlim (causal, and the window when there is one: one
    // unsigned compare per key either way); the CTA's first tile holds its first query's window
    // start.
    const unsigned wlim = window > 0 ? (unsigned)window : 0x7fffffffu;
    const int jt0 = window > 0 ? max(0, start + m0 + 1 - window) / BN : 0;

    const int bs_shift = fp_log2i(block_size), bs_mask = block_size - 1;
    const int row_stride = nkv * HD, vofs = block_size * row_stride, blk_stride = 2 * vofs;
    const int ldrow = threadIdx.x / CPR, lcol = (threadIdx.x % CPR) * 8;
    const bf16_t* kv_base = layer_kv + (i64)kvh * HD + lcol;

    auto fetch_blocks = [&](int tile, int* blk) {
#pragma unroll
        for (int it = 0; it < RPT; it++) {
            const int j = tile * BN + ldrow + it * STEP;
            blk[it] = j < kv_end ? table[j >> bs_shift] : -1;
        }
    };
    auto load_tile = [&](int tile, const int* blk) {
        bf16_t* ks = smem + (tile % FP3_STAGES) * TILE;
        bf16_t* vs = ks + BN * LD;
#pragma unroll
        for (int it = 0; it < RPT; it++) {
            const int r = ldrow + it * STEP, j = tile * BN + r;
            const bool ok = blk[it] >= 0;
            const bf16_t* src =
                ok ? kv_base + (i64)blk[it] * blk_stride + (j & bs_mask) * row_stride : layer_kv;
            fp_cp_async16(ks + r * LD + lcol, src, ok ? 16 : 0);
            fp_cp_async16(vs + r * LD + lcol, ok ? src + vofs : layer_kv, ok ? 16 : 0);
        }
    };

    int blk[RPT];
#pragma unroll
    for (int st = 0; st < FP3_STAGES - 1; st++) {
        if (jt0 + st < ntiles) {
            fetch_blocks(jt0 + st, blk);
            load_tile(jt0 + st, blk);
        }
        fp_cp_commit();
    }
    fetch_blocks(jt0 + FP3_STAGES - 1, blk);

    unsigned qf[KS][4];
    {
        const bf16_t* q0 = q + (i64)(row0 + r0) * qstride + (i64)h * HD + 2 * t;
        const bf16_t* q1 = q0 + 8 * qstride;
        const bool v0 = r0 < n, v1 = r1 < n;
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
            qf[kk][0] = v0 ? *(const unsigned*)(q0 + kk * 16) : 0u;
            qf[kk][1] = v1 ? *(const unsigned*)(q1 + kk * 16) : 0u;
            qf[kk][2] = v0 ? *(const unsigned*)(q0 + kk * 16 + 8) : 0u;
            qf[kk][3] = v1 ? *(const unsigned*)(q1 + kk * 16 + 8) : 0u;
        }
    }

    // S of tile `tile` (K from its ring buffer) into sc.
    auto scores = [&](int tile, float (&sc)[8][4]) {
        const bf16_t* ks = smem + (tile % FP3_STAGES) * TILE;
#pragma unroll
        for (int i = 0; i < 8; i++) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
#pragma unroll
            for (int np = 0; np < 4; np++) {
                unsigned b[4];
                fp_ldsm_x4(b, ks + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 +
                                  ((lane >> 3) & 1) * 8);
                fp_mma(sc[2 * np], qf[kk], b[0], b[1]);
                fp_mma(sc[2 * np + 1], qf[kk], b[2], b[3]);
            }
        }
    };

    float o[NT][4];
#pragma unroll
    for (int i = 0; i < NT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float mrow[2] = {-INFINITY, -INFINITY};  // running max of the raw scores
    float lrow[2] = {0.f, 0.f};              // this thread's part of the running sum

    // One tile: barrier, next load, then (if the warp has tile jt) mask + softmax + P V of tile
    // jt from sc, with S of tile jt + 1 into sn in the same block.
    auto step = [&](int jt, float (&sc)[8][4], float (&sn)[8][4]) {
        fp_cp_wait<FP3_STAGES - 3>();  // tiles <= jt + 1 have landed (this thread's copies)
        __syncthreads();               // everyone's; everyone is done with tile jt - 1
        {
            const int nxt = jt + FP3_STAGES - 1;  // into the buffer of tile jt - 1
            if (nxt < ntiles) {
                load_tile(nxt, blk);
                fetch_blocks(nxt + 1, blk);
            }
            fp_cp_commit();
        }
        if (jt >= wtiles) return;  // warp-uniform: every key of tile jt is past this warp
        const int k0 = jt * BN;
        if (k0 + BN - 1 > wfirst || (unsigned)(wlast - k0) >= wlim) {
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = k0 + nt * 8 + 2 * t + (e & 1);
                    if ((unsigned)((e < 2 ? qpos0 : qpos1) - key) >= wlim) sc[nt][e] = -INFINITY;
                }
            }
        }
        scores(jt + 1, sn);  // (dropped when jt + 1 >= wtiles)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float mx = mrow[i];
#pragma unroll
            for (int nt = 0; nt < 8; nt++) mx = fmaxf(mx, fmaxf(sc[nt][2 * i], sc[nt][2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float ms = (mx == -INFINITY ? 0.f : mx) * scale_log2;
            const float alpha = fp_ex2(mrow[i] * scale_log2 - ms);
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                sc[nt][2 * i] = fp_ex2(fmaf(sc[nt][2 * i], scale_log2, -ms));
                sc[nt][2 * i + 1] = fp_ex2(fmaf(sc[nt][2 * i + 1], scale_log2, -ms));
                sum += sc[nt][2 * i] + sc[nt][2 * i + 1];
            }
            lrow[i] = lrow[i] * alpha + sum;
            mrow[i] = mx;
#pragma unroll
            for (int dt = 0; dt < NT; dt++) {
                o[dt][2 * i] *= alpha;
                o[dt][2 * i + 1] *= alpha;
            }
        }
        const bf16_t* vs = smem + (jt % FP3_STAGES) * TILE + BN * LD;
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            unsigned pa[4];
            pa[0] = fp_pack(sc[2 * kk][0], sc[2 * kk][1]);
            pa[1] = fp_pack(sc[2 * kk][2], sc[2 * kk][3]);
            pa[2] = fp_pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            pa[3] = fp_pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < NT / 2; dp++) {
                unsigned b[4];
                fp_ldsm_x4_t(b, vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                                    dp * 16 + (lane >> 4) * 8);
                fp_mma(o[2 * dp], pa, b[0], b[1]);
                fp_mma(o[2 * dp + 1], pa, b[2], b[3]);
            }
        }
    };

    float sa[8][4], sb[8][4];
    fp_cp_wait<FP3_STAGES - 2>();  // tile 0
    __syncthreads();
    scores(jt0, sa);  // every warp has tile jt0 (it precedes every query)
    int jt = jt0;
    for (; jt + 1 < ntiles; jt += 2) {
        step(jt, sa, sb);
        step(jt + 1, sb, sa);
    }
    if (jt < ntiles) step(jt, sa, sb);
    fp_cp_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; i++) {
        float l = lrow[i];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int r = i == 0 ? r0 : r1;
        if (r < n) {
            bf16_t* y = out + (i64)(row0 + r) * qstride + (i64)h * HD + 2 * t;
#pragma unroll
            for (int dt = 0; dt < NT; dt++)
                *(unsigned*)(y + dt * 8) = fp_pack(o[dt][2 * i] * inv, o[dt][2 * i + 1] * inv);
        }
    }
}

// grid: (nh, ceil(n / 128)), block: 256, dynamic shared memory FP3_STAGES * 2 * 64 * (HD + 8) * 2
// bytes; block_size must be a power of two (the launcher falls back to the w8 kernel otherwise).
#define FLASH_PREFILL_V3_KERNEL(NAME, HD)                                                         \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                    \
        const bf16_t* __restrict__ q, bf16_t* __restrict__ out,                                   \
        const bf16_t* __restrict__ layer_kv, const int* __restrict__ table, int row0, int n,      \
        int start, int nh, int nkv, int block_size, float scale_log2, int window) {               \
        PD_GRID_WAIT();  PD_GRID_LAUNCH_DEPENDENTS();                                             \
        extern __shared__ __align__(16) unsigned char fp_dyn_smem[];                              \
        flash_prefill_v3_impl<HD, 8>(q, out, layer_kv, table, row0, n, start, nh, nkv,            \
                                     block_size, scale_log2, window, (bf16_t*)fp_dyn_smem);      \
    }

FLASH_PREFILL_V3_KERNEL(flash_prefill_hd64_v3, 64)
FLASH_PREFILL_V3_KERNEL(flash_prefill_hd128_v3, 128)
