//! ggml tensor types and their dequantization to f32, following ggml's reference implementation
//! (`ggml-quants.c`: `dequantize_row_q4_0`, `_q4_1`, `_q5_0`, `_q5_1`, `_q8_0`, `_q4_K`, `_q5_K`,
//! `_q6_K`) block for block, so values are bit-identical to llama.cpp's. Also the inverse for the
//! simple block types, used by tests and fixtures to build GGUF files.

use half::{bf16, f16};
use rayon::prelude::*;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Bf16,
}

impl GgmlType {
    /// From ggml's `enum ggml_type` value.
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            9 => GgmlType::Q8_1,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            15 => GgmlType::Q8K,
            30 => GgmlType::Bf16,
            _ => return None,
        })
    }

    pub fn to_u32(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q8_1 => 9,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::Q8K => 15,
            GgmlType::Bf16 => 30,
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => 32,
            GgmlType::Q8_0 | GgmlType::Q8_1 => 32,
            GgmlType::Q2K
            | GgmlType::Q3K
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
            | GgmlType::Q8K => QK_K,
        }
    }

    /// Bytes per block (ggml's `type_size`).
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q4_0 => 2 + 16,
            GgmlType::Q4_1 => 2 + 2 + 16,
            GgmlType::Q5_0 => 2 + 4 + 16,
            GgmlType::Q5_1 => 2 + 2 + 4 + 16,
            GgmlType::Q8_0 => 2 + 32,
            GgmlType::Q8_1 => 4 + 32,
            GgmlType::Q2K => QK_K / 16 + QK_K / 4 + 2 + 2,
            GgmlType::Q3K => QK_K / 8 + QK_K / 4 + 12 + 2,
            GgmlType::Q4K => 2 + 2 + 12 + QK_K / 2,
            GgmlType::Q5K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            GgmlType::Q6K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
            GgmlType::Q8K => 4 + QK_K + QK_K / 16 * 2,
        }
    }

    /// Whether [`dequantize`] handles this type.
    pub fn can_dequantize(self) -> bool {
        !matches!(
            self,
            GgmlType::Q8_1 | GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q8K
        )
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

fn get_scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Dequantizes one block `b` (exactly `block_bytes` long) into `y` (`block_elems` long).
fn dequant_block(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    match ty {
        GgmlType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => y[0] = f16_at(b, 0),
        GgmlType::Bf16 => y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        GgmlType::Q4_0 => {
            let d = f16_at(b, 0);
            let qs = &b[2..18];
            for j in 0..16 {
                y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
                y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        GgmlType::Q4_1 => {
            let d = f16_at(b, 0);
            let m = f16_at(b, 2);
            let qs = &b[4..20];
            for j in 0..16 {
                y[j] = (qs[j] & 0x0F) as f32 * d + m;
                y[j + 16] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        GgmlType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..22];
            for j in 0..16 {
                let xh0 = ((qh >> j) << 4) & 0x10;
                let xh1 = (qh >> (j + 12)) & 0x10;
                let x0 = ((qs[j] as u32 & 0x0F) | xh0) as i32 - 16;
                let x1 = ((qs[j] as u32 >> 4) | xh1) as i32 - 16;
                y[j] = x0 as f32 * d;
                y[j + 16] = x1 as f32 * d;
            }
        }
        GgmlType::Q5_1 => {
            let d = f16_at(b, 0);
            let m = f16_at(b, 2);
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let qs = &b[8..24];
            for j in 0..16 {
                let xh0 = ((qh >> j) << 4) & 0x10;
                let xh1 = (qh >> (j + 12)) & 0x10;
                let x0 = (qs[j] as u32 & 0x0F) | xh0;
                let x1 = (qs[j] as u32 >> 4) | xh1;
                y[j] = x0 as f32 * d + m;
                y[j + 16] = x1 as f32 * d + m;
            }
        }
        GgmlType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        GgmlType::Q4K => {
            let d = f16_at(b, 0);
            let min = f16_at(b, 2);
            let scales = &b[4..16];
            let mut q = &b[16..144];
            let mut is = 0;
            let mut out = 0;
            for _ in (0..QK_K).step_by(64) {
                let (sc, m) = get_scale_min_k4(is, scales);
                let (d1, m1) = (d * sc as f32, min * m as f32);
                let (sc, m) = get_scale_min_k4(is + 1, scales);
                let (d2, m2) = (d * sc as f32, min * m as f32);
                for l in 0..32 {
                    y[out + l] = d1 * (q[l] & 0xF) as f32 - m1;
                }
                for l in 0..32 {
                    y[out + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
                }
                out += 64;
                q = &q[32..];
                is += 2;
            }
        }
        GgmlType::Q5K => {
            let d = f16_at(b, 0);
            let min = f16_at(b, 2);
            let scales = &b[4..16];
            let qh = &b[16..48];
            let mut ql = &b[48..176];
            let (mut is, mut out) = (0, 0);
            let (mut u1, mut u2) = (1u8, 2u8);
            for _ in (0..QK_K).step_by(64) {
                let (sc, m) = get_scale_min_k4(is, scales);
                let (d1, m1) = (d * sc as f32, min * m as f32);
                let (sc, m) = get_scale_min_k4(is + 1, scales);
                let (d2, m2) = (d * sc as f32, min * m as f32);
                for l in 0..32 {
                    let h = if qh[l] & u1 != 0 { 16 } else { 0 };
                    y[out + l] = d1 * ((ql[l] & 0xF) + h) as f32 - m1;
                }
                for l in 0..32 {
                    let h = if qh[l] & u2 != 0 { 16 } else { 0 };
                    y[out + 32 + l] = d2 * ((ql[l] >> 4) + h) as f32 - m2;
                }
                ql = &ql[32..];
                out += 64;
                is += 2;
                u1 = u1.wrapping_shl(2);
                u2 = u2.wrapping_shl(2);
            }
        }
        GgmlType::Q6K => {
            let mut ql = &b[0..128];
            let mut qh = &b[128..192];
            let mut sc = &b[192..208];
            let d = f16_at(b, 208);
            let mut out = 0;
            for _ in (0..QK_K).step_by(128) {
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[out + l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    y[out + l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    y[out + l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    y[out + l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
                out += 128;
                ql = &ql[64..];
                qh = &qh[32..];
                sc = &sc[8..];
            }
        }
        GgmlType::Q8_1 | GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q8K => {
            // Rejected by `dequantize` before any block is touched.
        }
    }
}

/// Why [`dequantize`] refused its input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    #[error("ggml type {ty:?} is not supported for dequantization")]
    Unsupported { ty: GgmlType },
    #[error("{ty:?} data of {bytes} bytes does not hold {numel} elements")]
    Size {
        ty: GgmlType,
        bytes: usize,
        numel: usize,
    },
}

/// Dequantizes `numel` elements of type `ty` from `bytes` into f32 (multi-threaded).
pub fn dequantize(ty: GgmlType, bytes: &[u8], numel: usize) -> Result<Vec<f32>, DequantError> {
    if !ty.can_dequantize() {
        return Err(DequantError::Unsupported { ty });
    }
    let be = ty.block_elems();
    let bb = ty.block_bytes();
    if !numel.is_multiple_of(be) || (numel / be).checked_mul(bb) != Some(bytes.len()) {
        return Err(DequantError::Size {
            ty,
            bytes: bytes.len(),
            numel,
        });
    }
    let mut out = vec![0f32; numel];
    // Chunks of many blocks so the per-task overhead stays small.
    let blocks_per_task = (65536 / be).max(1);
    out.par_chunks_mut(be * blocks_per_task)
        .zip(bytes.par_chunks(bb * blocks_per_task))
        .for_each(|(y, b)| {
            for (yb, bl) in y.chunks_exact_mut(be).zip(b.chunks_exact(bb)) {
                dequant_block(ty, bl, yb);
            }
        });
    Ok(out)
}

/// Reference quantizers (ggml's `quantize_row_*_ref`) for the simple block types, used to build
/// test GGUF files. Returns `None` for other types or a length that is not a whole number of blocks.
pub fn quantize(ty: GgmlType, x: &[f32]) -> Option<Vec<u8>> {
    let be = ty.block_elems();
    if !x.len().is_multiple_of(be) {
        return None;
    }
    let mut out = Vec::with_capacity(x.len() / be * ty.block_bytes());
    match ty {
        GgmlType::F32 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        GgmlType::Bf16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        GgmlType::Q8_0 => {
            for b in x.chunks_exact(32) {
                let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(b.iter().map(|v| ((v * id).round() as i8) as u8));
            }
        }
        GgmlType::Q4_0 => {
            for b in x.chunks_exact(32) {
                let (mut amax, mut max) = (0f32, 0f32);
                for &v in b {
                    if v.abs() > amax {
                        amax = v.abs();
                        max = v;
                    }
                }
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                for j in 0..16 {
                    let x0 = ((b[j] * id + 8.5) as u8).min(15);
                    let x1 = ((b[j + 16] * id + 8.5) as u8).min(15);
                    out.push(x0 | (x1 << 4));
                }
            }
        }
        GgmlType::Q4_1 => {
            for b in x.chunks_exact(32) {
                let min = b.iter().cloned().fold(f32::INFINITY, f32::min);
                let max = b.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                for j in 0..16 {
                    let x0 = (((b[j] - min) * id + 0.5) as u8).min(15);
                    let x1 = (((b[j + 16] - min) * id + 0.5) as u8).min(15);
                    out.push(x0 | (x1 << 4));
                }
            }
        }
        _ => return None,
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect()
    }

    #[test]
    fn simple_types_round_trip_within_their_step() {
        let x = ramp(64);
        for (ty, tol) in [
            (GgmlType::F32, 0.0),
            (GgmlType::F16, 1e-3),
            (GgmlType::Bf16, 1e-2),
            (GgmlType::Q8_0, 0.02),
            (GgmlType::Q4_0, 0.2),
            (GgmlType::Q4_1, 0.12),
        ] {
            let q = quantize(ty, &x).unwrap();
            assert_eq!(q.len(), 64 / ty.block_elems() * ty.block_bytes());
            let y = dequantize(ty, &q, 64).unwrap();
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= tol, "{ty:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn q4_k_matches_hand_computed_block() {
        // d = 1.0, dmin = 0.5; sub-block scales 1..=8 and mins 0..=7 (all < 16 so only the low
        // 6-bit fields matter for j < 4; j >= 4 take the high nibbles of bytes 8..12).
        let mut b = vec![0u8; GgmlType::Q4K.block_bytes()];
        b[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        let (sc, mn): ([u8; 8], [u8; 8]) = ([1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7]);
        for j in 0..4 {
            b[4 + j] = sc[j];
            b[8 + j] = mn[j];
            b[12 + j] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
        }
        for (i, q) in b[16..144].iter_mut().enumerate() {
            *q = ((i % 16) as u8) | ((((i + 3) % 16) as u8) << 4);
        }
        let y = dequantize(GgmlType::Q4K, &b, QK_K).unwrap();
        for chunk in 0..4 {
            for l in 0..32 {
                let q = b[16 + chunk * 32 + l];
                let lo = sc[2 * chunk] as f32 * (q & 0xF) as f32 - 0.5 * mn[2 * chunk] as f32;
                let hi =
                    sc[2 * chunk + 1] as f32 * (q >> 4) as f32 - 0.5 * mn[2 * chunk + 1] as f32;
                assert_eq!(y[chunk * 64 + l], lo);
                assert_eq!(y[chunk * 64 + 32 + l], hi);
            }
        }
    }

    #[test]
    fn q6_k_matches_hand_computed_block() {
        let mut b = vec![0u8; GgmlType::Q6K.block_bytes()];
        for (i, v) in b[0..128].iter_mut().enumerate() {
            *v = (i * 7 % 256) as u8;
        }
        for (i, v) in b[128..192].iter_mut().enumerate() {
            *v = (i * 13 % 256) as u8;
        }
        for (i, v) in b[192..208].iter_mut().enumerate() {
            *v = (i as i8 - 8) as u8;
        }
        b[208..210].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        let y = dequantize(GgmlType::Q6K, &b, QK_K).unwrap();
        // Element e: half n = e / 128, l = e % 32, quarter k = (e % 128) / 32.
        for (e, &got) in y.iter().enumerate() {
            let (n, r) = (e / 128, e % 128);
            let (k, l) = (r / 32, r % 32);
            let ql = b[n * 64 + l + if k % 2 == 1 { 32 } else { 0 }];
            let low = if k < 2 { ql & 0xF } else { ql >> 4 };
            let high = (b[128 + n * 32 + l] >> (2 * k)) & 3;
            let q = (low | (high << 4)) as i32 - 32;
            let s = b[192 + n * 8 + l / 16 + 2 * k] as i8;
            assert_eq!(got, 0.25 * s as f32 * q as f32, "element {e}");
        }
    }

    #[test]
    fn wrong_sizes_and_unsupported_types_are_errors() {
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 17], 32),
            Err(DequantError::Size {
                bytes: 17,
                numel: 32,
                ..
            })
        ));
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 18], 31),
            Err(DequantError::Size { .. })
        ));
        assert!(matches!(
            dequantize(GgmlType::Q2K, &[0; 84], 256),
            Err(DequantError::Unsupported { ty: GgmlType::Q2K })
        ));
    }
}
