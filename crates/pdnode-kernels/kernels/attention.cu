// Paged attention over the KV pool, for decode and (chunked) prefill alike: query token t of
// sequence tok_seq[t] at position tok_pos[t] attends to keys lo..=tok_pos[t] of its sequence, lo =
// max(0, tok_pos[t] + 1 - window) with a sliding window, else 0 (window = 0: the whole context);
// the new tokens' K/V are already in the pool, written by rope_qkv. GQA-aware: one block serves up to
// ATT_MAXG query heads sharing one KV head, so each K/V row is read once per block. Split-K
// (flash-decoding): blockIdx.z takes keys [lo + z * split_len, lo + (z + 1) * split_len), so the
// splits cover the window only (the host sizes them for min(context, window) keys); with nsplit > 1
// the partial (max, sum, acc) go to part_ml / part_acc and attention_combine finishes.
//
// q: [T, nh, hd] bf16 (RoPE applied); out: [T, nh, hd] bf16.
// block_tables: [S, max_blocks] physical block ids; layer_kv: [num_blocks][2][bs][nkv][hd].
// grid: (T or len(tok_list), nkv * ceil(G / ATT_MAXG), nsplit), block: 32 * ATT_NW; tok_list
// (optional) maps blockIdx.x to the token it serves.

#define ATT_NW 4
#define ATT_MAXG 8
#define ATT_MAXDPL 8  // head_dim <= 256

extern "C" __global__ void __launch_bounds__(32 * ATT_NW)
paged_attention(const bf16_t* __restrict__ q, const bf16_t* __restrict__ layer_kv,
                const int* __restrict__ tok_seq, const int* __restrict__ tok_pos,
                const int* __restrict__ block_tables, int max_blocks, int nh, int nkv, int hd,
                int block_size, float scale, int split_len, bf16_t* __restrict__ out,
                float* __restrict__ part_ml, float* __restrict__ part_acc,
                const int* __restrict__ tok_list, int window) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ float sm_acc[ATT_NW][ATT_MAXG][ATT_MAXDPL * 32];
    __shared__ float sm_m[ATT_NW][ATT_MAXG];
    __shared__ float sm_l[ATT_NW][ATT_MAXG];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const i64 t = tok_list ? (i64)tok_list[blockIdx.x] : (i64)blockIdx.x;
    const int G = nh / nkv;
    const int hgroups = (G + ATT_MAXG - 1) / ATT_MAXG;
    const int kvh = blockIdx.y / hgroups, hg = blockIdx.y % hgroups;
    const int h0 = kvh * G + hg * ATT_MAXG;
    const int ng = min(ATT_MAXG, G - hg * ATT_MAXG);
    const int nsplit = gridDim.z;
    const int ctx = tok_pos[t] + 1;
    const int k0 = (window > 0 ? max(0, ctx - window) : 0) + blockIdx.z * split_len;
    const int k1 = min(ctx, k0 + split_len);
    const int dpl = (hd + 31) / 32;

    float qr[ATT_MAXG][ATT_MAXDPL], acc[ATT_MAXG][ATT_MAXDPL], m[ATT_MAXG], l[ATT_MAXG];
#pragma unroll
    for (int g = 0; g < ATT_MAXG; g++) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < ATT_MAXDPL; j++) {
            const int d = lane * dpl + j;
            const bool ok = g < ng && j < dpl && d < hd;
            qr[g][j] = ok ? bf2f(q[(t * nh + h0 + g) * hd + d]) * scale : 0.f;
            acc[g][j] = 0.f;
        }
    }
    const int* bt = block_tables + (i64)tok_seq[t] * max_blocks;
    const i64 row = (i64)nkv * hd;
    for (int k = k0 + w; k < k1; k += ATT_NW) {
        const i64 blk = bt[k / block_size];
        const int sl = k % block_size;
        const bf16_t* kp = layer_kv + (blk * 2 * block_size + sl) * row + (i64)kvh * hd;
        const bf16_t* vp = kp + (i64)block_size * row;
        float kr[ATT_MAXDPL], vr[ATT_MAXDPL];
#pragma unroll
        for (int j = 0; j < ATT_MAXDPL; j++) {
            const int d = lane * dpl + j;
            const bool ok = j < dpl && d < hd;
            kr[j] = ok ? bf2f(kp[d]) : 0.f;
            vr[j] = ok ? bf2f(vp[d]) : 0.f;
        }
#pragma unroll
        for (int g = 0; g < ATT_MAXG; g++) {
            if (g < ng) {
                float dot = 0.f;
#pragma unroll
                for (int j = 0; j < ATT_MAXDPL; j++) dot += qr[g][j] * kr[j];
                const float s = warp_sum(dot);
                const float mn = fmaxf(m[g], s);
                const float corr = __expf(m[g] - mn);
                const float p = __expf(s - mn);
                l[g] = l[g] * corr + p;
#pragma unroll
                for (int j = 0; j < ATT_MAXDPL; j++) acc[g][j] = acc[g][j] * corr + p * vr[j];
                m[g] = mn;
            }
        }
    }
#pragma unroll
    for (int g = 0; g < ATT_MAXG; g++) {
        if (g < ng) {
            if (lane == 0) {
                sm_m[w][g] = m[g];
                sm_l[w][g] = l[g];
            }
#pragma unroll
            for (int j = 0; j < ATT_MAXDPL; j++) {
                const int d = lane * dpl + j;
                if (j < dpl && d < hd) sm_acc[w][g][d] = acc[g][j];
            }
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < ng * hd; idx += blockDim.x) {
        const int g = idx / hd, d = idx - g * hd;
        float M = -INFINITY;
#pragma unroll
        for (int x = 0; x < ATT_NW; x++) M = fmaxf(M, sm_m[x][g]);
        float L = 0.f, A = 0.f;
        if (M != -INFINITY) {
#pragma unroll
            for (int x = 0; x < ATT_NW; x++) {
                const float wx = __expf(sm_m[x][g] - M);
                L += sm_l[x][g] * wx;
                A += sm_acc[x][g][d] * wx;
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

// Merges the nsplit partials of each (token, head). grid: (T or len(tok_list)) * nh, block: 128,
// hd <= COMB_DPT * 128. Per (token, head): M = the max of the partitions' maxima; each partition's
// weight exp(m - M) once into shared memory (COMB_CHUNK partitions at a time; a partition without
// a key, m = -inf, is skipped); L = sum of l * w by one thread, A = sum of acc * w by the thread
// of each dim, both in partition order; out = bf16(A / L). The partials' loads are issued eight
// at a time ahead of their sums: a loop of one dependent L2 round trip per partition took 12-15
// us a layer at 32 partitions (batch 1, ctx 8192). Up to COMB_FEW partitions each thread takes
// them all with no barrier (all loads first, one round trip; the same sums in the same order).
#define COMB_CHUNK 256
#define COMB_DPT 4
#define COMB_FEW 32  // up to this many partitions (and hd <= 128): the barrier-free path
// attention_combine's barrier-free path: one dim (acc at stride hd) over nsplit <= N partitions.
template <int N>
__device__ __forceinline__ void comb_few(const float* __restrict__ ml, const float* __restrict__ acc,
                                         int hd, int nsplit, bf16_t* __restrict__ out) {
    float2 mlz[N];
    float a[N];
#pragma unroll
    for (int z = 0; z < N; z++) {
        mlz[z] = z < nsplit ? ((const float2*)ml)[z] : make_float2(-INFINITY, 0.f);
        a[z] = z < nsplit ? acc[(i64)z * hd] : 0.f;
    }
    float M = -INFINITY;
#pragma unroll
    for (int z = 0; z < N; z++)
        if (z < nsplit) M = fmaxf(M, mlz[z].x);
    float L = 0.f, A = 0.f;
#pragma unroll
    for (int z = 0; z < N; z++) {
        if (z >= nsplit || mlz[z].x == -INFINITY) continue;
        const float wz = __expf(mlz[z].x - M);
        L += mlz[z].y * wz;
        A += a[z] * wz;
    }
    *out = f2bf(L > 0.f ? A / L : 0.f);  // L == 0: no key (padding token)
}

extern "C" __global__ void attention_combine(const float* __restrict__ part_ml,
                                             const float* __restrict__ part_acc,
                                             bf16_t* __restrict__ out, int hd, int nsplit,
                                             const int* __restrict__ tok_list, int nh) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ float s_w[COMB_CHUNK], s_l[COMB_CHUNK], s_red[33];
    const int tid = threadIdx.x, nt = blockDim.x;
    const i64 th = tok_list ? (i64)tok_list[blockIdx.x / nh] * nh + blockIdx.x % nh
                            : (i64)blockIdx.x;
    const float* ml = part_ml + th * nsplit * 2;
    if (hd <= nt && nsplit <= COMB_FEW) {
        // up to COMB_FEW partitions and a dim a thread: each thread all of the partitions, every
        // load issued first (one round trip), no barrier; 8 loads a thread where 8 partitions do
        if (tid < hd) {
            if (nsplit <= 8)
                comb_few<8>(ml, part_acc + th * nsplit * hd + tid, hd, nsplit, out + th * hd + tid);
            else
                comb_few<COMB_FEW>(ml, part_acc + th * nsplit * hd + tid, hd, nsplit,
                                   out + th * hd + tid);
        }
        return;
    }
    // the max is exact in any order: each thread's partitions, then across the block
    float m = -INFINITY;
    for (int z = tid; z < nsplit; z += nt) m = fmaxf(m, ml[2 * z]);
    m = warp_max(m);
    if ((tid & 31) == 0) s_red[tid >> 5] = m;
    __syncthreads();
    float M = -INFINITY;
    for (int i = 0; i < (nt >> 5); i++) M = fmaxf(M, s_red[i]);
    float L = 0.f;  // thread 0's
    float A[COMB_DPT];
#pragma unroll
    for (int j = 0; j < COMB_DPT; j++) A[j] = 0.f;
    for (int c0 = 0; c0 < nsplit; c0 += COMB_CHUNK) {
        const int n = min(COMB_CHUNK, nsplit - c0);
        __syncthreads();  // the previous chunk's weights are used up
        for (int z = tid; z < n; z += nt) {
            const float mz = ml[2 * (c0 + z)];
            s_w[z] = mz == -INFINITY ? -1.f : __expf(mz - M);  // -1: no key, skipped
            s_l[z] = ml[2 * (c0 + z) + 1];
        }
        __syncthreads();
        if (tid == 0)
            for (int z = 0; z < n; z++)
                if (s_w[z] >= 0.f) L += s_l[z] * s_w[z];
#pragma unroll
        for (int j = 0; j < COMB_DPT; j++) {
            const int d = tid + j * nt;
            if (d >= hd) break;
            const float* acc = part_acc + (th * nsplit + c0) * hd + d;
            int z = 0;
            for (; z + 8 <= n; z += 8) {
                float a[8];
#pragma unroll
                for (int u = 0; u < 8; u++) a[u] = acc[(i64)(z + u) * hd];
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const float w = s_w[z + u];
                    if (w >= 0.f) A[j] += a[u] * w;
                }
            }
            for (; z < n; z++) {
                const float w = s_w[z];
                if (w >= 0.f) A[j] += acc[(i64)z * hd] * w;
            }
        }
    }
    __syncthreads();
    if (tid == 0) s_red[32] = L;
    __syncthreads();
    L = s_red[32];
#pragma unroll
    for (int j = 0; j < COMB_DPT; j++) {
        const int d = tid + j * nt;
        if (d < hd) out[th * hd + d] = f2bf(L > 0.f ? A[j] / L : 0.f);  // L == 0: no key (padding token)
    }
}
