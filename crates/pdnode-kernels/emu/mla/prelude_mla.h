// Additions to emu/attn/prelude.h for the MLA / MoE kernels. Fibers switch only at barriers and
// shuffles, so a read-modify-write is atomic here.
static inline unsigned atomicOr(unsigned* p, unsigned v) {
    const unsigned o = *p;
    *p = o | v;
    return o;
}
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int atomicAdd(int* p, int v) {
    const int o = *p;
    *p = o + v;
    return o;
}
