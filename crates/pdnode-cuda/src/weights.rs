//! Model weights on the device: projections in bf16 (q/k/v fused into one `[q + 2 kv, hidden]`
//! matrix, gate/up into one `[2 inter, hidden]`), norms and biases in f32.

use super::CudaError;
use super::device::{DevBuf, Gpu};
use super::mla_weights::DevMla;
use super::ops;
use pdnode_engine::spec::{ModelSpec, RopeScaling};
use pdnode_engine::weights::{MlaWeights, Weights};

/// Which tensor-parallel slice of the model one GPU holds: rank `rank` of `size`. Heads,
/// KV heads and the MLP intermediate dimension are split evenly (q/k/v and gate/up by rows,
/// o-proj and down by columns); embeddings, norms and the lm_head are replicated.
///
/// A latent-attention model (DeepSeek) splits its query heads (q / q_b rows, each head's rows
/// of kv_b, o_proj's input columns) and every MLP by its intermediate size (the dense layers,
/// each routed expert and the shared experts: gate/up rows, down columns); kv_a, the norms, the
/// latent it writes to the pool and the MoE router are the same on every rank (`mla_weights.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
}

impl Shard {
    pub const WHOLE: Shard = Shard { rank: 0, size: 1 };

    /// Checks that `spec` splits evenly over `size` ranks.
    pub fn check(&self, spec: &ModelSpec) -> Result<(), CudaError> {
        let n = self.size;
        if n == 0 || self.rank >= n {
            return Err(CudaError::Unsupported {
                reason: format!("tensor-parallel rank {} of {n}", self.rank),
            });
        }
        for (what, v) in Self::split_dims(spec) {
            if v % n != 0 {
                return Err(CudaError::Unsupported {
                    reason: format!(
                        "{:?}: tensor_parallel = {n} does not divide {what} = {v}",
                        spec.arch
                    ),
                });
            }
        }
        Ok(())
    }

    /// The dimensions a split divides, by their config names.
    fn split_dims(spec: &ModelSpec) -> Vec<(&'static str, usize)> {
        if spec.mla.is_none() {
            return vec![
                ("num_kv_heads", spec.num_kv_heads),
                ("num_heads", spec.num_heads),
                ("intermediate_size", spec.intermediate_size),
            ];
        }
        // The latent is one "KV head" every rank holds whole: only the query heads split.
        let mut dims = vec![("num_heads", spec.num_heads)];
        // The dense MLP's size only where some layer runs it.
        if spec.moe.as_ref().is_none_or(|e| e.first_dense_layers > 0) {
            dims.push(("intermediate_size", spec.intermediate_size));
        }
        if let Some(e) = &spec.moe {
            // The shared experts' MLP (`n_shared_experts` of these) splits with it.
            dims.push(("moe_intermediate_size", e.expert_intermediate));
        }
        dims
    }

    /// The shapes one rank runs: heads, KV heads (not a latent model's: its latent is whole on
    /// every rank) and the intermediate sizes divided by `size`.
    pub fn rank_spec(&self, spec: &ModelSpec) -> ModelSpec {
        let mut s = spec.clone();
        s.num_heads /= self.size;
        if s.mla.is_none() {
            s.num_kv_heads /= self.size;
        }
        s.intermediate_size /= self.size;
        if let Some(e) = s.moe.as_mut() {
            e.expert_intermediate /= self.size;
        }
        s
    }

    /// This rank's part `[rank * len / size, (rank + 1) * len / size)` of `0..len`.
    pub fn part(&self, len: usize) -> std::ops::Range<usize> {
        let k = len / self.size;
        self.rank * k..(self.rank + 1) * k
    }
}

/// Rows `r` of a row-major `[rows, cols]` matrix.
pub(crate) fn rows_of(data: &[f32], cols: usize, r: std::ops::Range<usize>) -> &[f32] {
    &data[r.start * cols..r.end * cols]
}

/// Columns `c` of a row-major `[rows, cols]` matrix, as a `[rows, c.len()]` matrix.
pub(crate) fn cols_of(data: &[f32], cols: usize, c: std::ops::Range<usize>) -> Vec<f32> {
    data.chunks_exact(cols)
        .flat_map(|row| row[c.clone()].iter().copied())
        .collect()
}

pub struct DevLayer {
    pub attn_norm: DevBuf,
    pub wqkv: DevBuf,
    pub bqkv: Option<DevBuf>,
    pub q_norm: Option<DevBuf>,
    pub k_norm: Option<DevBuf>,
    pub wo: DevBuf,
    pub mlp_norm: DevBuf,
    pub w_gate_up: DevBuf,
    pub w_down: DevBuf,
}

pub struct DevWeights {
    pub embed: DevBuf,
    pub layers: Vec<DevLayer>,
    pub final_norm: DevBuf,
    /// None when tied to `embed`.
    pub lm_head: Option<DevBuf>,
    pub inv_freq: DevBuf,
    pub bytes: usize,
    /// A latent-attention model's layers (`layers` is then empty).
    pub mla: Option<DevMla>,
}

impl DevWeights {
    pub fn output(&self) -> &DevBuf {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Uploads host f32 weights (converted to bf16 / kept f32 as above); `shard`'s slice only.
    pub fn upload(
        gpu: &Gpu,
        spec: &ModelSpec,
        w: &Weights,
        shard: Shard,
    ) -> Result<Self, CudaError> {
        w.check_shapes(spec).map_err(|e| CudaError::Shape {
            op: "weights",
            reason: e.to_string(),
        })?;
        shard.check(spec)?;
        let (h, q, kv, i) = (
            spec.hidden_size,
            spec.q_dim(),
            spec.kv_dim(),
            spec.intermediate_size,
        );
        let (qr, kvr, ir) = (shard.part(q), shard.part(kv), shard.part(i));
        let mut bytes = 0usize;
        let mut bf = |data: &[f32]| -> Result<DevBuf, CudaError> {
            bytes += data.len() * 2;
            gpu.upload_bf16(data)
        };
        let cat = |parts: &[&[f32]]| parts.concat();
        let mut layers = Vec::with_capacity(spec.num_layers);
        for l in &w.layers {
            let wqkv = bf(&cat(&[
                rows_of(&l.wq.data, h, qr.clone()),
                rows_of(&l.wk.data, h, kvr.clone()),
                rows_of(&l.wv.data, h, kvr.clone()),
            ]))?;
            let wo = bf(&cols_of(&l.wo.data, q, qr.clone()))?;
            let w_gate_up = bf(&cat(&[
                rows_of(&l.w_gate.data, h, ir.clone()),
                rows_of(&l.w_up.data, h, ir.clone()),
            ]))?;
            let w_down = bf(&cols_of(&l.w_down.data, i, ir.clone()))?;
            let bqkv = match (&l.bq, &l.bk, &l.bv) {
                (Some(bq), Some(bk), Some(bv)) => Some(gpu.upload_f32(&cat(&[
                    &bq.data[qr.clone()],
                    &bk.data[kvr.clone()],
                    &bv.data[kvr.clone()],
                ]))?),
                _ => None,
            };
            layers.push(DevLayer {
                attn_norm: gpu.upload_f32(&l.attn_norm.data)?,
                wqkv,
                bqkv,
                q_norm: l
                    .q_norm
                    .as_ref()
                    .map(|t| gpu.upload_f32(&t.data))
                    .transpose()?,
                k_norm: l
                    .k_norm
                    .as_ref()
                    .map(|t| gpu.upload_f32(&t.data))
                    .transpose()?,
                wo,
                mlp_norm: gpu.upload_f32(&l.mlp_norm.data)?,
                w_gate_up,
                w_down,
            });
        }
        let embed = bf(&w.embed.data)?;
        let lm_head = w.lm_head.as_ref().map(|t| bf(&t.data)).transpose()?;
        Ok(Self {
            embed,
            layers,
            final_norm: gpu.upload_f32(&w.final_norm.data)?,
            lm_head,
            inv_freq: gpu.upload_f32(&inv_freq(spec))?,
            bytes,
            mla: None,
        })
    }

    /// Random weights generated on the device (benchmarks at real shapes without host copies):
    /// projections uniform in `±1/sqrt(in)`, embeddings in `±1` (or every matrix uniform with
    /// standard deviation `std` when given), norms 1, biases 0. Each element's value depends only
    /// on `seed`, the tensor and its index in the whole (unsharded) tensor, so every `shard`
    /// holds exactly its slice of what `Shard::WHOLE` generates.
    pub fn dummy(
        gpu: &Gpu,
        spec: &ModelSpec,
        seed: u64,
        std: Option<f32>,
        shard: Shard,
    ) -> Result<Self, CudaError> {
        if spec.mla.is_some() {
            return Self::dummy_mla(gpu, spec, seed, std, shard);
        }
        shard.check(spec)?;
        let (h, q, kv, i) = (
            spec.hidden_size,
            spec.q_dim(),
            spec.kv_dim(),
            spec.intermediate_size,
        );
        let (qr, kvr, ir) = (shard.part(q), shard.part(kv), shard.part(i));
        let mut bytes = 0usize;
        let mut n = 0u64;
        let fixed = std.map(|s| s * 3f32.sqrt());
        // One global tensor of `cols` columns per call; `blocks`: (first row, rows, first col,
        // cols) of the parts this rank keeps, stacked in order.
        let mut rnd = |cols: usize,
                       blocks: &[(usize, usize, usize, usize)],
                       scale: f32|
         -> Result<DevBuf, CudaError> {
            let scale = fixed.unwrap_or(scale);
            let elems: usize = blocks.iter().map(|b| b.1 * b.3).sum();
            let b = gpu.alloc(elems * 2)?;
            n += 1;
            let tseed = seed.wrapping_mul(1_000_003).wrapping_add(n);
            let mut off = 0;
            for &(r0, rows, c0, ncols) in blocks {
                ops::fill_uniform_bf16_2d(
                    gpu,
                    &b,
                    off,
                    rows,
                    ncols,
                    cols,
                    r0 * cols + c0,
                    tseed,
                    scale,
                )?;
                off += rows * ncols * 2;
            }
            bytes += elems * 2;
            Ok(b)
        };
        let ones = |elems: usize, v: f32| -> Result<DevBuf, CudaError> {
            let b = gpu.alloc(elems * 4)?;
            ops::fill_f32(gpu, &b, elems, v)?;
            Ok(b)
        };
        let sh = 1.0 / (h as f32).sqrt();
        let rows = |r: &std::ops::Range<usize>, base: usize| (base + r.start, r.len(), 0, h);
        let mut layers = Vec::with_capacity(spec.num_layers);
        for _ in 0..spec.num_layers {
            layers.push(DevLayer {
                attn_norm: ones(h, 1.0)?,
                wqkv: rnd(h, &[rows(&qr, 0), rows(&kvr, q), rows(&kvr, q + kv)], sh)?,
                bqkv: if spec.qkv_bias {
                    Some(ones(qr.len() + 2 * kvr.len(), 0.0)?)
                } else {
                    None
                },
                q_norm: if spec.qk_norm {
                    Some(ones(spec.head_dim, 1.0)?)
                } else {
                    None
                },
                k_norm: if spec.qk_norm {
                    Some(ones(spec.head_dim, 1.0)?)
                } else {
                    None
                },
                wo: rnd(q, &[(0, h, qr.start, qr.len())], 1.0 / (q as f32).sqrt())?,
                mlp_norm: ones(h, 1.0)?,
                w_gate_up: rnd(h, &[rows(&ir, 0), rows(&ir, i)], sh)?,
                w_down: rnd(i, &[(0, h, ir.start, ir.len())], 1.0 / (i as f32).sqrt())?,
            });
        }
        let whole = [(0, spec.vocab_size, 0, h)];
        let embed = rnd(h, &whole, 1.0)?;
        let lm_head = if spec.tie_word_embeddings {
            None
        } else {
            Some(rnd(h, &whole, sh)?)
        };
        gpu.sync()?;
        Ok(Self {
            embed,
            layers,
            final_norm: ones(h, 1.0)?,
            lm_head,
            inv_freq: gpu.upload_f32(&inv_freq(spec))?,
            bytes,
            mla: None,
        })
    }
}

impl DevWeights {
    /// `shard`'s slice of a latent-attention model's host f32 weights (the embedding, final
    /// norm and lm_head whole on every rank, as a Llama split keeps them).
    pub fn upload_mla(
        gpu: &Gpu,
        spec: &ModelSpec,
        w: &MlaWeights,
        shard: Shard,
    ) -> Result<Self, CudaError> {
        let (mla, layer_bytes) = DevMla::upload(gpu, spec, w, shard)?;
        let embed = gpu.upload_bf16(&w.embed.data)?;
        let lm_head = w
            .lm_head
            .as_ref()
            .map(|t| gpu.upload_bf16(&t.data))
            .transpose()?;
        let bytes = layer_bytes + embed.bytes() + lm_head.as_ref().map_or(0, |b| b.bytes());
        Ok(Self {
            embed,
            layers: Vec::new(),
            final_norm: gpu.upload_f32(&w.final_norm.data)?,
            lm_head,
            inv_freq: gpu.upload_f32(&inv_freq(spec))?,
            bytes,
            mla: Some(mla),
        })
    }

    /// Random weights of a latent-attention model generated on the device (benchmarks):
    /// `shard`'s slice of the layers, the tables whole.
    pub fn dummy_mla(
        gpu: &Gpu,
        spec: &ModelSpec,
        seed: u64,
        std: Option<f32>,
        shard: Shard,
    ) -> Result<Self, CudaError> {
        let (mla, layer_bytes) = DevMla::dummy(gpu, spec, seed, std, shard)?;
        let h = spec.hidden_size;
        let table = |n: u64, scale: f32| -> Result<DevBuf, CudaError> {
            let b = gpu.alloc(spec.vocab_size * h * 2)?;
            let s = std.map_or(scale, |s| s * 3f32.sqrt());
            ops::fill_uniform_bf16(gpu, &b, spec.vocab_size * h, seed ^ n, s)?;
            Ok(b)
        };
        let embed = table(0x05ee_de3b, 1.0)?;
        let lm_head = if spec.tie_word_embeddings {
            None
        } else {
            Some(table(0x05ee_d1a4, 1.0 / (h as f32).sqrt())?)
        };
        let final_norm = gpu.alloc(h * 4)?;
        ops::fill_f32(gpu, &final_norm, h, 1.0)?;
        gpu.sync()?;
        let bytes = layer_bytes + embed.bytes() + lm_head.as_ref().map_or(0, |b| b.bytes());
        Ok(Self {
            embed,
            layers: Vec::new(),
            final_norm,
            lm_head,
            inv_freq: gpu.upload_f32(&inv_freq(spec))?,
            bytes,
            mla: Some(mla),
        })
    }
}

/// RoPE inverse frequencies `[head_dim / 2]` with the spec's scaling applied (HF semantics).
pub fn inv_freq(spec: &ModelSpec) -> Vec<f32> {
    if let Some(m) = &spec.mla {
        // Latent attention turns only the RoPE part of its heads.
        return pdnode_engine::spec::rope_inv_freqs(
            m.qk_rope_head_dim,
            spec.rope_theta,
            spec.rope_scaling.as_ref(),
        );
    }
    if matches!(spec.rope_scaling, Some(RopeScaling::Yarn { .. })) {
        // YaRN outside DeepSeek (the loader refuses it): the engine's table.
        return pdnode_engine::spec::rope_inv_freqs(
            spec.head_dim,
            spec.rope_theta,
            spec.rope_scaling.as_ref(),
        );
    }
    let hd = spec.head_dim;
    (0..hd / 2)
        .map(|i| {
            let base = 1.0 / (spec.rope_theta as f64).powf(2.0 * i as f64 / hd as f64);
            let f = match &spec.rope_scaling {
                None => base,
                Some(RopeScaling::Linear { factor }) => base / *factor as f64,
                // Returned above.
                Some(RopeScaling::Yarn { .. }) => base,
                Some(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                }) => {
                    let (factor, low, high, orig) = (
                        *factor as f64,
                        *low_freq_factor as f64,
                        *high_freq_factor as f64,
                        *original_max_position_embeddings as f64,
                    );
                    let wavelen = 2.0 * std::f64::consts::PI / base;
                    if wavelen < orig / high {
                        base
                    } else if wavelen > orig / low {
                        base / factor
                    } else {
                        let smooth = (orig / wavelen - low) / (high - low);
                        (1.0 - smooth) * base / factor + smooth * base
                    }
                }
            };
            f as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdnode_engine::spec::Arch;

    fn spec(scaling: Option<RopeScaling>) -> ModelSpec {
        ModelSpec {
            arch: Arch::Llama,
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 1,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 128,
            vocab_size: 10,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: scaling,
            max_position_embeddings: 8192,
            tie_word_embeddings: true,
            qkv_bias: false,
            qk_norm: false,
            sliding_window: None,
            mla: None,
            moe: None,
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    }

    #[test]
    fn shards_split_heads_and_intermediate_evenly() {
        let s = spec(None); // 2 heads, 1 KV head, intermediate 128
        assert!(Shard::WHOLE.check(&s).is_ok());
        let e = Shard { rank: 0, size: 2 }.check(&s).unwrap_err();
        assert!(e.to_string().contains("num_kv_heads = 1"), "{e}");
        assert!(Shard { rank: 2, size: 2 }.check(&s).is_err());
        let mut s2 = s.clone();
        s2.num_kv_heads = 2;
        let sh = Shard { rank: 1, size: 2 };
        sh.check(&s2).unwrap();
        let r = sh.rank_spec(&s2);
        assert_eq!(
            (r.num_heads, r.num_kv_heads, r.intermediate_size),
            (1, 1, 64)
        );
        assert_eq!((r.hidden_size, r.vocab_size, r.head_dim), (64, 10, 128));
        assert_eq!(sh.part(256), 128..256);
        assert_eq!(Shard::WHOLE.part(7), 0..7);
    }

    #[test]
    fn row_and_column_slices_of_a_matrix() {
        // 3 x 4, element (r, c) = 10 r + c
        let m: Vec<f32> = (0..3)
            .flat_map(|r| (0..4).map(move |c| (10 * r + c) as f32))
            .collect();
        assert_eq!(rows_of(&m, 4, 1..2), &[10.0, 11.0, 12.0, 13.0]);
        assert_eq!(cols_of(&m, 4, 2..4), vec![2.0, 3.0, 12.0, 13.0, 22.0, 23.0]);
        // The column shards of a row-split matmul sum to the whole product.
        let x = [1.0f32, -2.0, 0.5, 3.0];
        let dot = |w: &[f32], xs: &[f32], cols: usize| -> Vec<f32> {
            w.chunks_exact(cols)
                .map(|row| row.iter().zip(xs).map(|(a, b)| a * b).sum())
                .collect()
        };
        let whole = dot(&m, &x, 4);
        let (a, b) = (
            dot(&cols_of(&m, 4, 0..2), &x[..2], 2),
            dot(&cols_of(&m, 4, 2..4), &x[2..], 2),
        );
        for i in 0..3 {
            assert!((whole[i] - (a[i] + b[i])).abs() < 1e-4);
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let plain = inv_freq(&spec(None));
        let scaled = inv_freq(&spec(Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        })));
        assert_eq!(plain.len(), 64);
        assert!((plain[0] - 1.0).abs() < 1e-7);
        assert!((plain[1] - 500000f64.powf(-2.0 / 128.0) as f32).abs() < 1e-7);
        // wavelength 2*pi/f below 8192/4 = 2048: unchanged; above 8192: divided by 8
        for (p, s) in plain.iter().zip(&scaled) {
            let wl = 2.0 * std::f32::consts::PI / p;
            if wl < 2048.0 {
                assert_eq!(p, s);
            } else if wl > 8192.0 {
                assert!((p / 8.0 - s).abs() <= 1e-6 * p);
            } else {
                assert!(*s < *p && *s > p / 8.0);
            }
        }
        let linear = inv_freq(&spec(Some(RopeScaling::Linear { factor: 4.0 })));
        assert!((linear[5] - plain[5] / 4.0).abs() < 1e-9);
    }
}
