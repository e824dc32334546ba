//! The latent-attention split on the host: every rank's slices put together are the whole
//! layer, each rank's slice has its rank spec's shapes, and the per-rank partial outputs of
//! attention and of the MLP or experts (plain f32, as the device computes them before its
//! all-reduce) sum to the unsplit layer's.

use super::*;
use pdnode_engine::backend::cpu::route_experts;
use pdnode_engine::loader::{LoadedModel, ModelWeights, load_path};
use pdnode_engine::spec::MLA_LORA_NORM_EPS;

/// The fixture `name`: under `PDNODE_FIXTURES` when set (scripts/gpu/run-all.sh sets it: on the
/// GPU host this binary runs from another checkout than the one it was built in), else this
/// checkout's.
fn fixture(name: &str) -> LoadedModel {
    let dir = std::env::var_os("PDNODE_FIXTURES")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../pdnode-engine/tests/fixtures")
        })
        .join(name);
    load_path(&dir).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn mla_weights(m: &LoadedModel) -> &MlaWeights {
    match &m.weights {
        ModelWeights::HostMla(w) => w,
        _ => panic!("not a latent-attention model"),
    }
}

/// The rows of `parts` stacked.
fn stack_rows(parts: &[&Tensor]) -> Vec<f32> {
    parts.iter().flat_map(|t| t.data.iter().copied()).collect()
}

/// Each row of `parts` side by side (`[rows][sum of cols]`).
fn stack_cols(parts: &[&Tensor]) -> Vec<f32> {
    let rows = parts[0].shape[0];
    (0..rows)
        .flat_map(|r| {
            parts.iter().flat_map(move |t| {
                let c = t.shape[1];
                t.data[r * c..(r + 1) * c].iter().copied()
            })
        })
        .collect()
}

fn query_rows(q: &MlaQuery) -> &Tensor {
    match q {
        MlaQuery::Direct { wq } => wq,
        MlaQuery::LowRank { wq_b, .. } => wq_b,
    }
}

fn mlps(f: &Ffn) -> Vec<&Expert> {
    match f {
        Ffn::Dense(e) => vec![e],
        Ffn::Moe(m) => m.experts.iter().chain(&m.shared).collect(),
    }
}

#[test]
fn every_ranks_slices_put_together_are_the_whole_layer() {
    for name in ["deepseek_v2", "deepseek_v3"] {
        let model = fixture(name);
        let (spec, w) = (&model.spec, mla_weights(&model));
        let m = spec.mla.as_ref().unwrap();
        for size in [2, 4] {
            let shards: Vec<Shard> = (0..size).map(|rank| Shard { rank, size }).collect();
            // each rank's slice is a model of its rank spec's shapes
            for &sh in &shards {
                sh.check(spec).unwrap();
                let rank = MlaWeights {
                    embed: w.embed.clone(),
                    layers: w
                        .layers
                        .iter()
                        .map(|l| shard_layer(l, m, spec.num_heads, sh).into_owned())
                        .collect(),
                    final_norm: w.final_norm.clone(),
                    lm_head: w.lm_head.clone(),
                };
                rank.check_shapes(&sh.rank_spec(spec))
                    .unwrap_or_else(|e| panic!("{name} rank {} of {size}: {e}", sh.rank));
            }
            for (li, l) in w.layers.iter().enumerate() {
                let parts: Vec<_> = shards
                    .iter()
                    .map(|&sh| shard_layer(l, m, spec.num_heads, sh))
                    .collect();
                let tag = format!("{name} TP = {size} layer {li}");
                let all = |f: &dyn Fn(&MlaLayerWeights) -> &Tensor| -> Vec<&Tensor> {
                    parts.iter().map(|p| f(p)).collect()
                };
                assert_eq!(
                    stack_rows(&all(&|p| query_rows(&p.q))),
                    query_rows(&l.q).data,
                    "{tag} q"
                );
                assert_eq!(stack_rows(&all(&|p| &p.wkv_b)), l.wkv_b.data, "{tag} kv_b");
                assert_eq!(stack_cols(&all(&|p| &p.wo)), l.wo.data, "{tag} o_proj");
                // rank r holds heads [r nh / size, (r + 1) nh / size): its kv_b rows and
                // o_proj columns are those heads' (checked against the whole by index)
                let (ph, vd) = (m.qk_nope_head_dim + m.v_head_dim, m.v_head_dim);
                let per = spec.num_heads / size;
                for (r, p) in parts.iter().enumerate() {
                    let kvb = &l.wkv_b.data[r * per * ph * m.kv_lora_rank..];
                    assert_eq!(&kvb[..p.wkv_b.data.len()], &p.wkv_b.data[..], "{tag}");
                    let cols = l.wo.shape[1];
                    assert_eq!(p.wo.data[0], l.wo.data[r * per * vd], "{tag}");
                    assert_eq!(p.wo.data[per * vd], l.wo.data[cols + r * per * vd], "{tag}");
                }
                // the replicated tensors are whole on every rank
                for p in &parts {
                    assert_eq!(p.wkv_a, l.wkv_a);
                    assert_eq!((&p.attn_norm, &p.kv_a_norm), (&l.attn_norm, &l.kv_a_norm));
                    assert_eq!(p.mlp_norm, l.mlp_norm);
                    if let (
                        MlaQuery::LowRank { wq_a, q_a_norm, .. },
                        MlaQuery::LowRank {
                            wq_a: a,
                            q_a_norm: n,
                            ..
                        },
                    ) = (&p.q, &l.q)
                    {
                        assert_eq!((wq_a, q_a_norm), (a, n), "{tag} q_a");
                    }
                    if let (Ffn::Moe(pm), Ffn::Moe(lm)) = (&p.ffn, &l.ffn) {
                        assert_eq!(pm.router, lm.router, "{tag} router");
                        assert_eq!(pm.score_bias, lm.score_bias, "{tag} bias");
                    }
                }
                // every MLP (dense, each routed expert, the shared ones) by its intermediate size
                let whole = mlps(&l.ffn);
                for (i, e) in whole.iter().enumerate() {
                    let ps: Vec<&Expert> = parts.iter().map(|p| mlps(&p.ffn)[i]).collect();
                    let g: Vec<&Tensor> = ps.iter().map(|x| &x.w_gate).collect();
                    let u: Vec<&Tensor> = ps.iter().map(|x| &x.w_up).collect();
                    let d: Vec<&Tensor> = ps.iter().map(|x| &x.w_down).collect();
                    assert_eq!(stack_rows(&g), e.w_gate.data, "{tag} mlp {i} gate");
                    assert_eq!(stack_rows(&u), e.w_up.data, "{tag} mlp {i} up");
                    assert_eq!(stack_cols(&d), e.w_down.data, "{tag} mlp {i} down");
                }
            }
        }
        // one rank borrows the layer as is
        let l = &w.layers[0];
        assert!(matches!(
            shard_layer(l, m, spec.num_heads, Shard::WHOLE),
            Cow::Borrowed(_)
        ));
    }
}

/// `x [t][k] * w^T` for `w [n][k]`.
fn matmul(x: &[f32], w: &Tensor) -> Vec<f32> {
    let (n, k) = (w.shape[0], w.shape[1]);
    x.chunks_exact(k)
        .flat_map(|row| {
            (0..n).map(move |j| {
                let wr = &w.data[j * k..(j + 1) * k];
                row.iter().zip(wr).map(|(a, b)| a * b).sum::<f32>()
            })
        })
        .collect()
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    x.chunks_exact(w.len())
        .flat_map(|r| {
            let ms = r.iter().map(|v| v * v).sum::<f32>() / r.len() as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            r.iter().zip(w).map(move |(v, g)| v * inv * g)
        })
        .collect()
}

/// One rank's share of a layer's attention output `[t][hidden]` (before the all-reduce): its
/// heads (from its slice's shapes) over `t` causal positions. RoPE is left out: it turns each
/// head's and the shared key's rope part alike, whatever the split.
fn attention_share(l: &MlaLayerWeights, m: &MlaSpec, x: &[f32], t: usize, eps: f32) -> Vec<f32> {
    let (nope, rope, vd, r) = (
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
        m.kv_lora_rank,
    );
    let (qk, ph) = (nope + rope, nope + vd);
    let heads = l.wo.shape[1] / vd;
    let xn = rmsnorm(x, &l.attn_norm.data, eps);
    let q = match &l.q {
        MlaQuery::Direct { wq } => matmul(&xn, wq),
        MlaQuery::LowRank {
            wq_a,
            q_a_norm,
            wq_b,
        } => matmul(
            &rmsnorm(&matmul(&xn, wq_a), &q_a_norm.data, MLA_LORA_NORM_EPS),
            wq_b,
        ),
    };
    let kva = matmul(&xn, &l.wkv_a);
    let ld = m.latent_dim();
    let lat: Vec<Vec<f32>> = (0..t)
        .map(|j| {
            let mut c = rmsnorm(
                &kva[j * ld..j * ld + r],
                &l.kv_a_norm.data,
                MLA_LORA_NORM_EPS,
            );
            c.extend_from_slice(&kva[j * ld + r..(j + 1) * ld]);
            c
        })
        .collect();
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    let scale = 1.0 / (qk as f32).sqrt();
    let mut att = vec![0f32; t * heads * vd];
    for hd in 0..heads {
        let kb = &l.wkv_b.data[hd * ph * r..(hd + 1) * ph * r];
        // expanded keys and values of every position (what transformers computes)
        let keys: Vec<Vec<f32>> = lat
            .iter()
            .map(|c| {
                (0..nope)
                    .map(|i| dot(&kb[i * r..(i + 1) * r], &c[..r]))
                    .collect()
            })
            .collect();
        let vals: Vec<Vec<f32>> = lat
            .iter()
            .map(|c| {
                (nope..ph)
                    .map(|i| dot(&kb[i * r..(i + 1) * r], &c[..r]))
                    .collect()
            })
            .collect();
        for i in 0..t {
            let qh = &q[(i * heads + hd) * qk..(i * heads + hd + 1) * qk];
            let s: Vec<f32> = (0..=i)
                .map(|j| (dot(&qh[..nope], &keys[j]) + dot(&qh[nope..], &lat[j][r..])) * scale)
                .collect();
            let mx = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = s.iter().map(|v| (v - mx).exp()).collect();
            let sum: f32 = e.iter().sum();
            let o = &mut att[(i * heads + hd) * vd..(i * heads + hd + 1) * vd];
            for (j, p) in e.iter().enumerate() {
                for (d, v) in o.iter_mut().zip(&vals[j]) {
                    *d += p / sum * v;
                }
            }
        }
    }
    matmul(&att, &l.wo)
}

fn swiglu(e: &Expert, xn: &[f32]) -> Vec<f32> {
    let g = matmul(xn, &e.w_gate);
    let u = matmul(xn, &e.w_up);
    let act: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        .collect();
    matmul(&act, &e.w_down)
}

/// One rank's share of a layer's MLP or experts output `[t][hidden]`: routed on the whole router
/// (every rank the same picks), its slice of each picked expert plus of the shared ones.
fn ffn_share(l: &MlaLayerWeights, spec: &ModelSpec, x: &[f32], eps: f32) -> Vec<f32> {
    let h = spec.hidden_size;
    let xn = rmsnorm(x, &l.mlp_norm.data, eps);
    match &l.ffn {
        Ffn::Dense(e) => swiglu(e, &xn),
        Ffn::Moe(mw) => {
            let e = spec.moe.as_ref().unwrap();
            let mut out = mw
                .shared
                .as_ref()
                .map_or(vec![0f32; xn.len()], |s| swiglu(s, &xn));
            for (row, o) in xn.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
                let logits = matmul(row, &mw.router);
                let bias = mw.score_bias.as_ref().map(|b| b.data.as_slice());
                for (x, wt) in route_experts(&logits, bias, e) {
                    for (d, v) in o.iter_mut().zip(swiglu(&mw.experts[x], row)) {
                        *d += wt * v;
                    }
                }
            }
            out
        }
    }
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let num: f32 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f32 = want.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}

/// The algebra of the split: each rank's share of attention and of the MLP or experts, summed
/// over the ranks (the all-reduce), is the unsplit layer's output within f32 rounding.
#[test]
fn per_rank_shares_of_attention_and_experts_sum_to_the_whole_layer() {
    let t = 5;
    for name in ["deepseek_v2", "deepseek_v3"] {
        let model = fixture(name);
        let (spec, w) = (&model.spec, mla_weights(&model));
        let m = spec.mla.as_ref().unwrap();
        let h = spec.hidden_size;
        let x: Vec<f32> = (0..t * h)
            .map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 0.8)
            .collect();
        let eps = spec.rms_norm_eps;
        for size in [2, 4] {
            for (li, l) in w.layers.iter().enumerate() {
                let whole_attn = attention_share(l, m, &x, t, eps);
                let whole_ffn = ffn_share(l, spec, &x, eps);
                let mut attn = vec![0f32; t * h];
                let mut ffn = vec![0f32; t * h];
                for rank in 0..size {
                    let p = shard_layer(l, m, spec.num_heads, Shard { rank, size });
                    let a = attention_share(&p, m, &x, t, eps);
                    let f = ffn_share(&p, spec, &x, eps);
                    // a rank's share is a real part of the output, not the whole of it
                    assert!(rel_err(&a, &whole_attn) > 1e-3, "{name} layer {li}");
                    for (s, v) in attn.iter_mut().zip(a) {
                        *s += v;
                    }
                    for (s, v) in ffn.iter_mut().zip(f) {
                        *s += v;
                    }
                }
                let (ea, ef) = (rel_err(&attn, &whole_attn), rel_err(&ffn, &whole_ffn));
                assert!(
                    ea < 1e-5,
                    "{name} TP = {size} layer {li}: attention rel err {ea}"
                );
                assert!(ef < 1e-5, "{name} TP = {size} layer {li}: MLP rel err {ef}");
            }
        }
    }
}
