// Decode paged attention, v4: flash-decoding split-K over the paged cache (the retired v3's
// partitions, every query head of a GQA group per block) with the dot
// products and the P V accumulation on tensor cores (mma.sync m16n8k16 bf16, fp32 accumulate),
// and one cp.async pipeline per warp (no block-wide barrier in the main loop).
//
// One block of 4 warps per (token, kv head [, head group of MG = 8 or 16], partition). The group's
// query heads are the M = 16 rows of the A operand (rows >= the group's size are zero). Warp w
// takes tiles w, w + 4, w + 8, ... of TK = 16 keys of the partition, each staged by cp.async in
// the warp's own NST shared-memory stages (K and V rows padded to HD + 8 bf16: ldmatrix reads them
// without bank conflicts). Per tile a warp does, for HD = 128:
//   S = Q K^T: 2 key n-tiles x 8 k-steps = 16 mma; K fragments by 8 ldmatrix.x4 (keys are the
//     rows of K in shared memory, which is B's "col" layout);
//   online softmax in registers (FlashAttention-2): S's accumulator layout (row g / g + 8, keys
//     2 t, 2 t + 1 of each n-tile) is P's A-fragment layout for the P V product, so a lane keeps
//     the running max of its 2 rows (quad shuffles) and a partial row sum (reduced at the end);
//   O += P V: 16 dim n-tiles x 1 k-step = 16 mma; V fragments by 8 ldmatrix.x4.trans.
// At the end the 4 warps' (m, l, O) are merged through shared memory. Scores are in the log2
// domain (q . k * scale * log2(e)).
//
// Same arguments and partial outputs as paged_attention (attention.cu): grid
// (T or len(tok_list), nkv * ceil(G / MG), nsplit), block 128, plus ATT4_SMEM(HD) bytes of dynamic
// shared memory; partition z takes keys [base + z * split_len, base + (z + 1) * split_len) of the
// token's context tok_pos[t] + 1 (read from device memory). base = 0 without a sliding window
// (window = 0); with one the token sees keys lo = max(0, ctx - window) ..= tok_pos[t] and base is
// lo rounded down to a multiple of TK (tiles stay TK-aligned: one block-table lookup per tile),
// the keys base .. lo - 1 of the first tile neither loaded nor scored; the host sizes the
// partitions for min(ctx, window + TK - 1) keys. A partition without a key in [lo, ctx) writes
// neutral partials (m = -inf, l = 0, acc = 0) that attention_combine skips; nsplit == 1 writes
// `out`.

#define ATT4_TK 16
#define ATT4_NST 3
#define ATT4_BT 512  // block-table entries of one partition staged in shared memory
// dynamic shared memory of one block of NW warps: NW x NST stages x (K, V) x TK rows of HD + 8 bf16
#define ATT4_SMEM_NW(HD, NW) ((NW) * ATT4_NST * 2 * ATT4_TK * ((HD) + 8) * 2)
#define ATT4_SMEM(HD) ATT4_SMEM_NW(HD, 4)

__device__ __forceinline__ unsigned att4_smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16-byte global -> shared copy; `bytes` = 0 fills the 16 bytes with zeros and reads nothing.
__device__ __forceinline__ void att4_cp16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(att4_smem_addr(dst)),
                 "l"(src), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void att4_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void att4_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8 and receives, of
// matrix i, row l / 4, columns 2 (l % 4), 2 (l % 4) + 1 in r[i] (lower column in the low half).
__device__ __forceinline__ void att4_ldsm_x4(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(att4_smem_addr(p)));
}

// As att4_ldsm_x4, transposed: r[i] holds rows 2 (l % 4), 2 (l % 4) + 1 of column l / 4.
__device__ __forceinline__ void att4_ldsm_x4_t(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(att4_smem_addr(p)));
}

// d += A B, A 16x16 bf16 (row), B 16x8 bf16 (col), d 16x8 f32. Lane l, g = l / 4, t = l % 4:
// a = {A[g][2t..], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..]}, b = {B[2t..][g], B[2t+8..][g]},
// d = {D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]}.
__device__ __forceinline__ void att4_mma(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as bf16x2 (lo in the low half), round to nearest even.
__device__ __forceinline__ unsigned att4_pack(float lo, float hi) {
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
}

template <int HD, int MG, int NW>
__device__ __forceinline__ void attn_v4(const bf16_t* __restrict__ q,
                                        const bf16_t* __restrict__ layer_kv,
                                        const int* __restrict__ tok_seq,
                                        const int* __restrict__ tok_pos,
                                        const int* __restrict__ block_tables, int max_blocks,
                                        int nh, int nkv, int block_size, float scale,
                                        int split_len, bf16_t* __restrict__ out,
                                        float* __restrict__ part_ml, float* __restrict__ part_acc,
                                        const int* __restrict__ tok_list, int window,
                                        unsigned char* dsmem) {
    constexpr int TK = ATT4_TK, NST = ATT4_NST, NT = NW * 32;
    constexpr int NCH = HD / 8;                // 16-byte chunks per K/V row
    constexpr int ROW = HD + 8;                // padded shared-memory row (bf16)
    constexpr int STAGE = 2 * TK * ROW;        // K rows, then V rows
    constexpr int KS = HD / 16;                // QK k-steps
    constexpr int DT = HD / 8;                 // PV dim n-tiles
    constexpr int CPL = TK * NCH / 32;         // K (and V) copies per lane per tile
    constexpr bool HI = MG > 8;                // rows 8..15 of the A operand hold heads
    static_assert(HD % 32 == 0 && (TK * NCH) % 32 == 0 && (32 % NCH == 0 || NCH % 32 == 0),
                  "whole copies per lane");
    static_assert(MG == 8 || MG == 16, "M = 16 rows");
    static_assert(NW == 2 || NW == 4, "2 or 4 warps");
    static_assert(NW * NST * STAGE * 2 >= NW * MG * HD * 4, "merge scratch fits the stages");

    bf16_t* const sbuf = (bf16_t*)dsmem;
    __shared__ float s_m[NW][MG], s_l[NW][MG];
    __shared__ int s_bt[ATT4_BT];

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const i64 t = tok_list ? (i64)tok_list[blockIdx.x] : (i64)blockIdx.x;
    const int G = nh / nkv;
    const int hgroups = (G + MG - 1) / MG;
    const int kvh = blockIdx.y / hgroups, hg = blockIdx.y % hgroups;
    const int h0 = kvh * G + hg * MG;
    const int ng = min(MG, G - hg * MG);
    const int nsplit = gridDim.z;
    const int seq = tok_seq[t];  // issued with tok_pos: one dependent load less before the copies
    const int ctx = min(tok_pos[t] + 1, max_blocks * block_size);
    const int lo = window > 0 ? max(0, ctx - window) : 0;  // first key the token sees
    const int k0 = (lo & ~(TK - 1)) + blockIdx.z * split_len;
    const int k1 = min(ctx, k0 + split_len);

    // Partition past the context, or (a split shorter than a tile) before the window: uniform over
    // the block, so no barrier is skipped.
    if (k1 <= max(k0, lo)) {
        for (int idx = tid; idx < ng * HD; idx += NT) {
            const int h = idx / HD, d = idx - h * HD;
            const i64 th = t * nh + h0 + h;
            if (nsplit == 1) {
                out[th * HD + d] = 0;  // empty context (padding token): zeros, not NaN
            } else {
                const i64 pi = th * nsplit + blockIdx.z;
                part_acc[pi * HD + d] = 0.f;
                if (d == 0) {
                    part_ml[pi * 2] = -INFINITY;
                    part_ml[pi * 2 + 1] = 0.f;
                }
            }
        }
        return;
    }

    const int* bt = block_tables + (i64)seq * max_blocks;
    const int b0 = k0 / block_size;
    const int nbt = (k1 - 1) / block_size - b0 + 1;
    // A tile of TK keys starting at a multiple of TK lies in one cache block when the block size
    // is a multiple of TK (partitions start at multiples of the block size then, see
    // attention_splits_v4): one block-table lookup per tile, straight from global memory (no
    // shared-memory staging on the way to the first copies); else one per key, staged.
    const bool one_block = block_size % TK == 0 && k0 % TK == 0;
    const bool bt_sm = !one_block && nbt <= ATT4_BT;
    if (bt_sm)
        for (int i = tid; i < nbt; i += NT) s_bt[i] = bt[b0 + i];

    // Q as A fragments (bf16 pairs straight from global memory), rows >= ng zero.
    unsigned qa[KS][4];
    {
        const bf16_t* qg = q + (t * nh + h0) * HD;
        const bool r0 = g < ng, r1 = HI && g + 8 < ng;
#pragma unroll
        for (int s = 0; s < KS; s++) {
            const int c = s * 16 + 2 * tq;
            qa[s][0] = r0 ? *(const unsigned*)(qg + g * HD + c) : 0u;
            qa[s][2] = r0 ? *(const unsigned*)(qg + g * HD + c + 8) : 0u;
            qa[s][1] = r1 ? *(const unsigned*)(qg + (g + 8) * HD + c) : 0u;
            qa[s][3] = r1 ? *(const unsigned*)(qg + (g + 8) * HD + c + 8) : 0u;
        }
    }
    const float qscale = scale * 1.4426950408889634f;
    __syncthreads();  // s_bt

    const i64 row = (i64)nkv * HD;
    const bf16_t* kv_head = layer_kv + (i64)kvh * HD;
    const int ntiles = (k1 - k0 + TK - 1) / TK;
    const int nmine = ntiles > w ? (ntiles - w + NW - 1) / NW : 0;  // tiles w, w + NW, ...
    bf16_t* const wbuf = sbuf + w * NST * STAGE;
    const bool bs_pow2 = (block_size & (block_size - 1)) == 0;
    const int bs_shift = __ffs(block_size) - 1;
    const int vstride = block_size * (int)row;  // V rows follow a block's K rows

    // Issues the copies of this warp's i-th tile into stage st (keys before lo or past k1
    // zero-filled).
    auto load_tile = [&](int i, int st) {
        const int kt = k0 + (w + i * NW) * TK;
        bf16_t* sk = wbuf + st * STAGE;
        const bf16_t* base = layer_kv;
        if (one_block) {
            const int bi = bs_pow2 ? kt >> bs_shift : kt / block_size;
            const i64 blk = bt[bi];
            base = kv_head + (blk * 2 * block_size + (kt - bi * block_size)) * row;
        }
#pragma unroll
        for (int j = 0; j < CPL; j++) {
            const int e = lane + j * 32;
            const int kk = e / NCH, c = e - kk * NCH;
            const int k = kt + kk;
            const bf16_t* src = layer_kv;
            int bytes = 0;
            if ((unsigned)(k - lo) < (unsigned)(k1 - lo)) {  // lo <= k < k1
                if (one_block) {
                    src = base + kk * row + c * 8;
                } else {
                    const int bi = bs_pow2 ? k >> bs_shift : k / block_size;
                    const i64 blk = bt_sm ? s_bt[bi - b0] : bt[bi];
                    src = kv_head + (blk * 2 * block_size + (k - bi * block_size)) * row + c * 8;
                }
                bytes = 16;
            }
            att4_cp16(sk + kk * ROW + c * 8, src, bytes);
            att4_cp16(sk + (TK + kk) * ROW + c * 8, bytes ? src + vstride : src, bytes);
        }
    };

    float o[DT][4];
#pragma unroll
    for (int n = 0; n < DT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // rows g, g + 8 (lane partial l)

#pragma unroll
    for (int i = 0; i < NST - 1; i++) {
        if (i < nmine) load_tile(i, i);
        att4_commit();
    }
    for (int i = 0; i < nmine; i++) {
        const int st = i % NST;
        att4_wait<NST - 2>();  // this lane's copies of tile i have landed
        __syncwarp();          // every lane's have; every lane is done with tile i - 1
        if (i + NST - 1 < nmine) load_tile(i + NST - 1, (i + NST - 1) % NST);
        att4_commit();

        const bf16_t* sk = wbuf + st * STAGE;
        const bf16_t* sv = sk + TK * ROW;
        const int kt = k0 + (w + i * NW) * TK;
        const int nk = min(TK, k1 - kt);
        const int nlo = lo - kt;  // > 0 only in a windowed token's first tile
        // S = Q K^T: n-tile n holds keys 8 n .. 8 n + 7 (B's column g = key 8 n + g).
        float s[2][4];
#pragma unroll
        for (int n = 0; n < 2; n++) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int sp = 0; sp < KS / 2; sp++) {
                unsigned b[4];  // k-step 2 sp: b[0], b[1]; k-step 2 sp + 1: b[2], b[3]
                att4_ldsm_x4(b, sk + (n * 8 + (lane & 7)) * ROW + sp * 32 + (lane >> 3) * 8);
                att4_mma(s[n], qa[2 * sp], b[0], b[1]);
                att4_mma(s[n], qa[2 * sp + 1], b[2], b[3]);
            }
        }
        // online softmax: lane holds keys 8 n + 2 tq + {0, 1} of rows g (s[n][0..1]) and g + 8
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int x = 0; x < 2; x++) {
                const int kk = n * 8 + 2 * tq + x;
                const bool ok = (unsigned)(kk - nlo) < (unsigned)(nk - nlo);  // nlo <= kk < nk
                s[n][x] = ok ? s[n][x] * qscale : -INFINITY;
                s[n][2 + x] = ok ? s[n][2 + x] * qscale : -INFINITY;
                mx0 = fmaxf(mx0, s[n][x]);
                mx1 = fmaxf(mx1, s[n][2 + x]);
            }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        // finite: the tile holds a key in [lo, k1) (the first tile holds lo, the others start past it)
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float c0 = exp2f(m0 - mn0), c1 = exp2f(m1 - mn1);
        m0 = mn0;
        m1 = mn1;
        unsigned pa[4];
        float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
        for (int n = 0; n < 2; n++) {
            const float p0 = exp2f(s[n][0] - mn0), p1 = exp2f(s[n][1] - mn0);
            const float p2 = exp2f(s[n][2] - mn1), p3 = exp2f(s[n][3] - mn1);
            ps0 += p0 + p1;
            ps1 += p2 + p3;
            pa[2 * n] = att4_pack(p0, p1);      // A[g][8 n + 2 tq ..]
            pa[2 * n + 1] = att4_pack(p2, p3);  // A[g + 8][8 n + 2 tq ..]
        }
        l0 = l0 * c0 + ps0;
        l1 = l1 * c1 + ps1;
        if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {
#pragma unroll
            for (int n = 0; n < DT; n++) {
                o[n][0] *= c0;
                o[n][1] *= c0;
                o[n][2] *= c1;
                o[n][3] *= c1;
            }
        }
        // O += P V: dims 16 dp .. 16 dp + 15 as two n-tiles; matrix l / 8 of the ldmatrix is
        // (keys 0-7 | 8-15) x (dims +0 | +8), so b[0..1] feed n-tile 2 dp and b[2..3] 2 dp + 1.
#pragma unroll
        for (int dp = 0; dp < DT / 2; dp++) {
            unsigned b[4];
            att4_ldsm_x4_t(b, sv + ((lane & 7) + ((lane >> 3) & 1) * 8) * ROW + dp * 16 +
                                  (lane >> 4) * 8);
            att4_mma(o[2 * dp], pa, b[0], b[1]);
            att4_mma(o[2 * dp + 1], pa, b[2], b[3]);
        }
    }
    att4_wait<0>();
    // row sums over the quad (each lane summed its own keys)
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    __syncthreads();  // every warp is done with its stages: reuse them as the merge scratch
    float* red = (float*)dsmem;  // [NW][MG][HD]
    if (tq == 0) {
        s_m[w][g] = m0;
        s_l[w][g] = l0;
        if (HI) {
            s_m[w][g + 8] = m1;
            s_l[w][g + 8] = l1;
        }
    }
#pragma unroll
    for (int n = 0; n < DT; n++) {
        const int d = n * 8 + 2 * tq;
        *(float2*)(red + (w * MG + g) * HD + d) = make_float2(o[n][0], o[n][1]);
        if (HI) *(float2*)(red + (w * MG + g + 8) * HD + d) = make_float2(o[n][2], o[n][3]);
    }
    __syncthreads();
    for (int idx = tid; idx < ng * HD; idx += NT) {
        const int h = idx / HD, d = idx - h * HD;
        float M = -INFINITY;
#pragma unroll
        for (int x = 0; x < NW; x++) M = fmaxf(M, s_m[x][h]);  // finite: warp 0 had a tile
        float A = 0.f, L = 0.f;
#pragma unroll
        for (int x = 0; x < NW; x++) {
            const float f = exp2f(s_m[x][h] - M);  // 0 for a warp without tiles (m = -inf)
            A += f * red[(x * MG + h) * HD + d];
            L += f * s_l[x][h];
        }
        const i64 th = t * nh + h0 + h;
        if (nsplit == 1) {
            out[th * HD + d] = f2bf(L > 0.f ? A / L : 0.f);
        } else {
            const i64 pi = th * nsplit + blockIdx.z;
            part_acc[pi * HD + d] = A;
            if (d == 0) {
                part_ml[pi * 2] = M * 0.6931471805599453f;  // natural log, as attention_combine
                part_ml[pi * 2 + 1] = L;
            }
        }
    }
}

extern __shared__ __align__(16) unsigned char att4_dsmem[];

// hd is a parameter only to keep paged_attention's signature; the wrapper launches the kernel whose
// HD equals it, NW * 32 threads a block, with ATT4_SMEM_NW(HD, NW) bytes of dynamic shared memory.
#define ATT4_KERNEL(NAME, HD, MG, NW, MINB)                                                       \
    extern "C" __global__ void __launch_bounds__(NW * 32, MINB) NAME(                             \
        const bf16_t* q, const bf16_t* layer_kv, const int* tok_seq, const int* tok_pos,          \
        const int* block_tables, int max_blocks, int nh, int nkv, int hd, int block_size,         \
        float scale, int split_len, bf16_t* out, float* part_ml, float* part_acc,                 \
        const int* tok_list, int window) {                                                        \
        PD_GRID_WAIT();  PD_GRID_LAUNCH_DEPENDENTS();                                             \
        attn_v4<HD, MG, NW>(q, layer_kv, tok_seq, tok_pos, block_tables, max_blocks, nh, nkv,     \
                            block_size, scale, split_len, out, part_ml, part_acc, tok_list,       \
                            window, att4_dsmem);                                                  \
    }

// _gN: up to N query heads per block (N = 8 for GQA groups up to 8, else 16: larger groups take
// ceil(G / 16) blocks per KV head). Shared memory: 55 KB (HD 64, 3 blocks per SM) or 104 KB
// (HD 128, 2 blocks per SM). _w2: two warps a block, 52 KB at HD 128 (4 blocks per SM): grids of
// more (token, KV head) items than two HD-128 blocks an SM hold run them in one wave.
ATT4_KERNEL(paged_attention_v4_d64_g8, 64, 8, 4, 3)
ATT4_KERNEL(paged_attention_v4_d64_g16, 64, 16, 4, 3)
ATT4_KERNEL(paged_attention_v4_d128_g8, 128, 8, 4, 2)
ATT4_KERNEL(paged_attention_v4_d128_g16, 128, 16, 4, 2)
ATT4_KERNEL(paged_attention_v4_d128_g8_w2, 128, 8, 2, 4)
