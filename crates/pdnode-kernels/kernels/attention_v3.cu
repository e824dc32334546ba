// Decode paged attention, v3: flash-decoding split-K over the paged cache, GQA-aware, with K/V
// tiles staged in shared memory by cp.async (several tiles in flight per block, so the loads in
// flight do not depend on the register budget).
//
// One block of 128 threads per (token, kv head [, head group of MG = 4 or 8], partition): it serves
// every query head of its GQA group, so each K/V byte is read from HBM once per token. Per tile of
// TK keys:
//   1. QK: LPK = HD / 8 lanes per key, each lane one 16-byte chunk of K against its chunk of q
//      (q of the group staged once in shared memory, f32), one butterfly reduce-scatter of all
//      heads' and keys' partial dots over the LPK lanes;
//      scores go to shared memory (log2 domain: q . k * scale * log2(e)).
//   2. softmax: a warp per head updates the running max / sum once per tile and turns the tile's
//      scores into probabilities.
//   3. PV: thread (row r, chunk c) accumulates 4 heads (MG / 4 rows per key slice) over keys
//      r / (MG / 4) + i * KS of the tile for dims [8c, 8c + 8) (fp32), so each V chunk read from
//      shared memory feeds 32 FMAs; all key slices of a head share the running max, so their
//      partial sums add up at the end.
//
// Same arguments, grid and partial outputs as paged_attention (attention.cu): grid (T or
// len(tok_list), nkv * ceil(G / MG), nsplit), block 128; partition z takes keys
// [z * split_len, (z + 1) * split_len) of the token's context tok_pos[t] + 1 (read from device
// memory, so one launch serves every context up to the one nsplit was chosen for). A partition
// past the context writes neutral partials (m = -inf, l = 0, acc = 0) that attention_combine
// skips. With nsplit == 1 the block writes `out` directly.

#define ATT3_NT 128
#define ATT3_BT 512  // block-table entries of one partition staged in shared memory
#define ATT3_LOG2E 1.4426950408889634f
#define ATT3_LN2 0.6931471805599453f

__device__ __forceinline__ unsigned att3_smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16-byte global -> shared copy; `bytes` = 0 fills the 16 bytes with zeros and reads nothing.
__device__ __forceinline__ void att3_cp16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(att3_smem_addr(dst)),
                 "l"(src), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void att3_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void att3_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Butterfly reduce-scatter over lane groups of 2 * O lanes: each stage keeps half of the N values
// (the upper half where lane bit O is set), adds the partner's copy of it, and sends the other
// half. With N >= 2 * O, lane c ends with the group sums of values c * NF .. c * NF + NF - 1 in
// v[0 .. NF), NF = N / (2 * O). With fewer values, the stages left once one value remains are
// a plain butterfly sum: lane c holds the sum of value c / DUP in v[0], DUP = 2 * O / N.
template <int N, int O>
__device__ __forceinline__ void att3_reduce_scatter(float* v, int lane) {
    if constexpr (O > 0) {
        if constexpr (N >= 2) {
            const bool up = (lane & O) != 0;
#pragma unroll
            for (int i = 0; i < N / 2; i++) {
                const float lo = v[i], hi = v[i + N / 2];
                v[i] = (up ? hi : lo) + __shfl_xor_sync(0xffffffffu, up ? lo : hi, O);
            }
            att3_reduce_scatter<N / 2, O / 2>(v, lane);
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
            att3_reduce_scatter<1, O / 2>(v, lane);
        }
    }
}

template <int HD, int TK, int NST, int MG>
__device__ __forceinline__ void attn_v3(const bf16_t* __restrict__ q,
                                        const bf16_t* __restrict__ layer_kv,
                                        const int* __restrict__ tok_seq,
                                        const int* __restrict__ tok_pos,
                                        const int* __restrict__ block_tables, int max_blocks,
                                        int nh, int nkv, int block_size, float scale,
                                        int split_len, bf16_t* __restrict__ out,
                                        float* __restrict__ part_ml, float* __restrict__ part_acc,
                                        const int* __restrict__ tok_list) {
    constexpr int NCH = HD / 8;          // 16-byte chunks per K/V row
    constexpr int LPK = NCH;             // QK: lanes per key
    constexpr int KPP = ATT3_NT / LPK;   // QK: keys per pass
    constexpr int NP = TK / KPP;         // QK: keys per lane per tile
    constexpr int NV = NP * MG;   // QK: partial dots per lane per tile
    constexpr int NF = NV >= LPK ? NV / LPK : 1;  // QK: full dots per lane after the reduce-scatter
    constexpr int DUP = NV >= LPK ? 1 : LPK / NV;  // QK: lanes holding the same full dot
    constexpr int ROWS = ATT3_NT / NCH;  // PV: thread rows
    constexpr int ROW = HD + 8;          // padded shared-memory row (bf16): no bank conflicts
    constexpr int STAGE = TK * ROW;
    constexpr int CPT = 2 * TK * NCH / ATT3_NT;  // 16-byte copies per thread per tile
    static_assert(HD % 8 == 0 && 32 % LPK == 0, "LPK lanes per key within a warp");
    static_assert(TK <= 32 && TK % KPP == 0, "a warp covers a tile's scores");
    static_assert(NV % LPK == 0 || LPK % NV == 0, "the reduce-scatter ends with whole values");
    static_assert((2 * TK * NCH) % ATT3_NT == 0, "whole copies per thread");
    static_assert(ROWS >= MG, "every head gets a PV row");
    constexpr int HPT = MG < 4 ? MG : 4;  // PV: heads per thread
    constexpr int HH = MG / HPT;           // PV: head quarters/halves (thread rows per key slice)
    constexpr int KS = ROWS / HH;          // PV: key slices
    static_assert(MG % HPT == 0 && ROWS % HH == 0, "PV rows split evenly");
    static_assert(2 * NST * STAGE * 2 >= KS * MG * HD * 4, "reduction scratch fits the stages");

    __shared__ __align__(16) bf16_t skv[2 * NST * STAGE];  // K stages, then V stages
    __shared__ __align__(16) float sq[MG * HD];
    __shared__ __align__(16) float ss[TK][MG];  // scores, then probabilities, key-major
    bf16_t* const sk = skv;
    bf16_t* const sv = skv + NST * STAGE;
    __shared__ float s_m[MG], s_l[MG], s_c[MG];
    __shared__ int s_bt[ATT3_BT];

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const i64 t = tok_list ? (i64)tok_list[blockIdx.x] : (i64)blockIdx.x;
    const int G = nh / nkv;
    const int hgroups = (G + MG - 1) / MG;
    const int kvh = blockIdx.y / hgroups, hg = blockIdx.y % hgroups;
    const int h0 = kvh * G + hg * MG;
    const int ng = min(MG, G - hg * MG);
    const int nsplit = gridDim.z;
    const int ctx = min(tok_pos[t] + 1, max_blocks * block_size);
    const int k0 = blockIdx.z * split_len;
    const int k1 = min(ctx, k0 + split_len);

    if (k1 <= k0) {  // partition past the context (uniform over the block: no barrier skipped)
        for (int idx = tid; idx < ng * HD; idx += ATT3_NT) {
            const int g = idx / HD, d = idx - g * HD;
            const i64 th = t * nh + h0 + g;
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

    // q of the group in shared memory (f32), read back one 8-dim chunk per head and key pass.
    for (int idx = tid; idx < ng * NCH; idx += ATT3_NT) {
        const int g = idx / NCH, c = idx - g * NCH;
        unpack8(*(const uint4*)(q + (t * nh + h0 + g) * HD + c * 8), sq + g * HD + c * 8);
    }
    const int kq = tid / LPK, cq = tid - kq * LPK;
    const float qscale = scale * ATT3_LOG2E;

    const int* bt = block_tables + (i64)tok_seq[t] * max_blocks;
    const int b0 = k0 / block_size;
    const int nbt = (k1 - 1) / block_size - b0 + 1;
    const bool bt_sm = nbt <= ATT3_BT;
    if (bt_sm)
        for (int i = tid; i < nbt; i += ATT3_NT) s_bt[i] = bt[b0 + i];
    for (int i = tid; i < TK * MG; i += ATT3_NT) (&ss[0][0])[i] = 0.f;  // heads >= ng stay 0
    if (tid < MG) {
        s_m[tid] = -INFINITY;
        s_l[tid] = 0.f;
        s_c[tid] = 0.f;
    }
    __syncthreads();

    const i64 row = (i64)nkv * HD;
    const bf16_t* kv_head = layer_kv + (i64)kvh * HD;
    const int ntiles = (k1 - k0 + TK - 1) / TK;

    // Issues the copies of tile j into stage st (keys past k1 are zero-filled, not read): each
    // thread copies the same 16-byte chunk of K and of V for CPT / 2 keys.
    const bool bs_pow2 = (block_size & (block_size - 1)) == 0;
    const int bs_shift = __ffs(block_size) - 1;
    auto load_tile = [&](int j, int st) {
        const int kt = k0 + j * TK;
#pragma unroll
        for (int i = 0; i < CPT / 2; i++) {
            const int e = tid + i * ATT3_NT;  // < TK * NCH
            const int kk = e / NCH, c = e - kk * NCH;
            const int k = kt + kk;
            const bf16_t* src = layer_kv;
            int bytes = 0;
            if (k < k1) {
                const int bi = bs_pow2 ? k >> bs_shift : k / block_size;
                const i64 blk = bt_sm ? s_bt[bi - b0] : bt[bi];
                src = kv_head + (blk * 2 * block_size + (k - bi * block_size)) * row + c * 8;
                bytes = 16;
            }
            const int so = st * STAGE + kk * ROW + c * 8;
            att3_cp16(sk + so, src, bytes);
            att3_cp16(sv + so, bytes ? src + (i64)block_size * row : src, bytes);
        }
    };

    // PV role of this thread: dims [8 pc, 8 pc + 8) of heads ph * HPT .. ph * HPT + HPT - 1
    // over keys pks, pks + KS, ... of each tile.
    const int pr = tid / NCH, pc = tid - pr * NCH;
    const int ph = pr % HH, pks = pr / HH;
    const bool pv_on = ph * HPT < ng;
    float acc[HPT][8];
#pragma unroll
    for (int g = 0; g < HPT; g++)
#pragma unroll
        for (int x = 0; x < 8; x++) acc[g][x] = 0.f;

#pragma unroll
    for (int j = 0; j < NST - 1; j++) {
        if (j < ntiles) load_tile(j, j);
        att3_commit();
    }
    for (int j = 0; j < ntiles; j++) {
        const int st = j % NST;
        att3_wait<NST - 2>();  // this thread's copies of tile j have landed
        __syncthreads();       // everyone's have; everyone is done with tile j - 1
        if (j + NST - 1 < ntiles) load_tile(j + NST - 1, (j + NST - 1) % NST);
        att3_commit();

        const int kt = k0 + j * TK;
        const int nk = min(TK, k1 - kt);
        // 1. scores: this lane's chunk of NP keys (kq, kq + KPP, ...) against every head's q
        // chunk (q read once for all NP keys), then one reduce-scatter over the LPK lanes of the
        // key group for all NV = NP * MAXG partial dots at once: log2(LPK) butterfly stages that
        // each send half of the values still held, NV - NV / LPK shuffles in all instead of
        // NV * log2(LPK) (see att3_reduce_scatter for which lane ends with which dot).
        const bf16_t* ks = sk + st * STAGE + kq * ROW + cq * 8;
        float kf[NP][8];
#pragma unroll
        for (int p = 0; p < NP; p++) unpack8(*(const uint4*)(ks + p * KPP * ROW), kf[p]);
        float v[NV];  // v[p * MG + g]
#pragma unroll
        for (int g = 0; g < MG; g++) {
            if (g < ng) {
                const float4 qa = *(const float4*)(sq + g * HD + cq * 8);
                const float4 qb = *(const float4*)(sq + g * HD + cq * 8 + 4);
                const float qf[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
                for (int p = 0; p < NP; p++) {
                    float dot = 0.f;
#pragma unroll
                    for (int x = 0; x < 8; x++) dot = fmaf(qf[x], kf[p][x], dot);
                    v[p * MG + g] = dot;
                }
            } else {
#pragma unroll
                for (int p = 0; p < NP; p++) v[p * MG + g] = 0.f;
            }
        }
        att3_reduce_scatter<NV, LPK / 2>(v, cq);
        if (cq % DUP == 0) {
#pragma unroll
            for (int i = 0; i < NF; i++) {
                const int idx = cq / DUP * NF + i;
                const int p = idx / MG, g = idx - p * MG;
                const int kk = p * KPP + kq;
                if (g < ng) ss[kk][g] = kk < nk ? v[i] * qscale : -INFINITY;
            }
        }
        __syncthreads();
        // 2. online softmax, once per tile and head
        for (int g = w; g < ng; g += ATT3_NT / 32) {
            const float s = lane < TK ? ss[lane][g] : -INFINITY;
            const float mo = s_m[g];
            const float mn = fmaxf(mo, warp_max(s));  // finite: key kt is valid
            const float p = exp2f(s - mn);
            if (lane < TK) ss[lane][g] = p;
            const float ps = warp_sum(p);
            if (lane == 0) {
                const float c = exp2f(mo - mn);
                s_c[g] = c;
                s_l[g] = s_l[g] * c + ps;
                s_m[g] = mn;
            }
        }
        __syncthreads();
        // 3. P V
        if (pv_on) {
#pragma unroll
            for (int g = 0; g < HPT; g++) {
                const float c = s_c[ph * HPT + g];
#pragma unroll
                for (int x = 0; x < 8; x++) acc[g][x] *= c;
            }
            const bf16_t* vs = sv + st * STAGE + pc * 8;
#pragma unroll 2
            for (int kk = pks; kk < nk; kk += KS) {
                float p[HPT];
                if constexpr (HPT == 4) {
                    const float4 p4 = *(const float4*)(&ss[kk][ph * HPT]);
                    p[0] = p4.x, p[1] = p4.y, p[2] = p4.z, p[3] = p4.w;
                } else {
#pragma unroll
                    for (int g = 0; g < HPT; g++) p[g] = ss[kk][ph * HPT + g];
                }
                float vf[8];
                unpack8(*(const uint4*)(vs + kk * ROW), vf);
#pragma unroll
                for (int g = 0; g < HPT; g++)
#pragma unroll
                    for (int x = 0; x < 8; x++) acc[g][x] = fmaf(p[g], vf[x], acc[g][x]);
            }
        }
    }
    att3_wait<0>();
    __syncthreads();  // K/V stages free: reuse them as the reduction scratch
    float* red = (float*)skv;  // [KS][MG][HD]
    if (pv_on) {
#pragma unroll
        for (int g = 0; g < HPT; g++) {
            float4* dst = (float4*)(red + (pks * MG + ph * HPT + g) * HD + pc * 8);
            dst[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
            dst[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
        }
    }
    __syncthreads();
    for (int idx = tid; idx < ng * HD; idx += ATT3_NT) {
        const int g = idx / HD, d = idx - g * HD;
        float A = 0.f;
        for (int ks = 0; ks < KS; ks++) A += red[(ks * MG + g) * HD + d];
        const float L = s_l[g];
        const i64 th = t * nh + h0 + g;
        if (nsplit == 1) {
            out[th * HD + d] = f2bf(L > 0.f ? A / L : 0.f);
        } else {
            const i64 pi = th * nsplit + blockIdx.z;
            part_acc[pi * HD + d] = A;
            if (d == 0) {
                part_ml[pi * 2] = s_m[g] * ATT3_LN2;  // natural-log domain, as attention_combine
                part_ml[pi * 2 + 1] = L;
            }
        }
    }
}

// hd is a parameter only to keep paged_attention's signature; the wrapper launches the kernel whose
// HD equals it.
#define ATT3_KERNEL(NAME, HD, TK, NST, MG)                                                        \
    extern "C" __global__ void __launch_bounds__(ATT3_NT, 5) NAME(                                \
        const bf16_t* q, const bf16_t* layer_kv, const int* tok_seq, const int* tok_pos,          \
        const int* block_tables, int max_blocks, int nh, int nkv, int hd, int block_size,         \
        float scale, int split_len, bf16_t* out, float* part_ml, float* part_acc,                 \
        const int* tok_list) {                                                                    \
        PD_GRID_WAIT();  PD_GRID_LAUNCH_DEPENDENTS();                                             \
        attn_v3<HD, TK, NST, MG>(q, layer_kv, tok_seq, tok_pos, block_tables, max_blocks, nh,     \
                                 nkv, block_size, scale, split_len, out, part_ml, part_acc,       \
                                 tok_list);                                                       \
    }

// _gN: up to N query heads per block (N = 4 for GQA groups up to 4, else 8: larger groups take
// ceil(G / 8) blocks per KV head).
ATT3_KERNEL(paged_attention_v3_d64_g4, 64, 32, 4, 4)
ATT3_KERNEL(paged_attention_v3_d64_g8, 64, 32, 4, 8)
ATT3_KERNEL(paged_attention_v3_d128_g4, 128, 16, 4, 4)
ATT3_KERNEL(paged_attention_v3_d128_g8, 128, 16, 4, 8)
