//! RoPE + KV-cache write (`ops::rope_qkv`): bias, q/k norms and the pool write against a host
//! reference; the per-token vector kernel bit-identical to the scalar one. Part of the
//! `cuda_kernels` test binary (scripts/gpu/run-all.sh kernels).

use super::cuda_support::*;
use super::{gpu, poisoned, pool_dims, pool_idx, up_i32};
use pdnode_cuda::device::{DevBuf, Gpu};
use pdnode_cuda::ops::{self, AttnDims};
use rand::Rng;
use rand::seq::SliceRandom;

/// RoPE's inverse frequencies for `theta`, `t` random positions below `max_pos` and `t`
/// distinct random cache slots below `slots_total`.
fn host_rope_args(
    r: &mut impl Rng,
    hd: usize,
    theta: f32,
    t: usize,
    max_pos: i32,
    slots_total: usize,
) -> (Vec<f32>, Vec<i32>, Vec<i64>) {
    let inv: Vec<f32> = (0..hd / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f32 / hd as f32))
        .collect();
    let pos: Vec<i32> = (0..t).map(|_| r.random_range(0..max_pos)).collect();
    let mut all_slots: Vec<i64> = (0..slots_total as i64).collect();
    all_slots.shuffle(r);
    (inv, pos, all_slots[..t].to_vec())
}

/// A rope call's device inputs: the qkv rows (bf16), inverse frequencies, positions and cache
/// slots of `tokens` tokens.
struct RopeInput {
    qkv: DevBuf,
    inv: DevBuf,
    pos: DevBuf,
    slots: DevBuf,
    tokens: usize,
}

impl RopeInput {
    fn upload(g: &Gpu, qkv: &[f32], inv: &[f32], pos: &[i32], slots: &[i64]) -> Self {
        let dslots = g.alloc(slots.len() * 8).unwrap();
        g.upload(&dslots, 0, slots).unwrap();
        RopeInput {
            qkv: g.upload_bf16(qkv).unwrap(),
            inv: g.upload_f32(inv).unwrap(),
            pos: up_i32(g, pos),
            slots: dslots,
            tokens: pos.len(),
        }
    }

    /// `ops::rope_qkv_ex` with kernel `k` and the optional (bias, q norm, k norm) into a fresh
    /// NaN-poisoned q output and pool of `layers` layers (layer `layer` written); returns both.
    fn run(
        &self,
        g: &Gpu,
        d: &AttnDims,
        (bias, q_norm, k_norm): (Option<&DevBuf>, Option<&DevBuf>, Option<&DevBuf>),
        layers: usize,
        layer: usize,
        k: ops::RopeKernel,
    ) -> (DevBuf, DevBuf) {
        let t = self.tokens;
        let qout = poisoned(g, t * d.num_heads * d.head_dim * 2);
        let pool = poisoned(g, layers * d.layer_elems() * 2);
        ops::rope_qkv_ex(
            g,
            d,
            &self.qkv,
            bias,
            q_norm,
            k_norm,
            &self.inv,
            self.pos.ptr(),
            self.slots.ptr(),
            t,
            &qout,
            &pool,
            layer,
            1e-6,
            k,
        )
        .unwrap();
        (qout, pool)
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn rope_qkv_bias_norm_and_cache_write() {
    let g = gpu();
    let mut r = rng("rope");
    for &(nh, nkv, hd, with_extras) in &[(8, 2, 128, false), (6, 3, 64, true), (4, 4, 16, true)] {
        let (t, bs, nb, layer, layers) = (11, 4, 16, 1, 2);
        let d = pool_dims(nh, nkv, hd, bs, nb);
        let ld = (nh + 2 * nkv) * hd;
        let qkv = randv(&mut r, t * ld, 2.0);
        let bias = with_extras.then(|| randv(&mut r, ld, 0.5));
        let qn = with_extras.then(|| randv(&mut r, hd, 1.0));
        let kn = with_extras.then(|| randv(&mut r, hd, 1.0));
        let (inv, pos, slots) = host_rope_args(&mut r, hd, 10000f32, t, 5000, nb * bs);
        let up = |v: &Option<Vec<f32>>| v.as_ref().map(|v| g.upload_f32(v).unwrap());
        let (db, dqn, dkn) = (up(&bias), up(&qn), up(&kn));
        let input = RopeInput::upload(&g, &qkv, &inv, &pos, &slots);
        let extras = (db.as_ref(), dqn.as_ref(), dkn.as_ref());
        let (qout, pool) = input.run(&g, &d, extras, layers, layer, ops::RopeKernel::Auto);
        let gq = g.download_bf16(&qout, t * nh * hd).unwrap();
        let gp = g.download_bf16(&pool, layers * d.layer_elems()).unwrap();
        let (mut wq, mut gq2, mut wkv, mut gkv) = (vec![], vec![], vec![], vec![]);
        for ti in 0..t {
            let row = |c: usize| -> Vec<f32> {
                (0..hd)
                    .map(|i| {
                        qkv[ti * ld + c * hd + i] + bias.as_ref().map_or(0.0, |b| b[c * hd + i])
                    })
                    .collect()
            };
            for h in 0..nh + nkv {
                let mut x = row(h);
                let nw = if h < nh { &qn } else { &kn };
                if let Some(nw) = nw {
                    x = rmsnorm(&x, nw, 1e-6);
                }
                rope(&mut x, pos[ti] as usize, &inv);
                if h < nh {
                    wq.extend_from_slice(&x);
                    gq2.extend_from_slice(&gq[(ti * nh + h) * hd..(ti * nh + h + 1) * hd]);
                } else {
                    let kh = h - nh;
                    let (blk, sl) = (slots[ti] as usize / bs, slots[ti] as usize % bs);
                    let k0 = pool_idx(&d, layer, blk, 0, sl, kh);
                    let v0 = pool_idx(&d, layer, blk, 1, sl, kh);
                    wkv.extend_from_slice(&x);
                    gkv.extend_from_slice(&gp[k0..k0 + hd]);
                    wkv.extend_from_slice(&row(nh + nkv + kh));
                    gkv.extend_from_slice(&gp[v0..v0 + hd]);
                }
            }
        }
        assert_eq!(gq.len(), gq2.len(), "every q element checked");
        let (eq, ekv) = (rel_err(&gq, &wq), rel_err(&gkv, &wkv));
        assert!(
            eq < 1e-2 && ekv < 1e-2,
            "nh={nh} nkv={nkv} hd={hd}: q {eq} kv {ekv}"
        );
        // Exactly 2 * t * nkv * hd pool elements were written; the rest is still NaN.
        let written = gp.iter().filter(|x| !x.is_nan()).count();
        assert_eq!(written, 2 * t * nkv * hd);
    }
}

/// The vectorized rope kernel (`rope_qkv_v4`, what prefill steps of 128+ tokens without bias or
/// q/k norm run) writes exactly what the scalar kernel writes: q rows and the pool, bit for bit
/// (the same expressions), at Llama-3.1-8B's head shape and smaller ones, positions up to 100k;
/// `Auto` takes it from 128 tokens; a bias makes the forced vector kernel a shape error.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn rope_qkv_vector_kernel_equals_scalar() {
    let g = gpu();
    let mut r = rng("rope_v4");
    for &(nh, nkv, hd, t) in &[
        (32usize, 8usize, 128usize, 300usize),
        (8, 2, 128, 7),
        (9, 3, 64, 130),
        (4, 4, 16, 129),
    ] {
        let (bs, layer, layers) = (16, 1, 2);
        let nb = t.div_ceil(bs) + 3;
        let d = pool_dims(nh, nkv, hd, bs, nb);
        let ld = (nh + 2 * nkv) * hd;
        let qkv = randv(&mut r, t * ld, 2.0);
        let (inv, pos, slots) = host_rope_args(&mut r, hd, 500000f32, t, 100_000, nb * bs);
        let input = RopeInput::upload(&g, &qkv, &inv, &pos, &slots);
        let run = |k: ops::RopeKernel| {
            let (qout, pool) = input.run(&g, &d, (None, None, None), layers, layer, k);
            let bits = |b: &DevBuf, n: usize| -> Vec<u32> {
                g.download_bf16(b, n)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            };
            (
                bits(&qout, t * nh * hd),
                bits(&pool, layers * d.layer_elems()),
            )
        };
        let scalar = run(ops::RopeKernel::Scalar);
        let vector = run(ops::RopeKernel::Vector);
        let q_same = scalar.0 == vector.0;
        let pool_same = scalar.1 == vector.1;
        println!(
            "{} rope_qkv_v4 vs scalar nh={nh} nkv={nkv} hd={hd} t={t}: q {}, pool {}",
            if q_same && pool_same { "PASS" } else { "FAIL" },
            if q_same { "identical" } else { "differs" },
            if pool_same { "identical" } else { "differs" },
        );
        assert!(q_same && pool_same, "nh={nh} nkv={nkv} hd={hd} t={t}");
        if t >= ops::ROPE_V4_MIN_TOKENS {
            assert!(run(ops::RopeKernel::Auto) == vector, "Auto at {t} tokens");
        }
    }
    // a bias is the scalar kernel's alone
    let d = pool_dims(4, 2, 64, 16, 4);
    let t = 2;
    let ld = 8 * 64;
    let dqkv = g.upload_bf16(&vec![0.5; t * ld]).unwrap();
    let bias = g.upload_f32(&vec![0.0; ld]).unwrap();
    let dinv = g.upload_f32(&[1.0; 32]).unwrap();
    let dpos = up_i32(&g, &[0, 1]);
    let dslots = g.alloc(t * 8).unwrap();
    g.upload(&dslots, 0, &[0i64, 1]).unwrap();
    let (qout, pool) = (
        g.alloc(t * 4 * 64 * 2).unwrap(),
        g.alloc(d.layer_elems() * 2).unwrap(),
    );
    let e = ops::rope_qkv_ex(
        &g,
        &d,
        &dqkv,
        Some(&bias),
        None,
        None,
        &dinv,
        dpos.ptr(),
        dslots.ptr(),
        t,
        &qout,
        &pool,
        0,
        1e-6,
        ops::RopeKernel::Vector,
    );
    assert!(
        matches!(e, Err(pdnode_cuda::CudaError::Shape { .. })),
        "{e:?}"
    );
}
