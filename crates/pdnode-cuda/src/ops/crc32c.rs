//! CRC32C (Castagnoli) of a device byte range ([`crc32c`], kernels/crc32c.cu): the same value as
//! `pdnode_transfer::checksum::crc32c` over the same bytes, so a KV hand-off through a device
//! arena can be verified like the host path (the fence record's sum) without copying the bytes
//! to the host.
//!
//! The range is cut into chunks counted from its end ([`chunking`]); one thread sums each chunk
//! into the bare CRC register (started from 0, never inverted: linear over GF(2)), shifts it over
//! the bytes after it with zero-append operators ([`shift_operators`], the GF(2) matrices of
//! zlib's `crc32_combine`), and the XOR of all of them is the bare CRC of the range;
//! [`finish`] turns that into the standard CRC32C. [`crc32c_host_model`] is the same arithmetic
//! on the CPU (the unit tests check it against a bitwise CRC32C).

use super::super::CudaError;
use super::super::device::{DevBuf, Gpu};
use super::{cfg, launched, shape, u32_of};

/// The reflected Castagnoli polynomial.
pub const POLY: u32 = 0x82F6_3B78;

/// Smallest chunk one thread sums, bytes (a multiple of 8: whole words after the first chunk).
pub const MIN_CHUNK: usize = 256;

/// Threads per block of `crc32c_chunks` (each builds one entry of each table).
const BLOCK: usize = 256;

/// Most shift operators the kernel holds (chunk counts up to 2^64).
const MAX_OPS: usize = 64;

/// `(chunk bytes, chunks)` for `len` bytes on `sm_count` SMs: about 2048 threads per SM (whole
/// waves of small chunks, so the loads of many threads are in flight), chunks of at least
/// [`MIN_CHUNK`] bytes and a multiple of 8. No chunk for 0 bytes.
pub fn chunking(len: usize, sm_count: usize) -> (usize, usize) {
    if len == 0 {
        return (MIN_CHUNK, 0);
    }
    let threads = sm_count.max(1) * 2048;
    let chunk = len.div_ceil(threads).next_multiple_of(8).max(MIN_CHUNK);
    (chunk, len.div_ceil(chunk))
}

/// `m * v` over GF(2): the XOR of the columns of `m` selected by the set bits of `v`.
pub fn gf2_times(m: &[u32; 32], v: u32) -> u32 {
    (0..32)
        .filter(|i| v >> i & 1 != 0)
        .fold(0, |acc, i| acc ^ m[i])
}

/// `m * m`: the operator applied twice.
pub fn gf2_square(m: &[u32; 32]) -> [u32; 32] {
    std::array::from_fn(|n| gf2_times(m, m[n]))
}

/// The operator that appends `bytes` zero bytes to a bare CRC register: `Z(bytes)`, with
/// `bare(A || B) = Z(|B|) bare(A) ^ bare(B)`.
pub fn zeros_operator(bytes: u64) -> [u32; 32] {
    // one zero bit: shift right, the polynomial where the low bit falls out
    let mut op: [u32; 32] = std::array::from_fn(|n| if n == 0 { POLY } else { 1 << (n - 1) });
    for _ in 0..3 {
        op = gf2_square(&op); // 2, 4, 8 bits: one byte
    }
    let mut result: [u32; 32] = std::array::from_fn(|n| 1 << n);
    let mut n = bytes;
    while n != 0 {
        if n & 1 != 0 {
            result = std::array::from_fn(|i| gf2_times(&op, result[i]));
        }
        n >>= 1;
        if n != 0 {
            op = gf2_square(&op);
        }
    }
    result
}

/// `Z(chunk * 2^k)` for every bit `k` of a chunk index below `nchunks` (none for one chunk).
pub fn shift_operators(chunk: usize, nchunks: usize) -> Vec<[u32; 32]> {
    let bits = (usize::BITS - nchunks.saturating_sub(1).leading_zeros()) as usize;
    let mut ops = Vec::with_capacity(bits);
    if bits > 0 {
        let mut op = zeros_operator(chunk as u64);
        ops.push(op);
        for _ in 1..bits {
            op = gf2_square(&op);
            ops.push(op);
        }
    }
    ops
}

/// The standard CRC32C (register started from all ones, result inverted) of `len` bytes whose
/// bare CRC is `bare`.
pub fn finish(bare: u32, len: u64) -> u32 {
    bare ^ gf2_times(&zeros_operator(len), 0xFFFF_FFFF) ^ 0xFFFF_FFFF
}

/// The bare CRC register after `data`, from `c` (bytewise, reflected).
fn bare_update(mut c: u32, data: &[u8]) -> u32 {
    for b in data {
        c ^= *b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
        }
    }
    c
}

/// What [`crc32c`] computes, on the CPU and in the kernel's order: chunks of `chunk` bytes counted
/// from the end (the first chunk takes the rest), each summed from 0 and shifted over the bytes
/// after it by the operators of its index's bits, XORed, then [`finish`]ed.
pub fn crc32c_host_model(data: &[u8], chunk: usize) -> u32 {
    let len = data.len();
    let nchunks = len.div_ceil(chunk.max(1));
    let ops = shift_operators(chunk, nchunks);
    let mut bare = 0u32;
    for j in 0..nchunks {
        let end = len - j * chunk;
        let begin = if j + 1 == nchunks { 0 } else { end - chunk };
        let mut c = bare_update(0, &data[begin..end]);
        for (k, op) in ops.iter().enumerate() {
            if j >> k & 1 != 0 {
                c = gf2_times(op, c);
            }
        }
        bare ^= c;
    }
    finish(bare, len as u64)
}

/// CRC32C of bytes `offset .. offset + len` of `buf`, equal to
/// `pdnode_transfer::checksum::crc32c` of the same bytes (0 for none). Allocates a small
/// scratch (the result word and the shift operators), launches `crc32c_chunks` once and waits
/// for its word: a check per hand-off, not per step.
pub fn crc32c(gpu: &Gpu, buf: &DevBuf, offset: usize, len: usize) -> Result<u32, CudaError> {
    const OP: &str = "crc32c";
    shape(
        OP,
        offset.checked_add(len).is_some_and(|e| e <= buf.bytes()),
        || format!("{len} bytes at {offset} of a {}-byte buffer", buf.bytes()),
    )?;
    if len == 0 {
        return Ok(0);
    }
    let (chunk, nchunks) = chunking(len, gpu.sm_count as usize);
    let ops = shift_operators(chunk, nchunks);
    shape(OP, ops.len() <= MAX_OPS, || {
        format!("{} shift operators", ops.len())
    })?;
    let flat: Vec<u32> = ops.iter().flatten().copied().collect();
    let scratch = gpu.alloc(4 + 4 * flat.len().max(1))?;
    gpu.memset(&scratch, 0)?;
    gpu.upload(&scratch, 4, &flat)?;
    let f = gpu.kernel("crc32c_chunks")?;
    let (data, ops_ptr, out) = (buf.at(offset), scratch.at(4), scratch.ptr());
    let (len_u, chunk_u, n_u, nops) = (len as u64, chunk as u64, nchunks as u64, ops.len() as i32);
    let mut b = gpu.launch_builder(f);
    b.arg(&data)
        .arg(&len_u)
        .arg(&chunk_u)
        .arg(&n_u)
        .arg(&ops_ptr)
        .arg(&nops)
        .arg(&out);
    let blocks = u32_of(OP, nchunks.div_ceil(BLOCK))?;
    // SAFETY: the range lies inside `buf` (checked above); the kernel reads only chunks
    // inside `data .. data + len`, `nops` operators of 32 words at `ops_ptr` and writes the one
    // word at `out` (both in `scratch`, sized for them); blocks are BLOCK threads, as the
    // kernel's table building needs.
    unsafe { b.launch(cfg((blocks, 1, 1), BLOCK as u32)) }.map_err(launched(OP))?;
    let mut bare = [0u32];
    gpu.download(&mut bare, &scratch, 0)?;
    Ok(finish(bare[0], len as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The textbook CRC32C, bit by bit.
    fn bitwise(data: &[u8]) -> u32 {
        !bare_update(!0, data)
    }

    #[test]
    fn zero_operators_shift_the_bare_register_like_zero_bytes() {
        for bytes in [0u64, 1, 7, 8, 255, 4096, 100_003] {
            let z = zeros_operator(bytes);
            for v in [0u32, 1, 0x8000_0000, 0xDEAD_BEEF, 0xFFFF_FFFF] {
                let zeros = vec![0u8; bytes as usize];
                assert_eq!(
                    gf2_times(&z, v),
                    bare_update(v, &zeros),
                    "{bytes} bytes, {v:#x}"
                );
            }
        }
        // squaring doubles the shift
        assert_eq!(gf2_square(&zeros_operator(300)), zeros_operator(600));
        // the operators of the chunk index bits: Z(chunk), Z(2 chunk), Z(4 chunk), ...
        let ops = shift_operators(512, 9);
        assert_eq!(ops.len(), 4);
        for (k, op) in ops.iter().enumerate() {
            assert_eq!(*op, zeros_operator(512 << k));
        }
        assert!(shift_operators(512, 1).is_empty());
        assert!(shift_operators(512, 0).is_empty());
    }

    #[test]
    fn combining_bare_crcs_is_concatenation() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for (la, lb) in [(0usize, 5usize), (3, 0), (13, 4096), (4096, 1), (1000, 777)] {
            let a: Vec<u8> = (0..la).map(|_| r.random()).collect();
            let b: Vec<u8> = (0..lb).map(|_| r.random()).collect();
            let ab = [a.as_slice(), b.as_slice()].concat();
            let combined =
                gf2_times(&zeros_operator(lb as u64), bare_update(0, &a)) ^ bare_update(0, &b);
            assert_eq!(combined, bare_update(0, &ab), "{la} + {lb}");
            assert_eq!(finish(combined, ab.len() as u64), bitwise(&ab));
        }
    }

    #[test]
    fn the_kernels_chunked_arithmetic_is_crc32c() {
        assert_eq!(crc32c_host_model(b"123456789", 8), 0xE306_9283);
        assert_eq!(crc32c_host_model(b"", 256), 0);
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let data: Vec<u8> = (0..70_001).map(|_| r.random()).collect();
        for len in [0usize, 1, 3, 8, 255, 256, 257, 1023, 4096, 12_345, 70_001] {
            let want = bitwise(&data[..len]);
            assert_eq!(
                want,
                pdnode_transfer::checksum::crc32c(&data[..len]),
                "the bitwise reference is checksum.rs's CRC32C"
            );
            for chunk in [8usize, 16, 256, 1000, 4096] {
                assert_eq!(
                    crc32c_host_model(&data[..len], chunk),
                    want,
                    "{len} bytes in chunks of {chunk}"
                );
            }
            let (chunk, n) = chunking(len, 132);
            assert_eq!(crc32c_host_model(&data[..len], chunk), want);
            assert!(n == len.div_ceil(chunk) && chunk % 8 == 0 && chunk >= MIN_CHUNK);
        }
    }

    #[test]
    fn chunking_fills_the_device_with_word_multiples() {
        assert_eq!(chunking(0, 132), (MIN_CHUNK, 0));
        assert_eq!(chunking(1, 132), (MIN_CHUNK, 1));
        let (c, n) = chunking(64 << 20, 132);
        assert_eq!(c % 8, 0);
        assert!((132 * 1024..=132 * 2048 + 1).contains(&n), "{c} x {n}");
        assert!(c * n >= 64 << 20 && c * (n - 1) < 64 << 20);
        assert!(shift_operators(c, n).len() <= MAX_OPS);
    }
}
