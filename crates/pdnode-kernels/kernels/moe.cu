// DeepSeek mixture of experts: routing, the experts' GEMVs for a few routed (token, expert)
// pairs, the weighted combine, and a row gather. The math of the CPU reference
// (crates/pdnode-engine/src/backend/cpu/moe.rs). Limits the wrappers check: experts <= 1024,
// top_k <= 16, pairs (tokens * top_k) <= MOE_MAX_PAIRS, reduction dims % 8 == 0.

#define MOE_MAX_EXPERTS 1024
#define MOE_MAX_TOPK 16
#define MOE_MAX_PAIRS 512
#define MOE_ROUTE_THREADS 256
#define MOE_GEMV_THREADS 256  // 8 warps
#define MOE_ROWS_PER_WARP 2
#define MOE_ROWS_PER_BLOCK (MOE_GEMV_THREADS / 32 * MOE_ROWS_PER_WARP)

// Rust's f32::total_cmp order as an unsigned key, with the lower index larger among equal
// values: the largest key is the value a stable descending sort puts first. Never 0, so 0 can
// mark "taken".
__device__ __forceinline__ unsigned long long moe_key(float v, int i) {
    int b = (int)__float_as_uint(v);
    b ^= (int)(((unsigned)(b >> 31)) >> 1);
    return ((unsigned long long)((unsigned)b ^ 0x80000000u) << 32) | (unsigned long long)(~(unsigned)i);
}

// The index of the largest moe_key(vals[i], i) over i < n not taken (-1 when all are): each
// warp's largest by shuffles, then every thread reads the warps' from `red` (one entry a warp,
// blockDim.x a multiple of 32): two barriers, where a tree over blockDim.x entries took
// log2(blockDim.x) + 2 (keys are unique, so any order finds the same one). Every thread calls it.
__device__ int moe_block_argmax(const float* vals, const unsigned char* taken, int n, unsigned long long* red) {
    unsigned long long best = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (!taken[i]) {
            const unsigned long long k = moe_key(vals[i], i);
            if (k > best) best = k;
        }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned lo = (unsigned)__shfl_xor_sync(0xffffffffu, (int)(unsigned)best, o);
        const unsigned hi = (unsigned)__shfl_xor_sync(0xffffffffu, (int)(unsigned)(best >> 32), o);
        const unsigned long long other = ((unsigned long long)hi << 32) | lo;
        if (other > best) best = other;
    }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = best;
    __syncthreads();
    unsigned long long b = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++)
        if (red[w] > b) b = red[w];
    __syncthreads();  // red free for the next call
    return b == 0 ? -1 : (int)~(unsigned)(b & 0xffffffffu);
}

__device__ float moe_block_max(float v, float* sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        float r = lane < nw ? sh[lane] : -INFINITY;
        r = warp_max(r);
        if (lane == 0) sh[32] = r;
    }
    __syncthreads();
    return sh[32];
}

// Routing of one token (cpu/moe.rs `route`). scoring: 0 softmax greedy, 1 softmax group-limited
// (V2), 2 sigmoid with the correction bias added for the choice only (V3). Grouped scorings keep
// the topk_groups groups with the best group score (the best expert under softmax, the sum of the
// best two under sigmoid) when topk_groups < num_groups and mask the other experts (0 under
// softmax, -inf under sigmoid). The top_k experts by choice score in descending order (the lower
// index first among equals, Rust's total_cmp order); weights: the (masked) softmax score, or the
// unbiased sigmoid; divided by their sum + 1e-20 when norm && top_k > 1; times `scaling`.
// logits: f32 [T][experts]; bias: f32 [experts] or null; ids: i32 [T][top_k]; weights: f32 [T][top_k].
// grid: (T), block: MOE_ROUTE_THREADS.
extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS)
    moe_route(const float* __restrict__ logits, const float* __restrict__ bias, int experts, int top_k,
              int num_groups, int topk_groups, int scoring, int norm, float scaling, int* __restrict__ ids,
              float* __restrict__ weights) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ float choice[MOE_MAX_EXPERTS], score[MOE_MAX_EXPERTS], gscore[MOE_MAX_EXPERTS];
    __shared__ unsigned char taken[MOE_MAX_EXPERTS], gkept[MOE_MAX_EXPERTS];
    __shared__ unsigned long long red[32];  // a warp's largest key (moe_block_argmax)
    __shared__ float sh[33];
    __shared__ int pick[MOE_MAX_TOPK];
    const i64 t = blockIdx.x;
    const float* lg = logits + t * experts;
    if (scoring < 2) {
        float mx = -INFINITY;
        for (int i = threadIdx.x; i < experts; i += blockDim.x) mx = fmaxf(mx, lg[i]);
        mx = moe_block_max(mx, sh);
        float s = 0.f;
        for (int i = threadIdx.x; i < experts; i += blockDim.x) {
            const float e = expf(lg[i] - mx);
            choice[i] = e;
            s += e;
        }
        const float sum = block_sum(s, sh);
        for (int i = threadIdx.x; i < experts; i += blockDim.x) choice[i] = choice[i] / sum;
    } else {
        for (int i = threadIdx.x; i < experts; i += blockDim.x) {
            const float p = 1.f / (1.f + expf(-lg[i]));
            score[i] = p;
            choice[i] = bias ? p + bias[i] : p;
        }
    }
    for (int i = threadIdx.x; i < experts; i += blockDim.x) taken[i] = 0;
    __syncthreads();
    if (scoring != 0 && topk_groups < num_groups) {
        const int per = experts / num_groups;
        for (int g = threadIdx.x; g < num_groups; g += blockDim.x) {
            unsigned long long k1 = 0, k2 = 0;
            float v1 = 0.f, v2 = 0.f;
            for (int i = g * per; i < (g + 1) * per; i++) {
                const unsigned long long k = moe_key(choice[i], i);
                if (k > k1) {
                    k2 = k1;
                    v2 = v1;
                    k1 = k;
                    v1 = choice[i];
                } else if (k > k2) {
                    k2 = k;
                    v2 = choice[i];
                }
            }
            gscore[g] = scoring == 2 ? v1 + v2 : v1;
            gkept[g] = 0;
        }
        __syncthreads();
        for (int r = 0; r < topk_groups; r++) {
            const int g = moe_block_argmax(gscore, gkept, num_groups, red);
            if (threadIdx.x == 0 && g >= 0) gkept[g] = 1;
            __syncthreads();
        }
        const float masked = scoring == 2 ? -INFINITY : 0.f;
        for (int i = threadIdx.x; i < experts; i += blockDim.x)
            if (!gkept[i / per]) choice[i] = masked;
        __syncthreads();
    }
    for (int r = 0; r < top_k; r++) {
        const int e = moe_block_argmax(choice, taken, experts, red);
        if (threadIdx.x == 0) {
            pick[r] = e < 0 ? 0 : e;
            if (e >= 0) taken[e] = 1;
        }
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    float w[MOE_MAX_TOPK];
    float den = 0.f;
    for (int r = 0; r < top_k; r++) {
        w[r] = scoring == 2 ? score[pick[r]] : choice[pick[r]];
        den += w[r];
    }
    den += 1e-20f;
    for (int r = 0; r < top_k; r++) {
        float v = w[r];
        if (norm && top_k > 1) v /= den;
        ids[t * top_k + r] = pick[r];
        weights[t * top_k + r] = v * scaling;
    }
}

// The block's expert and its pairs. Slot `slot` (blockIdx.y) serves the slot-th smallest expert
// id any pair routes to (-1 past the last: the block exits), so the grid needs only
// min(experts, pairs) slots and no block waits on an expert nobody picked. The pairs p < pairs
// routed to it go into list[0..*cnt): p itself when ids[p] == e, and, for slot 0 only, -1 - p
// when ids[p] is outside 0..experts (those pairs get zeros: no expert reads or writes out of
// bounds for them). Order is not deterministic, the outputs are (each pair's output depends on
// that pair alone). Every thread calls it; returns *cnt, the expert in *e_out.
__device__ int moe_pairs_of(const int* ids, int pairs, int slot, int experts, int* list, int* cnt,
                            int* e_out) {
    __shared__ unsigned bits[MOE_MAX_EXPERTS / 32];
    for (int i = threadIdx.x; i < MOE_MAX_EXPERTS / 32; i += blockDim.x) bits[i] = 0;
    if (threadIdx.x == 0) {
        *cnt = 0;
        *e_out = -1;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int id = ids[p];
        if (id >= 0 && id < experts) atomicOr(&bits[id >> 5], 1u << (id & 31));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int seen = 0;
        for (int w = 0; w < (experts + 31) / 32; w++) {
            const int c = __popc(bits[w]);
            if (seen + c > slot) {
                unsigned b = bits[w];
                for (int k = slot - seen; k > 0; k--) b &= b - 1;  // drop the lowest set bits
                *e_out = w * 32 + __ffs((int)b) - 1;
                break;
            }
            seen += c;
        }
    }
    __syncthreads();
    const int e = *e_out;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int id = ids[p];
        const bool bad = id < 0 || id >= experts;
        if ((e >= 0 && id == e) || (slot == 0 && bad)) list[atomicAdd(cnt, 1)] = bad ? -1 - p : p;
    }
    __syncthreads();
    return *cnt;
}

__device__ __forceinline__ float moe_silu_mul(float g, float u) { return g / (1.f + __expf(-g)) * u; }

#define MOE_GU_PB 4  // pairs per pass over a weight row (moe_gate_up_swiglu)
#define MOE_DN_PB 8  // (moe_down)

// act[p][n] = silu(W[e][n] . x[t]) * (W[e][inter + n] . x[t]) for the pairs p = t * top_k + j
// routed to the block's expert (moe_pairs_of); rows n of blockIdx.x's MOE_ROWS_PER_BLOCK, a warp
// per row.
// Blocks of experts no pair routes to exit at once, so each touched expert's rows are read from
// memory once per launch (again from cache for each further MOE_GU_PB pairs).
// w: bf16 [experts][2 inter][hidden]; x: bf16 [T][hidden]; act: bf16 [pairs][inter]; hidden % 8 == 0,
// w and x 16-byte aligned. grid: (ceil(inter / MOE_ROWS_PER_BLOCK), min(experts, pairs)), block:
// MOE_GEMV_THREADS.
extern "C" __global__ void __launch_bounds__(MOE_GEMV_THREADS)
    moe_gate_up_swiglu(const bf16_t* __restrict__ w, const bf16_t* __restrict__ x, const int* __restrict__ ids,
                       int pairs, int top_k, int experts, int inter, int hidden, bf16_t* __restrict__ act) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ int list[MOE_MAX_PAIRS];
    __shared__ int cnt, e_sh;
    const int n_pairs = moe_pairs_of(ids, pairs, blockIdx.y, experts, list, &cnt, &e_sh);
    if (n_pairs == 0) return;
    // only out-of-range pairs (e < 0): expert 0's rows are read (in bounds), zeros written
    const int e = e_sh < 0 ? 0 : e_sh;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = 0; r < MOE_ROWS_PER_WARP; r++) {
        const int n = blockIdx.x * MOE_ROWS_PER_BLOCK + warp * MOE_ROWS_PER_WARP + r;
        if (n >= inter) break;
        const bf16_t* wg = w + ((i64)e * 2 * inter + n) * hidden;
        const bf16_t* wu = wg + (i64)inter * hidden;
        for (int b0 = 0; b0 < n_pairs; b0 += MOE_GU_PB) {
            int pp[MOE_GU_PB];
            float ag[MOE_GU_PB], au[MOE_GU_PB];
#pragma unroll
            for (int j = 0; j < MOE_GU_PB; j++) {
                pp[j] = b0 + j < n_pairs ? list[b0 + j] : -1;
                ag[j] = 0.f;
                au[j] = 0.f;
            }
#pragma unroll 4
            for (int c = lane * 8; c < hidden; c += 256) {
                float fg[8], fu[8];
                unpack8(*(const uint4*)(wg + c), fg);
                unpack8(*(const uint4*)(wu + c), fu);
#pragma unroll
                for (int j = 0; j < MOE_GU_PB; j++) {
                    if (pp[j] < 0) continue;
                    float fx[8];
                    unpack8(*(const uint4*)(x + (i64)(pp[j] / top_k) * hidden + c), fx);
#pragma unroll
                    for (int k = 0; k < 8; k++) {
                        ag[j] += fg[k] * fx[k];
                        au[j] += fu[k] * fx[k];
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < MOE_GU_PB; j++) {
                const float g = warp_sum(ag[j]), u = warp_sum(au[j]);
                if (lane != 0 || b0 + j >= n_pairs) continue;
                const int p = list[b0 + j];
                if (p >= 0)
                    act[(i64)p * inter + n] = f2bf(moe_silu_mul(g, u));
                else
                    act[(i64)(-1 - p) * inter + n] = 0;
            }
        }
    }
}

// y[p][n] = W[e][n] . act[p] for the pairs routed to the block's expert e (zeros for a pair
// whose id is out of range); as moe_gate_up_swiglu otherwise. w: bf16 [experts][hidden][inter];
// act: bf16 [pairs][inter]; y: f32 [pairs][hidden]; inter % 8 == 0, w and act 16-byte aligned.
// grid: (ceil(hidden / MOE_ROWS_PER_BLOCK), min(experts, pairs)), block: MOE_GEMV_THREADS.
extern "C" __global__ void __launch_bounds__(MOE_GEMV_THREADS)
    moe_down(const bf16_t* __restrict__ w, const bf16_t* __restrict__ act, const int* __restrict__ ids, int pairs,
             int experts, int hidden, int inter, float* __restrict__ y) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ int list[MOE_MAX_PAIRS];
    __shared__ int cnt, e_sh;
    const int n_pairs = moe_pairs_of(ids, pairs, blockIdx.y, experts, list, &cnt, &e_sh);
    if (n_pairs == 0) return;
    const int e = e_sh < 0 ? 0 : e_sh;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = 0; r < MOE_ROWS_PER_WARP; r++) {
        const int n = blockIdx.x * MOE_ROWS_PER_BLOCK + warp * MOE_ROWS_PER_WARP + r;
        if (n >= hidden) break;
        const bf16_t* wr = w + ((i64)e * hidden + n) * inter;
        for (int b0 = 0; b0 < n_pairs; b0 += MOE_DN_PB) {
            int pp[MOE_DN_PB];
            float a[MOE_DN_PB];
#pragma unroll
            for (int j = 0; j < MOE_DN_PB; j++) {
                pp[j] = b0 + j < n_pairs ? list[b0 + j] : -1;
                a[j] = 0.f;
            }
#pragma unroll 4
            for (int c = lane * 8; c < inter; c += 256) {
                float fw[8];
                unpack8(*(const uint4*)(wr + c), fw);
#pragma unroll
                for (int j = 0; j < MOE_DN_PB; j++) {
                    if (pp[j] < 0) continue;
                    float fx[8];
                    unpack8(*(const uint4*)(act + (i64)pp[j] * inter + c), fx);
#pragma unroll
                    for (int k = 0; k < 8; k++) a[j] += fw[k] * fx[k];
                }
            }
#pragma unroll
            for (int j = 0; j < MOE_DN_PB; j++) {
                const float s = warp_sum(a[j]);
                if (lane != 0 || b0 + j >= n_pairs) continue;
                const int p = list[b0 + j];
                y[(i64)(p >= 0 ? p : -1 - p) * hidden + n] = p >= 0 ? s : 0.f;
            }
        }
    }
}

// resid[t][n] += sum over j < top_k (in order) of weights[t][j] * y[row][n], row = map[t * top_k + j]
// when map is given else t * top_k + j; a row outside 0..y_rows adds nothing.
// y: f32 [y_rows][hidden]; resid: f32 [T][hidden]. grid: (T), block: 256.
extern "C" __global__ void moe_combine(const float* __restrict__ y, int y_rows, const int* __restrict__ map,
                                       const float* __restrict__ weights, int top_k, int hidden,
                                       float* __restrict__ resid) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 t = blockIdx.x;
    for (int n = threadIdx.x; n < hidden; n += blockDim.x) {
        // Eight picks at a time: their rows, weights and y values all loaded before their sums
        // (a branch a pick made each load wait for the sum before it); a pick past top_k or a row
        // outside y reads nothing of y and adds nothing. The same sums in the same order as that
        // loop.
        float acc = 0.f;
        for (int j0 = 0; j0 < top_k; j0 += 8) {
            bool ok[8];
            float w[8], v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const i64 p = t * top_k + (j0 + u < top_k ? j0 + u : j0);
                const int row = map ? map[p] : (int)p;
                w[u] = weights[p];
                ok[u] = j0 + u < top_k && row >= 0 && row < y_rows;
                v[u] = ok[u] ? y[(i64)row * hidden + n] : 0.f;
            }
#pragma unroll
            for (int u = 0; u < 8; u++) acc = ok[u] ? acc + w[u] * v[u] : acc;
        }
        resid[t * hidden + n] += acc;
    }
}

// dst[i] = src[idx[i]] for rows of `cols` bf16 (zeros for an index outside 0..src_rows); 16-byte
// words when vec (cols % 8 == 0, both pointers 16-byte aligned). grid: (n), block: 128.
extern "C" __global__ void gather_rows_bf16(const bf16_t* __restrict__ src, int src_rows, const int* __restrict__ idx,
                                            int cols, int vec, bf16_t* __restrict__ dst) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const i64 i = blockIdx.x;
    const int r = idx[i];
    const bool ok = r >= 0 && r < src_rows;
    if (vec) {
        const uint4* s = (const uint4*)(src + (i64)r * cols);
        uint4* d = (uint4*)(dst + i * cols);
        for (int c = threadIdx.x; c < cols / 8; c += blockDim.x) d[c] = ok ? s[c] : make_uint4(0, 0, 0, 0);
    } else {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[i * cols + c] = ok ? src[(i64)r * cols + c] : 0;
    }
}
