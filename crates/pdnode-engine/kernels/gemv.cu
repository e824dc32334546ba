// Skinny GEMM for decode (T <= 8 token rows), bandwidth-bound on the weights:
// y[t, o] (+)= sum_i w[o, i] * x[t, i]. One warp per output row o (grid-stride), 16-byte loads
// of w and x, f32 accumulation. w: bf16 [out, in]; x: bf16 [T, in], in % 8 == 0.
// y: f32 (accumulate != 0: y += result) or bf16 (y_f32 == 0). block: 256.

template <int MT>
__device__ void gemv_impl(const bf16_t* __restrict__ w, const bf16_t* __restrict__ x,
                          void* __restrict__ y, int T, int out, int in, int y_f32,
                          int accumulate) {
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int nwarps = (gridDim.x * blockDim.x) >> 5;
    const int nv = in >> 3;
    for (int o = warp; o < out; o += nwarps) {
        float acc[MT];
#pragma unroll
        for (int t = 0; t < MT; t++) acc[t] = 0.f;
        const uint4* wr = (const uint4*)(w + (i64)o * in);
#pragma unroll 4
        for (int v = lane; v < nv; v += 32) {
            float wf[8];
            unpack8(wr[v], wf);
#pragma unroll
            for (int t = 0; t < MT; t++) {
                if (t < T) {
                    float xf[8];
                    unpack8(((const uint4*)(x + (i64)t * in))[v], xf);
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[t] += wf[j] * xf[j];
                }
            }
        }
#pragma unroll
        for (int t = 0; t < MT; t++) {
            if (t < T) {
                const float s = warp_sum(acc[t]);
                if (lane == 0) {
                    const i64 k = (i64)t * out + o;
                    if (y_f32) {
                        float* yf = (float*)y;
                        yf[k] = accumulate ? yf[k] + s : s;
                    } else {
                        ((bf16_t*)y)[k] = f2bf(s);
                    }
                }
            }
        }
    }
}

#define GEMV_KERNEL(NAME, MT)                                                                    \
    extern "C" __global__ void __launch_bounds__(256) NAME(const bf16_t* w, const bf16_t* x,      \
                                                           void* y, int T, int out, int in,       \
                                                           int y_f32, int accumulate) {           \
        gemv_impl<MT>(w, x, y, T, out, in, y_f32, accumulate);                                   \
    }

GEMV_KERNEL(gemv_t1, 1)
GEMV_KERNEL(gemv_t2, 2)
GEMV_KERNEL(gemv_t4, 4)
GEMV_KERNEL(gemv_t8, 8)
