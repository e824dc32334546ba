//! A GGUF (v2/v3) reader: header, metadata key/values (every value type, arrays included), tensor
//! infos and the aligned data section, over a memory-mapped file. Every offset and count is
//! bounds-checked against the file, so a truncated or corrupted file is a [`LoadError::Malformed`]
//! naming the file, never a panic or a huge allocation.
//!
//! Format: <https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>. Tensor dims are stored
//! innermost first (`ne[0]` is contiguous); [`GgufTensorInfo::shape`] gives them outermost first, the
//! row-major convention of [`crate::weights::Tensor`].

use super::LoadError;
use super::quant::GgmlType;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Nesting limit for arrays of arrays (the format allows it; real files use one level).
const MAX_ARRAY_DEPTH: u32 = 4;
/// Dimensions a tensor may have (ggml's GGML_MAX_DIMS).
const MAX_DIMS: u32 = 4;
/// Elements one metadata array may have, and all of them together: each element becomes a
/// [`GgufValue`] of 32 bytes for as little as one byte of file. Real files hold at most a few
/// hundred thousand per array (vocabularies of 32k-262k tokens, as many merges, types and scores).
pub const MAX_ARRAY_ELEMENTS: u64 = 1 << 24;
pub const MAX_METADATA_ELEMENTS: u64 = 1 << 25;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The value as an unsigned integer, when it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, when it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, from any float or integer type.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A short rendering for logs (arrays as their length).
    pub fn summary(&self) -> String {
        match self {
            GgufValue::String(s) if s.len() > 80 => {
                format!("{:?}...", &s[..s.floor_char_boundary(80)])
            }
            GgufValue::String(s) => format!("{s:?}"),
            GgufValue::Array(a) => format!("[{} items]", a.len()),
            GgufValue::Bool(b) => b.to_string(),
            GgufValue::F32(v) => v.to_string(),
            GgufValue::F64(v) => v.to_string(),
            v => v.as_i64().map(|i| i.to_string()).unwrap_or_default(),
        }
    }
}

/// One tensor's entry in the tensor-info table.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dims as stored: innermost (contiguous) first.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute byte range of the tensor data inside the file.
    pub range: std::ops::Range<usize>,
}

impl GgufTensorInfo {
    /// Row-major shape, outermost first (HF orientation for 2-D weights: `[out, in]`).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn numel(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }
}

/// A parsed GGUF file over its memory map.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, GgufValue>,
    /// Metadata keys in file order.
    pub metadata_order: Vec<String>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    /// Where the data section starts.
    pub data_offset: usize,
    bytes: Bytes,
}

/// The file bytes: a memory map, or an owned buffer (tests).
enum Bytes {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mmap(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and parses `path` (memory-mapped; tensor data is not read until asked for).
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
        // SAFETY: the map is read-only and private to this process; the usual caveat of mmap
        // applies (another process truncating the file underneath us), as in every mmap-based
        // model loader. All reads below are bounds-checked against the length at map time.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
        Self::parse(path, Bytes::Mmap(map))
    }

    /// Parses a GGUF image held in memory; `path` only names it in errors.
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self, LoadError> {
        Self::parse(path, Bytes::Owned(bytes))
    }

    fn parse(path: &Path, bytes: Bytes) -> Result<Self, LoadError> {
        let mut r = Reader {
            buf: &bytes,
            pos: 0,
            path,
            elements: 0,
        };
        let magic = r.take(4, "magic")?;
        if magic != MAGIC {
            return Err(r.err(format!("bad magic {magic:02x?}, expected \"GGUF\"")));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(LoadError::Unsupported {
                path: path.to_path_buf(),
                reason: format!("GGUF version {version} (supported: 2, 3)"),
            });
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        // Every KV takes at least 8 (key len) + 4 (type) + 1 bytes; every tensor info at least
        // 8 + 4 + 4 + 8: reject counts the file cannot possibly hold before allocating.
        r.check_count(n_kv, 13, "metadata count")?;
        r.check_count(n_tensors, 24, "tensor count")?;

        let mut metadata = HashMap::with_capacity(n_kv as usize);
        let mut metadata_order = Vec::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let key = r.string(&format!("metadata key #{i}"))?;
            let ty = r.u32(&format!("type of `{key}`"))?;
            let value = r.value(ty, &key, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(r.err(format!("duplicate metadata key `{key}`")));
            }
            metadata_order.push(key);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
                _ => {
                    return Err(r.err(format!(
                        "general.alignment {} is not a power of two",
                        v.summary()
                    )));
                }
            },
        };

        let mut raw_infos = Vec::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = r.string(&format!("tensor #{i} name"))?;
            let n_dims = r.u32(&format!("tensor `{name}` dim count"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(r.err(format!("tensor `{name}` has {n_dims} dims (1..=4 allowed)")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&format!("tensor `{name}` dims"))?);
            }
            let ty = r.u32(&format!("tensor `{name}` type"))?;
            let offset = r.u64(&format!("tensor `{name}` offset"))?;
            raw_infos.push((name, dims, ty, offset));
        }

        let data_offset = align_up(r.pos as u64, alignment)
            .filter(|&o| o <= bytes.len() as u64)
            .ok_or_else(|| r.err("file ends before the tensor data section".into()))?
            as usize;

        let mut tensors = Vec::with_capacity(raw_infos.len());
        let mut seen = std::collections::HashSet::new();
        for (name, dims, ty, offset) in raw_infos {
            if !seen.insert(name.clone()) {
                return Err(r.err(format!("duplicate tensor `{name}`")));
            }
            let ggml_type = GgmlType::from_u32(ty).ok_or_else(|| LoadError::Unsupported {
                path: path.to_path_buf(),
                reason: format!(
                    "tensor `{name}` has ggml type {ty}, which this reader does not know"
                ),
            })?;
            let numel = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n > 0)
                .ok_or_else(|| r.err(format!("tensor `{name}` has bad dims {dims:?}")))?;
            let block = ggml_type.block_elems() as u64;
            if dims[0] % block != 0 {
                return Err(r.err(format!(
                    "tensor `{name}`: row length {} is not a multiple of the {:?} block size {block}",
                    dims[0], ggml_type
                )));
            }
            let nbytes = (numel / block)
                .checked_mul(ggml_type.block_bytes() as u64)
                .ok_or_else(|| r.err(format!("tensor `{name}` is too large")))?;
            let start = (data_offset as u64).checked_add(offset);
            let end = start.and_then(|s| s.checked_add(nbytes));
            match (start, end) {
                (Some(s), Some(e)) if e <= bytes.len() as u64 => tensors.push(GgufTensorInfo {
                    name,
                    dims,
                    ggml_type,
                    range: s as usize..e as usize,
                }),
                _ => {
                    return Err(r.err(format!(
                        "tensor `{name}` data (offset {offset}, {nbytes} bytes) runs past the end of the file ({} bytes)",
                        bytes.len()
                    )));
                }
            }
        }

        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            metadata_order,
            tensors,
            alignment,
            data_offset,
            bytes,
        })
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw (possibly quantized) bytes of a tensor.
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> &[u8] {
        // `range` was checked against the buffer length at parse time.
        &self.bytes[info.range.clone()]
    }

    /// Total bytes of the file.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

fn align_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|v| v / a * a)
}

/// A bounds-checked little-endian cursor.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
    /// Metadata array elements read so far (bounded by [`MAX_METADATA_ELEMENTS`]).
    elements: u64,
}

impl<'a> Reader<'a> {
    fn err(&self, reason: String) -> LoadError {
        LoadError::Malformed {
            path: self.path.to_path_buf(),
            format: "GGUF",
            reason,
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], LoadError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(e) => {
                let s = &self.buf[self.pos..e];
                self.pos = e;
                Ok(s)
            }
            None => Err(self.err(format!(
                "truncated: {what} needs {n} bytes at offset {}, file has {}",
                self.pos,
                self.buf.len()
            ))),
        }
    }

    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N], LoadError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, LoadError> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, LoadError> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    /// Rejects a count of items of at least `min_size` bytes each that cannot fit in what is left.
    fn check_count(&self, n: u64, min_size: u64, what: &str) -> Result<(), LoadError> {
        let left = (self.buf.len() - self.pos) as u64;
        if n.checked_mul(min_size).is_none_or(|b| b > left) {
            return Err(self.err(format!(
                "{what} {n} cannot fit in the {left} bytes left at offset {}",
                self.pos
            )));
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String, LoadError> {
        let len = self.u64(what)?;
        self.check_count(len, 1, what)?;
        let at = self.pos;
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| self.err(format!("{what} at offset {at} is not UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<GgufValue, LoadError> {
        Ok(match ty {
            0 => GgufValue::U8(u8::from_le_bytes(self.arr(key)?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.arr(key)?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.arr(key)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.arr(key)?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.arr(key)?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.arr(key)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.arr(key)?)),
            7 => match self.arr::<1>(key)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(self.err(format!("`{key}`: bool byte {b}"))),
            },
            8 => GgufValue::String(self.string(key)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format!("`{key}`: arrays nested too deep")));
                }
                let ety = self.u32(key)?;
                let n = self.u64(key)?;
                let min = match ety {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => return Err(self.err(format!("`{key}`: unknown array element type {t}"))),
                };
                self.check_count(n, min, key)?;
                if n > MAX_ARRAY_ELEMENTS {
                    return Err(self.err(format!(
                        "`{key}`: an array of {n} elements (at most {MAX_ARRAY_ELEMENTS})"
                    )));
                }
                self.elements += n;
                if self.elements > MAX_METADATA_ELEMENTS {
                    return Err(self.err(format!(
                        "`{key}`: the metadata arrays pass {MAX_METADATA_ELEMENTS} elements in all"
                    )));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, key, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(u64::from_le_bytes(self.arr(key)?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.arr(key)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.arr(key)?)),
            t => return Err(self.err(format!("`{key}`: unknown value type {t}"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The image of one metadata array of `n` u8 (its bytes only as far as `body` goes).
    fn u8_array(n: u64, body: usize) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&n.to_le_bytes());
        b.resize(b.len() + body, 1);
        b
    }

    fn read_array(bytes: &[u8], elements_before: u64) -> Result<GgufValue, LoadError> {
        let mut r = Reader {
            buf: bytes,
            pos: 4,
            path: Path::new("t.gguf"),
            elements: elements_before,
        };
        r.value(9, "k", 0)
    }

    #[test]
    fn metadata_arrays_are_bounded_in_all() {
        let b = u8_array(10, 10);
        assert_eq!(
            read_array(&b, 0).unwrap().as_array().map(<[_]>::len),
            Some(10)
        );
        let room = MAX_METADATA_ELEMENTS - 10;
        assert!(read_array(&b, room).is_ok());
        assert!(matches!(
            read_array(&b, room + 1),
            Err(LoadError::Malformed { reason, .. }) if reason.contains("`k`")
        ));
    }
}

/// A minimal GGUF writer for tests and fixtures: metadata and tensors (already encoded).
pub mod write {
    use super::{GgufValue, align_up};

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn type_id(v: &GgufValue) -> u32 {
        match v {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }

    fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
        match v {
            GgufValue::U8(x) => out.push(*x),
            GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::Bool(x) => out.push(u8::from(*x)),
            GgufValue::String(s) => put_str(out, s),
            GgufValue::Array(a) => {
                // An empty array is written as an array of u8.
                let ety = a.first().map(type_id).unwrap_or(0);
                out.extend_from_slice(&ety.to_le_bytes());
                out.extend_from_slice(&(a.len() as u64).to_le_bytes());
                for x in a {
                    put_value(out, x);
                }
            }
            GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        }
    }

    /// A tensor to write: name, dims innermost first, ggml type id, encoded bytes.
    pub struct TensorData {
        pub name: String,
        pub dims: Vec<u64>,
        pub ggml_type: u32,
        pub data: Vec<u8>,
    }

    /// Serializes a GGUF v3 image with the default alignment (32), or `general.alignment` when
    /// the metadata sets it.
    pub fn gguf_bytes(metadata: &[(String, GgufValue)], tensors: &[TensorData]) -> Vec<u8> {
        let alignment = metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .unwrap_or(32);
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&type_id(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for t in tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = align_up(offset + t.data.len() as u64, alignment).unwrap_or(u64::MAX);
        }
        let data_start = align_up(out.len() as u64, alignment).unwrap_or(0) as usize;
        out.resize(data_start, 0);
        for (t, off) in tensors.iter().zip(offsets) {
            out.resize(data_start + off as usize, 0);
            out.extend_from_slice(&t.data);
        }
        out
    }
}
