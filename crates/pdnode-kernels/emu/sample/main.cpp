// Host run of kernels/sample.cu's sample_rows on the SIMT emulator against a port of the Rust
// reference (crate::sampling::device): see run.sh.
#include "kernels.inc"
#include <functional>
#include <random>

static std::function<void()> g_fn;
static void body() { g_fn(); }

static void launch(unsigned gx, unsigned nt, std::function<void()> f) {
    g_fn = std::move(f);
    gridDim = {gx, 1, 1};
    blockDim = {nt, 1, 1};
    for (unsigned x = 0; x < gx; x++) {
        blockIdx = {x, 0, 0};
        run_block((int)nt, body);
    }
}

static int fails = 0;
static void report(bool ok, const char* what) {
    printf("%s %s\n", ok ? "PASS" : "FAIL", what);
    if (!ok) fails++;
}

// ---- the reference: crate::sampling::device::{kept_set, pick_kept} ----
static bool finite(float v) { return std::isfinite(v); }
// logprobs::desc: NaN as -inf, f32::total_cmp descending, then ascending id
static int total_key(float v) {
    if (std::isnan(v)) v = -INFINITY;
    int32_t b;
    memcpy(&b, &v, 4);
    return b ^ (int32_t)((uint32_t)(b >> 31) >> 1);
}
struct Kept {
    std::vector<uint32_t> ids;
    std::vector<float> w;
    double mass = 0, margin = 1e300;
};
struct Draw {
    float t, top_p, min_p;
    unsigned top_k;
    double u;
};
static bool kept_set(const float* row, int n, const Draw& d, Kept& k) {
    float mx = -INFINITY;
    for (int i = 0; i < n; i++)
        if (finite(row[i])) mx = std::max(mx, row[i]);
    if (!finite(mx)) return false;
    const float inv_t = 1.0f / d.t;
    double margin = 1e300;
    auto weight = [&](float l) -> float {
        if (!finite(l)) return 0.f;
        const float x = expf((l - mx) * inv_t);
        if (d.min_p > 0) margin = std::min(margin, (double)std::fabs(x - d.min_p) / d.min_p);
        return x < d.min_p ? 0.f : x;
    };
    std::vector<uint32_t> cand(n);
    for (int i = 0; i < n; i++) cand[i] = i;
    if (d.top_k > 0 && d.top_k < (unsigned)n) {
        std::sort(cand.begin(), cand.end(), [&](uint32_t a, uint32_t b) {
            const int ka = total_key(row[a]), kb = total_key(row[b]);
            return ka != kb ? ka > kb : a < b;
        });
        cand.resize(d.top_k);
    }
    std::vector<std::pair<uint32_t, float>> c;
    for (uint32_t i : cand) {
        const float w = weight(row[i]);
        if (w > 0) c.push_back({i, w});
    }
    if (d.top_p < 1.0f && !c.empty()) {
        double total = 0;
        for (auto& x : c) total += x.second;
        const double need = (double)d.top_p * total;
        std::sort(c.begin(), c.end(), [](auto& a, auto& b) {
            return a.second != b.second ? a.second > b.second : a.first < b.first;
        });
        double above = 0;
        size_t j = 0, keep = c.size();
        while (j < c.size()) {
            const float wv = c[j].second;
            size_t e = j;
            while (e < c.size() && c[e].second == wv) e++;
            const double w = wv, group = w * (double)(e - j);
            if (above + group >= need) {
                double q = std::ceil((need - above) / w);
                size_t nt = q < 1 ? 1 : (q > (double)(e - j) ? e - j : (size_t)q);
                keep = j + nt;
                const double after = above + nt * w, before = above + (nt - 1) * w;
                margin = std::min(margin, std::min(std::fabs(after - need), std::fabs(need - before)) / total);
                break;
            }
            above += group;
            j = e;
        }
        c.resize(keep);
    }
    std::sort(c.begin(), c.end());
    k = Kept{};
    for (auto& x : c) {
        k.ids.push_back(x.first);
        k.w.push_back(x.second);
        k.mass += x.second;
    }
    k.margin = margin;
    return true;
}
// token (-1: none) and margin
static int pick_kept(const Kept& k, double u, double& margin) {
    const double target = u * k.mass;
    double acc = 0;
    for (size_t i = 0; i < k.ids.size(); i++) {
        const double before = acc;
        acc += k.w[i];
        if (acc > target) {
            margin = std::min(std::min(target - before, acc - target) / k.mass, k.margin);
            return (int)k.ids[i];
        }
    }
    margin = 0;
    return k.ids.empty() ? -1 : (int)k.ids.back();
}

// ---- cases ----
static void run_rows(const std::vector<float>& logits, int vocab, const std::vector<Draw>& draws,
                     std::vector<int>& out) {
    const int rows = (int)draws.size();
    out.assign(rows, 0x7f7f7f7f);
    for (int r0 = 0; r0 < rows; r0 += SAMPLE_ROWS_PER_LAUNCH) {
        SampleBatch b{};
        const int n = std::min(rows - r0, SAMPLE_ROWS_PER_LAUNCH);
        for (int i = 0; i < n; i++) {
            const Draw& d = draws[r0 + i];
            b.r[i] = SampleRowArg{d.u, d.t, d.top_p, d.min_p, d.top_k, r0 + i, 0};
        }
        launch(n, 1024, [&] { sample_rows(logits.data(), vocab, b, out.data()); });
    }
}

int main() {
    std::mt19937_64 rng(1234);
    std::uniform_real_distribution<double> U(0, 1);
    long total = 0, exact = 0, near = 0, bad = 0;
    const int vocabs[] = {1, 5, 37, 1000, 4099, 32000, 128256};
    for (int vocab : vocabs) {
        const int rows = vocab >= 32000 ? 24 : 96;
        std::vector<float> logits((size_t)rows * vocab);
        std::vector<Draw> draws(rows);
        for (int r = 0; r < rows; r++) {
            float* row = &logits[(size_t)r * vocab];
            const int kind = r % 6;
            std::normal_distribution<float> N(0.f, kind == 5 ? 8.f : 2.5f);
            for (int i = 0; i < vocab; i++) {
                float v = N(rng);
                if (kind == 1) v = std::round(v * 2) / 2;  // exact ties
                if (kind == 2) v = (float)(rng() % 4);      // few levels, huge ties
                if (kind == 3 && rng() % 50 == 0) {
                    const float sp[] = {-INFINITY, NAN, INFINITY, -NAN};
                    v = sp[rng() % 4];
                }
                row[i] = v;
            }
            if (r % 23 == 22)
                for (int i = 0; i < vocab; i++) row[i] = (i % 3) ? -INFINITY : NAN;  // nothing finite
            if (r % 29 == 28) {
                for (int i = 0; i < vocab; i++) row[i] = -INFINITY;
                row[vocab / 2] = 1.5f;  // one finite value
            }
            const float ts[] = {1.0f, 0.7f, 1.3f, 0.25f, 2.0f};
            const unsigned ks[] = {0, 0, 1, 2, 5, 50, 1000, (unsigned)vocab - 1};
            const float ps[] = {1.0f, 1.0f, 0.95f, 0.8f, 0.5f, 1e-4f, 0.999f};
            const float ms[] = {0.f, 0.f, 0.f, 0.05f, 0.3f};
            draws[r] = Draw{ts[rng() % 5], ps[rng() % 7], ms[rng() % 5], ks[rng() % 8], U(rng)};
            if (r % 7 == 0) draws[r].u = 0.0;
            if (r % 11 == 0) draws[r].u = 0.9999999999;
        }
        std::vector<int> got;
        run_rows(logits, vocab, draws, got);
        long vb = 0, vn = 0;
        for (int r = 0; r < rows; r++) {
            Kept k;
            double margin = 1e300;
            int want = -1;
            if (kept_set(&logits[(size_t)r * vocab], vocab, draws[r], k)) want = pick_kept(k, draws[r].u, margin);
            total++;
            if (got[r] == want) {
                exact++;
            } else if (margin < 1e-5) {
                near++;
                vn++;
            } else {
                bad++;
                vb++;
                const Draw& d = draws[r];
                printf("MISMATCH vocab %d row %d: got %d want %d (T %g k %u p %g min_p %g u %.17g margin %g kept %zu)\n",
                       vocab, r, got[r], want, d.t, d.top_k, d.top_p, d.min_p, d.u, margin, k.ids.size());
            }
        }
        char what[160];
        snprintf(what, sizeof what, "sample_rows vocab %d: %d rows, %ld near-boundary, %ld wrong", vocab, rows, vn, vb);
        report(vb == 0, what);
    }
    // a grid of u on one row: each kept token's share is its weight
    {
        const int vocab = 300, G = 4096;
        std::vector<float> row(vocab);
        std::normal_distribution<float> N(0.f, 1.5f);
        for (auto& v : row) v = N(rng);
        Draw d{0.9f, 0.9f, 0.02f, 40, 0};
        std::vector<float> logits;
        std::vector<Draw> draws;
        for (int g = 0; g < G; g++) {
            logits.insert(logits.end(), row.begin(), row.end());
            d.u = (g + 0.5) / G;
            draws.push_back(d);
        }
        std::vector<int> got;
        run_rows(logits, vocab, draws, got);
        Kept k;
        kept_set(row.data(), vocab, d, k);
        std::vector<int> cnt(vocab, 0);
        for (int t : got) if (t >= 0 && t < vocab) cnt[t]++;
        double worst = 0;
        long outside = 0;
        for (int i = 0; i < vocab; i++) {
            auto it = std::find(k.ids.begin(), k.ids.end(), (uint32_t)i);
            if (it == k.ids.end()) { outside += cnt[i]; continue; }
            const double p = k.w[it - k.ids.begin()] / k.mass;
            worst = std::max(worst, std::fabs(cnt[i] / (double)G - p));
        }
        char what[160];
        snprintf(what, sizeof what, "sample_rows u grid: %zu kept, worst share error %.3g (grid step %.3g), %ld outside", k.ids.size(), worst, 1.0 / G, outside);
        report(worst <= 1.0 / G + 1e-9 && outside == 0, what);
    }
    printf("%ld rows: %ld exact, %ld near-boundary, %ld wrong; %d failed\n", total, exact, near, bad, fails);
    return fails ? 1 : 0;
}
