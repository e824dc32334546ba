// ---- gemv_chain: consecutive decode GEMVs in one launch, their weights through one ring -------
// Up to GC_MAX_PHASES GEMVs of gemv_stream's kind (same output modes, x given or the RMSNorm of
// the residual computed in the block), where phase p + 1 reads what phase p wrote (the decode
// step's o -> gate_up -> down -> next qkv). One block an SM, each owning a contiguous range of
// every phase's units; the producer (lane 0 of warp GS_CONSUMERS) streams the block's weight
// spans of all phases, one after the other, through one ring of `stages` stages of
// `stage_bytes` each (a stage: as many whole units of one phase as fit, one bulk copy for the
// rows, two for GLU's gate and up rows), never waiting for a phase to end: while the consumers
// wait at a phase boundary for every block (a grid-wide barrier), the ring keeps filling with the
// next phase's weights, so DRAM does not idle between the GEMVs as it does between kernels. As in
// gemv_stream the first fill starts before the grid-dependency wait.
//
// Consumer warp c < nc = min(stages, GS_CONSUMERS) takes the global stages c, c + nc, ...
// (stages a multiple of nc: each slot has one consumer). At a phase boundary the consumers
// sync, thread 0 passes the grid barrier (count / generation words in `sync`, both 0 before the
// first launch; every launch leaves count at 0), the consumers sync again and load the next x
// (and the accumulated y values) from L2 (ld.cg: other blocks wrote them). All blocks must be
// resident at once: grid <= SMs, one block an SM (the launcher's shared memory makes sure).
//
// Shared memory: GS_HEAD, x (T * max_in bf16), ys (T * max_per_block f32), each rounded up to
// 128 bytes, then the stages.

#define GC_MAX_PHASES 4

struct GcPhase {
    const bf16_t* w;      // bf16 [units, in] (GS_GLU: [2 units, in])
    const bf16_t* x;      // bf16 [T, in]; unused where norm_w is set
    const float* resid;   // f32 [T, in]: the norm's input
    const float* norm_w;  // f32 [in], or null: x given
    void* y;              // [T, units], as the mode says
    int units, in, mode, norm_threads;
};

struct GcArgs {
    GcPhase ph[GC_MAX_PHASES];
    int nphase, T, stage_bytes, stages, max_in, max_per_block;
    float eps;
    unsigned* sync;  // [2]: arrivals, generation
};

// PTX-BEGIN: the grid barrier

// Every block's consumers reach it (the caller syncs them before and after); thread 0 arrives:
// the last of `nblocks` resets the count and bumps the generation, the others wait for the bump.
__device__ __forceinline__ void gc_grid_sync(unsigned* sync, int nblocks) {
    __threadfence();
    volatile unsigned* gen = sync + 1;
    const unsigned g = *gen;
    if (atomicAdd(sync, 1u) == (unsigned)nblocks - 1u) {
        sync[0] = 0u;
        __threadfence();
        atomicAdd(sync + 1, 1u);
    } else {
        while (*gen == g) __nanosleep(32);
    }
    __threadfence();
}

__device__ __forceinline__ float4 gc_ldcg4(const float* p) { return __ldcg((const float4*)p); }
__device__ __forceinline__ uint4 gc_ldcg16(const void* p) { return __ldcg((const uint4*)p); }
__device__ __forceinline__ float gc_ldcg(const float* p) { return __ldcg(p); }

// PTX-END

template <int MT>
__device__ __forceinline__ void gemv_chain_impl(const GcArgs& a, unsigned char* smem) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int T = a.T, stages = a.stages;
    const unsigned base = fp_smem_addr(smem);
    const unsigned full0 = base, empty0 = base + 8 * GS_MAX_STAGES;
    float* red = (float*)(smem + 16 * GS_MAX_STAGES);
    bf16_t* xs = (bf16_t*)(smem + GS_HEAD);
    const unsigned xbytes = ((unsigned)(T * a.max_in * 2) + 127u) & ~127u;
    float* ys = (float*)(smem + GS_HEAD + xbytes);
    const unsigned ybytes = ((unsigned)(T * a.max_per_block * 4) + 127u) & ~127u;
    unsigned char* st0 = smem + GS_HEAD + xbytes + ybytes;
    if (tid == 0) {
        for (int s = 0; s < stages; s++) {
            ws_mbar_init(full0 + 8 * s, 1);
            ws_mbar_init(empty0 + 8 * s, 1);
        }
        ws_mbar_init_fence();
    }
    __syncthreads();
    if (warp == GS_CONSUMERS) {
        PD_GRID_LAUNCH_DEPENDENTS();
        if (lane == 0) {
            int g = 0;
            for (int p = 0; p < a.nphase; p++) {
                const GcPhase& ph = a.ph[p];
                const bool glu = ph.mode == GS_GLU;
                const unsigned row = (unsigned)ph.in * 2u, unit = glu ? 2u * row : row;
                const int upp = a.stage_bytes / (int)unit;
                const int u0 = (int)((i64)blockIdx.x * ph.units / gridDim.x);
                const int n = (int)((i64)(blockIdx.x + 1) * ph.units / gridDim.x) - u0;
                for (int k0 = 0; k0 < n; k0 += upp, g++) {
                    const int s = g % stages, cnt = min(upp, n - k0);
                    if (g >= stages) ws_mbar_wait(empty0 + 8 * s, (unsigned)((g / stages) - 1) & 1u);
                    const unsigned bar = full0 + 8 * s;
                    const unsigned dst = fp_smem_addr(st0) + (unsigned)s * (unsigned)a.stage_bytes;
                    ws_mbar_expect_tx(bar, (unsigned)cnt * unit);
                    gs_bulk_load(dst, ph.w + (i64)(u0 + k0) * ph.in, (unsigned)cnt * row, bar);
                    if (glu)
                        gs_bulk_load(dst + (unsigned)cnt * row, ph.w + (i64)(u0 + k0 + ph.units) * ph.in,
                                     (unsigned)cnt * row, bar);
                    ws_mbar_arrive(bar);
                }
            }
        }
        return;
    }
    PD_GRID_WAIT();
    PD_GRID_LAUNCH_DEPENDENTS();
    const int nc = stages < GS_CONSUMERS ? stages : GS_CONSUMERS;
    int g = 0;
    for (int p = 0; p < a.nphase; p++) {
        const GcPhase& ph = a.ph[p];
        const bool glu = ph.mode == GS_GLU;
        const int in = ph.in, units = ph.units;
        const unsigned row = (unsigned)in * 2u, unit = glu ? 2u * row : row;
        const int upp = a.stage_bytes / (int)unit;
        const int u0 = (int)((i64)blockIdx.x * units / gridDim.x);
        const int n = (int)((i64)(blockIdx.x + 1) * units / gridDim.x) - u0;
        if (p > 0) {
            ws_turn_wait(0);  // this block's phase p - 1 outputs written, x and ys free
            if (tid == 0) gc_grid_sync(a.sync, gridDim.x);
            ws_turn_wait(0);
        }
        if (ph.norm_w) {
            // add_rmsnorm_v4 (no delta) with norm_threads threads, as gemv_stream does
            const int n4 = in >> 2, nt = ph.norm_threads, nwn = nt >> 5;
            for (int t = 0; t < T; t++) {
                const float* xr = ph.resid + (i64)t * in;
                float4 v[GS_NORM_WORDS];
                float ss = 0.f;
                if (tid < nt) {
#pragma unroll
                    for (int j = 0; j < GS_NORM_WORDS; ++j) {
                        const int c = j * nt + tid;
                        v[j] = c < n4 ? gc_ldcg4(xr + 4 * c) : make_float4(0.f, 0.f, 0.f, 0.f);
                    }
#pragma unroll
                    for (int j = 0; j < GS_NORM_WORDS; ++j)
                        ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
                    ss = warp_sum(ss);
                    if (lane == 0) red[warp] = ss;
                }
                ws_turn_wait(0);
                if (tid < nt) {
                    float r = lane < nwn ? red[lane] : 0.f;
                    r = warp_sum(r);
                    const float inv = rsqrtf(r / (float)in + a.eps);
                    const float4* w4 = (const float4*)ph.norm_w;
                    uint2* o = (uint2*)(xs + (i64)t * in);
#pragma unroll
                    for (int j = 0; j < GS_NORM_WORDS; ++j) {
                        const int c = j * nt + tid;
                        if (c < n4) {
                            const float4 ww = w4[c];
                            uint2 q;
                            q.x = gs_pack_bf16x2(v[j].x * inv * ww.x, v[j].y * inv * ww.y);
                            q.y = gs_pack_bf16x2(v[j].z * inv * ww.z, v[j].w * inv * ww.w);
                            o[c] = q;
                        }
                    }
                }
                ws_turn_wait(0);
            }
        } else {
            const int nx = (T * in) >> 3;
            for (int i = tid; i < nx; i += 32 * GS_CONSUMERS)
                ((uint4*)xs)[i] = gc_ldcg16((const uint4*)ph.x + i);
        }
        if (ph.mode == GS_F32_ACC) {
            for (int i = tid; i < T * n; i += 32 * GS_CONSUMERS) {
                const int t = i / n, k = i - t * n;
                ys[t * a.max_per_block + k] = gc_ldcg((const float*)ph.y + (i64)t * units + u0 + k);
            }
        }
        ws_turn_wait(0);  // x (and ys) complete
        const int nst = (n + upp - 1) / upp;
        const int nv = in >> 3;
        for (int j = 0; j < nst; j++, g++) {
            if (warp >= nc || g % nc != warp) continue;
            const int s = g % stages, k0 = j * upp, cnt = min(upp, n - k0);
            ws_mbar_wait(full0 + 8 * s, (unsigned)(g / stages) & 1u);
            const unsigned char* sp = st0 + (size_t)s * a.stage_bytes;
            for (int i = 0; i < cnt; i++) {
                const uint4* wr = (const uint4*)(sp + (size_t)i * row);
                const uint4* ur = (const uint4*)(sp + (size_t)(cnt + i) * row);
                float ag[MT][4], au[MT][4];
#pragma unroll
                for (int t = 0; t < MT; t++) {
#pragma unroll
                    for (int q = 0; q < 4; q++) ag[t][q] = au[t][q] = 0.f;
                }
#pragma unroll 4
                for (int v = lane; v < nv; v += 32) {
                    float wf[8], uf[8];
                    unpack8(wr[v], wf);
                    if (glu) unpack8(ur[v], uf);
#pragma unroll
                    for (int t = 0; t < MT; t++) {
                        if (t < T) {
                            float xf[8];
                            unpack8(((const uint4*)(xs + (i64)t * in))[v], xf);
#pragma unroll
                            for (int e = 0; e < 8; e++) ag[t][e & 3] += wf[e] * xf[e];
                            if (glu) {
#pragma unroll
                                for (int e = 0; e < 8; e++) au[t][e & 3] += uf[e] * xf[e];
                            }
                        }
                    }
                }
                const int k = k0 + i, u = u0 + k;
#pragma unroll
                for (int t = 0; t < MT; t++) {
                    if (t < T) {
                        const float sg = warp_sum((ag[t][0] + ag[t][1]) + (ag[t][2] + ag[t][3]));
                        const float su =
                            glu ? warp_sum((au[t][0] + au[t][1]) + (au[t][2] + au[t][3])) : 0.f;
                        if (lane == 0) {
                            const i64 o = (i64)t * units + u;
                            if (ph.mode == GS_BF16) {
                                ((bf16_t*)ph.y)[o] = f2bf(sg);
                            } else if (glu) {
                                const float gg = bf2f(f2bf(sg)), uu = bf2f(f2bf(su));
                                ((bf16_t*)ph.y)[o] = f2bf(gg / (1.f + __expf(-gg)) * uu);
                            } else {
                                float* yf = (float*)ph.y;
                                yf[o] = ph.mode == GS_F32_ACC ? ys[t * a.max_per_block + k] + sg : sg;
                            }
                        }
                    }
                }
            }
            __syncwarp();
            if (lane == 0) ws_mbar_arrive(empty0 + 8 * s);
        }
    }
}

// block: GS_THREADS; dynamic shared memory as above (the launcher's plan).
extern "C" __global__ void __launch_bounds__(GS_THREADS, 1)
    gemv_chain_t1(const __grid_constant__ GcArgs a) {
    WG_BODY(gemv_chain_impl<1>(a, wg_smem_aligned()))
}
