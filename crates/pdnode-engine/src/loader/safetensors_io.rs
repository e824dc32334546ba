//! Memory-mapped `*.safetensors` files (one file, or shards listed by
//! `model.safetensors.index.json`), read by tensor name and converted to f32.

use super::LoadError;
use super::progress::LoadProgress;
use crate::weights::Tensor;
use half::{bf16, f16};
use rayon::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

struct Shard {
    path: PathBuf,
    map: memmap2::Mmap,
}

/// All safetensors shards of a model directory.
pub struct SafetensorsSet {
    shards: Vec<Shard>,
    /// Tensor name -> shard index.
    index: HashMap<String, usize>,
    progress: LoadProgress,
    /// Block FP8 (`quantization_config.weight_block_size`): an `F8_E4M3` tensor `x` is
    /// multiplied by `x_scale_inv`, one f32 per block of this many rows and columns.
    fp8_block: Option<[usize; 2]>,
}

fn malformed(path: &Path, reason: String) -> LoadError {
    LoadError::Malformed {
        path: path.to_path_buf(),
        format: "safetensors",
        reason,
    }
}

impl SafetensorsSet {
    /// Opens the shards of `dir`: those named by `model.safetensors.index.json` when it exists,
    /// else every `*.safetensors` file. Headers are validated here; data is read on demand.
    pub fn open_dir(dir: &Path) -> Result<Self, LoadError> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.is_file() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| LoadError::io(&index_path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| malformed(&index_path, format!("invalid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| malformed(&index_path, "no `weight_map` object".into()))?;
            let mut files: Vec<String> = Vec::new();
            for (name, f) in map {
                let f = f.as_str().ok_or_else(|| {
                    malformed(&index_path, format!("`{name}` maps to a non-string"))
                })?;
                if f.contains('/') || f.contains('\\') || f == ".." {
                    return Err(malformed(
                        &index_path,
                        format!("shard name `{f}` is a path"),
                    ));
                }
                if !files.iter().any(|x| x == f) {
                    files.push(f.to_string());
                }
            }
            files.sort();
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| LoadError::io(dir, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .collect();
            v.sort();
            v
        };
        if files.is_empty() {
            return Err(LoadError::io(
                dir,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no *.safetensors files"),
            ));
        }
        Self::open_files(&files)
    }

    /// Opens the given shard files (at least one).
    pub fn open_files(files: &[PathBuf]) -> Result<Self, LoadError> {
        if files.is_empty() {
            return Err(LoadError::io(
                Path::new(""),
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "no safetensors files given",
                ),
            ));
        }
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        let mut total = 0u64;
        for (i, path) in files.iter().enumerate() {
            let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
            // SAFETY: read-only private map; every access goes through `SafeTensors`, which checks
            // offsets against the mapped length.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| malformed(path, format!("{e}")))?;
            for name in st.names() {
                if index.insert(name.to_string(), i).is_some() {
                    return Err(malformed(
                        path,
                        format!("tensor `{name}` appears in two shards"),
                    ));
                }
            }
            total += map.len() as u64;
            drop(st);
            shards.push(Shard {
                path: path.clone(),
                map,
            });
        }
        let label = files
            .first()
            .and_then(|p| p.parent())
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(Self {
            shards,
            index,
            progress: LoadProgress::new(&label, total),
            fp8_block: None,
        })
    }

    /// Tensors in the set.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// Dequantizes block-FP8 tensors at load with blocks of `block` (rows, columns).
    pub fn set_fp8_block(&mut self, block: [usize; 2]) {
        self.fp8_block = Some(block);
    }

    /// The file holding `name` (for error messages), or the first shard.
    pub fn file_of(&self, name: &str) -> &Path {
        let i = self.index.get(name).copied().unwrap_or(0);
        // `open_files` refuses an empty list: there is a first shard.
        &self.shards[i].path
    }

    /// The shard and view of tensor `name`, its shape checked.
    fn view(&self, name: &str, expected: &[usize]) -> Result<(&Path, TensorView<'_>), LoadError> {
        let Some(&i) = self.index.get(name) else {
            return Err(LoadError::MissingTensor {
                path: self
                    .file_of(name)
                    .parent()
                    .unwrap_or(Path::new(""))
                    .to_path_buf(),
                name: name.to_string(),
            });
        };
        let shard = &self.shards[i];
        let st = SafeTensors::deserialize(&shard.map)
            .map_err(|e| malformed(&shard.path, format!("{e}")))?;
        let view = st
            .tensor(name)
            .map_err(|e| malformed(&shard.path, format!("tensor `{name}`: {e}")))?;
        if view.shape() != expected {
            return Err(LoadError::TensorShape {
                path: shard.path.clone(),
                name: name.to_string(),
                got: view.shape().to_vec(),
                expected: expected.to_vec(),
            });
        }
        Ok((&shard.path, view))
    }

    /// Reads tensor `name` as f32, checking its shape.
    pub fn load(&self, name: &str, expected: &[usize]) -> Result<Tensor, LoadError> {
        let (path, view) = self.view(name, expected)?;
        if view.dtype() == Dtype::F8_E4M3 {
            return self.load_fp8(name, path, view.data(), expected);
        }
        self.convert(
            name,
            path,
            &view,
            expected,
            "F32, F16, BF16, block-scaled F8_E4M3",
        )
    }

    /// An F32/F16/BF16 `view` as f32; other dtypes are an error listing `supported`.
    fn convert(
        &self,
        name: &str,
        path: &Path,
        view: &TensorView<'_>,
        expected: &[usize],
        supported: &str,
    ) -> Result<Tensor, LoadError> {
        let bytes = view.data();
        let data = to_f32(view.dtype(), bytes).ok_or_else(|| LoadError::Unsupported {
            path: path.to_path_buf(),
            reason: format!(
                "tensor `{name}` has dtype {:?} (supported: {supported})",
                view.dtype()
            ),
        })?;
        self.progress.inc(bytes.len() as u64);
        Ok(Tensor::new(expected.to_vec(), data))
    }

    /// A block-FP8 matrix dequantized: `fp8[i][j] * scale_inv[i / b0][j / b1]`.
    fn load_fp8(
        &self,
        name: &str,
        path: &Path,
        bytes: &[u8],
        shape: &[usize],
    ) -> Result<Tensor, LoadError> {
        let unsupported = |reason: String| LoadError::Unsupported {
            path: path.to_path_buf(),
            reason,
        };
        let Some([b0, b1]) = self.fp8_block else {
            return Err(unsupported(format!(
                "tensor `{name}` is F8_E4M3 but config.json has no \
                 `quantization_config.weight_block_size`"
            )));
        };
        let &[rows, cols] = shape else {
            return Err(unsupported(format!(
                "tensor `{name}`: F8_E4M3 only for matrices (shape {shape:?})"
            )));
        };
        let grid = [rows.div_ceil(b0), cols.div_ceil(b1)];
        // A scale is plain floats: read directly, never through `load` (an F8 scale of an F8
        // scale of ... would recurse).
        let scale_name = format!("{name}_scale_inv");
        let (scale_path, scale_view) = self.view(&scale_name, &grid)?;
        let scale = self.convert(
            &scale_name,
            scale_path,
            &scale_view,
            &grid,
            "F32, F16, BF16",
        )?;
        if rows == 0 || cols == 0 {
            // Nothing to scale (and no row to chunk by).
            return Ok(Tensor::new(shape.to_vec(), Vec::new()));
        }
        let mut out = vec![0f32; rows * cols];
        out.par_chunks_mut(cols)
            .zip(bytes.par_chunks(cols))
            .enumerate()
            .for_each(|(i, (o, b))| {
                let srow = &scale.data[(i / b0) * grid[1]..(i / b0 + 1) * grid[1]];
                for (j, (o, &x)) in o.iter_mut().zip(b).enumerate() {
                    *o = f8_e4m3_to_f32(x) * srow[j / b1];
                }
            });
        self.progress.inc(bytes.len() as u64);
        Ok(Tensor::new(shape.to_vec(), out))
    }

    pub fn finish(&self) {
        self.progress.finish();
    }
}

/// An OCP FP8 E4M3 (`float8_e4m3fn`: bias 7, no infinities, `S.1111.111` NaN) to f32.
pub fn f8_e4m3_to_f32(x: u8) -> f32 {
    let sign = if x & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = (x >> 3) & 0x0f;
    let man = (x & 0x07) as f32;
    if exp == 0x0f && x & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp as i32 - 7)
    }
}

/// Little-endian F32/F16/BF16 bytes to f32 (multi-threaded); `None` for other dtypes.
fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    const CHUNK: usize = 1 << 16;
    let conv = |size: usize, f: fn(&[u8]) -> f32| -> Vec<f32> {
        let mut out = vec![0f32; bytes.len() / size];
        out.par_chunks_mut(CHUNK)
            .zip(bytes.par_chunks(CHUNK * size))
            .for_each(|(o, b)| {
                for (x, c) in o.iter_mut().zip(b.chunks_exact(size)) {
                    *x = f(c);
                }
            });
        out
    };
    match dtype {
        Dtype::F32 => Some(conv(4, |c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        Dtype::F16 => Some(conv(2, |c| f16::from_le_bytes([c[0], c[1]]).to_f32())),
        Dtype::BF16 => Some(conv(2, |c| bf16::from_le_bytes([c[0], c[1]]).to_f32())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::f8_e4m3_to_f32;

    #[test]
    fn e4m3_decodes_as_torch_float8_e4m3fn() {
        for (bits, want) in [
            (0x38u8, 1.0f32),
            (0xb8, -1.0),
            (0x7e, 448.0),
            (0x01, 2f32.powi(-9)),
            (0x08, 2f32.powi(-6)),
            (0x3c, 1.5),
            (0x00, 0.0),
        ] {
            assert_eq!(f8_e4m3_to_f32(bits), want, "{bits:#x}");
        }
        assert!(f8_e4m3_to_f32(0x7f).is_nan() && f8_e4m3_to_f32(0xff).is_nan());
        // 0x78 (exponent 15, mantissa 0) is a number in e4m3fn, not an infinity.
        assert_eq!(f8_e4m3_to_f32(0x78), 256.0);
    }
}
