// What sample.cu needs beyond the attention emulator's prelude: typed warp shuffles, ballots,
// shared-memory atomics (fibers run one at a time: a plain add is atomic) and IEEE intrinsics.
static uint64_t g_sbuf[32][32];
static unsigned g_bbuf[32][32];
template <class T>
static T emu_exchange(T v, int src) {
    const int t = g_cur, w = t / 32, l = t % 32;
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    g_sbuf[w][l] = b;
    emu_warp_sync();
    const uint64_t x = g_sbuf[w][(src < 0 || src > 31) ? l : src];
    T r;
    memcpy(&r, &x, sizeof(T));
    emu_warp_sync();
    return r;
}
static double __shfl_xor_sync(unsigned, double v, int o) { return emu_exchange(v, (g_cur % 32) ^ o); }
static unsigned __shfl_up_sync(unsigned, unsigned v, int d) { return emu_exchange(v, g_cur % 32 - d); }
static double __shfl_up_sync(unsigned, double v, int d) { return emu_exchange(v, g_cur % 32 - d); }
static float __shfl_down_sync(unsigned, float v, int d) {
    const int s = g_cur % 32 + d;
    return emu_exchange(v, s > 31 ? -1 : s);
}
static int __shfl_down_sync(unsigned, int v, int d) {
    const int s = g_cur % 32 + d;
    return emu_exchange(v, s > 31 ? -1 : s);
}
static double __shfl_sync(unsigned, double v, int src) { return emu_exchange(v, src); }
static unsigned __ballot_sync(unsigned, bool p) {
    const int t = g_cur, w = t / 32, l = t % 32;
    g_bbuf[w][l] = p;
    emu_warp_sync();
    unsigned r = 0;
    for (int i = 0; i < 32; i++) r |= (g_bbuf[w][i] ? 1u : 0u) << i;
    emu_warp_sync();
    return r;
}
static int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
static unsigned atomicAdd(unsigned* p, unsigned v) {
    const unsigned o = *p;
    *p = o + v;
    return o;
}
static double atomicAdd(double* p, double v) {
    const double o = *p;
    *p = o + v;
    return o;
}
static float __fmul_rn(float a, float b) { return a * b; }
static float __fsub_rn(float a, float b) { return a - b; }
static float __fdiv_rn(float a, float b) { return a / b; }
