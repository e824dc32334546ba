// Host emulation harness of kernels/prefill_flash.cu: see run.sh.
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>
using std::min;
struct D3 { unsigned x = 0, y = 0, z = 0; };
thread_local D3 threadIdx, blockIdx;
D3 gridDim, blockDim;
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __align__(x) __attribute__((aligned(x)))
#define __shared__ static
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
struct uint4 { unsigned x, y, z, w; };
struct WarpX {
    std::barrier<> bar{32};
    const void* ptr[32];
    unsigned a[32][4], b[32][2];
    float f[32];
};
std::barrier<>* g_cta;
WarpX* g_warps;
static inline WarpX& warp_of() { return g_warps[threadIdx.x >> 5]; }
static inline void __syncthreads() { g_cta->arrive_and_wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int m) {
    WarpX& W = warp_of();
    int l = threadIdx.x & 31;
    W.f[l] = v;
    W.bar.arrive_and_wait();
    float r = W.f[l ^ m];
    W.bar.arrive_and_wait();
    return r;
}
static inline int __any_sync(unsigned, int v) {
    WarpX& W = warp_of();
    int l = threadIdx.x & 31;
    W.f[l] = v ? 1.f : 0.f;
    W.bar.arrive_and_wait();
    int r = 0;
    for (int i = 0; i < 32; i++) r |= W.f[i] != 0.f;
    W.bar.arrive_and_wait();
    return r;
}
#include "kern.inc"

typedef void (*Kern)(const bf16_t*, bf16_t*, const bf16_t*, const int*, int, int, int, int, int, int, float);
static void launch(Kern k, unsigned gx, unsigned gy, unsigned threads, const bf16_t* q, bf16_t* out,
                   const bf16_t* kv, const int* tab, int row0, int n, int start, int nh, int nkv,
                   int bs, float sl2) {
    gridDim = {gx, gy, 1};
    blockDim = {threads, 1, 1};
    for (unsigned by = 0; by < gy; by++)
        for (unsigned bx = 0; bx < gx; bx++) {
            std::barrier<> cta(threads);
            std::vector<WarpX> warps(threads / 32);
            g_cta = &cta;
            g_warps = warps.data();
            std::vector<std::thread> th;
            for (unsigned t = 0; t < threads; t++)
                th.emplace_back([=] {
                    threadIdx = {t, 0, 0};
                    blockIdx = {bx, by, 0};
                    k(q, out, kv, tab, row0, n, start, nh, nkv, bs, sl2);
                });
            for (auto& x : th) x.join();
        }
}

int main() {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> U(-1.f, 1.f);
    struct K { const char* name; Kern k; int hd, threads, bm; bool heads_x = false; };
    K ks[] = {
        {"hd64_w8", flash_prefill_hd64_w8, 64, 256, 128},  {"hd128_w8", flash_prefill_hd128_w8, 128, 256, 128},
        {"hd64_v3", flash_prefill_hd64_v3, 64, 256, 128, true}, {"hd128_v3", flash_prefill_hd128_v3, 128, 256, 128, true},
    };
    // (nh, nkv, bs, start, n)
    int cases[][5] = {{2, 1, 16, 37, 129}, {1, 1, 32, 0, 1}, {4, 1, 32, 0, 70}, {2, 2, 16, 100, 17},
                      {1, 1, 64, 0, 300}, {2, 1, 16, 200, 150}};
    int fails = 0;
    for (auto& kk : ks) {
        for (auto& c : cases) {
            int nh = c[0], nkv = c[1], bs = c[2], start = c[3], n = c[4], hd = kk.hd;
            int e = start + n, nblk = (e + bs - 1) / bs, nb = nblk + 3, row0 = 3, T = row0 + n + 2;
            std::vector<bf16_t> pool((size_t)nb * 2 * bs * nkv * hd), q((size_t)T * nh * hd), out(q.size(), 0xffff);
            for (auto& x : pool) x = f2bf(U(rng));
            for (auto& x : q) x = f2bf(2 * U(rng));
            std::vector<int> tab(nblk);
            for (int i = 0; i < nblk; i++) tab[i] = (i * 7 + 2) % nb;  // distinct since nb coprime-ish
            std::vector<int> used(nb, 0);
            for (int i = 0; i < nblk; i++) { while (used[tab[i]]) tab[i] = (tab[i] + 1) % nb; used[tab[i]] = 1; }
            float sl2 = 1.4426950408889634f / std::sqrt((float)hd);
            const unsigned tiles = (n + kk.bm - 1) / kk.bm;
            launch(kk.k, kk.heads_x ? nh : tiles, kk.heads_x ? tiles : nh, kk.threads, q.data(), out.data(), pool.data(), tab.data(),
                   row0, n, start, nh, nkv, bs, sl2);
            double num = 0, den = 0;
            int untouched_bad = 0;
            for (int r = 0; r < T; r++)
                for (int h = 0; h < nh; h++) {
                    bool in = r >= row0 && r < row0 + n;
                    if (!in) {
                        for (int d = 0; d < hd; d++) untouched_bad += out[((size_t)r * nh + h) * hd + d] != 0xffff;
                        continue;
                    }
                    int pos = start + r - row0, kh = h / (nh / nkv);
                    std::vector<double> s(pos + 1);
                    double m = -1e300;
                    for (int j = 0; j <= pos; j++) {
                        const bf16_t* kp = &pool[(((size_t)tab[j / bs] * 2 + 0) * bs + j % bs) * nkv * hd + kh * hd];
                        double acc = 0;
                        for (int d = 0; d < hd; d++) acc += (double)bf2f(q[((size_t)r * nh + h) * hd + d]) * bf2f(kp[d]);
                        s[j] = acc / std::sqrt((double)hd);
                        m = std::max(m, s[j]);
                    }
                    double l = 0;
                    for (auto& x : s) { x = std::exp(x - m); l += x; }
                    for (int d = 0; d < hd; d++) {
                        double o = 0;
                        for (int j = 0; j <= pos; j++) {
                            const bf16_t* vp = &pool[(((size_t)tab[j / bs] * 2 + 1) * bs + j % bs) * nkv * hd + kh * hd];
                            o += s[j] / l * bf2f(vp[d]);
                        }
                        double got = bf2f(out[((size_t)r * nh + h) * hd + d]);
                        if (std::isnan(got)) got = 1e30;
                        num += (got - o) * (got - o);
                        den += o * o;
                    }
                }
            double rel = std::sqrt(num / den);
            bool ok = rel < 1e-2 && untouched_bad == 0;
            fails += !ok;
            printf("%s %-10s nh=%d nkv=%d bs=%d start=%d n=%d: rel err %.2e untouched_bad=%d\n", ok ? "PASS" : "FAIL",
                   kk.name, nh, nkv, bs, start, n, rel, untouched_bad);
        }
    }
    return fails != 0;
}
