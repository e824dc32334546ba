// Emulation of what prefill_flash_wg.cu reaches through inline PTX (spliced in by run.sh): the
// fp_* helpers of prefill_flash.cu it uses, then one section per PTX region of the kernel file.
// Shared memory is one arena; a "shared address" is an offset into it (so wgmma descriptors,
// whose address field holds 18 bits, decode back to it). cp.async copies are deferred: the
// plain kernel's to cp.async.wait_group, the warp-specialized kernel's until a thread waits on
// the mbarrier their group arrives on (or EMU_SYNC=1: every copy at once).
#include <cstdint>
#include <vector>

#include <map>
#define __grid_constant__
struct uint2 { unsigned x, y; };
static inline float rsqrtf(float v) { return 1.f / sqrtf(v); }  // the device's is approximate
static unsigned char g_arena[256 * 1024] __attribute__((aligned(1024)));
#define EMU_BAR_OFF (224 * 1024)
static const bool g_sync = getenv("EMU_SYNC") != nullptr;
static long g_progress = 0;  // barrier events: a spinning thread that sees none for long is stuck

static unsigned emu_addr(const void* p) {
    const unsigned char* c = (const unsigned char*)p;
    if (c < g_arena || c >= g_arena + sizeof(g_arena)) {
        fprintf(stderr, "EMU: shared address of a pointer outside shared memory\n");
        exit(3);
    }
    return (unsigned)(c - g_arena);
}
static unsigned char* emu_ptr(unsigned a) {
    if (a >= sizeof(g_arena)) {
        fprintf(stderr, "EMU: shared address %u out of range\n", a);
        exit(3);
    }
    return g_arena + a;
}
// A spinning thread yields; one that saw no barrier event for a long time reports a deadlock.
static void emu_spin(long& seen, long& idle) {
    if (g_progress != seen) { seen = g_progress; idle = 0; }
    if (++idle > 100000) { fprintf(stderr, "EMU: deadlock (a thread spins on a barrier)\n"); exit(3); }
    emu_yield(SPIN);
}

struct EmuCp { unsigned char* d; const void* s; int b; };
static inline void emu_copy(const EmuCp& c) {
    if (c.b == 16) memcpy(c.d, c.s, 16); else memset(c.d, 0, 16);
}
static std::vector<std::vector<EmuCp>> g_open(1024);                   // issued, uncommitted
static std::vector<std::vector<std::vector<EmuCp>>> g_groups(1024);    // committed groups

// ---- prefill_flash.cu's helpers
static inline unsigned fp_smem_addr(const void* p) { return emu_addr(p); }
static inline void fp_cp_async16(void* smem, const void* gmem, int src_bytes) {
    EmuCp c{(unsigned char*)smem, gmem, src_bytes};
    if (g_sync) emu_copy(c); else g_open[g_cur].push_back(c);
}
static inline void fp_cp_commit() { g_groups[g_cur].push_back(g_open[g_cur]); g_open[g_cur].clear(); }
template <int N> static inline void fp_cp_wait() {
    auto& q = g_groups[g_cur];
    while ((int)q.size() > N) { for (auto& c : q.front()) emu_copy(c); q.erase(q.begin()); }
}
static inline unsigned fp_pack(float lo, float hi) {
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
}
static inline float fp_ex2(float x) { return exp2f(x); }
static inline int fp_log2i(int x) { return __ffs(x) - 1; }
static int g_wshfl[32][32];
static int __shfl_sync(unsigned, int v, int src) {
    int t = g_cur, w = t / 32, l = t % 32;
    g_wshfl[w][l] = v;
    emu_warp_sync();
    int r = g_wshfl[w][src & 31];
    emu_warp_sync();
    return r;
}

//@@ REGION wgmma
// wgmma with the 128-byte swizzle: an operand's logical byte address, then bits 4-6 XOR bits
// 7-9 (the arena, like the kernel's shared memory, is 1024-byte aligned).
struct EmuDesc { unsigned start, lbo, sbo; };
static EmuDesc emu_desc(unsigned long long d) {
    if ((d >> 62) != 1) { fprintf(stderr, "EMU: wgmma descriptor without 128-byte swizzle\n"); exit(3); }
    return {(unsigned)((d & 0x3FFFull) << 4), (unsigned)(((d >> 16) & 0x3FFFull) << 4),
            (unsigned)(((d >> 32) & 0x3FFFull) << 4)};
}
static float emu_bf16_at(unsigned a) {
    a ^= ((a >> 7) & 7) << 4;
    uint16_t v;
    memcpy(&v, emu_ptr(a), 2);
    return bf2f(v);
}
// K-major operand: row m (of 64 or 128), element k (of 16)
static float emu_kmaj(const EmuDesc& d, int m, int k) {
    return emu_bf16_at(d.start + (m >> 3) * d.sbo + (m & 7) * 128 + 2 * k);
}
// MN-major operand (imm-trans 1): element k (of 16) of column n (of 128); lbo between the
// 64-column halves, sbo between 8-k groups
static float emu_mnmaj(const EmuDesc& d, int k, int n) {
    return emu_bf16_at(d.start + (n >> 6) * d.lbo + (k >> 3) * d.sbo + (k & 7) * 128 + 2 * (n & 63));
}
static inline void wg_fence() {}
static inline void wg_commit() {}
template <int N> static inline void wg_wait() {}
static inline void wg_fence_proxy() {}
static inline void wg_keep(float*) {}
// this thread's (warp of its warpgroup, g, t)
static inline void emu_wg_lane(int& w, int& g, int& t) {
    const int x = (int)threadIdx.x % 128;
    w = x / 32;
    g = (x % 32) / 4;
    t = x % 4;
}
static void emu_mma_ss(float* d, unsigned long long da, unsigned long long db, bool acc) {
    const EmuDesc a = emu_desc(da), b = emu_desc(db);
    int w, g, t;
    emu_wg_lane(w, g, t);
    for (int i = 0; i < 16; i++)
        for (int e = 0; e < 4; e++) {
            const int row = 16 * w + g + 8 * (e >> 1), col = 8 * i + 2 * t + (e & 1);
            float s = 0.f;
            for (int k = 0; k < 16; k++) s += emu_kmaj(a, row, k) * emu_kmaj(b, col, k);
            d[4 * i + e] = (acc ? d[4 * i + e] : 0.f) + s;
        }
}
static inline void wg_mma_ss(float* d, unsigned long long da, unsigned long long db, int scale_d) {
    emu_mma_ss(d, da, db, scale_d != 0);
}
static inline void wg_mma_ss_zero(float* d, unsigned long long da, unsigned long long db) {
    emu_mma_ss(d, da, db, false);
}
// A from the warp's registers (the mma.m16n8k16 A fragment of its 16 rows), exchanged through
// a per-warp buffer
static unsigned g_wa[32][32][4];
static void emu_mma_rs(float* d, const unsigned* a, unsigned long long db, bool trans) {
    const EmuDesc b = emu_desc(db);
    int w, g, t;
    emu_wg_lane(w, g, t);
    const int cw = (int)threadIdx.x / 32, l = (int)threadIdx.x % 32;
    for (int i = 0; i < 4; i++) g_wa[cw][l][i] = a[i];
    emu_warp_sync();
    auto A = [&](int r, int k) {  // row r (0..15 of the warp's), element k (0..15)
        const unsigned v = g_wa[cw][(r & 7) * 4 + ((k & 7) >> 1)][(r >> 3) + 2 * (k >> 3)];
        return bf2f((bf16_t)((k & 1) ? v >> 16 : v & 0xffffu));
    };
    for (int i = 0; i < 16; i++)
        for (int e = 0; e < 4; e++) {
            const int r = g + 8 * (e >> 1), col = 8 * i + 2 * t + (e & 1);
            float s = 0.f;
            for (int k = 0; k < 16; k++)
                s += A(r, k) * (trans ? emu_mnmaj(b, k, col) : emu_kmaj(b, col, k));
            d[4 * i + e] += s;
        }
    emu_warp_sync();
}
static inline void wg_mma_rs_t1(float* d, const unsigned* a, unsigned long long db) { emu_mma_rs(d, a, db, true); }
static inline void wg_mma_rs_t0(float* d, const unsigned* a, unsigned long long db) { emu_mma_rs(d, a, db, false); }

//@@ REGION ws
// mbarrier: its 8 bytes hold the expected and pending arrival counts and the phase; the bytes
// still to land on it (expect_tx / complete_tx) are kept beside. A phase completes when no
// arrival is pending and no byte is owed.
struct EmuMbar { unsigned short expected, pending; unsigned phase; };
static EmuMbar* emu_mbar(unsigned a) { return (EmuMbar*)emu_ptr(a); }
static std::map<unsigned, long> g_tx;
static void emu_try_complete(unsigned bar) {
    EmuMbar* m = emu_mbar(bar);
    if (m->pending == 0 && g_tx[bar] == 0) { m->phase++; m->pending = m->expected; }
    g_progress++;
}
static void emu_arrive(unsigned bar) {
    EmuMbar* m = emu_mbar(bar);
    if (m->pending == 0) { fprintf(stderr, "EMU: arrival on an uninitialized or over-arrived mbarrier\n"); exit(3); }
    --m->pending;
    emu_try_complete(bar);
}
// a thread's copies committed to an mbarrier arrival, not yet landed
struct EmuArrival { int thread; unsigned bar; std::vector<EmuCp> cps; };
static std::vector<EmuArrival> g_arrivals;
static void emu_land(const EmuArrival& a) { for (auto& c : a.cps) emu_copy(c); emu_arrive(a.bar); }
// A TMA copy in flight: the emulator's tensor map (main.cpp fills it in place of a CUtensorMap),
// the box's coordinates, its shared destination and barrier.
struct EmuTmap { const unsigned char* base; long long dim[5], stride[5]; int box[5]; };
struct EmuTma { unsigned dst, bar; const EmuTmap* map; int c[5]; };
static std::vector<EmuTma> g_tmas;
static long emu_tma_bytes(const EmuTma& t) {
    long n = 2;
    for (int k = 0; k < 5; k++) n *= t.map->box[k];
    return n;
}
// The box, rows of box[0] elements (128 bytes) one after another, 128-byte swizzled by address;
// elements outside the tensor read as zero. Then its bytes complete on the barrier.
static void emu_tma_land(const EmuTma& t) {
    const EmuTmap& m = *t.map;
    if (m.box[0] * 2 != 128) { fprintf(stderr, "EMU: TMA box rows must be 128 bytes\n"); exit(3); }
    unsigned row = 0;
    for (int i4 = 0; i4 < m.box[4]; i4++)
        for (int i3 = 0; i3 < m.box[3]; i3++)
            for (int i2 = 0; i2 < m.box[2]; i2++)
                for (int i1 = 0; i1 < m.box[1]; i1++, row++)
                    for (int i0 = 0; i0 < m.box[0]; i0++) {
                        const long long c[5] = {t.c[0] + i0, t.c[1] + i1, t.c[2] + i2, t.c[3] + i3, t.c[4] + i4};
                        bool oob = false;
                        long long off = 0;
                        for (int k = 0; k < 5; k++) {
                            oob = oob || c[k] < 0 || c[k] >= m.dim[k];
                            off += c[k] * m.stride[k];
                        }
                        uint16_t v = 0;
                        if (!oob) memcpy(&v, m.base + off, 2);
                        unsigned a = t.dst + row * 128 + 2 * i0;
                        a ^= ((a >> 7) & 7) << 4;
                        memcpy(emu_ptr(a), &v, 2);
                    }
    g_tx[t.bar] -= emu_tma_bytes(t);
    if (g_tx[t.bar] < 0) { fprintf(stderr, "EMU: TMA bytes landed on a barrier that did not expect them\n"); exit(3); }
    emu_try_complete(t.bar);
}
// Lands every pending arrival `pick` selects, in issue order, and the TMA copies on `bar`.
template <class P> static void emu_land_if(P pick) {
    for (size_t i = 0; i < g_arrivals.size();) {
        if (pick(g_arrivals[i])) {
            EmuArrival a = g_arrivals[i];
            g_arrivals.erase(g_arrivals.begin() + i);
            emu_land(a);
        } else {
            i++;
        }
    }
}
static void emu_land_tma(unsigned bar) {
    for (size_t i = 0; i < g_tmas.size();) {
        if (g_tmas[i].bar == bar) {
            EmuTma t = g_tmas[i];
            g_tmas.erase(g_tmas.begin() + i);
            emu_tma_land(t);
        } else {
            i++;
        }
    }
}
// A 1-d bulk copy in flight (gemv_stream.cu's gs_bulk_load): lands as a TMA box does.
struct EmuBulk { unsigned dst, bar, bytes; const void* src; };
static std::vector<EmuBulk> g_bulks;
static void emu_bulk_land(const EmuBulk& b) {
    memcpy(emu_ptr(b.dst), b.src, b.bytes);
    if (b.bytes && b.dst + b.bytes - 1 >= EMU_BAR_OFF) { fprintf(stderr, "EMU: bulk copy past the arena\n"); exit(3); }
    g_tx[b.bar] -= b.bytes;
    if (g_tx[b.bar] < 0) { fprintf(stderr, "EMU: bulk bytes landed on a barrier that did not expect them\n"); exit(3); }
    emu_try_complete(b.bar);
}
static void emu_land_bulk(unsigned bar) {
    for (size_t i = 0; i < g_bulks.size();) {
        if (g_bulks[i].bar == bar) {
            EmuBulk b = g_bulks[i];
            g_bulks.erase(g_bulks.begin() + i);
            emu_bulk_land(b);
        } else {
            i++;
        }
    }
}
static inline void ws_mbar_expect_tx(unsigned bar, unsigned bytes) { g_tx[bar] += bytes; }
static inline void ws_tma_load5(unsigned dst, unsigned long long map, int c0, int c1, int c2,
                                int c3, int c4, unsigned bar) {
    if (dst & 127) { fprintf(stderr, "EMU: TMA destination not 128-byte aligned\n"); exit(3); }
    EmuTma t{dst, bar, (const EmuTmap*)map, {c0, c1, c2, c3, c4}};
    if (g_sync) emu_tma_land(t); else g_tmas.push_back(t);
}
static inline void ws_cp_arrive_inc(unsigned bar) {
    emu_mbar(bar)->pending++;
    EmuArrival a{g_cur, bar, g_open[g_cur]};
    g_open[g_cur].clear();
    if (g_sync) emu_land(a); else g_arrivals.push_back(a);
}
static inline void ws_mbar_init(unsigned bar, unsigned count) {
    EmuMbar* m = emu_mbar(bar);
    m->expected = m->pending = (unsigned short)count;
    m->phase = 0;
    g_tx[bar] = 0;
}
static inline void ws_mbar_wait(unsigned bar, unsigned parity) {
    long seen = -1, idle = 0;
    for (;;) {
        if ((emu_mbar(bar)->phase & 1) != parity) return;
        // land the groups that arrive on this barrier (as late as a thread can need them)
        emu_land_if([&](const EmuArrival& a) { return a.bar == bar; });
        emu_land_tma(bar);
        emu_land_bulk(bar);
        if ((emu_mbar(bar)->phase & 1) != parity) return;
        emu_spin(seen, idle);
    }
}
static inline void ws_mbar_init_fence() {}
static inline void ws_mbar_arrive(unsigned bar) { emu_arrive(bar); }
static inline void ws_cp_arrive(unsigned bar) {
    EmuArrival a{g_cur, bar, g_open[g_cur]};
    g_open[g_cur].clear();
    if (g_sync) emu_land(a); else g_arrivals.push_back(a);
}
// named barriers 1, 2: 256 threads each (one warpgroup's sync + the other's arrive)
static int g_nbar_count[16];
static unsigned g_nbar_gen[16];
static unsigned emu_bar_arrive(int id) {
    const unsigned gen = g_nbar_gen[id];
    if (++g_nbar_count[id] == 256) { g_nbar_count[id] = 0; g_nbar_gen[id]++; g_progress++; }
    return gen;
}
static inline void ws_turn_wait(int c) {
    const unsigned gen = emu_bar_arrive(1 + c);
    long seen = -1, idle = 0;
    while (g_nbar_gen[1 + c] == gen) emu_spin(seen, idle);
}
static inline void ws_turn_give(int c) { emu_bar_arrive(1 + c); }
static inline void ws_cp16(unsigned dst, const void* src, int src_bytes) {
    EmuCp c{emu_ptr(dst), src, src_bytes};
    if (g_sync) emu_copy(c); else g_open[g_cur].push_back(c);
}
static inline void ws_cp_wait_all() {
    emu_land_if([](const EmuArrival& a) { return a.thread == g_cur; });
    for (auto& c : g_open[g_cur]) emu_copy(c);
    g_open[g_cur].clear();
}
static inline void ws_regs_producer() {}
static inline void ws_regs_consumer() {}

//@@ REGION gemv
// gemv_stream.cu's PTX region: the bulk copy (16-byte aligned, a multiple of 16 bytes), landing
// when a thread waits on its barrier (or at once with EMU_SYNC=1).
static inline void gs_bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    if ((dst & 15) || (bytes & 15) || ((uintptr_t)src & 15)) { fprintf(stderr, "EMU: bulk copy not 16-byte aligned\n"); exit(3); }
    EmuBulk b{dst, bar, bytes, src};
    if (g_sync) emu_bulk_land(b); else g_bulks.push_back(b);
}
static inline void gs_prefetch_l2(const void*, unsigned bytes) {
    if (bytes & 15) { fprintf(stderr, "EMU: L2 prefetch not a multiple of 16 bytes\n"); exit(3); }
}
