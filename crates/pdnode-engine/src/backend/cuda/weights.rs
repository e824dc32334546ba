//! Model weights on the device: projections in bf16 (q/k/v fused into one `[q + 2 kv, hidden]`
//! matrix, gate/up into one `[2 inter, hidden]`), norms and biases in f32.

use super::CudaError;
use super::device::{DevBuf, Gpu};
use super::ops;
use crate::spec::{ModelSpec, RopeScaling};
use crate::weights::Weights;

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
}

impl DevWeights {
    pub fn output(&self) -> &DevBuf {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Uploads host f32 weights (converted to bf16 / kept f32 as above).
    pub fn upload(gpu: &Gpu, spec: &ModelSpec, w: &Weights) -> Result<Self, CudaError> {
        w.check_shapes(spec).map_err(|reason| CudaError::Shape {
            op: "weights",
            reason,
        })?;
        let mut bytes = 0usize;
        let mut bf = |data: &[f32]| -> Result<DevBuf, CudaError> {
            bytes += data.len() * 2;
            gpu.upload_bf16(data)
        };
        let cat = |parts: &[&[f32]]| parts.concat();
        let mut layers = Vec::with_capacity(spec.num_layers);
        for l in &w.layers {
            let wqkv = bf(&cat(&[&l.wq.data, &l.wk.data, &l.wv.data]))?;
            let wo = bf(&l.wo.data)?;
            let w_gate_up = bf(&cat(&[&l.w_gate.data, &l.w_up.data]))?;
            let w_down = bf(&l.w_down.data)?;
            let bqkv = match (&l.bq, &l.bk, &l.bv) {
                (Some(q), Some(k), Some(v)) => {
                    Some(gpu.upload_f32(&cat(&[&q.data, &k.data, &v.data]))?)
                }
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
        })
    }

    /// Random weights generated on the device (benchmarks at real shapes without host copies):
    /// projections uniform in `±1/sqrt(in)`, embeddings in `±1` (or every matrix uniform with
    /// standard deviation `std` when given), norms 1, biases 0.
    pub fn dummy(
        gpu: &Gpu,
        spec: &ModelSpec,
        seed: u64,
        std: Option<f32>,
    ) -> Result<Self, CudaError> {
        let (h, q, kv, i) = (
            spec.hidden_size,
            spec.q_dim(),
            spec.kv_dim(),
            spec.intermediate_size,
        );
        let mut bytes = 0usize;
        let mut n = 0u64;
        let fixed = std.map(|s| s * 3f32.sqrt());
        let mut rnd = |elems: usize, scale: f32| -> Result<DevBuf, CudaError> {
            let scale = fixed.unwrap_or(scale);
            let b = gpu.alloc(elems * 2)?;
            n += 1;
            ops::fill_uniform_bf16(
                gpu,
                &b,
                elems,
                seed.wrapping_mul(1_000_003).wrapping_add(n),
                scale,
            )?;
            bytes += elems * 2;
            Ok(b)
        };
        let ones = |elems: usize, v: f32| -> Result<DevBuf, CudaError> {
            let b = gpu.alloc(elems * 4)?;
            ops::fill_f32(gpu, &b, elems, v)?;
            Ok(b)
        };
        let sh = 1.0 / (h as f32).sqrt();
        let mut layers = Vec::with_capacity(spec.num_layers);
        for _ in 0..spec.num_layers {
            layers.push(DevLayer {
                attn_norm: ones(h, 1.0)?,
                wqkv: rnd((q + 2 * kv) * h, sh)?,
                bqkv: if spec.qkv_bias {
                    Some(ones(q + 2 * kv, 0.0)?)
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
                wo: rnd(h * q, 1.0 / (q as f32).sqrt())?,
                mlp_norm: ones(h, 1.0)?,
                w_gate_up: rnd(2 * i * h, sh)?,
                w_down: rnd(h * i, 1.0 / (i as f32).sqrt())?,
            });
        }
        let embed = rnd(spec.vocab_size * h, 1.0)?;
        let lm_head = if spec.tie_word_embeddings {
            None
        } else {
            Some(rnd(spec.vocab_size * h, sh)?)
        };
        gpu.sync()?;
        Ok(Self {
            embed,
            layers,
            final_norm: ones(h, 1.0)?,
            lm_head,
            inv_freq: gpu.upload_f32(&inv_freq(spec))?,
            bytes,
        })
    }
}

/// RoPE inverse frequencies `[head_dim / 2]` with the spec's scaling applied (HF semantics).
pub fn inv_freq(spec: &ModelSpec) -> Vec<f32> {
    let hd = spec.head_dim;
    (0..hd / 2)
        .map(|i| {
            let base = 1.0 / (spec.rope_theta as f64).powf(2.0 * i as f64 / hd as f64);
            let f = match &spec.rope_scaling {
                None => base,
                Some(RopeScaling::Linear { factor }) => base / *factor as f64,
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
    use crate::spec::Arch;

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
            bos_token_id: None,
            eos_token_ids: vec![],
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
