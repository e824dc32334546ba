//! KVH64: a 64-bit hash of a KV hand-off's bytes built for the GPU, where the CRC32C of
//! `pdnode_transfer::checksum` is compute-bound (a table lookup per byte: 0.13 of the H200's read
//! ceiling). The bytes are 16-byte words (KV layer-blocks always are); word `j` (counted from
//! the start of the hashed span) contributes an independent term `term(lo, hi, j)`, and the hash
//! is `finish(Σ terms mod 2^64, byte length)`.
//!
//! Because the terms are independent and summed, any thread may hash any word in any order and
//! the partial sums of separate launches add up: the device computes it inside the copies a
//! hand-off runs anyway (`kv_gather_h64` / `kv_scatter_h64`, kernels/kvh64.cu), so verifying a
//! hand-off costs a few integer operations per 16 bytes already in registers instead of another
//! pass over the bytes. The position enters each term, so moved or swapped words change the
//! hash; one flipped bit changes its word's term to an unrelated value.
//!
//! It detects corruption, misdelivery and stale writes (what the fence check is for); it is not
//! a MAC and does not resist someone who chooses the bytes.

/// Bytes per hashed word.
pub const WORD: usize = 16;

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;

/// MurmurHash3's 64-bit finalizer (a bijection with full avalanche).
#[inline]
pub fn fmix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// The term of the word whose little-endian halves are `lo`, `hi`, at word index `j`.
#[inline]
pub fn term(lo: u64, hi: u64, j: u64) -> u64 {
    let x = (lo ^ j.wrapping_mul(P1)).wrapping_mul(P2);
    let y = hi ^ j.wrapping_mul(P3);
    fmix(x.wrapping_add(y.rotate_left(31)))
}

/// The sum of the terms of `data`'s words, the first at index `word0`; `None` when `data` is not
/// whole words.
pub fn sum(data: &[u8], word0: u64) -> Option<u64> {
    if !data.len().is_multiple_of(WORD) {
        return None;
    }
    let mut s = 0u64;
    for (i, w) in data.chunks_exact(WORD).enumerate() {
        let lo = u64::from_le_bytes(w[..8].try_into().expect("8 bytes"));
        let hi = u64::from_le_bytes(w[8..].try_into().expect("8 bytes"));
        s = s.wrapping_add(term(lo, hi, word0.wrapping_add(i as u64)));
    }
    Some(s)
}

/// The hash of `len` bytes whose terms sum to `sum`.
#[inline]
pub fn finish(sum: u64, len: u64) -> u64 {
    fmix(sum ^ len.wrapping_mul(P1))
}

/// KVH64 of `data`; `None` when its length is not a multiple of [`WORD`].
pub fn kvh64(data: &[u8]) -> Option<u64> {
    Some(finish(sum(data, 0)?, data.len() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = fmix(x.wrapping_add(P2));
                x as u8
            })
            .collect()
    }

    #[test]
    fn known_values_pin_the_definition() {
        // The device kernels and any other implementation must give these.
        assert_eq!(kvh64(&[]), Some(fmix(0)));
        let w: Vec<u8> = (0u8..32).collect();
        let t0 = term(
            u64::from_le_bytes(w[0..8].try_into().unwrap()),
            u64::from_le_bytes(w[8..16].try_into().unwrap()),
            0,
        );
        let t1 = term(
            u64::from_le_bytes(w[16..24].try_into().unwrap()),
            u64::from_le_bytes(w[24..32].try_into().unwrap()),
            1,
        );
        assert_eq!(kvh64(&w), Some(finish(t0.wrapping_add(t1), 32)));
        assert_eq!(
            kvh64(&w),
            Some(0x0b48_dcd8_18a3_b33f),
            "{:#x}",
            kvh64(&w).unwrap()
        );
    }

    #[test]
    fn partial_sums_of_any_split_add_up() {
        let d = bytes(16 * 1000, 3);
        let whole = sum(&d, 0).unwrap();
        for cut in [0usize, 1, 17, 500, 999, 1000] {
            let (a, b) = d.split_at(cut * WORD);
            let s = sum(a, 0).unwrap().wrapping_add(sum(b, cut as u64).unwrap());
            assert_eq!(s, whole, "cut at word {cut}");
        }
    }

    #[test]
    fn flips_moves_and_lengths_change_the_hash() {
        let d = bytes(16 * 256, 9);
        let h = kvh64(&d).unwrap();
        for bit in [0usize, 7, 64, 127, 16 * 255 * 8 + 3] {
            let mut e = d.clone();
            e[bit / 8] ^= 1 << (bit % 8);
            assert_ne!(kvh64(&e).unwrap(), h, "bit {bit}");
        }
        // two words swapped
        let mut e = d.clone();
        let (a, b) = e.split_at_mut(16 * 10);
        a[..16].swap_with_slice(&mut b[..16]);
        assert_ne!(kvh64(&e).unwrap(), h);
        // zero words appended
        let mut e = d.clone();
        e.extend_from_slice(&[0u8; 16]);
        assert_ne!(kvh64(&e).unwrap(), h);
        // not whole words
        assert_eq!(kvh64(&d[..15]), None);
        assert_eq!(sum(&d[..17], 0), None);
    }
}
