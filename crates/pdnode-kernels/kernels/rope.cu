// q/k/v post-processing after the fused QKV projection: bias, per-head q/k RMSNorm (Qwen3), RoPE
// (HF rotate_half convention), q written contiguous, k and v written into the paged KV pool.
//
// qkv: [T, (nh + 2*nkv) * hd] bf16: q heads, then k heads, then v heads.
// bias: [(nh + 2*nkv) * hd] f32 or null; q_norm, k_norm: [hd] f32 or null.
// inv_freq: [hd/2] f32 (rope scaling already applied); pos: [T]; slots: [T] = block * bs + slot.
// layer_kv: this layer's part of the pool, [num_blocks][2][bs][nkv][hd] bf16.
// grid: (T, nh + nkv), block: hd/2 rounded up to a multiple of 32.
extern "C" __global__ void rope_qkv(const bf16_t* __restrict__ qkv, const float* __restrict__ bias,
                                    const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                    const float* __restrict__ inv_freq, const int* __restrict__ pos,
                                    const i64* __restrict__ slots, bf16_t* __restrict__ q_out,
                                    bf16_t* __restrict__ layer_kv, int nh, int nkv, int hd,
                                    int block_size, float eps) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ float sh[33];
    const i64 t = blockIdx.x;
    const int j = blockIdx.y;
    const int half = hd / 2;
    const int i = threadIdx.x;
    const bool act = i < half;
    const i64 ld = (i64)(nh + 2 * nkv) * hd;
    const bool is_q = j < nh;
    const int col = j * hd;  // q head j, or k head j - nh (k heads start at nh * hd)
    const bf16_t* x = qkv + t * ld + col;
    float x1 = 0.f, x2 = 0.f;
    if (act) {
        x1 = bf2f(x[i]);
        x2 = bf2f(x[i + half]);
        if (bias) {
            x1 += bias[col + i];
            x2 += bias[col + i + half];
        }
    }
    const float* nw = is_q ? q_norm : k_norm;
    if (nw) {  // uniform over the block
        const float r = rsqrtf(block_sum(x1 * x1 + x2 * x2, sh) / (float)hd + eps);
        if (act) {
            x1 = x1 * r * nw[i];
            x2 = x2 * r * nw[i + half];
        }
    }
    if (!act) return;
    float s, c;
    sincosf((float)pos[t] * inv_freq[i], &s, &c);
    const float o1 = x1 * c - x2 * s;
    const float o2 = x2 * c + x1 * s;
    if (is_q) {
        bf16_t* qo = q_out + (t * nh + j) * hd;
        qo[i] = f2bf(o1);
        qo[i + half] = f2bf(o2);
        return;
    }
    const int kh = j - nh;
    const i64 slot = slots[t];
    const i64 blk = slot / block_size, sl = slot % block_size;
    const i64 row = (i64)nkv * hd;
    bf16_t* kd = layer_kv + (blk * 2 * block_size + sl) * row + (i64)kh * hd;
    bf16_t* vd = kd + (i64)block_size * row;
    kd[i] = f2bf(o1);
    kd[i + half] = f2bf(o2);
    const int vcol = (nh + nkv + kh) * hd;
    float v1 = bf2f(qkv[t * ld + vcol + i]);
    float v2 = bf2f(qkv[t * ld + vcol + i + half]);
    if (bias) {
        v1 += bias[vcol + i];
        v2 += bias[vcol + i + half];
    }
    vd[i] = f2bf(v1);
    vd[i + half] = f2bf(v2);
}

// rope_qkv for long steps without bias or q/k norm (Llama): one block per token, each thread 4 + 4
// elements of one q or k head (8-byte loads and stores at i0 and half + i0; a k head's thread
// also copies the same elements of its v head), the token's cos / sin computed once into shared
// memory by the first hd / 2 threads (the scalar kernel recomputes them for every head). Same
// expressions as rope_qkv, so the same results.
// grid: (T), block: (nh + nkv) * hd / 8 threads (<= 1024; hd % 8 == 0), dynamic shared: hd floats.
extern "C" __global__ void rope_qkv_v4(const bf16_t* __restrict__ qkv,
                                       const float* __restrict__ inv_freq,
                                       const int* __restrict__ pos, const i64* __restrict__ slots,
                                       bf16_t* __restrict__ q_out, bf16_t* __restrict__ layer_kv,
                                       int nh, int nkv, int hd, int block_size) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    extern __shared__ float rope_cs[];  // cos [hd / 2], then sin [hd / 2]
    const i64 t = blockIdx.x;
    const int half = hd >> 1, per_head = half >> 2;
    const float p = (float)pos[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        rope_cs[i] = c;
        rope_cs[half + i] = s;
    }
    __syncthreads();
    const int j = threadIdx.x / per_head, i0 = (threadIdx.x % per_head) * 4;
    if (j >= nh + nkv) return;
    const i64 ld = (i64)(nh + 2 * nkv) * hd;
    const bf16_t* x = qkv + t * ld + (i64)j * hd;
    const uint2 a = *(const uint2*)(x + i0), b = *(const uint2*)(x + half + i0);
    const unsigned av[2] = {a.x, a.y}, bv[2] = {b.x, b.y};
    unsigned lo[2], hi[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const float x1a = __uint_as_float(av[k] << 16), x1b = __uint_as_float(av[k] & 0xffff0000u);
        const float x2a = __uint_as_float(bv[k] << 16), x2b = __uint_as_float(bv[k] & 0xffff0000u);
        const float ca = rope_cs[i0 + 2 * k], sa = rope_cs[half + i0 + 2 * k];
        const float cb = rope_cs[i0 + 2 * k + 1], sb = rope_cs[half + i0 + 2 * k + 1];
        const float o1a = x1a * ca - x2a * sa, o2a = x2a * ca + x1a * sa;
        const float o1b = x1b * cb - x2b * sb, o2b = x2b * cb + x1b * sb;
        lo[k] = (unsigned)f2bf(o1a) | ((unsigned)f2bf(o1b) << 16);
        hi[k] = (unsigned)f2bf(o2a) | ((unsigned)f2bf(o2b) << 16);
    }
    bf16_t* dst;
    if (j < nh) {
        dst = q_out + (t * nh + j) * hd;
    } else {
        const int kh = j - nh;
        const i64 slot = slots[t];
        const i64 blk = slot / block_size, sl = slot % block_size;
        const i64 row = (i64)nkv * hd;
        dst = layer_kv + (blk * 2 * block_size + sl) * row + (i64)kh * hd;
        bf16_t* vd = dst + (i64)block_size * row;
        const bf16_t* v = qkv + t * ld + (i64)(nh + nkv + kh) * hd;
        *(uint2*)(vd + i0) = *(const uint2*)(v + i0);
        *(uint2*)(vd + half + i0) = *(const uint2*)(v + half + i0);
    }
    *(uint2*)(dst + i0) = make_uint2(lo[0], lo[1]);
    *(uint2*)(dst + half + i0) = make_uint2(hi[0], hi[1]);
}
