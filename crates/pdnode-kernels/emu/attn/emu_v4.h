// Emulated warp-collective primitives of attention_v4.cu (spliced in by run.sh in place of the
// inline-PTX helpers): cp.async copies deferred to cp.async.wait_group (or immediate with
// EMU_SYNC=1), ldmatrix and mma.sync m16n8k16 from the PTX ISA's fragment layouts (lane l,
// g = l / 4, t = l % 4), exchanged through per-warp buffers.
struct Cp { void* d; const void* s; int b; };
static std::vector<std::vector<std::vector<Cp>>> g_groups(128);
static std::vector<std::vector<Cp>> g_open(128);
static const bool g_sync = getenv("EMU_SYNC") != nullptr;
static inline void emu_copy(const Cp& c) { if (c.b == 16) memcpy(c.d, c.s, 16); else memset(c.d, 0, 16); }
static inline void att4_cp16(void* dst, const void* src, int bytes) {
    if (g_sync) emu_copy({dst, src, bytes}); else g_open[g_cur].push_back({dst, src, bytes});
}
static inline void att4_commit() { g_groups[g_cur].push_back(g_open[g_cur]); g_open[g_cur].clear(); }
template <int N> static inline void att4_wait() {
    auto& q = g_groups[g_cur];
    while ((int)q.size() > N) { for (auto& c : q.front()) emu_copy(c); q.erase(q.begin()); }
}

static const void* g_wp[32][32];
static unsigned g_wu[32][32][6];

// ldmatrix.x4: lane l gives the row address l % 8 of matrix l / 8.
static void emu_ldsm(unsigned* r, const void* p, bool tr) {
    const int w = g_cur / 32, l = g_cur % 32;
    g_wp[w][l] = p;
    emu_warp_sync();
    for (int i = 0; i < 4; i++) {
        if (!tr) {  // row l / 4, columns 2 (l % 4), +1
            memcpy(&r[i], (const char*)g_wp[w][i * 8 + l / 4] + (l % 4) * 4, 4);
        } else {  // rows 2 (l % 4), +1 of column l / 4
            const uint16_t* a = (const uint16_t*)g_wp[w][i * 8 + (l % 4) * 2];
            const uint16_t* b = (const uint16_t*)g_wp[w][i * 8 + (l % 4) * 2 + 1];
            r[i] = (unsigned)a[l / 4] | ((unsigned)b[l / 4] << 16);
        }
    }
    emu_warp_sync();
}
static inline void att4_ldsm_x4(unsigned* r, const void* p) { emu_ldsm(r, p, false); }
static inline void att4_ldsm_x4_t(unsigned* r, const void* p) { emu_ldsm(r, p, true); }

static inline float emu_bf_half(unsigned v, int half) {
    return __uint_as_float(((v >> (16 * half)) & 0xffffu) << 16);
}

// d += A (16x16, row) B (16x8, col), fp32.
static void att4_mma(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    const int w = g_cur / 32, l = g_cur % 32;
    for (int i = 0; i < 4; i++) g_wu[w][l][i] = a[i];
    g_wu[w][l][4] = b0;
    g_wu[w][l][5] = b1;
    emu_warp_sync();
    const int g = l / 4, t = l % 4;
    float r[4];
    for (int x = 0; x < 4; x++) {
        const int row = g + (x >= 2) * 8, col = 2 * t + (x & 1);
        float acc = d[x];
        for (int k = 0; k < 16; k++) {
            const unsigned av = g_wu[w][(row % 8) * 4 + (k % 8) / 2][(row >= 8) + (k >= 8) * 2];
            const unsigned bv = g_wu[w][col * 4 + (k % 8) / 2][4 + (k >= 8)];
            acc += emu_bf_half(av, k % 2) * emu_bf_half(bv, k % 2);
        }
        r[x] = acc;
    }
    emu_warp_sync();
    for (int x = 0; x < 4; x++) d[x] = r[x];
}

