// Causal flash attention for prefill, reading K/V straight from the paged pool (FlashAttention-2
// scheme on bf16 tensor cores, mma.sync m16n8k16, f32 accumulate, online softmax in registers).
//
// One CTA: BM = 16 * NW query rows (one 16-row slice per warp) of one q head; K/V tiles of 64
// keys staged in shared memory by cp.async (separate K and V buffers: V of tile j and K of tile
// j + 1 load while the tile before is being used). The query rows are positions
// start .. start + n of one sequence whose K/V for positions 0 .. start + n are already in the
// pool (rope_qkv wrote them). With a sliding window (window > 0) query position p sees keys
// p + 1 - window ..= p only: a CTA starts at the tile of its first query's window (tiles before
// it are not loaded) and masks the older keys on the tiles that hold some. Key j lies in block table[j / block_size], slot j % block_size; a
// layer of the pool is [num_blocks][2][block_size][nkv][hd]. q and out: rows row0 .. row0 + n of
// [T, nh, hd] bf16. GQA: q head h reads kv head h / (nh / nkv).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 .bf16; g = lane >> 2, t = lane & 3; a .b32 register
// holds two bf16, the lower-indexed element in the low half):
//   A (16x16, row major), 4 regs: a0 = (row g,   cols 2t, 2t+1)   a1 = (row g+8, cols 2t, 2t+1)
//                                 a2 = (row g,   cols 2t+8, +9)   a3 = (row g+8, cols 2t+8, +9)
//   B (16x8, "col"), 2 regs:      b0 = (k 2t, 2t+1; n g)          b1 = (k 2t+8, 2t+9; n g)
//   C/D (16x8, f32), 4 regs:      c0, c1 = (row g, cols 2t, 2t+1) c2, c3 = (row g+8, cols 2t, 2t+1)
// ldmatrix.m8n8.x4: lane l gives the address of row (l & 7) of matrix (l >> 3); for matrix i the
// lane receives reg i = (stored row g, stored cols 2t, 2t+1), or with .trans (stored rows 2t, 2t+1;
// stored col g).
//   S = Q K^T: B[k = d][n = key] = K[key][d]: ldmatrix (no trans) of K rows gives b0/b1 directly.
//   O = P V:   B[k = key][n = d] = V[key][d]: ldmatrix .trans of V rows.
//   P as A: the C fragments of key n-tiles 2i and 2i+1 are exactly the A fragment of keys
//   16i .. 16i + 15 (a0 = c0c1 of tile 2i, a1 = c2c3 of 2i, a2 = c0c1 of 2i+1, a3 = c2c3 of 2i+1).

#define FP_BN 64

__device__ __forceinline__ unsigned fp_smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, the rest zero-filled when src_bytes < 16 (0: nothing is read).
__device__ __forceinline__ void fp_cp_async16(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fp_smem_addr(smem)),
                 "l"(gmem), "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void fp_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void fp_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void fp_ldsm_x4(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fp_smem_addr(p))
                 : "memory");
}

__device__ __forceinline__ void fp_ldsm_x4_t(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(fp_smem_addr(p))
                 : "memory");
}

// c += a * b (16x8x16, bf16 in, f32 accumulate).
__device__ __forceinline__ void fp_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 to bf16x2 (round to nearest even): lo in the low half.
__device__ __forceinline__ unsigned fp_pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x on the MUFU unit (flush-to-zero; ex2(-inf) = +0), without exp2f's range fix-up.
__device__ __forceinline__ float fp_ex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}

// log2 of a power of two.
__device__ __forceinline__ int fp_log2i(int x) { return __ffs(x) - 1; }

// Keys k0 .. k0 + BN - 1 of part `kv` (0 = K, 1 = V) of kv head `kvh` into dst [BN][HD + 8];
// keys at or past kv_end are zero-filled.
template <int HD, int NW, int BN = FP_BN>
__device__ __forceinline__ void fp_load_tile(bf16_t* dst, const bf16_t* __restrict__ layer_kv,
                                             const int* __restrict__ table, int k0, int kv_end,
                                             int kv, int kvh, int nkv, int block_size) {
    constexpr int CPR = HD / 8;  // 16-byte chunks per row
    constexpr int LD = HD + 8;
    static_assert((BN * CPR) % (NW * 32) == 0, "tile chunks split evenly over the threads");
#pragma unroll
    for (int it = 0; it < BN * CPR / (NW * 32); it++) {
        const int c = threadIdx.x + it * NW * 32;
        const int r = c / CPR, col = (c % CPR) * 8;
        const int j = k0 + r;
        const bf16_t* src = layer_kv;
        int bytes = 0;
        if (j < kv_end) {
            const i64 blk = table[j / block_size];
            src = layer_kv + ((blk * 2 + kv) * block_size + j % block_size) * (i64)nkv * HD +
                  (i64)kvh * HD + col;
            bytes = 16;
        }
        fp_cp_async16(dst + r * LD + col, src, bytes);
    }
}

template <int HD, int NW>
__device__ __forceinline__ void flash_prefill_impl(const bf16_t* __restrict__ q,
                                                   bf16_t* __restrict__ out,
                                                   const bf16_t* __restrict__ layer_kv,
                                                   const int* __restrict__ table, int row0, int n,
                                                   int start, int nh, int nkv, int block_size,
                                                   float scale_log2, int window, bf16_t* ks,
                                                   bf16_t* vs) {
    constexpr int BM = 16 * NW, LD = HD + 8, KS = HD / 16, NT = HD / 8;
    // Heaviest (last) query tiles first: the causal work grows with the tile index.
    const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;
    const int h = blockIdx.y;
    const int kvh = h / (nh / nkv);
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = m0 + w * 16 + g, r1 = r0 + 8;  // this thread's two query rows (tile-relative to n)
    const int kv_end = start + min(m0 + BM, n);
    const int ntiles = (kv_end + FP_BN - 1) / FP_BN;
    const i64 qstride = (i64)nh * HD;
    // Query p keeps key j iff 0 <= p - j < wlim: causal, and within the window when there is one
    // (one unsigned compare per key either way). Tiles start at the CTA's first query's window.
    const unsigned wlim = window > 0 ? (unsigned)window : 0x7fffffffu;
    const int jt0 = window > 0 ? max(0, start + m0 + 1 - window) / FP_BN : 0;
    const int qlast = kv_end - 1;  // the CTA's last query position

    fp_load_tile<HD, NW>(ks, layer_kv, table, jt0 * FP_BN, kv_end, 0, kvh, nkv, block_size);
    fp_cp_commit();

    // Q fragments straight from global memory (rows past n read as zero).
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

    float o[NT][4];
#pragma unroll
    for (int i = 0; i < NT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float mrow[2] = {-INFINITY, -INFINITY};  // running max (scaled, log2 domain)
    float lrow[2] = {0.f, 0.f};              // this thread's part of the running sum
    const int qpos0 = start + r0, qpos1 = start + r1;

    for (int jt = jt0; jt < ntiles; jt++) {
        const int k0 = jt * FP_BN;
        fp_load_tile<HD, NW>(vs, layer_kv, table, k0, kv_end, 1, kvh, nkv, block_size);
        fp_cp_commit();
        fp_cp_wait<1>();  // K of tile jt
        __syncthreads();

        float s[8][4];
#pragma unroll
        for (int i = 0; i < 8; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
#pragma unroll
            for (int np = 0; np < 4; np++) {
                // matrices: (keys 16np+0..7, d 16kk+0..7), (same keys, d +8), (keys +8, d), (keys +8, d +8)
                unsigned b[4];
                fp_ldsm_x4(b, ks + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 +
                                  ((lane >> 3) & 1) * 8);
                fp_mma(s[2 * np], qf[kk], b[0], b[1]);
                fp_mma(s[2 * np + 1], qf[kk], b[2], b[3]);
            }
        }
        __syncthreads();  // every warp is done with K of tile jt
        if (jt + 1 < ntiles)
            fp_load_tile<HD, NW>(ks, layer_kv, table, k0 + FP_BN, kv_end, 0, kvh, nkv, block_size);
        fp_cp_commit();  // (possibly empty: keeps the group count uniform)

        // Scale, mask (only where a key can pass the CTA's first query or, with a window, fall
        // out of its last query's window), online softmax.
        const bool diag = k0 + FP_BN - 1 > start + m0 || (unsigned)(qlast - k0) >= wlim;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = k0 + nt * 8 + 2 * t + (e & 1);
                float x = s[nt][e] * scale_log2;
                if (diag && (unsigned)((e < 2 ? qpos0 : qpos1) - key) >= wlim) x = -INFINITY;
                s[nt][e] = x;
            }
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < 8; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * i], s[nt][2 * i + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(mrow[i], mx);
            const float mref = mnew == -INFINITY ? 0.f : mnew;
            const float alpha = exp2f(mrow[i] - mref);  // 0 when mrow was -inf
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                s[nt][2 * i] = exp2f(s[nt][2 * i] - mref);
                s[nt][2 * i + 1] = exp2f(s[nt][2 * i + 1] - mref);
                sum += s[nt][2 * i] + s[nt][2 * i + 1];
            }
            lrow[i] = lrow[i] * alpha + sum;
            mrow[i] = mnew;
#pragma unroll
            for (int dt = 0; dt < NT; dt++) {
                o[dt][2 * i] *= alpha;
                o[dt][2 * i + 1] *= alpha;
            }
        }

        fp_cp_wait<1>();  // V of tile jt
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {  // keys 16kk .. 16kk + 15 of the tile
            unsigned pa[4];
            pa[0] = fp_pack(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = fp_pack(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = fp_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = fp_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < NT / 2; dp++) {
                // matrices: (keys 16kk+0..7, d 16dp+0..7), (keys +8, d), (keys, d +8), (keys +8, d +8)
                unsigned b[4];
                fp_ldsm_x4_t(b, vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                                    dp * 16 + (lane >> 4) * 8);
                fp_mma(o[2 * dp], pa, b[0], b[1]);
                fp_mma(o[2 * dp + 1], pa, b[2], b[3]);
            }
        }
        __syncthreads();  // every warp is done with V of tile jt
    }
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

// grid: (ceil(n / BM), nh), block: 32 * NW. See flash_prefill_impl for the arguments.
#define FLASH_PREFILL_KERNEL(NAME, HD, NW)                                                        \
    extern "C" __global__ void __launch_bounds__(NW * 32) NAME(                                   \
        const bf16_t* __restrict__ q, bf16_t* __restrict__ out,                                   \
        const bf16_t* __restrict__ layer_kv, const int* __restrict__ table, int row0, int n,      \
        int start, int nh, int nkv, int block_size, float scale_log2, int window) {               \
        PD_GRID_WAIT();  PD_GRID_LAUNCH_DEPENDENTS();                                             \
        __shared__ __align__(16) bf16_t ks[FP_BN * (HD + 8)];                                     \
        __shared__ __align__(16) bf16_t vs[FP_BN * (HD + 8)];                                     \
        flash_prefill_impl<HD, NW>(q, out, layer_kv, table, row0, n, start, nh, nkv, block_size,  \
                                   scale_log2, window, ks, vs);                                   \
    }

FLASH_PREFILL_KERNEL(flash_prefill_hd64_w8, 64, 8)
FLASH_PREFILL_KERNEL(flash_prefill_hd128_w8, 128, 8)
