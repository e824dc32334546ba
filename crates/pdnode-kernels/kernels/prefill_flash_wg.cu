// Causal flash prefill attention on Hopper's warpgroup MMA (wgmma), head_dim 128 (issue 20: the
// FlashAttention-3 approach; flash_prefill_hd128_wg without its warp specialization, and
// flash_prefill_hd128_ws with it, below, the one the launcher runs at block size 8 or more: its
// producer on TMA, each lane issuing the boxes of one pool block, 0.98 against the plain
// kernel's 1.30 ms a layer at 8k; docs/benchmarks.md, session 22). Compiled in a
// program of its own for compute_90a (wgmma exists only there; `pdnode_kernels::ptx_for_wgmma`),
// after common.cuh and prefill_flash.cu (whose fp_* helpers it uses); on any other target the
// entry points are empty and the launcher never picks them.
//
// One CTA: 128 query rows of one q head as two warpgroups of 64 rows (threads 0-127, 128-255).
// Per 128-key tile of the paged pool: S = Q K^T is 8 wgmma m64n128k16 per warpgroup with Q and
// K in shared memory, the online softmax runs on S in registers, and O += P V is 8 wgmma with P
// in registers (the S accumulator converted to bf16 is the A fragment) and V in shared memory.
// K/V tiles come in by cp.async (every thread issues its share; the block-table lookups of a
// tile are fetched one tile ahead), two tiles in flight, one barrier per tile. Measured on the
// H200 and not kept (docs/benchmarks.md, session 18): 3 stages; a warp-specialized producer
// warp with mbarrier stages; an explicit ping-pong (a named barrier ordering the warpgroups' S
// issues; within noise); FA3's intra-warpgroup overlap (softmax of tile j + 1 under the P V of
// tile j: 1.51 against 1.30 ms a layer at 8k tokens, spill-free at 255 registers);
// skipping the O rescale where no row max moved; (session 20) the next tile's copies issued after
// the S wgmma, and 3 stages with them issued under the P V; (session 22) the tiles by TMA from
// warp 0 (1.39 ms), and that without the tile barrier, the warpgroups taking turns (1.46);
// warpgroup 1 half a tile behind, its P V of the tile before issued with S (1.32).
//
// Shared memory, every matrix in the 128-byte-swizzle layout wgmma reads (1024-byte aligned):
// Q [2][128 rows][128 B], then per stage K and V the same: half h (dims 64h .. 64h + 63) of row r
// at h * 16384 + r * 128, its 16-byte chunk c at ((c ^ (r & 7)) << 4). Descriptors: K-major
// (Q, K: the reduction over dims) with stride 1024 B between 8-row groups, one 16-dim step = 32
// B; V MN-major (imm-trans-b: dims are the output columns, keys the reduction) with 1024 B
// between 8-key groups and 16384 B between the two dim halves, one 16-key step = 2048 B.
// Fragment layouts: as prefill_flash.cu's mma.m16n8k16 ones, per warp of the warpgroup (warp
// w holds rows 16 w .. 16 w + 15 of its 64): accumulator element 4 i + e of lane (g, t) is row
// 16 w + g + 8 (e >> 1), column 8 i + 2 t + (e & 1).
//
// Every inline PTX sits in the two regions marked PTX-BEGIN / PTX-END: emu/wg/run.sh replaces
// them with C++ emulations and runs both kernels on the CPU against a reference (test emu).

#define WG_HD 128
// A CUtensorMap as a kernel parameter (128 opaque bytes, 64-byte aligned; passed by value as
// __grid_constant__ so its address is the one TMA reads). flash_prefill_hd128_ws's describes one
// layer of the pool [block][K|V][block_size][nkv][128] bf16, dims innermost first (128 dims,
// nkv, block_size, 2, blocks), box (64, 1, min(block_size, 128), 1, 1), 128-byte swizzle.
struct __align__(64) WsTmap {
    unsigned long long v[16];
};
#define WG_BM 128
#define WG_BN 128
#define WG_Q_BYTES (WG_BM * WG_HD * 2)
#define WG_TILE_BYTES (2 * WG_BN * WG_HD * 2)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// A shared-memory matrix descriptor for wgmma, 128-byte swizzle.
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) |
           ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

// Byte offset of 16-byte chunk c (0..15 along the 128 dims) of row r in a swizzled matrix.
__device__ __forceinline__ unsigned wg_off(int r, int c) {
    return (unsigned)((c >> 3) * (WG_BN * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// PTX-BEGIN: wgmma (emu/wg/run.sh splices its emulation in place of this region)

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// cp.async writes (generic proxy) made visible to wgmma's reads (async proxy).
__device__ __forceinline__ void wg_fence_proxy() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// d[64] (+)= A (64x16, smem descriptor) * B (16x128, smem descriptor), both K-major: a 64 x 128
// f32 tile per warpgroup; scale_d 0: d's old values are ignored (d = A B).
__device__ __forceinline__ void wg_mma_ss(float* d, unsigned long long da, unsigned long long db,
                                          int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(scale_d));
}

// d[64] = A (64x16) * B (16x128), both K-major smem descriptors, d's old values neither read
// nor kept (write-only operands: the registers are dead before the first wgmma of an S).
__device__ __forceinline__ void wg_mma_ss_zero(float* d, unsigned long long da,
                                               unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31]), "=f"(d[32]), "=f"(d[33]), "=f"(d[34]), "=f"(d[35]), "=f"(d[36]), "=f"(d[37]), "=f"(d[38]), "=f"(d[39]), "=f"(d[40]), "=f"(d[41]), "=f"(d[42]), "=f"(d[43]), "=f"(d[44]), "=f"(d[45]), "=f"(d[46]), "=f"(d[47]), "=f"(d[48]), "=f"(d[49]), "=f"(d[50]), "=f"(d[51]), "=f"(d[52]), "=f"(d[53]), "=f"(d[54]), "=f"(d[55]), "=f"(d[56]), "=f"(d[57]), "=f"(d[58]), "=f"(d[59]), "=f"(d[60]), "=f"(d[61]), "=f"(d[62]), "=f"(d[63])
        : "l"(da), "l"(db), "r"(0));
}

// d[64] += A (64x16 in registers: each warp's 16 rows as the mma.m16n8k16 A fragment) * B (16x128,
// smem descriptor, MN-major: imm-trans-b 1).
__device__ __forceinline__ void wg_mma_rs_t1(float* d, const unsigned* a, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// d[64] += A (64x16 in registers: each warp's 16 rows as the mma.m16n8k16 A fragment) * B (16x128,
// smem descriptor, K-major).
__device__ __forceinline__ void wg_mma_rs_t0(float* d, const unsigned* a, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// The accumulator's values pinned in place so the compiler keeps wgmma's registers live across
// the async window (wgmma.wait_group orders them only for the hardware).
__device__ __forceinline__ void wg_keep(float* d) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// PTX-END

// S = Q K^T of one 128-key tile for this warpgroup's 64 rows, issued and committed (the caller
// waits): 8 wgmma m64n128k16 over the 128 dims, both operands K-major in shared memory.
__device__ __forceinline__ void wg_scores_issue(float* s, unsigned q_addr, unsigned k_addr) {
    wg_fence();
    wg_mma_ss_zero(s, wg_desc(q_addr, 16, 1024), wg_desc(k_addr, 16, 1024));
#pragma unroll
    for (int kk = 1; kk < WG_HD / 16; kk++) {
        const unsigned off = (kk >> 2) * (WG_BN * 128) + (kk & 3) * 32;
        wg_mma_ss(s, wg_desc(q_addr + off, 16, 1024), wg_desc(k_addr + off, 16, 1024), 1);
    }
    wg_commit();
}

// The causal / window mask on S (keys k0 ..) and the online softmax on it (running max mrow and
// sum lrow of this thread's two rows; S becomes P, unnormalized); alpha: each row's factor for
// the O accumulated so far. A tile whose every key is masked leaves mrow and lrow as they were.
__device__ __forceinline__ void wg_softmax(float* s, float* alpha, float* mrow, float* lrow,
                                           int k0, int qpos0, int qpos1, int gfirst, int glast,
                                           unsigned wlim, int t, float scale_log2) {
    constexpr int BN = WG_BN;
    if (k0 + BN - 1 > gfirst || (unsigned)(glast - k0) >= wlim) {
#pragma unroll
        for (int i = 0; i < 16; i++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = k0 + i * 8 + 2 * t + (e & 1);
                if ((unsigned)((e < 2 ? qpos0 : qpos1) - key) >= wlim) s[4 * i + e] = -INFINITY;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = mrow[r];
#pragma unroll
        for (int i = 0; i < 16; i++) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float ms = (mx == -INFINITY ? 0.f : mx) * scale_log2;
        alpha[r] = fp_ex2(mrow[r] * scale_log2 - ms);
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            s[4 * i + 2 * r] = fp_ex2(fmaf(s[4 * i + 2 * r], scale_log2, -ms));
            s[4 * i + 2 * r + 1] = fp_ex2(fmaf(s[4 * i + 2 * r + 1], scale_log2, -ms));
            sum += s[4 * i + 2 * r] + s[4 * i + 2 * r + 1];
        }
        lrow[r] = lrow[r] * alpha[r] + sum;
        mrow[r] = mx;
    }
}

__device__ __forceinline__ void wg_rescale(float* o, const float* alpha) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
#pragma unroll
        for (int i = 0; i < 16; i++) {
            o[4 * i + 2 * r] *= alpha[r];
            o[4 * i + 2 * r + 1] *= alpha[r];
        }
    }
}

// P (the softmaxed S) as bf16 A fragments: keys 16 kk .. 16 kk + 15 in p[4 kk .. 4 kk + 3].
__device__ __forceinline__ void wg_pack_p(unsigned* p, const float* s) {
#pragma unroll
    for (int kk = 0; kk < 8; kk++) {
        p[4 * kk + 0] = fp_pack(s[8 * kk + 0], s[8 * kk + 1]);
        p[4 * kk + 1] = fp_pack(s[8 * kk + 2], s[8 * kk + 3]);
        p[4 * kk + 2] = fp_pack(s[8 * kk + 4], s[8 * kk + 5]);
        p[4 * kk + 3] = fp_pack(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

// O += P V with P from registers (wg_pack_p) and V of the tile at v_addr: 8 wgmma, issued and
// committed (the caller waits).
__device__ __forceinline__ void wg_pv_issue(float* o, const unsigned* p, unsigned v_addr) {
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < WG_BN / 16; kk++)
        wg_mma_rs_t1(o, p + 4 * kk, wg_desc(v_addr + kk * 2048, WG_BN * 128, 1024));
    wg_commit();
}

// Mask + softmax of S, O rescaled, then O += P V, returning when the PV wgmma has completed
// (V's buffer may be reused).
__device__ __forceinline__ void wg_softmax_pv(float* s, float* o, float* mrow, float* lrow,
                                              unsigned v_addr, int k0, int qpos0, int qpos1,
                                              int gfirst, int glast, unsigned wlim, int t,
                                              float scale_log2) {
    float alpha[2];
    wg_softmax(s, alpha, mrow, lrow, k0, qpos0, qpos1, gfirst, glast, wlim, t, scale_log2);
    wg_rescale(o, alpha);
    unsigned p[32];
    wg_pack_p(p, s);
    wg_pv_issue(o, p, v_addr);
    wg_wait<0>();
    wg_keep(o);
}

// O / l of this thread's two rows (those below n) into out [T, nh, 128].
__device__ __forceinline__ void wg_store(bf16_t* __restrict__ out, const float* o,
                                         const float* lrow, int row0, int r0, int r1, int n,
                                         i64 qstride, int h, int t) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float l = lrow[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = r == 0 ? r0 : r1;
        if (row < n) {
            bf16_t* y = out + (i64)(row0 + row) * qstride + (i64)h * WG_HD + 2 * t;
#pragma unroll
            for (int i = 0; i < 16; i++)
                *(unsigned*)(y + i * 8) = fp_pack(o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
        }
    }
}

template <int STAGES>
__device__ __forceinline__ void flash_prefill_wg_impl(const bf16_t* __restrict__ q,
                                                      bf16_t* __restrict__ out,
                                                      const bf16_t* __restrict__ layer_kv,
                                                      const int* __restrict__ table, int row0,
                                                      int n, int start, int nh, int nkv,
                                                      int block_size, float scale_log2,
                                                      int window, unsigned char* smem) {
    constexpr int HD = WG_HD, BM = WG_BM, BN = WG_BN, RPT = BN / 16;
    const int h = blockIdx.x;
    const int m0 = (gridDim.y - 1 - blockIdx.y) * BM;
    const int kvh = h / (nh / nkv);
    const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = m0 + wg * 64 + w * 16 + g, r1 = r0 + 8;  // this thread's two query rows
    const int kv_end = start + min(m0 + BM, n);
    const int ntiles = (kv_end + BN - 1) / BN;
    const i64 qstride = (i64)nh * HD;
    const int qpos0 = start + r0, qpos1 = start + r1;
    const int gfirst = start + m0 + wg * 64, glast = gfirst + 63;  // the warpgroup's queries
    const unsigned wlim = window > 0 ? (unsigned)window : 0x7fffffffu;
    const int jt0 = window > 0 ? max(0, start + m0 + 1 - window) / BN : 0;

    const int bs_shift = fp_log2i(block_size), bs_mask = block_size - 1;
    const int row_stride = nkv * HD, vofs = block_size * row_stride, blk_stride = 2 * vofs;
    // loads: thread -> 16-byte chunk lc of rows ldrow + 16 it
    const int ldrow = tid >> 4, lc = tid & 15;
    const bf16_t* kv_base = layer_kv + (i64)kvh * HD + lc * 8;
    unsigned char* qs = smem;
    const unsigned smem_base = fp_smem_addr(smem);

    auto fetch_blocks = [&](int tile, int* blk) {
#pragma unroll
        for (int it = 0; it < RPT; it++) {
            const int j = tile * BN + ldrow + it * 16;
            blk[it] = j < kv_end ? table[j >> bs_shift] : -1;
        }
    };
    auto load_tile = [&](int tile, const int* blk) {
        unsigned char* ks = smem + WG_Q_BYTES + ((tile - jt0) % STAGES) * WG_TILE_BYTES;
        unsigned char* vs = ks + WG_TILE_BYTES / 2;
#pragma unroll
        for (int it = 0; it < RPT; it++) {
            const int r = ldrow + it * 16, j = tile * BN + r;
            const bool ok = blk[it] >= 0;
            const bf16_t* src =
                ok ? kv_base + (i64)blk[it] * blk_stride + (j & bs_mask) * row_stride : layer_kv;
            const unsigned o = wg_off(r, lc);
            fp_cp_async16(ks + o, src, ok ? 16 : 0);
            fp_cp_async16(vs + o, ok ? src + vofs : layer_kv, ok ? 16 : 0);
        }
    };

    // Q rows m0 .. m0 + 127 (zero past n), with the first tiles
    {
#pragma unroll
        for (int it = 0; it < BM / 16; it++) {
            const int r = ldrow + it * 16;
            const bool ok = m0 + r < n;
            const bf16_t* src = ok ? q + (i64)(row0 + m0 + r) * qstride + (i64)h * HD + lc * 8 : q;
            fp_cp_async16(qs + wg_off(r, lc), src, ok ? 16 : 0);
        }
    }
    int blk[RPT];
#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) {
        if (jt0 + st < ntiles) {
            fetch_blocks(jt0 + st, blk);
            load_tile(jt0 + st, blk);
        }
        fp_cp_commit();
    }
    fetch_blocks(jt0 + STAGES - 1, blk);

    float o[64];
#pragma unroll
    for (int i = 0; i < 64; i++) o[i] = 0.f;
    float mrow[2] = {-INFINITY, -INFINITY};
    float lrow[2] = {0.f, 0.f};
    const unsigned q_addr = smem_base + wg * 64 * 128;

    for (int jt = jt0; jt < ntiles; jt++) {
        fp_cp_wait<STAGES - 2>();  // tile jt (and Q) landed: this thread's copies
        wg_fence_proxy();
        __syncthreads();           // everyone's; everyone is done with tile jt - 1
        {
            const int nxt = jt + STAGES - 1;  // into the buffer of tile jt - 1
            if (nxt < ntiles) {
                load_tile(nxt, blk);
                fetch_blocks(nxt + 1, blk);
            }
            fp_cp_commit();
        }
        const unsigned k_addr = smem_base + WG_Q_BYTES + ((jt - jt0) % STAGES) * WG_TILE_BYTES;
        const unsigned v_addr = k_addr + WG_TILE_BYTES / 2;
        float s[64];
        wg_scores_issue(s, q_addr, k_addr);
        wg_wait<0>();
        wg_keep(s);
        wg_softmax_pv(s, o, mrow, lrow, v_addr, jt * BN, qpos0, qpos1, gfirst, glast, wlim, t,
                      scale_log2);
    }
    fp_cp_wait<0>();

    wg_store(out, o, lrow, row0, r0, r1, n, qstride, h, t);
}

// ---- the warp-specialized variant (FlashAttention-3's schedule; issue 20) ----------------------
//
// 384 threads: warpgroup 0 is the producer (setmaxnreg down to 48 registers), warpgroups 1 and 2
// the consumers (up to 224), each 64 of the CTA's 128 query rows. The producer's 128 threads load
// Q once by cp.async (a full barrier of 128 arrivals, cp.async.mbarrier.arrive.noinc); then, per
// 128-key tile j, its warp 0 issues the TMA copies (cp.async.bulk.tensor, one box per pool
// block and dim half, lane l those of the tile's l-th block, 128-byte swizzled by the tensor
// map) of K of tile j and V of tile j - 1 into two stages, each completing on its full barrier
// (expect_tx per box, then one counted arrival). V rows from the partial last block on come by
// cp.async instead, zero-filled past the keys (their arrival counted in with
// cp.async.mbarrier.arrive), so stale pool values never meet P V; stale K rows only give scores
// the causal mask replaces. The consumers release
// a stage's K once their S wgmma of it completed and its V once their P V of it did (one arrival
// per consumer warpgroup), which the producer waits for before refilling. A consumer step issues
// S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back, then runs the softmax of S_j while the P V
// is in flight (intra-warpgroup overlap); the two consumers take turns issuing (named barriers 1
// and 2: ping-pong), so one's softmax runs under the other's wgmma. Block-table entries: lane l
// of the producer warp reads the tile's l-th pool block, a tile ahead (block_size 8 or more: at
// most 16 blocks a tile, each box on the swizzle's 1024-byte period).

// barrier words in the kernel's static shared memory: full Q, full K[2], full V[2], empty K[2],
// empty V[2]
#define WS_FULL_Q 0
#define WS_FULL_K 1
#define WS_FULL_V 3
#define WS_EMPTY_K 5
#define WS_EMPTY_V 7
#define WS_NBAR 9
// registers a thread of the producer warpgroup / of the consumers (setmaxnreg)
#define WS_REGS_P 48
#define WS_REGS_C 224
static_assert(128 * WS_REGS_P + 256 * WS_REGS_C <= 384 * 168, "setmaxnreg beyond the CTA's registers");


// PTX-BEGIN: mbarriers, named barriers, cp.async, setmaxnreg

__device__ __forceinline__ void ws_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// The initializations visible to the other proxies (cp.async arrivals) before the CTA barrier.
__device__ __forceinline__ void ws_mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Spins until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void ws_mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred p;\nWS_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@p bra WS_DONE;\nbra WS_WAIT;\nWS_DONE:\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void ws_mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// An arrival on `bar` once every cp.async this thread issued so far has landed (counted in the
// barrier's expected arrivals: .noinc).
__device__ __forceinline__ void ws_cp_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// `bytes` more to land on `bar` (by cp.async.bulk.tensor) before its phase can complete.
__device__ __forceinline__ void ws_mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
// An arrival on `bar` once this thread's cp.async so far landed, not counted in the barrier's
// expected arrivals (the pending count goes up now, back down when they land).
__device__ __forceinline__ void ws_cp_arrive_inc(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// TMA: the box of tensor map `map` (a generic address of the kernel parameter) at coordinates
// c0 .. c4 into shared memory at `dst`, counted as complete_tx bytes on `bar`.
__device__ __forceinline__ void ws_tma_load5(unsigned dst, unsigned long long map, int c0, int c1,
                                             int c2, int c3, int c4, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
        : "memory");
}
// The two consumer warpgroups' turns: named barrier 1 + c is consumer c's, 256 threads (the
// waiting warpgroup's sync plus the other's arrive).
__device__ __forceinline__ void ws_turn_wait(int c) {
    asm volatile("bar.sync %0, 256;\n" ::"r"(1 + c) : "memory");
}
__device__ __forceinline__ void ws_turn_give(int c) {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + c) : "memory");
}
// 16 bytes global -> shared address `dst`, zero-filled past src_bytes (0: nothing is read).
__device__ __forceinline__ void ws_cp16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void ws_cp_wait_all() {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}
// The producer warpgroup's registers down to WS_REGS_P, the consumers' up to WS_REGS_C. The one
// CTA of an SM starts with 168 a thread (65536 / 384 rounded down to 8, what ptxas allocates under
// __launch_bounds__(384, 1)); setmaxnreg.inc waits until the pool holds the registers, so the
// two must fit in it or the consumers wait forever (48 / 232 did: 65536 > 64512).
__device__ __forceinline__ void ws_regs_producer() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WS_REGS_P) : "memory");
}
__device__ __forceinline__ void ws_regs_consumer() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WS_REGS_C) : "memory");
}

// PTX-END


__device__ __forceinline__ void flash_prefill_ws_impl(const bf16_t* __restrict__ q,
                                                      bf16_t* __restrict__ out,
                                                      const bf16_t* __restrict__ layer_kv,
                                                      const int* __restrict__ table, int row0,
                                                      int n, int start, int nh, int nkv,
                                                      int block_size, float scale_log2,
                                                      int window, const WsTmap& kv_map,
                                                      unsigned char* smem) {
    constexpr int HD = WG_HD, BM = WG_BM, BN = WG_BN;
    __shared__ __align__(8) unsigned long long ws_bar[WS_NBAR];
    const int h = blockIdx.x;
    const int m0 = (gridDim.y - 1 - blockIdx.y) * BM;
    const int tid = threadIdx.x;
    const int kv_end = start + min(m0 + BM, n);
    const int ntiles = (kv_end + BN - 1) / BN;
    const i64 qstride = (i64)nh * HD;
    const int jt0 = window > 0 ? max(0, start + m0 + 1 - window) / BN : 0;
    const int nt = ntiles - jt0;  // >= 1: key start + m0 is in tile jt0 .. ntiles - 1
    const unsigned bar0 = fp_smem_addr(ws_bar);
    const unsigned smem_base = fp_smem_addr(smem);
    const unsigned tiles_base = smem_base + WG_Q_BYTES;
    if (tid == 0) {
        ws_mbar_init(bar0 + 8 * WS_FULL_Q, 128);
#pragma unroll
        for (int s = 0; s < 2; s++) {
            ws_mbar_init(bar0 + 8 * (WS_FULL_K + s), 1);
            ws_mbar_init(bar0 + 8 * (WS_FULL_V + s), 1);
            ws_mbar_init(bar0 + 8 * (WS_EMPTY_K + s), 2);
            ws_mbar_init(bar0 + 8 * (WS_EMPTY_V + s), 2);
        }
        ws_mbar_init_fence();
    }
    __syncthreads();

    if (tid < 128) {
        // ---- producer ----
        ws_regs_producer();
        const int lane = tid & 31, ldrow = tid >> 4, lc = tid & 15;  // Q rows ldrow + 8 it
        // Q rows m0 .. m0 + 127 (zero past n), by all 128 threads
#pragma unroll 4
        for (int it = 0; it < 16; it++) {
            const int r = ldrow + 8 * it;
            const bool ok = m0 + r < n;
            const bf16_t* src = ok ? q + (i64)(row0 + m0 + r) * qstride + (i64)h * HD + lc * 8 : q;
            fp_cp_async16(smem + wg_off(r, lc), src, ok ? 16 : 0);
        }
        ws_cp_arrive(bar0 + 8 * WS_FULL_Q);
        if (tid < 32) {
            // K and V tiles: warp 0 issuing the TMA copies (one box of min(block_size,
            // 128) rows x 64 dims per pool block and dim half, 128-byte swizzled as wgmma reads
            // them); V rows of the partial last block and past it by cp.async, zero-filled past
            // kv_end, so no stale value of the pool (whatever an earlier owner of the block left)
            // reaches P V. Stale K rows only give scores the causal mask discards.
            const int kvh = h / (nh / nkv);
            const int bs_shift = fp_log2i(block_size), bs_mask = block_size - 1;
            const int box = block_size < BN ? block_size : BN;
            const int row_stride = nkv * HD, blk_stride = 2 * block_size * row_stride;
            const int last_blk = (kv_end - 1) >> bs_shift;
            const int blks_per_tile = BN >> bs_shift;  // >= 1 for block_size <= 128 (else 0: one)
            const int tail0 = (kv_end >> bs_shift) << bs_shift;  // first key of a partial block
            const unsigned long long map = (unsigned long long)&kv_map;
            // lane l: the pool block of the tile's l-th block (-1 past the keys)
            auto tile_blk = [&](int tile) {
                const int b = ((tile * BN) >> bs_shift) + lane;
                return (b <= last_blk && (lane < blks_per_tile || lane == 0)) ? table[b] : -1;
            };
            // one tile's K (part 0) or V (part 1) into `dst`, completing phase on `bar`
            // (lane l issues the boxes of the tile's l-th pool block, rows l * box .., all lanes
            // at once)
            auto load = [&](int tile, int blkv, unsigned dst, int part, unsigned bar) {
                const int k0 = tile * BN, row = lane * box;
                const int tma_rows = part == 0 ? BN : min(BN, max(0, tail0 - k0));
                if (row < tma_rows && blkv >= 0) {
                    ws_mbar_expect_tx(bar, 2 * box * 128);
#pragma unroll
                    for (int half = 0; half < 2; half++)
                        ws_tma_load5(dst + half * (BN * 128) + row * 128, map, half * 64, kvh,
                                     (k0 + row) & bs_mask, part, blkv, bar);
                }
                if (tma_rows < BN) {
                    const bf16_t* vbase = layer_kv + (i64)kvh * HD + (lane & 15) * 8 +
                                          (i64)block_size * row_stride;
                    for (int r = tma_rows + (lane >> 4); r < BN; r += 2) {
                        const int j = k0 + r;
                        const int b = j < kv_end ? table[j >> bs_shift] : -1;
                        const bf16_t* src =
                            b >= 0 ? vbase + (i64)b * blk_stride + (j & bs_mask) * row_stride
                                   : layer_kv;
                        ws_cp16(dst + wg_off(r, lane & 15), src, b >= 0 ? 16 : 0);
                    }
                    ws_cp_arrive_inc(bar);
                }
                __syncwarp();  // every lane's expect_tx and increment before the counted arrival
                if (lane == 0) ws_mbar_arrive(bar);
            };
            int blk_prev = -1, blk_cur = tile_blk(jt0);
            for (int i = 0; i < nt; i++) {
                const int st = i & 1;
                const int blk_next = i + 1 < nt ? tile_blk(jt0 + i + 1) : -1;
                // the stage's previous K (tile i - 2) released by both consumers
                ws_mbar_wait(bar0 + 8 * (WS_EMPTY_K + st), ((i >> 1) & 1) ^ 1);
                load(jt0 + i, blk_cur, tiles_base + st * WG_TILE_BYTES, 0,
                     bar0 + 8 * (WS_FULL_K + st));
                if (i > 0) {
                    const int ps = (i - 1) & 1;
                    ws_mbar_wait(bar0 + 8 * (WS_EMPTY_V + ps), (((i - 1) >> 1) & 1) ^ 1);
                    load(jt0 + i - 1, blk_prev, tiles_base + ps * WG_TILE_BYTES + WG_TILE_BYTES / 2,
                         1, bar0 + 8 * (WS_FULL_V + ps));
                }
                blk_prev = blk_cur;
                blk_cur = blk_next;
            }
            const int ls = (nt - 1) & 1;
            ws_mbar_wait(bar0 + 8 * (WS_EMPTY_V + ls), (((nt - 1) >> 1) & 1) ^ 1);
            load(jt0 + nt - 1, blk_prev, tiles_base + ls * WG_TILE_BYTES + WG_TILE_BYTES / 2, 1,
                 bar0 + 8 * (WS_FULL_V + ls));
        }
        // its copies landed (each has also arrived on its full barrier) before the producer ends
        ws_cp_wait_all();
        return;
    }

    // ---- consumers ----
    ws_regs_consumer();
    const int ct = tid - 128, c = ct >> 7, w = (ct >> 5) & 3, lane = ct & 31;
    const int g = lane >> 2, t = lane & 3;
    const bool leader = (ct & 127) == 0;
    const int r0 = m0 + c * 64 + w * 16 + g, r1 = r0 + 8;
    const int qpos0 = start + r0, qpos1 = start + r1;
    const int gfirst = start + m0 + c * 64, glast = gfirst + 63;
    const unsigned wlim = window > 0 ? (unsigned)window : 0x7fffffffu;
    const unsigned q_addr = smem_base + c * 64 * 128;

    float o[64];
#pragma unroll
    for (int i = 0; i < 64; i++) o[i] = 0.f;
    float mrow[2] = {-INFINITY, -INFINITY};
    float lrow[2] = {0.f, 0.f};
    float s[64], alpha[2];
    unsigned p[32];

    if (c == 0) ws_turn_give(0);  // consumer 0 issues first
    ws_mbar_wait(bar0 + 8 * WS_FULL_Q, 0);
    // tile jt0: S only
    ws_mbar_wait(bar0 + 8 * WS_FULL_K, 0);
    wg_fence_proxy();
    ws_turn_wait(c);
    wg_scores_issue(s, q_addr, tiles_base);
    if (c == 0 || nt > 1) ws_turn_give(1 - c);
    wg_wait<0>();
    wg_keep(s);
    if (leader) ws_mbar_arrive(bar0 + 8 * WS_EMPTY_K);
    wg_softmax(s, alpha, mrow, lrow, jt0 * BN, qpos0, qpos1, gfirst, glast, wlim, t, scale_log2);
    wg_pack_p(p, s);
    for (int i = 1; i < nt; i++) {
        const int st = i & 1, ps = st ^ 1;
        const unsigned k_addr = tiles_base + st * WG_TILE_BYTES;
        const unsigned v_addr = tiles_base + ps * WG_TILE_BYTES + WG_TILE_BYTES / 2;
        ws_mbar_wait(bar0 + 8 * (WS_FULL_K + st), (i >> 1) & 1);
        wg_fence_proxy();
        ws_turn_wait(c);
        wg_scores_issue(s, q_addr, k_addr);
        // V of tile i - 1 was loaded after K of tile i: waited for only once S is under way
        ws_mbar_wait(bar0 + 8 * (WS_FULL_V + ps), ((i - 1) >> 1) & 1);
        wg_fence_proxy();
        wg_pv_issue(o, p, v_addr);
        // consumer 1's last turn is given to nobody (consumer 0 waits for no further one)
        if (c == 0 || i + 1 < nt) ws_turn_give(1 - c);
        wg_wait<1>();  // S_i landed (P V of tile i - 1 may still run)
        wg_keep(s);
        if (leader) ws_mbar_arrive(bar0 + 8 * (WS_EMPTY_K + st));
        wg_softmax(s, alpha, mrow, lrow, (jt0 + i) * BN, qpos0, qpos1, gfirst, glast, wlim, t,
                   scale_log2);
        wg_wait<0>();
        wg_keep(o);
        if (leader) ws_mbar_arrive(bar0 + 8 * (WS_EMPTY_V + ps));
        wg_rescale(o, alpha);
        wg_pack_p(p, s);
    }
    {
        const int ls = (nt - 1) & 1;
        ws_mbar_wait(bar0 + 8 * (WS_FULL_V + ls), ((nt - 1) >> 1) & 1);
        wg_fence_proxy();
        wg_pv_issue(o, p, tiles_base + ls * WG_TILE_BYTES + WG_TILE_BYTES / 2);
        wg_wait<0>();
        wg_keep(o);
    }
    wg_store(out, o, lrow, row0, r0, r1, n, qstride, h, t);
}


// Checks the descriptor layouts on the device (cuda_kernels_prefill's wgmma probe): a [64][128]
// and b [128][128] bf16 into the swizzled layout; c1 = a b^T (both K-major, as S = Q K^T),
// c2 = a b (a from registers, b MN-major with imm-trans-b = trans and the given byte offsets, as
// O = P V). One warpgroup.
__device__ void wg_probe_impl(const bf16_t* a, const bf16_t* b, float* c1, float* c2,
                              unsigned lbo, unsigned sbo, int trans, unsigned char* smem) {
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    unsigned char* as = smem;
    unsigned char* bs = smem + 64 * 256 * 2;  // a's layout is sized for 128 rows
    for (int i = tid; i < 64 * 16; i += 128) {
        const int r = i >> 4, c = i & 15;
        *(uint4*)(as + wg_off(r, c)) = *(const uint4*)(a + r * 128 + c * 8);
    }
    for (int i = tid; i < 128 * 16; i += 128) {
        const int r = i >> 4, c = i & 15;
        *(uint4*)(bs + wg_off(r, c)) = *(const uint4*)(b + r * 128 + c * 8);
    }
    wg_fence_proxy();
    __syncthreads();
    const unsigned a_addr = fp_smem_addr(as), b_addr = fp_smem_addr(bs);
    float d[64];
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 8; kk++)
        wg_mma_ss(d, wg_desc(a_addr + (kk >> 2) * (128 * 128) + (kk & 3) * 32, 16, 1024),
                  wg_desc(b_addr + (kk >> 2) * (128 * 128) + (kk & 3) * 32, 16, 1024), kk > 0);
    wg_commit();
    wg_wait<0>();
    wg_keep(d);
    const int ra = w * 16 + g;
#pragma unroll
    for (int i = 0; i < 16; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) c1[(ra + 8 * (e >> 1)) * 128 + i * 8 + 2 * t + (e & 1)] = d[4 * i + e];
    // a from registers: rows ra, ra + 8, 16 keys per step
    unsigned af[32];
#pragma unroll
    for (int kk = 0; kk < 8; kk++) {
        const bf16_t* p0 = a + ra * 128 + kk * 16 + 2 * t;
        af[4 * kk + 0] = *(const unsigned*)p0;
        af[4 * kk + 1] = *(const unsigned*)(p0 + 8 * 128);
        af[4 * kk + 2] = *(const unsigned*)(p0 + 8);
        af[4 * kk + 3] = *(const unsigned*)(p0 + 8 * 128 + 8);
    }
#pragma unroll
    for (int i = 0; i < 64; i++) d[i] = 0.f;
    wg_fence();
    if (trans) {
#pragma unroll
        for (int kk = 0; kk < 8; kk++) wg_mma_rs_t1(d, af + 4 * kk, wg_desc(b_addr + kk * 2048, lbo, sbo));
    } else {
#pragma unroll
        for (int kk = 0; kk < 8; kk++) wg_mma_rs_t0(d, af + 4 * kk, wg_desc(b_addr + kk * 2048, lbo, sbo));
    }
    wg_commit();
    wg_wait<0>();
    wg_keep(d);
#pragma unroll
    for (int i = 0; i < 16; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) c2[(ra + 8 * (e >> 1)) * 128 + i * 8 + 2 * t + (e & 1)] = d[4 * i + e];
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// grid: (nh, ceil(n / 128)), block: 256, dynamic shared memory 1024 (alignment) + 32768 (Q) +
// STAGES * 65536; block_size a power of two, head_dim 128.
#define FLASH_PREFILL_WG_KERNEL(NAME, STAGES)                                                     \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(                                    \
        const bf16_t* __restrict__ q, bf16_t* __restrict__ out,                                   \
        const bf16_t* __restrict__ layer_kv, const int* __restrict__ table, int row0, int n,      \
        int start, int nh, int nkv, int block_size, float scale_log2, int window) {               \
        PD_GRID_WAIT();  PD_GRID_LAUNCH_DEPENDENTS();                                             \
        WG_BODY(flash_prefill_wg_impl<STAGES>(q, out, layer_kv, table, row0, n, start, nh, nkv,   \
                                              block_size, scale_log2, window, wg_smem_aligned())) \
    }

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_BODY(...) __VA_ARGS__;
__device__ __forceinline__ unsigned char* wg_smem_aligned() {
    extern __shared__ __align__(1024) unsigned char wg_dyn_smem[];
    const unsigned base = fp_smem_addr(wg_dyn_smem);
    return wg_dyn_smem + ((1024u - (base & 1023u)) & 1023u);
}
#else
#define WG_BODY(...) __trap();
#endif

FLASH_PREFILL_WG_KERNEL(flash_prefill_hd128_wg, 2)

// The warp-specialized variant: grid (nh, ceil(n / 128)), block 384 (producer warpgroup + two
// consumers), dynamic shared memory as flash_prefill_hd128_wg's (two stages); block_size a power
// of two of at least 8; kv_map the layer's pool as a 5-d TMA tensor map (see WsTmap).
extern "C" __global__ void __launch_bounds__(384, 1)
    flash_prefill_hd128_ws(const bf16_t* __restrict__ q, bf16_t* __restrict__ out,
                           const bf16_t* __restrict__ layer_kv, const int* __restrict__ table,
                           int row0, int n, int start, int nh, int nkv, int block_size,
                           float scale_log2, int window, const __grid_constant__ WsTmap kv_map) {
    PD_GRID_WAIT();  PD_GRID_LAUNCH_DEPENDENTS();
    WG_BODY(flash_prefill_ws_impl(q, out, layer_kv, table, row0, n, start, nh, nkv, block_size,
                                  scale_log2, window, kv_map, wg_smem_aligned()))
}

// block: 128, dynamic shared memory 1024 + 32768 + 32768.
extern "C" __global__ void __launch_bounds__(128, 1)
    wgmma_probe(const bf16_t* a, const bf16_t* b, float* c1, float* c2, unsigned lbo,
                unsigned sbo, int trans) {
    PD_GRID_WAIT();  PD_GRID_LAUNCH_DEPENDENTS();
    WG_BODY(wg_probe_impl(a, b, c1, c2, lbo, sbo, trans, wg_smem_aligned()))
}
