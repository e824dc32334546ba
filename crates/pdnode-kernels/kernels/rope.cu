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
