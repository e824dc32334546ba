// Greedy tokens on the device: the arg-max of each logits row, so a greedy step copies one id per
// row to the host instead of the whole row.

// True for a value the host arg-max skips: NaN or -inf (bit tests, independent of fast-math).
__device__ __forceinline__ bool argmax_skip(float v) {
    const unsigned u = __float_as_uint(v);
    return (u & 0x7fffffffu) > 0x7f800000u || u == 0xff800000u;
}

// (value, index) pair order of the arg-max: a larger value wins, the lower index on equal values;
// index -1 is "none yet" and loses to anything.
__device__ __forceinline__ void argmax_merge(float& best, int& idx, float v, int i) {
    if (i < 0) return;
    if (idx < 0 || v > best || (v == best && i < idx)) {
        best = v;
        idx = i;
    }
}

// One block per row (blockIdx.x), blockDim.x a multiple of 32 up to 1024: out[row] = the id of
// the largest value of logits[row * vocab .. + vocab) that is neither NaN nor -inf, the lowest id
// on ties (exactly sampling::argmax on the host); -1 when the row has no such value.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab,
                                       int* __restrict__ out) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const float* row = logits + (size_t)blockIdx.x * (size_t)vocab;
    float best = 0.0f;
    int idx = -1;
    // Each thread visits increasing ids: a strict > keeps its lowest id among equal values.
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (argmax_skip(v)) continue;
        if (idx < 0 || v > best) {
            best = v;
            idx = i;
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, best, off);
        const int oi = __shfl_down_sync(0xffffffffu, idx, off);
        argmax_merge(best, idx, ov, oi);
    }
    __shared__ float s_best[32];
    __shared__ int s_idx[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        s_best[warp] = best;
        s_idx[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        const int nwarps = (blockDim.x + 31) >> 5;
        best = lane < nwarps ? s_best[lane] : 0.0f;
        idx = lane < nwarps ? s_idx[lane] : -1;
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_down_sync(0xffffffffu, best, off);
            const int oi = __shfl_down_sync(0xffffffffu, idx, off);
            argmax_merge(best, idx, ov, oi);
        }
        if (lane == 0) out[blockIdx.x] = idx;
    }
}

// ---- Sampled tokens on the device (temperature, top-k, top-p, min-p) -------------------------
// Exactly the canonical device sampling of crate::sampling::device (`sample_row`): the weight of a
// token is expf((l - max) / T) over the finite logits (0 below min_p); top-k keeps the k largest
// logits (NaN as -inf, ties toward lower ids); top-p keeps the shortest most-likely set (by
// weight, boundary ties toward lower ids) whose mass reaches top_p x the candidates' mass; the
// token is the first kept id, ascending, at which the running weight (f64) exceeds u x the kept
// mass. Thresholds come from radix selects (four 8-bit passes) over order-preserving bits:
// counts of logit keys for top-k, sums of weights for top-p, and of ids for the ties of either.

// One sampled row (host: `SampleRowArg` in pdnode-cuda/src/backend/logits.rs, same layout: 32 bytes).
struct SampleRowArg {
    double u;           // uniform in [0, 1)
    float temperature;  // > 0
    float top_p;        // >= 1: off
    float min_p;        // 0: off
    unsigned top_k;     // 0 (or >= vocab): off
    int row;            // logits row
    int pad_;
};

#define SAMPLE_ROWS_PER_LAUNCH 64
struct SampleBatch {
    SampleRowArg r[SAMPLE_ROWS_PER_LAUNCH];
};

struct SampleSmem {
    unsigned cnt[256];
    double mass[256];
    double wmass[32];
    int wlast[32];
    float fmax[32];
    unsigned sel_prefix, sel_rem, sel_eq;
    double sel_need;
    double total;
    double target;
    double cross_base;
    int cross_warp;
    int result;
};

__device__ __forceinline__ bool samp_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// exp((l - mx) * inv_t) as the host computes it (f32, IEEE, no contraction); 0 for a non-finite
// logit or below min_p.
__device__ __forceinline__ float samp_weight(float l, float mx, float inv_t, float min_p) {
    if (!samp_finite(l)) return 0.f;
    const float x = expf(__fmul_rn(__fsub_rn(l, mx), inv_t));
    return x < min_p ? 0.f : x;
}

// Order-preserving key of a logit in the host's top-k order (f32::total_cmp, NaN as -inf).
__device__ __forceinline__ unsigned samp_key(float l) {
    unsigned u = __float_as_uint(l);
    if ((u & 0x7fffffffu) > 0x7f800000u) u = 0xff800000u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Warp 0 picks the digit of one radix pass: scanning digits from 255 down, the first at which the
// running count (`mass` false) or mass (`mass` true) reaches `need` (and is positive); when
// rounding leaves the need unreached, the lowest digit holding anything. Writes sel_prefix (with
// the digit), sel_rem / sel_need (what is still needed inside that digit) and sel_eq (the count
// of the digit).
__device__ void samp_walk(SampleSmem* sm, bool mass, unsigned need_c, double need_m, unsigned prefix,
                          int shift) {
    const int lane = threadIdx.x & 31;
    unsigned c[8];
    double m[8];
    unsigned sc = 0;
    double sm_ = 0.0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        c[j] = sm->cnt[255 - 8 * lane - j];
        m[j] = mass ? sm->mass[255 - 8 * lane - j] : 0.0;
        sc += c[j];
        sm_ += m[j];
    }
    unsigned ic = sc;
    double im = sm_;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const unsigned tc = __shfl_up_sync(0xffffffffu, ic, off);
        const double tm = __shfl_up_sync(0xffffffffu, im, off);
        if (lane >= off) {
            ic += tc;
            im += tm;
        }
    }
    unsigned ec = __shfl_up_sync(0xffffffffu, ic, 1);
    double em = __shfl_up_sync(0xffffffffu, im, 1);
    if (lane == 0) {
        ec = 0;
        em = 0.0;
    }
    bool ok = mass ? (im >= need_m && im > 0.0) : (ic >= need_c && ic > 0);
    unsigned ballot = __ballot_sync(0xffffffffu, ok);
    if (ballot == 0) {
        // Not reached (rounding, or fewer than needed): the last lane holding anything.
        ballot = __ballot_sync(0xffffffffu, sc > 0);
        if (ballot == 0) {
            if (lane == 0) {
                sm->sel_prefix = prefix;
                sm->sel_rem = 0;
                sm->sel_eq = 0;
                sm->sel_need = 0.0;
            }
            return;
        }
        ballot = 1u << (31 - __clz(ballot));
    }
    const int L = __ffs(ballot) - 1;
    if (lane == L) {
        unsigned ac = ec;
        double am = em;
        int pick = -1;
        unsigned pc = 0;
        double pm = 0.0;
        for (int j = 0; j < 8; j++) {
            if (c[j] == 0) continue;
            pick = j;
            pc = ac;
            pm = am;
            const bool hit = mass ? (am + m[j] >= need_m) : (ac + c[j] >= need_c);
            if (hit) break;
            ac += c[j];
            am += m[j];
        }
        if (pick < 0) pick = 0;  // unreachable: this lane holds something
        const unsigned d = 255u - 8u * (unsigned)lane - (unsigned)pick;
        sm->sel_prefix = prefix | (d << shift);
        sm->sel_eq = c[pick];
        sm->sel_rem = need_c > pc ? need_c - pc : 1u;
        sm->sel_need = need_m - pm;
    }
}

// Radix select over the keys `key_of(i, &k, &m)` gives (false: token not counted; m: its mass),
// four 8-bit passes: by count (`mass` false: the key of the need_c-th largest) or by summed mass
// (the key at which the mass from the top reaches need_m). Results in sm->sel_* (see samp_walk),
// for all threads after the return. Each thread adds runs of one digit at once (the digits of a
// pass are few and shared by most tokens: per-token shared atomics would serialize).
template <class K>
__device__ void samp_select(SampleSmem* sm, int n, bool mass, unsigned need_c, double need_m,
                            K key_of) {
    unsigned prefix = 0, hi = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) {
            sm->cnt[b] = 0;
            sm->mass[b] = 0.0;
        }
        __syncthreads();
        unsigned run_d = 256u, run_c = 0;
        double run_m = 0.0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            unsigned k;
            double m;
            if (!key_of(i, k, m) || (k & hi) != prefix) continue;
            const unsigned d = (k >> shift) & 255u;
            if (d != run_d) {
                if (run_c) {
                    atomicAdd(&sm->cnt[run_d], run_c);
                    if (mass) atomicAdd(&sm->mass[run_d], run_m);
                }
                run_d = d;
                run_c = 0;
                run_m = 0.0;
            }
            run_c++;
            run_m += m;
        }
        if (run_c) {
            atomicAdd(&sm->cnt[run_d], run_c);
            if (mass) atomicAdd(&sm->mass[run_d], run_m);
        }
        __syncthreads();
        if (threadIdx.x < 32) samp_walk(sm, mass, need_c, need_m, prefix, shift);
        __syncthreads();
        prefix = sm->sel_prefix;
        need_c = sm->sel_rem;
        need_m = sm->sel_need;
        hi |= 255u << shift;
    }
}

// One block (1024 threads) per sampled row: out[r.row] = the sampled id, -1 when the row has no
// finite logit (or nothing with weight among its top-k).
extern "C" __global__ void __launch_bounds__(1024)
    sample_rows(const float* __restrict__ logits, int vocab, SampleBatch batch, int* __restrict__ out) {
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    __shared__ SampleSmem sm;
    const SampleRowArg a = batch.r[blockIdx.x];
    const float* x = logits + (size_t)a.row * (size_t)vocab;
    const int n = vocab;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;

    // 1. the largest finite logit
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = x[i];
        if (samp_finite(v)) mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    if (lane == 0) sm.fmax[warp] = mx;
    __syncthreads();
    mx = -INFINITY;
    for (int w = 0; w < nwarps; w++) mx = fmaxf(mx, sm.fmax[w]);
    if (!samp_finite(mx)) {
        if (threadIdx.x == 0) out[a.row] = -1;
        return;
    }
    const float inv_t = __fdiv_rn(1.0f, a.temperature);
    const float min_p = a.min_p;

    // 2. top-k: the key of the k-th largest logit, and the highest id kept among its ties
    const bool topk = a.top_k > 0 && a.top_k < (unsigned)n;
    unsigned kk = 0, ik = 0xffffffffu;
    if (topk) {
        samp_select(&sm, n, false, a.top_k, 0.0, [&](int i, unsigned& k, double& m) {
            k = samp_key(x[i]);
            m = 0.0;
            return true;
        });
        kk = sm.sel_prefix;
        const unsigned need = sm.sel_rem, eq = sm.sel_eq;
        if (need < eq) {
            // the `need` lowest ids among the ties: the need-th largest of ~id
            samp_select(&sm, n, false, need, 0.0, [&](int i, unsigned& k, double& m) {
                k = ~(unsigned)i;
                m = 0.0;
                return samp_key(x[i]) == kk;
            });
            ik = ~sm.sel_prefix;
        }
    }
    auto cand = [&](int i, float l) {
        if (!topk) return true;
        const unsigned k = samp_key(l);
        return k > kk || (k == kk && (unsigned)i <= ik);
    };

    // 3. top-p: the boundary weight and the highest id kept among its ties
    const bool topp = a.top_p < 1.0f;
    unsigned wb = 0, ip = 0xffffffffu;
    if (topp) {
        double s = 0.0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float l = x[i];
            if (cand(i, l)) s += (double)samp_weight(l, mx, inv_t, min_p);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) sm.wmass[warp] = s;
        __syncthreads();
        if (threadIdx.x == 0) {
            double t = 0.0;
            for (int w = 0; w < nwarps; w++) t += sm.wmass[w];
            sm.total = t;
        }
        __syncthreads();
        const double total = sm.total;
        __syncthreads();
        if (total > 0.0) {
            auto wkey = [&](int i, unsigned& k, double& m) {
                const float l = x[i];
                if (!cand(i, l)) return false;
                const float w = samp_weight(l, mx, inv_t, min_p);
                k = __float_as_uint(w);
                m = (double)w;
                return w > 0.f;
            };
            samp_select(&sm, n, true, 0u, (double)a.top_p * total, wkey);
            wb = sm.sel_prefix;
            const unsigned eq = sm.sel_eq;
            const double wv = (double)__uint_as_float(wb);
            const double q = wv > 0.0 ? ceil(sm.sel_need / wv) : 1.0;
            const unsigned nt = q < 1.0 ? 1u : (q >= (double)eq ? eq : (unsigned)q);
            if (nt < eq) {
                samp_select(&sm, n, false, nt, 0.0, [&](int i, unsigned& k, double& m) {
                    unsigned kw;
                    if (!wkey(i, kw, m) || kw != wb) return false;
                    k = ~(unsigned)i;
                    return true;
                });
                ip = ~sm.sel_prefix;
            }
        }
    }
    // weight of token i if kept, else 0
    auto kept_w = [&](int i) -> float {
        const float l = x[i];
        if (!cand(i, l)) return 0.f;
        const float w = samp_weight(l, mx, inv_t, min_p);
        if (w <= 0.f || !topp) return w;
        const unsigned k = __float_as_uint(w);
        return (k > wb || (k == wb && (unsigned)i <= ip)) ? w : 0.f;
    };

    // 4. the pick: warp w owns ids [w * span, (w + 1) * span), lanes striding within it
    const int span = (((n + nwarps - 1) / nwarps) + 31) & ~31;
    const int w0 = warp * span, w1 = min(n, w0 + span);
    double acc = 0.0;
    int last = -1;
    for (int i = w0 + lane; i < w1; i += 32) {
        const float w = kept_w(i);
        if (w > 0.f) {
            acc += (double)w;
            last = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        acc += __shfl_xor_sync(0xffffffffu, acc, o);
        last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    }
    if (lane == 0) {
        sm.wmass[warp] = acc;
        sm.wlast[warp] = last;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double kept = 0.0;
        int lastk = -1;
        for (int w = 0; w < nwarps; w++) {
            kept += sm.wmass[w];
            lastk = max(lastk, sm.wlast[w]);
        }
        const double target = a.u * kept;
        double pre = 0.0;
        int cw = -1;
        for (int w = 0; w < nwarps; w++) {
            if (sm.wmass[w] > 0.0 && pre + sm.wmass[w] > target) {
                cw = w;
                break;
            }
            pre += sm.wmass[w];
        }
        sm.target = target;
        sm.cross_warp = cw;
        sm.cross_base = pre;
        sm.result = lastk;  // past the end by rounding (or nothing kept: -1)
    }
    __syncthreads();
    if (warp == sm.cross_warp) {
        const double target = sm.target;
        double base = sm.cross_base;
        int found = -1;
        for (int g = w0; g < w1 && found < 0; g += 32) {
            const int i = g + lane;
            const double w = i < w1 ? (double)kept_w(i) : 0.0;
            double incl = w;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const double t = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += t;
            }
            const unsigned hit = __ballot_sync(0xffffffffu, w > 0.0 && base + incl > target);
            if (hit) {
                found = g + __ffs(hit) - 1;
            } else {
                base += __shfl_sync(0xffffffffu, incl, 31);
            }
        }
        if (lane == 0) out[a.row] = found >= 0 ? found : sm.wlast[warp];
    } else if (sm.cross_warp < 0 && threadIdx.x == 0) {
        out[a.row] = sm.result;
    }
}
