//! Programmatic dependent launch (`engine.cuda.pdl`, `pdnode_cuda::launch`): a decode-like chain of
//! our kernels, each reading what the one before it wrote (embedding gather, then rounds of
//! RMSNorm -> gate_up GEMV -> SwiGLU -> down GEMV accumulating into the f32 residual), run with
//! plain launches, with PDL launches, and plain again: the outputs must be bit-identical (a
//! kernel that touched memory before its `griddepcontrol.wait` would read its predecessor's
//! half-written output). Also times the chain both ways (printed, not asserted). Part of the
//! `cuda_kernels` test binary; prints one PASS/FAIL line.

use super::cuda_support::*;
use super::gpu;
use pdnode_cuda::blas::OutType;
use pdnode_cuda::device::{DevBuf, Gpu};
use pdnode_cuda::ops::{self, LinearImpl};

const T: usize = 2;
const H: usize = 512;
const I: usize = 1024;
const VOCAB: usize = 64;
const ROUNDS: usize = 64;
/// Kernels one chain launches: the gather, four a round, the final norm.
const KERNELS: usize = 1 + 4 * ROUNDS + 1;

struct Chain {
    table: DevBuf,
    ids: DevBuf,
    norm_w: DevBuf,
    w1: DevBuf,
    w2: DevBuf,
    resid: DevBuf,
    x: DevBuf,
    gu: DevBuf,
    act: DevBuf,
}

impl Chain {
    fn new(g: &Gpu, r: &mut rand_chacha::ChaCha8Rng) -> Self {
        use rand::Rng;
        let ids: Vec<u32> = (0..T).map(|_| r.random_range(0..VOCAB as u32)).collect();
        let idb = g.alloc(T * 4).unwrap();
        g.upload(&idb, 0, &ids).unwrap();
        let norm_w: Vec<f32> = (0..H).map(|_| r.random_range(0.5..1.5)).collect();
        Self {
            table: g.upload_bf16(&randv(r, VOCAB * H, 1.0)).unwrap(),
            ids: idb,
            norm_w: g.upload_f32(&norm_w).unwrap(),
            w1: g.upload_bf16(&randv(r, 2 * I * H, 0.05)).unwrap(),
            w2: g.upload_bf16(&randv(r, H * I, 0.05)).unwrap(),
            resid: g.alloc(T * H * 4).unwrap(),
            x: g.alloc(T * H * 2).unwrap(),
            gu: g.alloc(T * 2 * I * 2).unwrap(),
            act: g.alloc(T * I * 2).unwrap(),
        }
    }

    /// NaN into every buffer the chain writes, and waits (so a capture may begin after it).
    fn poison(&self, g: &Gpu) {
        for b in [&self.resid, &self.x, &self.gu, &self.act] {
            g.memset(b, 0xFF).unwrap();
        }
        g.sync().unwrap();
    }

    /// Enqueues the chain (no allocation, no wait: capturable).
    fn enqueue(&self, g: &Gpu) {
        let norm = |g: &Gpu| {
            ops::add_rmsnorm(
                g,
                &self.resid,
                T,
                None,
                &self.norm_w,
                &self.x,
                None,
                T,
                H,
                1e-5,
            )
            .unwrap()
        };
        ops::embed_gather(g, &self.table, VOCAB, self.ids.ptr(), T, &self.resid, H).unwrap();
        for round in 0..ROUNDS {
            norm(g);
            let (x, gu, act) = (&self.x, &self.gu, &self.act);
            ops::linear(
                g,
                2 * I,
                T,
                H,
                &self.w1,
                x,
                gu,
                OutType::Bf16,
                false,
                LinearImpl::GemvMma,
            )
            .unwrap();
            ops::swiglu(g, gu, act, T, I).unwrap();
            // both GEMV kernel families, alternately
            let how = if round % 2 == 0 {
                LinearImpl::GemvMma
            } else {
                LinearImpl::Gemv
            };
            ops::linear(
                g,
                H,
                T,
                I,
                &self.w2,
                act,
                &self.resid,
                OutType::F32,
                true,
                how,
            )
            .unwrap();
        }
        norm(g);
    }

    /// The residual and the final normed rows (waits).
    fn outputs(&self, g: &Gpu) -> (Vec<f32>, Vec<f32>) {
        (
            g.download_f32(&self.resid, T * H).unwrap(),
            g.download_bf16(&self.x, T * H).unwrap(),
        )
    }

    /// Poisons, runs the chain eagerly and waits: (seconds, outputs).
    fn run(&self, g: &Gpu) -> (f64, (Vec<f32>, Vec<f32>)) {
        self.poison(g);
        let t0 = std::time::Instant::now();
        self.enqueue(g);
        g.sync().unwrap();
        (t0.elapsed().as_secs_f64(), self.outputs(g))
    }

    /// Captures the chain into a CUDA graph (with the GPU's current launch kind) and replays it
    /// `reps` times: (best seconds of a replay, outputs of the last).
    fn replay(&self, g: &Gpu, reps: usize) -> (f64, (Vec<f32>, Vec<f32>)) {
        use cudarc::driver::sys;
        self.poison(g);
        g.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        self.enqueue(g);
        let graph = g
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("a graph");
        graph.upload().unwrap();
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            self.poison(g);
            let t0 = std::time::Instant::now();
            graph.launch().unwrap();
            g.sync().unwrap();
            best = best.min(t0.elapsed().as_secs_f64());
        }
        (best, self.outputs(g))
    }
}

/// Elements whose bits differ.
fn differing(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn pdl_kernel_chain_matches_plain_launches() {
    let mut g = gpu();
    let mut r = rng("pdl_chain");
    let c = Chain::new(&g, &mut r);
    if !g.set_pdl(true) {
        println!(
            "PDL chain: SKIP (compute capability {:?} or the driver takes no programmatic launches)",
            g.compute_capability
        );
        return;
    }
    let mut eager = [f64::INFINITY; 2];
    let mut outs: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
    // plain, PDL, plain again (a control: a difference between the two plain runs would be a
    // nondeterministic kernel, not PDL), then more of both for the timing
    for (i, pdl) in [false, true, false, true, false, true, false, true]
        .into_iter()
        .enumerate()
    {
        assert_eq!(g.set_pdl(pdl), pdl);
        let (secs, out) = c.run(&g);
        eager[usize::from(pdl)] = eager[usize::from(pdl)].min(secs);
        if i < 3 {
            outs.push(out);
        }
    }
    // the same chain captured into a CUDA graph each way, replayed (device-bound timing)
    let mut graph = [0f64; 2];
    for pdl in [false, true] {
        assert_eq!(g.set_pdl(pdl), pdl);
        let (secs, out) = c.replay(&g, 10);
        graph[usize::from(pdl)] = secs;
        outs.push(out);
    }
    let plain = &outs[0];
    assert!(
        plain.0.iter().all(|v| v.is_finite()),
        "the chain wrote the residual"
    );
    assert!(
        plain.1.iter().all(|v| v.is_finite()),
        "the chain wrote the normed rows"
    );
    let diff = |o: &(Vec<f32>, Vec<f32>)| differing(&o.0, &plain.0) + differing(&o.1, &plain.1);
    let (control, with, g_plain, g_pdl) = (
        diff(&outs[2]),
        diff(&outs[1]),
        diff(&outs[3]),
        diff(&outs[4]),
    );
    let ok = control + with + g_plain + g_pdl == 0;
    let us = |s: f64| s * 1e6;
    println!(
        "PDL chain: {}, {KERNELS} dependent kernels (T={T}, H={H}, I={I}), values differing from the first plain eager run (of {} each): PDL eager {with}, plain eager again {control}, plain graph {g_plain}, PDL graph {g_pdl}",
        if ok { "PASS" } else { "FAIL" },
        2 * T * H
    );
    println!(
        "PDL chain timing (best, host-timed): eager plain {:.0} us, PDL {:.0} us; graph replay plain {:.0} us, PDL {:.0} us ({:.2} us a kernel saved in the graph)",
        us(eager[0]),
        us(eager[1]),
        us(graph[0]),
        us(graph[1]),
        us(graph[0] - graph[1]) / KERNELS as f64
    );
    assert_eq!(control, 0, "two plain runs of the chain differ");
    assert_eq!(with, 0, "PDL changed the chain's results (eager)");
    assert_eq!(g_plain, 0, "the plain graph's results differ from eager");
    assert_eq!(g_pdl, 0, "PDL changed the chain's results (graph)");
}
