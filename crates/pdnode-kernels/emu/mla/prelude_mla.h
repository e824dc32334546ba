// Additions to emu/attn/prelude.h for the MLA / MoE kernels. Fibers switch only at barriers and
// shuffles, so a read-modify-write is atomic here.
static inline unsigned atomicOr(unsigned* p, unsigned v) {
    const unsigned o = *p;
    *p = o | v;
    return o;
}
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static int g_wballot[32][32];
static unsigned __ballot_sync(unsigned, bool p) {
    int t = g_cur, w = t / 32, l = t % 32;
    g_wballot[w][l] = p;
    emu_warp_sync();
    unsigned r = 0;
    for (int i = 0; i < 32; i++)
        if (g_wballot[w][i]) r |= 1u << i;
    emu_warp_sync();
    return r;
}
static inline int atomicAdd(int* p, int v) {
    const int o = *p;
    *p = o + v;
    return o;
}
