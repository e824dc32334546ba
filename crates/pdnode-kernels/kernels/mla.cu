// DeepSeek multi-head latent attention (MLA) on the paged latent pool, the math of the CPU
// reference (crates/pdnode-engine/src/backend/cpu/mla.rs) in the absorbed form.
//
// The pool holds one latent row of `rank + rope` bf16 per token slot ([layer][block][slot][row]),
// so slot `s = block * block_size + i` is row `s` of a layer. Limits the wrappers check:
// rank % 8 == 0, rank <= 512, rope even, rope <= 64.

#define MLA_KT 32          // keys per shared-memory tile of mla_attn_split
#define MLA_LAT_MAX 576    // longest latent row (rank 512 + rope 64)
#define MLA_THREADS 256    // threads of an mla_attn_split block (8 warps)
#define MLA_HPB 16         // heads per mla_attn_split block: 2 per warp
#define MLA_MIN_CHUNK 16   // fewest keys a split takes (later splits are empty)
#define MLA_MAX_SPLITS 256 // most splits mla_attn_combine merges
#define MLA_PRE ((MLA_KT * MLA_LAT_MAX / 8 + MLA_THREADS - 1) / MLA_THREADS)

// The new tokens' latent rows and the RoPE of their queries. For token t:
//   row = [rmsnorm(kva[t][..rank]) * kv_norm | rope(kva[t][rank..])] written bf16 to slot slots[t]
//   (a negative slot writes nothing), and each head's last `rope` values of q rotated in place.
// RoPE angle pos[t] * inv_freq[i] (f32), cos and sin times rope_factor (YaRN's mscale); pairs
// (2i, 2i + 1) when interleave, else (i, i + rope / 2).
// kva: f32 [T][rank + rope]; q: bf16 [T][heads][nope + rope]; layer_pool: this layer's rows.
// grid: (T), block: 256 (a multiple of 32).
extern "C" __global__ void mla_rope_latent(const float* __restrict__ kva, const float* __restrict__ kv_norm,
                                           float eps, bf16_t* __restrict__ q,
                                           const float* __restrict__ inv_freq, float rope_factor,
                                           int interleave, const int* __restrict__ pos,
                                           const i64* __restrict__ slots, bf16_t* __restrict__ layer_pool,
                                           int heads, int nope, int rope, int rank) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ float sh[33];
    const i64 t = blockIdx.x;
    const int latent = rank + rope, half = rope / 2, qk = nope + rope;
    const float* row = kva + t * latent;
    float ss = 0.f;
    for (int i = threadIdx.x; i < rank; i += blockDim.x) ss += row[i] * row[i];
    const float inv = 1.f / sqrtf(block_sum(ss, sh) / (float)rank + eps);
    const i64 slot = slots[t];
    bf16_t* dst = slot >= 0 ? layer_pool + slot * latent : nullptr;
    if (dst)
        for (int i = threadIdx.x; i < rank; i += blockDim.x) dst[i] = f2bf(kv_norm[i] * (row[i] * inv));
    const float p = (float)pos[t];
    // pieces 0..heads-1: the query heads; piece `heads`: the latent's RoPE key
    for (int k = threadIdx.x; k < (heads + 1) * half; k += blockDim.x) {
        const int piece = k / half, i = k - piece * half;
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        c *= rope_factor;
        s *= rope_factor;
        const int a = interleave ? 2 * i : i, b = interleave ? 2 * i + 1 : i + half;
        if (piece < heads) {
            bf16_t* x = q + (t * heads + piece) * qk + nope;
            const float x1 = bf2f(x[a]), x2 = bf2f(x[b]);
            x[a] = f2bf(x1 * c - x2 * s);
            x[b] = f2bf(x2 * c + x1 * s);
        } else if (dst) {
            const float x1 = row[rank + a], x2 = row[rank + b];
            dst[rank + a] = f2bf(x1 * c - x2 * s);
            dst[rank + b] = f2bf(x2 * c + x1 * s);
        }
    }
}

// The keys [s0, s1) split `split` of `nsplit` takes of a context of `ctx` keys (chunks of at
// least MLA_MIN_CHUNK; later splits may be empty: s0 >= s1).
__device__ __forceinline__ void mla_split_range(int ctx, int nsplit, int split, int& s0, int& s1) {
    int chunk = (ctx + nsplit - 1) / nsplit;
    if (chunk < MLA_MIN_CHUNK) chunk = MLA_MIN_CHUNK;
    s0 = split * chunk;
    s1 = ctx < s0 + chunk ? ctx : s0 + chunk;
}

// A tile's latent rows into registers: 16-byte words threadIdx.x + i * NT of the rows of keys
// k0 .. min(k0 + KT, s1) (row j of the sequence at slot block_tables[bt + j / bs] * bs + j % bs);
// words past the tile are not loaded.
template <int PRE, int NT, int KT>
__device__ __forceinline__ void mla_load_tile(uint4 (&pre)[PRE], const bf16_t* __restrict__ layer_pool,
                                              const int* __restrict__ block_tables, i64 bt, int block_size,
                                              int latent, int k0, int s1) {
    const int nvec = latent >> 3;
    const int tot = (s1 - k0 < KT ? s1 - k0 : KT) * nvec;
#pragma unroll
    for (int i = 0; i < PRE; i++) {
        const int v = threadIdx.x + i * NT;
        if (v < tot) {
            const int key = v / nvec, ch = v - key * nvec, j = k0 + key;
            const i64 r = (i64)block_tables[bt + j / block_size] * block_size + j % block_size;
            pre[i] = *(const uint4*)(layer_pool + r * latent + ch * 8);
        }
    }
}

// Absorbed latent attention, one split of one token's context for up to 16 heads. Token t
// (sequence tok_seq[t], position tok_pos[t]) attends to positions 0..=tok_pos[t]; split z takes
// positions [z * chunk, (z + 1) * chunk) of them, chunk = max(ceil(ctx / nsplit), MLA_MIN_CHUNK).
// score_j = (q_lat . c_j + q_pe . kpe_j) * scale, c_j the row's first rank values, kpe_j its last
// rope values; the split's online softmax over its keys gives (m, l, acc = sum_j e^(s_j - m) c_j).
// nsplit == 1: o_lat[t][h] = acc / l (bf16). Else (m, l) to part_ml [N][heads][nsplit][2] and acc
// to part_acc [N][heads][nsplit][rank] (N: the tokens attended for, indexed by their place in
// tok_list); an empty split writes m = -inf, l = 0 and no acc.
// Keys are staged MLA_KT at a time in shared memory (the next tile's loads in flight in registers
// while the current one is used), so a block reads each latent once for all its heads. Warp w
// serves heads 2w, 2w + 1 of the block's group; lane l holds rank dims c * 256 + 8 l + [0, 8)
// (c = 0, 1) and rope dims 2 l, 2 l + 1 of the queries, and the same dims of the accumulators.
// q_lat: f32 [T][heads][rank]; q: bf16 [T][heads][nope + rope] (q_pe its last rope values).
// tok_list: the tokens to attend for (i32 indices into the step's tokens), or null for all.
// grid: (list length or T, ceil(heads / 16), nsplit), block: MLA_THREADS.
extern "C" __global__ void __launch_bounds__(MLA_THREADS)
    mla_attn_split(const float* __restrict__ q_lat, const bf16_t* __restrict__ q,
                   const bf16_t* __restrict__ layer_pool, const int* __restrict__ tok_seq,
                   const int* __restrict__ tok_pos, const int* __restrict__ block_tables, int max_blocks,
                   int heads, int nope, int rope, int rank, int block_size, float scale, int nsplit,
                   float* __restrict__ part_ml, float* __restrict__ part_acc, bf16_t* __restrict__ o_lat,
                   const int* __restrict__ tok_list) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ __align__(16) bf16_t tile[MLA_KT * MLA_LAT_MAX];
    const i64 t = tok_list ? (i64)tok_list[blockIdx.x] : (i64)blockIdx.x;
    const int split = blockIdx.z;
    const int latent = rank + rope, qk = nope + rope;
    const int ls = (latent + 7) & ~7;  // tile row stride: 16-byte aligned rows
    const int seq = tok_seq[t];
    int s0, s1;
    mla_split_range(tok_pos[t] + 1, nsplit, split, s0, s1);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h0 = blockIdx.y * MLA_HPB + warp * 2;
    const bool active = h0 < heads;  // warp-uniform

    float ql[2][16], qp[2][2], acc[2][16], m[2], l[2];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int h = h0 + hh;
        const bool ok = h < heads;
        const float* qr = q_lat + (t * heads + h) * rank;
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const int d0 = c * 256 + lane * 8;
#pragma unroll
            for (int e = 0; e < 8; e++) {
                ql[hh][c * 8 + e] = ok && d0 < rank ? qr[d0 + e] * scale : 0.f;
                acc[hh][c * 8 + e] = 0.f;
            }
        }
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int d = 2 * lane + e;
            qp[hh][e] = ok && d < rope ? bf2f(q[(t * heads + h) * qk + nope + d]) * scale : 0.f;
        }
        m[hh] = -INFINITY;
        l[hh] = 0.f;
    }

    const i64 bt = (i64)seq * max_blocks;
    const bool vec = (latent & 7) == 0;
    const int nvec = latent >> 3;
    uint4 pre[MLA_PRE];
    auto load = [&](int k0) {
        mla_load_tile<MLA_PRE, MLA_THREADS, MLA_KT>(pre, layer_pool, block_tables, bt, block_size, latent, k0, s1);
    };
    auto store = [&](int k0) {
        const int tot = (s1 - k0 < MLA_KT ? s1 - k0 : MLA_KT) * nvec;
#pragma unroll
        for (int i = 0; i < MLA_PRE; i++) {
            const int v = threadIdx.x + i * MLA_THREADS;
            if (v < tot) {
                const int key = v / nvec, ch = v - key * nvec;
                *(uint4*)(tile + key * ls + ch * 8) = pre[i];
            }
        }
    };

    if (vec && s0 < s1) load(s0);
    for (int k0 = s0; k0 < s1; k0 += MLA_KT) {
        const int nk = s1 - k0 < MLA_KT ? s1 - k0 : MLA_KT;
        __syncthreads();  // the previous tile is used up
        if (vec) {
            store(k0);
        } else {
            for (int v = threadIdx.x; v < nk * latent; v += MLA_THREADS) {
                const int key = v / latent, e = v - key * latent, j = k0 + key;
                const i64 r = (i64)block_tables[bt + j / block_size] * block_size + j % block_size;
                tile[key * ls + e] = layer_pool[r * latent + e];
            }
        }
        __syncthreads();
        if (vec && k0 + MLA_KT < s1) load(k0 + MLA_KT);
        if (!active) continue;
        for (int k = 0; k < nk; k++) {
            const bf16_t* row = tile + k * ls;
            float c[16];
#pragma unroll
            for (int cc = 0; cc < 2; cc++) {
                const int d0 = cc * 256 + lane * 8;
                if (d0 < rank) {
                    unpack8(*(const uint4*)(row + d0), c + cc * 8);
                } else {
#pragma unroll
                    for (int e = 0; e < 8; e++) c[cc * 8 + e] = 0.f;
                }
            }
            float kp0 = 0.f, kp1 = 0.f;
            if (2 * lane < rope) {
                const unsigned u = *(const unsigned*)(row + rank + 2 * lane);
                kp0 = __uint_as_float(u << 16);
                kp1 = __uint_as_float(u & 0xffff0000u);
            }
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                float s = qp[hh][0] * kp0 + qp[hh][1] * kp1;
#pragma unroll
                for (int e = 0; e < 16; e++) s += ql[hh][e] * c[e];
                s = warp_sum(s);  // the same value in every lane: the branch below is uniform
                if (s > m[hh]) {
                    const float corr = expf(m[hh] - s);
                    l[hh] *= corr;
#pragma unroll
                    for (int e = 0; e < 16; e++) acc[hh][e] *= corr;
                    m[hh] = s;
                }
                const float p = expf(s - m[hh]);
                l[hh] += p;
#pragma unroll
                for (int e = 0; e < 16; e++) acc[hh][e] += p * c[e];
            }
        }
    }
    if (!active) return;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int h = h0 + hh;
        if (h >= heads) continue;
        const i64 hr = t * heads + h;
        if (nsplit == 1) {
            const float inv = 1.f / l[hh];
#pragma unroll
            for (int cc = 0; cc < 2; cc++) {
                const int d0 = cc * 256 + lane * 8;
                if (d0 < rank)
#pragma unroll
                    for (int e = 0; e < 8; e++) o_lat[hr * rank + d0 + e] = f2bf(acc[hh][cc * 8 + e] * inv);
            }
            continue;
        }
        // partials by the block's place in the list (blockIdx.x), not by token
        const i64 pr = ((i64)blockIdx.x * heads + h) * nsplit + split;
        if (lane == 0) {
            part_ml[pr * 2] = s0 < s1 ? m[hh] : -INFINITY;
            part_ml[pr * 2 + 1] = s0 < s1 ? l[hh] : 0.f;
        }
        if (s0 >= s1) continue;
#pragma unroll
        for (int cc = 0; cc < 2; cc++) {
            const int d0 = cc * 256 + lane * 8;
            if (d0 < rank) {
                float4* o = (float4*)(part_acc + pr * rank + d0);
                o[0] = make_float4(acc[hh][cc * 8], acc[hh][cc * 8 + 1], acc[hh][cc * 8 + 2], acc[hh][cc * 8 + 3]);
                o[1] = make_float4(acc[hh][cc * 8 + 4], acc[hh][cc * 8 + 5], acc[hh][cc * 8 + 6], acc[hh][cc * 8 + 7]);
            }
        }
    }
}

// The same attention on tensor cores (mma.sync m16n8k16 bf16, f32 accumulate; the helpers of
// attention_v4.cu), for latents whose rank and rope are multiples of 16 (DeepSeek: 512 + 64).
// Same grid, splits, partials and outputs as mla_attn_split; a block of 4 warps serves one token,
// 16 heads (the MMA rows; rows past `heads` are zero queries and write nothing) and one split,
// 16 keys a tile staged in shared memory (the next tile's loads in flight in registers):
//   S (16 heads x 16 keys) = Q K^T over the latent: warp w takes k-steps w, w + 4, ..; the four
//     partial tiles are summed in a fixed order (so every run sums alike), times scale;
//   online softmax per head (16 threads), P as bf16, the accumulators' correction per head;
//   O^T (rank dims x 16 heads) += V^T P^T: the latent tile read transposed (ldmatrix.trans) as
//     the A operand (dims as rows), P^T as B; warp w owns the 16-dim tiles w, w + 4, .. of rank.
// Q is rounded to bf16 (q_lat is f32), as the Llama kernels' queries are.
#define MLA_TC_KT 16
#define MLA_TC_THREADS 128
#define MLA_TC_LS (MLA_LAT_MAX + 8)  // tile row stride: 16-byte rows, conflict-free ldmatrix
#define MLA_TC_PRE ((MLA_TC_KT * MLA_LAT_MAX / 8 + MLA_TC_THREADS - 1) / MLA_TC_THREADS)
#define MLA_TC_PS (MLA_TC_KT / 2 + 4)  // P row stride in bf16 pairs

__device__ __forceinline__ unsigned mla_pack2(float lo, float hi) {
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
}

extern "C" __global__ void __launch_bounds__(MLA_TC_THREADS)
    mla_attn_split_tc(const float* __restrict__ q_lat, const bf16_t* __restrict__ q,
                      const bf16_t* __restrict__ layer_pool, const int* __restrict__ tok_seq,
                      const int* __restrict__ tok_pos, const int* __restrict__ block_tables, int max_blocks,
                      int heads, int nope, int rope, int rank, int block_size, float scale, int nsplit,
                      float* __restrict__ part_ml, float* __restrict__ part_acc, bf16_t* __restrict__ o_lat,
                      const int* __restrict__ tok_list) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ __align__(16) bf16_t qs[16 * MLA_TC_LS];
    __shared__ __align__(16) bf16_t kt[MLA_TC_KT * MLA_TC_LS];
    __shared__ float sp[4][16][MLA_TC_KT + 1];
    __shared__ unsigned ps[16][MLA_TC_PS];
    __shared__ float corr_s[16], m_s[16], l_s[16];
    const i64 t = tok_list ? (i64)tok_list[blockIdx.x] : (i64)blockIdx.x;
    const int split = blockIdx.z;
    const int latent = rank + rope, qk = nope + rope;
    const int seq = tok_seq[t];
    int s0, s1;
    mla_split_range(tok_pos[t] + 1, nsplit, split, s0, s1);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, tq = lane & 3, mi = lane >> 3;
    const int hbase = blockIdx.y * 16;

    // the queries: rows of 16 heads, [q_lat | q_pe] unscaled, bf16; zero rows past `heads`. A
    // warp a head: q_lat in 16-byte loads (rank % 16 == 0), no division per element
    for (int h = warp; h < 16; h += 4) {
        const int hh = hbase + h;
        bf16_t* qrow = qs + h * MLA_TC_LS;
        if (hh < heads) {
            const float4* ql = (const float4*)(q_lat + (t * heads + hh) * rank);
            for (int v = lane; v < (rank >> 2); v += 32) {
                const float4 f = ql[v];
                unsigned* o = (unsigned*)(qrow + 4 * v);
                o[0] = mla_pack2(f.x, f.y);
                o[1] = mla_pack2(f.z, f.w);
            }
            const bf16_t* qp = q + (t * heads + hh) * qk + nope;
            for (int d = lane; d < rope; d += 32) qrow[rank + d] = qp[d];
        } else {
            for (int d = lane; d < latent; d += 32) qrow[d] = 0;
        }
    }
    if (threadIdx.x < 16) {
        m_s[threadIdx.x] = -INFINITY;
        l_s[threadIdx.x] = 0.f;
    }
    float acc[8][2][4];
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int x = 0; x < 4; x++) acc[i][n][x] = 0.f;

    const i64 bt = (i64)seq * max_blocks;
    const int nvec = latent >> 3, ksteps = latent >> 4, mtiles = rank >> 4;
    uint4 pre[MLA_TC_PRE];
    auto load = [&](int k0) {
        mla_load_tile<MLA_TC_PRE, MLA_TC_THREADS, MLA_TC_KT>(pre, layer_pool, block_tables, bt, block_size, latent,
                                                             k0, s1);
    };
    if (s0 < s1) load(s0);
    for (int k0 = s0; k0 < s1; k0 += MLA_TC_KT) {
        const int nk = s1 - k0 < MLA_TC_KT ? s1 - k0 : MLA_TC_KT;
        __syncthreads();  // the previous tile, P and the corrections are used up
#pragma unroll
        for (int i = 0; i < MLA_TC_PRE; i++) {
            const int v = threadIdx.x + i * MLA_TC_THREADS;
            if (v < MLA_TC_KT * nvec) {
                const int key = v / nvec, ch = v - key * nvec;
                // rows past the split's keys are zeros: P is 0 there, and 0 * NaN would not be
                *(uint4*)(kt + key * MLA_TC_LS + ch * 8) = key < nk ? pre[i] : make_uint4(0u, 0u, 0u, 0u);
            }
        }
        __syncthreads();
        if (k0 + MLA_TC_KT < s1) load(k0 + MLA_TC_KT);
        // S: this warp's k-steps of both 8-key tiles
        float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        for (int kk = warp; kk < ksteps; kk += 4) {
            unsigned a[4], b[4];
            att4_ldsm_x4(a, qs + ((mi & 1) * 8 + (lane & 7)) * MLA_TC_LS + kk * 16 + (mi >> 1) * 8);
            att4_ldsm_x4(b, kt + ((mi >> 1) * 8 + (lane & 7)) * MLA_TC_LS + kk * 16 + (mi & 1) * 8);
            att4_mma(sc[0], a, b[0], b[1]);
            att4_mma(sc[1], a, b[2], b[3]);
        }
#pragma unroll
        for (int n = 0; n < 2; n++) {
            sp[warp][g][n * 8 + 2 * tq] = sc[n][0];
            sp[warp][g][n * 8 + 2 * tq + 1] = sc[n][1];
            sp[warp][g + 8][n * 8 + 2 * tq] = sc[n][2];
            sp[warp][g + 8][n * 8 + 2 * tq + 1] = sc[n][3];
        }
        __syncthreads();
        if (threadIdx.x < 16) {  // online softmax of head row h over the tile's keys
            const int h = threadIdx.x;
            float sv[MLA_TC_KT];
            const float mo = m_s[h];
            float mx = mo;
#pragma unroll
            for (int k = 0; k < MLA_TC_KT; k++) {
                const float v = (((sp[0][h][k] + sp[1][h][k]) + sp[2][h][k]) + sp[3][h][k]) * scale;
                sv[k] = k < nk ? v : -INFINITY;
                mx = fmaxf(mx, sv[k]);
            }
            const float corr = expf(mo - mx);  // 0 on the first tile (mo = -inf)
            float l = l_s[h] * corr;
#pragma unroll
            for (int k = 0; k < MLA_TC_KT; k += 2) {
                const float p0 = k < nk ? expf(sv[k] - mx) : 0.f;
                const float p1 = k + 1 < nk ? expf(sv[k + 1] - mx) : 0.f;
                l += p0 + p1;
                ps[h][k / 2] = mla_pack2(p0, p1);
            }
            corr_s[h] = corr;
            m_s[h] = mx;
            l_s[h] = l;
        }
        __syncthreads();
        // O^T += V^T P^T on this warp's dim tiles
        float cf[2][2];
#pragma unroll
        for (int n = 0; n < 2; n++) {
            cf[n][0] = corr_s[n * 8 + 2 * tq];
            cf[n][1] = corr_s[n * 8 + 2 * tq + 1];
        }
        unsigned pb[2][2];
#pragma unroll
        for (int n = 0; n < 2; n++) {
            pb[n][0] = ps[n * 8 + g][tq];
            pb[n][1] = ps[n * 8 + g][4 + tq];
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int mt = warp + 4 * i;
            if (mt < mtiles) {
                unsigned a[4];
                att4_ldsm_x4_t(a, kt + ((mi >> 1) * 8 + (lane & 7)) * MLA_TC_LS + mt * 16 + (mi & 1) * 8);
#pragma unroll
                for (int n = 0; n < 2; n++) {
                    acc[i][n][0] *= cf[n][0];
                    acc[i][n][1] *= cf[n][1];
                    acc[i][n][2] *= cf[n][0];
                    acc[i][n][3] *= cf[n][1];
                    att4_mma(acc[i][n], a, pb[n][0], pb[n][1]);
                }
            }
        }
    }
    __syncthreads();  // l_s and m_s final (also for an empty split)
    // outputs: acc[i][n] holds dims 16 mt + g (+ 8 for x >= 2) of heads n * 8 + 2 tq (+ 1 for odd x)
    if (nsplit > 1 && threadIdx.x < 16) {
        const int h = hbase + threadIdx.x;
        if (h < heads) {
            const i64 pr = ((i64)blockIdx.x * heads + h) * nsplit + split;
            part_ml[pr * 2] = s0 < s1 ? m_s[threadIdx.x] : -INFINITY;
            part_ml[pr * 2 + 1] = s0 < s1 ? l_s[threadIdx.x] : 0.f;
        }
    }
    if (s0 >= s1) return;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int mt = warp + 4 * i;
        if (mt >= mtiles) continue;
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const int hl = n * 8 + 2 * tq + (x & 1), h = hbase + hl;
                const int d = mt * 16 + g + (x >= 2 ? 8 : 0);
                if (h >= heads) continue;
                if (nsplit == 1) {
                    o_lat[(t * heads + h) * rank + d] = f2bf(acc[i][n][x] / l_s[hl]);
                } else {
                    const i64 pr = ((i64)blockIdx.x * heads + h) * nsplit + split;
                    part_acc[pr * rank + d] = acc[i][n][x];
                }
            }
    }
}

// Merges the splits of mla_attn_split: o_lat[row] = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s
// over the splits with l_s != 0 (the empty ones write l = 0 and no acc), M their largest m.
// Rows are (token, head) pairs, row = t * heads + h; with tok_list, block x serves token
// tok_list[x / heads]. A token's splits with keys are a prefix (keys past its context fall in the
// last splits), so the sums stop after the last split with keys. grid: (T * heads, or list
// length * heads; ceil(rank / blockDim.x)): block y sums dims [y * blockDim.x, ..) of the row, so
// a batch-1 step reads its partials with heads * rank / 128 blocks instead of heads.
// block: 128.
extern "C" __global__ void mla_attn_combine(const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                                            bf16_t* __restrict__ o_lat, int rank, int nsplit,
                                            const int* __restrict__ tok_list, int heads) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ float wsh[MLA_MAX_SPLITS];
    __shared__ float inv_l;
    __shared__ int nlast;
    // the partials' row (by place in the list) and the output's (by token)
    const i64 prow = blockIdx.x;
    const i64 row = tok_list ? (i64)tok_list[blockIdx.x / heads] * heads + blockIdx.x % heads
                             : (i64)blockIdx.x;
    const float* ml = part_ml + prow * nsplit * 2;
    if (threadIdx.x < 32) {  // warp 0: the splits' max and weights, a lane per split
        const int lane = threadIdx.x;
        // the (m, l) pairs of this lane's splits (lane + 32 k) all loaded first, each from a valid
        // address (8-byte aligned: the launcher checks part_ml)
        constexpr int K = MLA_MAX_SPLITS / 32;
        float2 p[K];
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int s = lane + 32 * k;
            p[k] = ((const float2*)ml)[s < nsplit ? s : 0];
        }
        float mx = -INFINITY;
        int last = 0;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int s = lane + 32 * k;
            if (s < nsplit && p[k].y != 0.f) {
                mx = fmaxf(mx, p[k].x);
                last = s + 1;
            }
        }
        mx = warp_max(mx);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
        float lsum = 0.f;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int s = lane + 32 * k;
            if (s < nsplit) {
                const float w = p[k].y != 0.f ? expf(p[k].x - mx) : 0.f;
                wsh[s] = w;
                lsum += w * p[k].y;
            }
        }
        lsum = warp_sum(lsum);
        if (lane == 0) {
            inv_l = 1.f / lsum;
            nlast = last;
        }
    }
    __syncthreads();
    const int n = nlast;
    const int d = blockIdx.y * blockDim.x + threadIdx.x;
    if (d < rank) {
        const float* acc = part_acc + prow * nsplit * rank + d;
        // Eight splits' loads issued before their sums, every load unconditional (an empty split's
        // acc, never written, is read and dropped by the select): behind a branch a split, each
        // load waited for the sum before it (up to 132 round trips at batch 1). The same sums in
        // the same order as that loop.
        float a = 0.f;
        int s = 0;
        for (; s + 8 <= n; s += 8) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = acc[(i64)(s + j) * rank];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float w = wsh[s + j];
                a = w != 0.f ? a + w * v[j] : a;
            }
        }
        for (; s < n; s++) {
            const float w = wsh[s], v = acc[(i64)s * rank];
            a = w != 0.f ? a + w * v : a;
        }
        o_lat[row * rank + d] = f2bf(a * inv_l);
    }
}

// Prefill through GEMMs (the absorbed form on tensor cores, backend/mla.rs): the latent rows of
// positions [0, len) of one sequence (block table `table`) into lc [len][row] (contiguous).
// grid: (len), block: 64.
extern "C" __global__ void mla_gather_seq(const bf16_t* __restrict__ layer_pool,
                                          const int* __restrict__ table, int block_size, int row,
                                          int len, bf16_t* __restrict__ lc) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 p = blockIdx.x;
    if (p >= len) return;
    const i64 slot = (i64)table[p / block_size] * block_size + p % block_size;
    const bf16_t* src = layer_pool + slot * row;
    bf16_t* dst = lc + p * row;
    for (int d = threadIdx.x; d < row; d += blockDim.x) dst[d] = src[d];
}

// Rows [row0, row0 + n) of the absorbed queries as head-major bf16 rows of the latent's width:
// qc[h][i] = [q_lat[row0 + i][h] (rank, f32 -> bf16) | q[row0 + i][h][nope..nope + rope]].
// grid: (n, heads), block: 64.
extern "C" __global__ void mla_q_head_major(const float* __restrict__ q_lat, const bf16_t* __restrict__ q,
                                            int row0, int n, int heads, int rank, int nope, int rope,
                                            bf16_t* __restrict__ qc) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 i = blockIdx.x, h = blockIdx.y;
    const i64 t = row0 + i;
    const int row = rank + rope;
    const float* ql = q_lat + (t * heads + h) * rank;
    const bf16_t* qp = q + (t * heads + h) * (nope + rope) + nope;
    bf16_t* dst = qc + (h * n + i) * row;
    for (int d = threadIdx.x; d < rank; d += blockDim.x) dst[d] = f2bf(ql[d]);
    for (int d = threadIdx.x; d < rope; d += blockDim.x) dst[rank + d] = qp[d];
}
