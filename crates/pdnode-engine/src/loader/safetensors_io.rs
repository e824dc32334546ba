//! Memory-mapped `*.safetensors` files (one file, or shards listed by
//! `model.safetensors.index.json`), read by tensor name and converted to f32.

use super::LoadError;
use super::progress::LoadProgress;
use crate::weights::Tensor;
use half::{bf16, f16};
use rayon::prelude::*;
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

    /// Opens the given shard files.
    pub fn open_files(files: &[PathBuf]) -> Result<Self, LoadError> {
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
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The file holding `name` (for error messages), or the first shard.
    pub fn file_of(&self, name: &str) -> &Path {
        let i = self.index.get(name).copied().unwrap_or(0);
        &self.shards[i].path
    }

    /// Reads tensor `name` as f32, checking its shape.
    pub fn load(&self, name: &str, expected: &[usize]) -> Result<Tensor, LoadError> {
        let Some(&i) = self.index.get(name) else {
            return Err(LoadError::MissingTensor {
                path: self.shards[0]
                    .path
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
        let bytes = view.data();
        let data = to_f32(view.dtype(), bytes).ok_or_else(|| LoadError::Unsupported {
            path: shard.path.clone(),
            reason: format!(
                "tensor `{name}` has dtype {:?} (supported: F32, F16, BF16)",
                view.dtype()
            ),
        })?;
        self.progress.inc(bytes.len() as u64);
        Ok(Tensor::new(expected.to_vec(), data))
    }

    pub fn finish(&self) {
        self.progress.finish();
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
