// Decode-oriented paged attention, v2: a warp covers KPW keys at once (LPK = hd / DPL lanes per
// key, each lane DPL contiguous dims loaded as 16-byte words), two key steps in flight per warp,
// so the dot-product reduction costs log2(LPK) shuffles per KPW keys instead of 5 per key.
// Same contract (window included), grid and partial outputs as paged_attention (attention.cu), except that one
// block serves up to ATT2_MAXG query heads, and `tok_list` (optional) maps blockIdx.x to a token.
// Needs head_dim % DPL == 0 and 32 % (head_dim / DPL) == 0.

#define ATT2_NW 4
#define ATT2_MAXG 4
#define ATT2_SMEM_BT 1024  // block-table entries of one split staged in shared memory

template <int DPL>
__device__ __forceinline__ void load_row(const bf16_t* p, float* f) {
#pragma unroll
    for (int v = 0; v < DPL / 8; v++) unpack8(((const uint4*)p)[v], f + 8 * v);
}

template <int DPL>
__device__ void attn_v2(const bf16_t* __restrict__ q, const bf16_t* __restrict__ layer_kv,
                        const int* __restrict__ tok_seq, const int* __restrict__ tok_pos,
                        const int* __restrict__ block_tables, int max_blocks, int nh, int nkv,
                        int hd, int block_size, float scale, int split_len,
                        bf16_t* __restrict__ out, float* __restrict__ part_ml,
                        float* __restrict__ part_acc, const int* __restrict__ tok_list,
                        int window) {
    constexpr int SLOTS = ATT2_NW * 32;  // upper bound of NW * KPW
    __shared__ float sm_acc[ATT2_NW * ATT2_MAXG * 32 * DPL];
    __shared__ float sm_m[SLOTS][ATT2_MAXG];
    __shared__ float sm_l[SLOTS][ATT2_MAXG];
    __shared__ int sm_bt[ATT2_SMEM_BT];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int LPK = hd / DPL, KPW = 32 / LPK;
    const int kg = lane / LPK, li = lane - kg * LPK, d0 = li * DPL;
    const i64 t = tok_list ? (i64)tok_list[blockIdx.x] : (i64)blockIdx.x;
    const int G = nh / nkv;
    const int hgroups = (G + ATT2_MAXG - 1) / ATT2_MAXG;
    const int kvh = blockIdx.y / hgroups, hg = blockIdx.y % hgroups;
    const int h0 = kvh * G + hg * ATT2_MAXG;
    const int ng = min(ATT2_MAXG, G - hg * ATT2_MAXG);
    const int nsplit = gridDim.z;
    const int ctx = tok_pos[t] + 1;
    const int k0 = (window > 0 ? max(0, ctx - window) : 0) + blockIdx.z * split_len;
    const int k1 = min(ctx, k0 + split_len);

    float qr[ATT2_MAXG][DPL], acc[ATT2_MAXG][DPL], m[ATT2_MAXG], l[ATT2_MAXG];
#pragma unroll
    for (int g = 0; g < ATT2_MAXG; g++) {
        m[g] = -INFINITY;
        l[g] = 0.f;
        if (g < ng) {
            load_row<DPL>(q + (t * nh + h0 + g) * hd + d0, qr[g]);
        } else {
#pragma unroll
            for (int j = 0; j < DPL; j++) qr[g][j] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < DPL; j++) {
            qr[g][j] *= scale;
            acc[g][j] = 0.f;
        }
    }
    const int* bt = block_tables + (i64)tok_seq[t] * max_blocks;
    // This split's block-table entries in shared memory: the K/V loads then depend on one
    // shared-memory read instead of a global one.
    const int b0 = k0 / block_size;
    const int nbt = k1 > k0 ? (k1 - 1) / block_size - b0 + 1 : 0;
    const bool bt_sm = nbt <= ATT2_SMEM_BT;
    if (bt_sm)
        for (int i = threadIdx.x; i < nbt; i += blockDim.x) sm_bt[i] = bt[b0 + i];
    __syncthreads();
    const i64 row = (i64)nkv * hd;
    const int step = ATT2_NW * KPW;
    for (int kb = k0 + w * KPW; kb < k1; kb += 2 * step) {
        float kr[2][DPL], vr[2][DPL];
        bool valid[2];
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int k = kb + u * step + kg;
            valid[u] = k < k1;
            if (valid[u]) {
                const int bi = k / block_size;
                const i64 blk = bt_sm ? sm_bt[bi - b0] : bt[bi];
                const bf16_t* kp = layer_kv + (blk * 2 * block_size + (k % block_size)) * row +
                                   (i64)kvh * hd + d0;
                load_row<DPL>(kp, kr[u]);
                load_row<DPL>(kp + (i64)block_size * row, vr[u]);
            } else {
#pragma unroll
                for (int j = 0; j < DPL; j++) kr[u][j] = vr[u][j] = 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < 2; u++) {
#pragma unroll
            for (int g = 0; g < ATT2_MAXG; g++) {
                if (g < ng) {
                    float dot = 0.f;
#pragma unroll
                    for (int j = 0; j < DPL; j++) dot += qr[g][j] * kr[u][j];
                    for (int o = LPK >> 1; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                    if (valid[u]) {
                        const float mn = fmaxf(m[g], dot);
                        const float corr = __expf(m[g] - mn);
                        const float p = __expf(dot - mn);
                        l[g] = l[g] * corr + p;
#pragma unroll
                        for (int j = 0; j < DPL; j++) acc[g][j] = acc[g][j] * corr + p * vr[u][j];
                        m[g] = mn;
                    }
                }
            }
        }
    }
    const int slot = w * KPW + kg;
    const int nslots = ATT2_NW * KPW;
#pragma unroll
    for (int g = 0; g < ATT2_MAXG; g++) {
        if (g < ng) {
            if (li == 0) {
                sm_m[slot][g] = m[g];
                sm_l[slot][g] = l[g];
            }
#pragma unroll
            for (int j = 0; j < DPL; j++) sm_acc[(slot * ATT2_MAXG + g) * hd + d0 + j] = acc[g][j];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < ng * hd; idx += blockDim.x) {
        const int g = idx / hd, d = idx - g * hd;
        float M = -INFINITY;
        for (int s = 0; s < nslots; s++) M = fmaxf(M, sm_m[s][g]);
        float L = 0.f, A = 0.f;
        if (M != -INFINITY) {
            for (int s = 0; s < nslots; s++) {
                const float ms = sm_m[s][g];
                if (ms == -INFINITY) continue;
                const float wx = __expf(ms - M);
                L += sm_l[s][g] * wx;
                A += sm_acc[(s * ATT2_MAXG + g) * hd + d] * wx;
            }
        }
        const i64 th = t * nh + h0 + g;
        if (nsplit == 1) {
            out[th * hd + d] = f2bf(A / L);
        } else {
            const i64 pi = th * nsplit + blockIdx.z;
            part_acc[pi * hd + d] = A;
            if (d == 0) {
                part_ml[pi * 2] = M;
                part_ml[pi * 2 + 1] = L;
            }
        }
    }
}

#define ATT2_KERNEL(NAME, DPL)                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * ATT2_NW) NAME(                              \
        const bf16_t* q, const bf16_t* layer_kv, const int* tok_seq, const int* tok_pos,          \
        const int* block_tables, int max_blocks, int nh, int nkv, int hd, int block_size,         \
        float scale, int split_len, bf16_t* out, float* part_ml, float* part_acc,                 \
        const int* tok_list, int window) {                                                        \
        PD_GRID_WAIT();  PD_GRID_LAUNCH_DEPENDENTS();                                             \
        attn_v2<DPL>(q, layer_kv, tok_seq, tok_pos, block_tables, max_blocks, nh, nkv, hd,        \
                     block_size, scale, split_len, out, part_ml, part_acc, tok_list, window);     \
    }

ATT2_KERNEL(paged_attention_v2_d8, 8)
ATT2_KERNEL(paged_attention_v2_d16, 16)
