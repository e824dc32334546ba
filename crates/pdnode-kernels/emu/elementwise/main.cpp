// Host run of kernels/elementwise.cu's swiglu/add_rmsnorm kernels on the SIMT emulator: see run.sh.
#include "kernels.inc"
#include <functional>
#include <random>

static std::function<void()> g_fn;
static void body() { g_fn(); }

// Runs `f` for every thread of a gx x gy grid of nt-thread blocks.
static void launch(unsigned gx, unsigned gy, unsigned nt, std::function<void()> f) {
    g_fn = std::move(f);
    gridDim = {gx, gy, 1};
    blockDim = {nt, 1, 1};
    for (unsigned y = 0; y < gy; y++)
        for (unsigned x = 0; x < gx; x++) {
            blockIdx = {x, y, 0};
            run_block((int)nt, body);
        }
}

static int fails = 0;
static void report(bool ok, const char* what) {
    printf("%s %s\n", ok ? "PASS" : "FAIL", what);
    if (!ok) fails++;
}

static const int GUARD = 64;

// The wrapper's swiglu_v8 grid x (ops::swiglu_vector_grid): 128 threads x 2 words a block.
static unsigned swiglu_grid_x(int inter) { return (unsigned)((inter / 8 + 255) / 256); }
// The wrapper's add_rmsnorm_v4 block (ops::rmsnorm_vector_block).
static unsigned rms_block(int hidden) { return (unsigned)(((hidden / 4 + 7) / 8 + 31) / 32 * 32); }

static void swiglu_cases(std::mt19937& rng) {
    // (tokens, inter, rows on grid y): y below tokens exercises the row loop
    int cases[][3] = {{3, 2056, 65535}, {5, 8, 2}, {2, 14336, 65535}, {7, 1000, 3}, {1, 4096, 1},
                      {9, 2048, 4}, {4, 16, 65535}};
    for (auto& c : cases) {
        int t = c[0], inter = c[1], ycap = c[2];
        size_t n = (size_t)t * inter;
        std::vector<bf16_t> gu((size_t)t * 2 * inter);
        std::uniform_real_distribution<float> U(-12.f, 12.f);
        for (size_t k = 0; k < gu.size(); k++)
            gu[k] = (k / (2 * inter)) % 2 ? f2bf(U(rng)) : (bf16_t)(rng() & 0xffff);
        std::vector<bf16_t> ref(n + GUARD, 0xffff), a(n + GUARD, 0xffff), b(n + GUARD, 0x5a5a);
        // the scalar kernel, a small grid so the grid-stride loop wraps
        launch(3, 1, 256, [&] { swiglu(gu.data(), ref.data(), t, inter); });
        unsigned gy = (unsigned)std::min(t, ycap);
        launch(swiglu_grid_x(inter), gy, 128, [&] { swiglu_v8(gu.data(), a.data(), t, inter); });
        launch(swiglu_grid_x(inter), gy, 128, [&] { swiglu_v8(gu.data(), b.data(), t, inter); });
        size_t same = 0, guard_bad = 0;
        for (size_t k = 0; k < n; k++) same += ref[k] == a[k] && ref[k] == b[k];
        for (size_t k = n; k < n + GUARD; k++) guard_bad += a[k] != 0xffff || b[k] != 0x5a5a || ref[k] != 0xffff;
        // the ordinary rows against f64
        double worst = 0;
        for (int tt = 1; tt < t; tt += 2)
            for (int i = 0; i < inter; i++) {
                double g = bf2f(gu[(size_t)tt * 2 * inter + i]), u = bf2f(gu[(size_t)tt * 2 * inter + inter + i]);
                double want = g / (1 + std::exp(-g)) * u, got = bf2f(a[(size_t)tt * inter + i]);
                worst = std::max(worst, std::fabs(got - want) / std::max(std::fabs(want), 1e-3));
            }
        char msg[256];
        snprintf(msg, sizeof msg,
                 "swiglu_v8 t=%d inter=%d grid=%ux%u: %zu/%zu bit-identical to swiglu, guard bad %zu, worst rel %.1e",
                 t, inter, swiglu_grid_x(inter), gy, same, n, guard_bad, worst);
        report(same == n && guard_bad == 0 && worst < 8e-3, msg);
    }
}

static double ref_norm(const float* x, const float* w, int h, float eps, int i) {
    double ss = 0;
    for (int j = 0; j < h; j++) ss += (double)x[j] * x[j];
    return x[i] / std::sqrt(ss / h + eps) * w[i];
}

static int ordered(bf16_t x) { return x & 0x8000 ? -(int)(x & 0x7fff) : (int)(x & 0x7fff); }

static void rmsnorm_cases(std::mt19937& rng) {
    const float eps = 1e-5f;
    const int R = 6;
    std::uniform_real_distribution<float> U(-3.f, 3.f);
    for (int h : {4, 64, 576, 4096, 4136, 5120, 8192, 32768}) {
        std::vector<float> x0((size_t)R * h + GUARD), d((size_t)R * h + GUARD), w(h);
        for (auto& v : x0) v = U(rng);
        for (auto& v : d) v = U(rng) / 3;
        for (auto& v : w) v = U(rng) / 3;
        for (int k = 0; k < GUARD; k++) x0[(size_t)R * h + k] = d[(size_t)R * h + k] = 7.f;
        std::vector<float> sum(x0);
        for (size_t k = 0; k < (size_t)R * h; k++) sum[k] = x0[k] + d[k];
        unsigned nt = rms_block(h);
        struct Case { const char* name; bool delta; std::vector<int> rows; };
        Case cs[] = {{"delta, all rows", true, {}}, {"no delta, rows 4,1,4", false, {4, 1, 4}},
                     {"delta, rows 3,0", true, {3, 0}}, {"no delta, all rows", false, {}}};
        for (auto& c : cs) {
            int rn = c.rows.empty() ? R : (int)c.rows.size();
            size_t n = (size_t)rn * h;
            std::vector<float> xs(x0), xv(x0);
            std::vector<bf16_t> os(n + GUARD, 0xffff), ov(n + GUARD, 0xffff), ov2(n + GUARD, 0x5a5a);
            const int* rp = c.rows.empty() ? nullptr : c.rows.data();
            const float* dp = c.delta ? d.data() : nullptr;
            launch(rn, 1, 256, [&] { add_rmsnorm(xs.data(), dp, w.data(), os.data(), rp, h, eps); });
            launch(rn, 1, nt, [&] { add_rmsnorm_v4(xv.data(), dp, w.data(), ov.data(), rp, h, eps); });
            std::vector<float> xv2(x0);
            launch(rn, 1, nt, [&] { add_rmsnorm_v4(xv2.data(), dp, w.data(), ov2.data(), rp, h, eps); });
            // resid: rows given delta become x + delta exactly; the rest untouched (guard too)
            bool resid_ok = xv == xs && xv2 == xs;
            for (int r = 0; r < R && resid_ok; r++) {
                bool upd = c.delta && (c.rows.empty() || std::count(c.rows.begin(), c.rows.end(), r));
                const float* want = upd ? &sum[(size_t)r * h] : &x0[(size_t)r * h];
                resid_ok = std::equal(want, want + h, &xv[(size_t)r * h]);
            }
            resid_ok = resid_ok && std::equal(x0.end() - GUARD, x0.end(), xv.end() - GUARD);
            int max_ulp = 0;
            size_t written = 0, guard_bad = 0;
            double worst = 0;
            for (int r = 0; r < rn; r++) {
                int s = rp ? rp[r] : r;
                // the row as normalized: resid after the call (checked against x and x + delta)
                const float* src = &xs[(size_t)s * h];
                for (int i = 0; i < h; i++) {
                    size_t k = (size_t)r * h + i;
                    max_ulp = std::max(max_ulp, std::abs(ordered(os[k]) - ordered(ov[k])));
                    written += ov[k] == ov2[k];
                    double want = ref_norm(src, w.data(), h, eps, i);
                    worst = std::max(worst, std::fabs(bf2f(ov[k]) - want) / std::max(std::fabs(want), 1e-2));
                }
            }
            for (size_t k = n; k < n + GUARD; k++) guard_bad += ov[k] != 0xffff || ov2[k] != 0x5a5a;
            char msg[256];
            snprintf(msg, sizeof msg,
                     "add_rmsnorm_v4 hidden=%d block=%u %s: %zu/%zu written, max %d ulp from add_rmsnorm, worst rel %.1e vs f64, resid ok %d, guard bad %zu",
                     h, nt, c.name, written, n, max_ulp, worst, (int)resid_ok, guard_bad);
            report(written == n && max_ulp <= 1 && worst < 8e-3 && resid_ok && guard_bad == 0, msg);
        }
    }
}

int main() {
    std::mt19937 rng(12);
    swiglu_cases(rng);
    rmsnorm_cases(rng);
    printf("%s: %d failed\n", fails ? "EMU FAILED" : "all passed", fails);
    return fails ? 1 : 0;
}
