//! Shared helpers of the CUDA tests: fresh seeds, bf16 rounding, error norms, and an f32
//! reference forward pass with the CPU backend's semantics (HF rotate_half RoPE, GQA, SwiGLU,
//! qkv bias, q/k norm, tied embeddings).
#![allow(dead_code)]

use pdnode_engine::spec::{Arch, ModelSpec, RopeScaling};
use pdnode_engine::weights::{LayerWeights, Tensor, Weights};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub const NEEDS_GPU: &str = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host";

/// A fresh seed per run (printed, so a failure can be replayed with PDNODE_TEST_SEED).
pub fn rng(test: &str) -> ChaCha8Rng {
    let seed = std::env::var("PDNODE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("{test}: PDNODE_TEST_SEED={seed}");
    ChaCha8Rng::seed_from_u64(seed)
}

pub fn bf16r(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

pub fn randv(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| bf16r(rng.random_range(-scale..scale)))
        .collect()
}

/// ||a - b|| / ||b||; NaN anywhere in `a` fails (returns infinity).
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    if a.iter().any(|x| !x.is_finite()) {
        return f32::INFINITY;
    }
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt() as f32
}

pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * w).collect()
}

/// HF inverse frequencies with scaling (same formula as the backend, computed independently).
pub fn inv_freq(s: &ModelSpec) -> Vec<f32> {
    let hd = s.head_dim;
    (0..hd / 2)
        .map(|i| {
            let base = 1.0 / (s.rope_theta as f64).powf((2 * i) as f64 / hd as f64);
            match &s.rope_scaling {
                None => base as f32,
                Some(RopeScaling::Linear { factor }) => (base / *factor as f64) as f32,
                Some(RopeScaling::Yarn { .. }) => panic!("YaRN is a DeepSeek (CPU-only) scaling"),
                Some(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                }) => {
                    let o = *original_max_position_embeddings as f64;
                    let (lo, hi, f) = (
                        *low_freq_factor as f64,
                        *high_freq_factor as f64,
                        *factor as f64,
                    );
                    let wl = 2.0 * std::f64::consts::PI / base;
                    let v = if wl < o / hi {
                        base
                    } else if wl > o / lo {
                        base / f
                    } else {
                        let sm = (o / wl - lo) / (hi - lo);
                        (1.0 - sm) * base / f + sm * base
                    };
                    v as f32
                }
            }
        })
        .collect()
}

/// rotate_half RoPE of one head in place.
pub fn rope(x: &mut [f32], pos: usize, inv: &[f32]) {
    let half = x.len() / 2;
    for i in 0..half {
        let a = pos as f32 * inv[i];
        let (s, c) = a.sin_cos();
        let (x1, x2) = (x[i], x[i + half]);
        x[i] = x1 * c - x2 * s;
        x[i + half] = x2 * c + x1 * s;
    }
}

/// `y[o] = sum_i w[o, i] x[i]`.
pub fn matvec(w: &Tensor, x: &[f32]) -> Vec<f32> {
    let (out, inp) = (w.shape[0], w.shape[1]);
    (0..out)
        .map(|o| {
            w.data[o * inp..(o + 1) * inp]
                .iter()
                .zip(x)
                .map(|(a, b)| a * b)
                .sum()
        })
        .collect()
}

/// Causal attention for one query (already RoPE'd) over `keys`/`vals` (`[ctx][hd]`).
pub fn attend(q: &[f32], keys: &[Vec<f32>], vals: &[Vec<f32>]) -> Vec<f32> {
    let hd = q.len();
    let scale = 1.0 / (hd as f32).sqrt();
    let s: Vec<f32> = keys
        .iter()
        .map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale)
        .collect();
    let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let p: Vec<f32> = s.iter().map(|v| (v - m).exp()).collect();
    let l: f32 = p.iter().sum();
    let mut o = vec![0f32; hd];
    for (pi, v) in p.iter().zip(vals) {
        for d in 0..hd {
            o[d] += pi / l * v[d];
        }
    }
    o
}

/// One KV head's (k, v) at one position.
pub type KvHead = (Vec<f32>, Vec<f32>);

/// f32 reference model: per sequence, a KV cache `[layer][pos] -> (k heads, v heads)`.
pub struct RefModel<'a> {
    pub s: &'a ModelSpec,
    pub w: &'a Weights,
    pub inv: Vec<f32>,
    /// `[layer][pos][kv_head]` -> (k, v)
    pub kv: Vec<Vec<Vec<KvHead>>>,
}

impl<'a> RefModel<'a> {
    pub fn new(s: &'a ModelSpec, w: &'a Weights) -> Self {
        Self {
            s,
            w,
            inv: inv_freq(s),
            kv: vec![Vec::new(); s.num_layers],
        }
    }

    /// Runs one token at the next position; returns the logits.
    pub fn step(&mut self, tok: u32) -> Vec<f32> {
        let s = self.s;
        let (h, hd, nh, nkv) = (s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads);
        let pos = self.kv[0].len();
        let mut x = self.w.embed.data[tok as usize * h..(tok as usize + 1) * h].to_vec();
        for (li, l) in self.w.layers.iter().enumerate() {
            let xn = rmsnorm(&x, &l.attn_norm.data, s.rms_norm_eps);
            let mut q = matvec(&l.wq, &xn);
            let mut k = matvec(&l.wk, &xn);
            let mut v = matvec(&l.wv, &xn);
            if let (Some(bq), Some(bk), Some(bv)) = (&l.bq, &l.bk, &l.bv) {
                q.iter_mut().zip(&bq.data).for_each(|(a, b)| *a += b);
                k.iter_mut().zip(&bk.data).for_each(|(a, b)| *a += b);
                v.iter_mut().zip(&bv.data).for_each(|(a, b)| *a += b);
            }
            let mut heads_k = Vec::new();
            for kh in 0..nkv {
                let mut kk = k[kh * hd..(kh + 1) * hd].to_vec();
                if let Some(n) = &l.k_norm {
                    kk = rmsnorm(&kk, &n.data, s.rms_norm_eps);
                }
                rope(&mut kk, pos, &self.inv);
                heads_k.push((kk, v[kh * hd..(kh + 1) * hd].to_vec()));
            }
            self.kv[li].push(heads_k);
            let mut attn = vec![0f32; nh * hd];
            for qh in 0..nh {
                let mut qq = q[qh * hd..(qh + 1) * hd].to_vec();
                if let Some(n) = &l.q_norm {
                    qq = rmsnorm(&qq, &n.data, s.rms_norm_eps);
                }
                rope(&mut qq, pos, &self.inv);
                let kh = qh / (nh / nkv);
                let keys: Vec<Vec<f32>> = self.kv[li].iter().map(|p| p[kh].0.clone()).collect();
                let vals: Vec<Vec<f32>> = self.kv[li].iter().map(|p| p[kh].1.clone()).collect();
                attn[qh * hd..(qh + 1) * hd].copy_from_slice(&attend(&qq, &keys, &vals));
            }
            let o = matvec(&l.wo, &attn);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let xn = rmsnorm(&x, &l.mlp_norm.data, s.rms_norm_eps);
            let g = matvec(&l.w_gate, &xn);
            let u = matvec(&l.w_up, &xn);
            let act: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let d = matvec(&l.w_down, &act);
            x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        }
        let xn = rmsnorm(&x, &self.w.final_norm.data, s.rms_norm_eps);
        matvec(self.w.output(), &xn)
    }
}

/// A tiny spec; `qwen3` adds q/k norm and qkv bias (covering both code paths), llama3 scaling.
pub fn tiny_spec(qwen_like: bool, tied: bool) -> ModelSpec {
    ModelSpec {
        arch: if qwen_like { Arch::Qwen3 } else { Arch::Llama },
        hidden_size: 96,
        intermediate_size: 160,
        num_layers: 3,
        num_heads: 6,
        num_kv_heads: 2,
        head_dim: 32,
        vocab_size: 251,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: if qwen_like {
            None
        } else {
            Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64,
            })
        },
        max_position_embeddings: 4096,
        tie_word_embeddings: tied,
        qkv_bias: qwen_like,
        qk_norm: qwen_like,
        sliding_window: None,
        mla: None,
        moe: None,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

/// Random weights, every value bf16-representable (so the device copy is exact).
pub fn tiny_weights(s: &ModelSpec, rng: &mut ChaCha8Rng) -> Weights {
    let (h, q, kv, i) = (s.hidden_size, s.q_dim(), s.kv_dim(), s.intermediate_size);
    let mut t = |shape: Vec<usize>, scale: f32| {
        let n = shape.iter().product();
        Tensor::new(shape, randv(rng, n, scale))
    };
    let sh = 1.0 / (h as f32).sqrt();
    let layers = (0..s.num_layers)
        .map(|_| LayerWeights {
            attn_norm: t(vec![h], 1.0).map_abs_plus_half(),
            wq: t(vec![q, h], sh * 1.7),
            wk: t(vec![kv, h], sh * 1.7),
            wv: t(vec![kv, h], sh * 1.7),
            bq: s.qkv_bias.then(|| t(vec![q], 0.3)),
            bk: s.qkv_bias.then(|| t(vec![kv], 0.3)),
            bv: s.qkv_bias.then(|| t(vec![kv], 0.3)),
            q_norm: s
                .qk_norm
                .then(|| t(vec![s.head_dim], 1.0).map_abs_plus_half()),
            k_norm: s
                .qk_norm
                .then(|| t(vec![s.head_dim], 1.0).map_abs_plus_half()),
            wo: t(vec![h, q], 1.0 / (q as f32).sqrt()),
            mlp_norm: t(vec![h], 1.0).map_abs_plus_half(),
            w_gate: t(vec![i, h], sh * 1.7),
            w_up: t(vec![i, h], sh * 1.7),
            w_down: t(vec![h, i], 1.0 / (i as f32).sqrt()),
        })
        .collect();
    Weights {
        embed: t(vec![s.vocab_size, h], 1.0),
        layers,
        final_norm: t(vec![h], 1.0).map_abs_plus_half(),
        lm_head: (!s.tie_word_embeddings).then(|| t(vec![s.vocab_size, h], sh * 3.0)),
    }
}

pub trait AbsPlusHalf {
    fn map_abs_plus_half(self) -> Self;
}

impl AbsPlusHalf for Tensor {
    /// Norm weights around 1 (0.5..1.5), as trained models have.
    fn map_abs_plus_half(mut self) -> Self {
        self.data.iter_mut().for_each(|x| *x = bf16r(x.abs() + 0.5));
        self
    }
}
