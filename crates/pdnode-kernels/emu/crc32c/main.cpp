// Emulator of kernels/crc32c.cu (see run.sh). The launch arithmetic (chunking from the end, the
// zero-append operators, the final inversion) mirrors pdnode-cuda's ops/crc32c.rs.
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static std::barrier<>* g_block;
static std::barrier<>* g_warp[8];
static unsigned g_xchg[256];

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __restrict__
#define __shared__ static
#define PD_GRID_WAIT()
#define PD_GRID_LAUNCH_DEPENDENTS()
static inline void __syncthreads() { g_block->arrive_and_wait(); }
static inline unsigned __shfl_xor_sync(unsigned, unsigned v, int o) {
    const unsigned t = threadIdx.x;
    g_xchg[t] = v;
    g_warp[t / 32]->arrive_and_wait();
    const unsigned r = g_xchg[t ^ o];
    g_warp[t / 32]->arrive_and_wait();
    return r;
}
static inline unsigned atomicXor(unsigned* p, unsigned v) {
    return std::atomic_ref<unsigned>(*p).fetch_xor(v);
}
#include "kernels.inc"

static const uint32_t POLY = 0x82F63B78u;
typedef std::vector<uint32_t> Mat;  // 32 columns
static uint32_t times(const Mat& m, uint32_t v) {
    uint32_t s = 0;
    for (int i = 0; i < 32; i++)
        if (v >> i & 1) s ^= m[i];
    return s;
}
static Mat square(const Mat& m) {
    Mat r(32);
    for (int i = 0; i < 32; i++) r[i] = times(m, m[i]);
    return r;
}
static Mat zeros(uint64_t bytes) {
    Mat op(32), res(32);
    op[0] = POLY;
    for (int n = 1; n < 32; n++) op[n] = 1u << (n - 1);
    for (int i = 0; i < 3; i++) op = square(op);
    for (int n = 0; n < 32; n++) res[n] = 1u << n;
    while (bytes) {
        if (bytes & 1) {
            Mat nx(32);
            for (int i = 0; i < 32; i++) nx[i] = times(op, res[i]);
            res = nx;
        }
        bytes >>= 1;
        if (bytes) op = square(op);
    }
    return res;
}
static uint32_t bitwise(const uint8_t* d, size_t n) {
    uint32_t c = ~0u;
    for (size_t i = 0; i < n; i++) {
        c ^= d[i];
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
    }
    return ~c;
}

static uint32_t device_crc(const uint8_t* data, uint64_t len, uint64_t chunk) {
    if (len == 0) return 0;
    const uint64_t n = (len + chunk - 1) / chunk;
    int bits = 0;
    while (bits < 64 && (n - 1) >> bits) bits++;
    std::vector<unsigned> ops;
    if (bits) {
        Mat op = zeros(chunk);
        for (int k = 0; k < bits; k++) {
            ops.insert(ops.end(), op.begin(), op.end());
            op = square(op);
        }
    }
    unsigned out = 0;
    blockDim = {256, 1, 1};
    gridDim = {(unsigned)((n + 255) / 256), 1, 1};
    for (unsigned b = 0; b < gridDim.x; b++) {
        std::barrier<> block(256);
        std::vector<std::barrier<>*> warps;
        for (int w = 0; w < 8; w++) g_warp[w] = new std::barrier<>(32);
        g_block = &block;
        std::vector<std::thread> th;
        for (unsigned t = 0; t < 256; t++)
            th.emplace_back([&, t] {
                threadIdx = {t, 0, 0};
                blockIdx = {b, 0, 0};
                crc32c_chunks(data, len, chunk, n, ops.data(), bits, &out);
            });
        for (auto& x : th) x.join();
        for (int w = 0; w < 8; w++) delete g_warp[w];
    }
    return out ^ times(zeros(len), 0xFFFFFFFFu) ^ 0xFFFFFFFFu;
}

int main() {
    std::mt19937 rng(5);
    std::vector<uint8_t> buf(300000 + 64);
    for (auto& x : buf) x = rng() & 0xff;
    int fails = 0, cases = 0;
    const uint64_t lens[] = {1, 3, 7, 8, 9, 255, 256, 257, 1000, 4096, 65537, 300000};
    for (uint64_t len : lens)
        for (int off : {0, 1, 5, 8})
            for (uint64_t chunk : {8ull, 256ull, 4096ull}) {
                if (len / chunk > 2000) continue;  // keep the thread count sane
                const uint8_t* p = buf.data() + off;
                const uint32_t want = bitwise(p, len), got = device_crc(p, len, chunk);
                cases++;
                if (got != want) {
                    fails++;
                    printf("FAIL len=%llu off=%d chunk=%llu: %08x want %08x\n", (unsigned long long)len, off,
                           (unsigned long long)chunk, got, want);
                }
            }
    if (bitwise((const uint8_t*)"123456789", 9) != 0xE3069283u) fails++, printf("FAIL check value\n");
    printf(fails ? "EMU FAILED %d of %d\n" : "EMU ALL PASS (%d cases)\n", fails ? fails : cases, cases);
    return fails != 0;
}
