// Additions to emu/attn/prelude.h for the MLA / MoE kernels. Fibers switch only at barriers and
// shuffles, so a read-modify-write is atomic here.
static inline int atomicAdd(int* p, int v) {
    const int o = *p;
    *p = o + v;
    return o;
}
