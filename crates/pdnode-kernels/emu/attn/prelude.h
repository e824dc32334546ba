// Tiny SIMT emulator: one CTA at a time, each thread a ucontext fiber on one OS thread;
// __syncthreads and warp shuffles are barriers implemented by the scheduler.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <ucontext.h>
#undef INFINITY
using std::min;
using std::max;

struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
static inline float2 make_float2(float a, float b) { return {a, b}; }
struct dim3e { unsigned x, y, z; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
#define __expf expf
static inline int __ffs(int x) { return __builtin_ffs(x); }

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

// SPIN: a thread polling a condition (an mbarrier, a named barrier) yields and runs again once
// nothing else can run.
enum { RUN, CTA_WAIT, WARP_WAIT, DONE, SPIN };
struct Fiber { ucontext_t ctx; int state; dim3e tid; std::vector<char> stack; };
static std::vector<Fiber> g_f;
static int g_cur = -1;
static ucontext_t g_sched;
static dim3e blockIdx, gridDim, blockDim;
static float g_wbuf[32][32];
static int g_wbuf_i[32][32];
#define threadIdx (g_f[g_cur].tid)

static void emu_yield(int st) { g_f[g_cur].state = st; swapcontext(&g_f[g_cur].ctx, &g_sched); }
static void __syncthreads() { emu_yield(CTA_WAIT); }
static void emu_warp_sync() { emu_yield(WARP_WAIT); }
static void __syncwarp() { emu_warp_sync(); }
static int g_wany[32][32];
static bool __any_sync(unsigned, bool p) {
    int t = g_cur, w = t / 32, l = t % 32;
    g_wany[w][l] = p;
    emu_warp_sync();
    bool r = false;
    for (int i = 0; i < 32; i++) r = r || g_wany[w][i];
    emu_warp_sync();
    return r;
}
// A lane's value from lane l ^ o, through the warp's buffer (float, or int by its bits).
static float __shfl_xor_sync(unsigned, float v, int o) {
    int t = g_cur, w = t / 32, l = t % 32;
    g_wbuf[w][l] = v;
    emu_warp_sync();
    float r = g_wbuf[w][l ^ o];
    emu_warp_sync();
    return r;
}
static int __shfl_xor_sync(unsigned m, int v, int o) {
    return (int)__float_as_uint(__shfl_xor_sync(m, __int_as_float(v), o));
}

static void (*g_body)();
static void fiber_main() { g_body(); g_f[g_cur].state = DONE; }

// Runs body for every thread of one block, honouring the barriers.
static void run_block(int nt, void (*body)()) {
    g_body = body;
    g_f.assign(nt, Fiber{});
    for (int i = 0; i < nt; i++) {
        Fiber& f = g_f[i];
        f.stack.resize(1 << 16);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = &g_sched;
        makecontext(&f.ctx, fiber_main, 0);
        f.state = RUN;
        f.tid = {(unsigned)i, 0, 0};
    }
    for (;;) {
        bool ran = false;
        for (int i = 0; i < nt; i++) {
            if (g_f[i].state == RUN) {
                g_cur = i;
                swapcontext(&g_sched, &g_f[i].ctx);
                ran = true;
            }
        }
        if (ran) continue;
        // nobody runnable: release complete barriers
        int done = 0, cta = 0;
        for (auto& f : g_f) { done += f.state == DONE; cta += f.state == CTA_WAIT; }
        if (done == nt) return;
        bool released = false;
        for (int w = 0; w < nt / 32; w++) {
            int n = 0;
            for (int l = 0; l < 32; l++) n += g_f[w * 32 + l].state == WARP_WAIT;
            if (n == 32) {
                for (int l = 0; l < 32; l++) g_f[w * 32 + l].state = RUN;
                released = true;
            } else if (n > 0) {
                int others_done = 0;
                for (int l = 0; l < 32; l++) others_done += g_f[w * 32 + l].state == DONE;
                if (others_done) { fprintf(stderr, "EMU: shuffle with exited lanes\n"); exit(3); }
            }
        }
        if (released) continue;
        if (cta + done == nt && cta > 0) {
            if (done > 0) { fprintf(stderr, "EMU: barrier with exited threads\n"); exit(3); }
            for (auto& f : g_f) f.state = RUN;
            continue;
        }
        bool spinning = false;
        for (auto& f : g_f)
            if (f.state == SPIN) { f.state = RUN; spinning = true; }
        if (spinning) continue;
        fprintf(stderr, "EMU: deadlock (cta wait %d, done %d)\n", cta, done);
        exit(3);
    }
}
