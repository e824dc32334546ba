//! CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the checksum a prefill node computes
//! over each rank's KV bytes and a decode node checks before it scatters them (docs/protocol.md,
//! "Fencing and verification").
//!
//! On x86-64 with SSE 4.2 the `crc32` instruction runs three independent streams (the
//! instruction's 3-cycle latency would otherwise cap one stream at ~8 bytes every 3 cycles),
//! combined with a zero-extension matrix; elsewhere a slicing-by-8 table. Both give the same
//! value (tested against each other and against the standard check value).

/// The reflected Castagnoli polynomial.
const POLY: u32 = 0x82F6_3B78;

/// Slicing-by-8 tables, built at compile time.
const TABLES: [[u32; 256]; 8] = tables();

const fn tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut s = 1;
    while s < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = t[s - 1][i];
            t[s][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            i += 1;
        }
        s += 1;
    }
    t
}

/// CRC32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c_append(0, data)
}

/// CRC32C of the bytes already summed into `crc` followed by `data`.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("sse4.2") {
            // SAFETY: the CPU supports SSE 4.2 (checked just above).
            return !unsafe { hw::update(!crc, data) };
        }
    }
    !sw_update(!crc, data)
}

/// Slicing-by-8 over the inverted running value.
fn sw_update(mut c: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(8);
    for ch in &mut chunks {
        let lo = c ^ u32::from_le_bytes([ch[0], ch[1], ch[2], ch[3]]);
        c = TABLES[7][(lo & 0xff) as usize]
            ^ TABLES[6][((lo >> 8) & 0xff) as usize]
            ^ TABLES[5][((lo >> 16) & 0xff) as usize]
            ^ TABLES[4][(lo >> 24) as usize]
            ^ TABLES[3][ch[4] as usize]
            ^ TABLES[2][ch[5] as usize]
            ^ TABLES[1][ch[6] as usize]
            ^ TABLES[0][ch[7] as usize];
    }
    for b in chunks.remainder() {
        c = (c >> 8) ^ TABLES[0][((c ^ *b as u32) & 0xff) as usize];
    }
    c
}

/// GF(2) helpers to shift a CRC over `n` zero bytes (combining the three hardware streams).
mod gf2 {
    /// `mat * vec` over GF(2); `mat` is 32 columns.
    fn times(mat: &[u32; 32], mut vec: u32) -> u32 {
        let mut sum = 0;
        let mut i = 0;
        while vec != 0 {
            if vec & 1 != 0 {
                sum ^= mat[i];
            }
            vec >>= 1;
            i += 1;
        }
        sum
    }

    fn square(mat: &[u32; 32]) -> [u32; 32] {
        let mut sq = [0u32; 32];
        for (n, s) in sq.iter_mut().enumerate() {
            *s = times(mat, mat[n]);
        }
        sq
    }

    /// The operator that appends `len` zero bytes to an (inverted) CRC register.
    pub(super) fn zeros_operator(len: usize) -> [u32; 32] {
        // One zero bit.
        let mut odd = [0u32; 32];
        odd[0] = super::POLY;
        for (n, o) in odd.iter_mut().enumerate().skip(1) {
            *o = 1 << (n - 1);
        }
        // Identity, then square up to the bytes wanted.
        let mut result = [0u32; 32];
        for (n, r) in result.iter_mut().enumerate() {
            *r = 1 << n;
        }
        let mut op = square(&square(&square(&odd))); // eight zero bits: one byte
        let mut len = len;
        while len != 0 {
            if len & 1 != 0 {
                let mut next = [0u32; 32];
                for (n, x) in next.iter_mut().enumerate() {
                    *x = times(&op, result[n]);
                }
                result = next;
            }
            len >>= 1;
            if len != 0 {
                op = square(&op);
            }
        }
        result
    }

    pub(super) fn apply(op: &[u32; 32], crc: u32) -> u32 {
        times(op, crc)
    }
}

#[cfg(target_arch = "x86_64")]
mod hw {
    use std::arch::x86_64::{_mm_crc32_u8, _mm_crc32_u64};
    use std::sync::OnceLock;

    /// Bytes per stream per block of the three-stream loop.
    const LANE: usize = 4096;

    fn shift_op() -> &'static [u32; 32] {
        static OP: OnceLock<[u32; 32]> = OnceLock::new();
        OP.get_or_init(|| super::gf2::zeros_operator(LANE))
    }

    fn word(b: &[u8]) -> u64 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[..8]);
        u64::from_le_bytes(w)
    }

    /// # Safety
    /// The CPU must support SSE 4.2.
    #[target_feature(enable = "sse4.2")]
    unsafe fn serial(mut c: u32, data: &[u8]) -> u32 {
        let mut words = data.chunks_exact(8);
        for w in &mut words {
            c = _mm_crc32_u64(c as u64, word(w)) as u32;
        }
        for b in words.remainder() {
            c = _mm_crc32_u8(c, *b);
        }
        c
    }

    /// # Safety
    /// The CPU must support SSE 4.2.
    #[target_feature(enable = "sse4.2")]
    pub(super) unsafe fn update(mut c: u32, data: &[u8]) -> u32 {
        let op = shift_op();
        let mut blocks = data.chunks_exact(3 * LANE);
        for blk in &mut blocks {
            let p = blk.as_ptr();
            let (mut ca, mut cb, mut cd) = (c as u64, 0u64, 0u64);
            for i in (0..LANE).step_by(8) {
                // SAFETY: `blk` is 3 * LANE bytes and `i + 8 <= LANE`, so the three words at
                // `i`, `LANE + i` and `2 * LANE + i` are inside it; unaligned reads of bytes.
                let (wa, wb, wd) = unsafe {
                    (
                        std::ptr::read_unaligned(p.add(i) as *const u64),
                        std::ptr::read_unaligned(p.add(LANE + i) as *const u64),
                        std::ptr::read_unaligned(p.add(2 * LANE + i) as *const u64),
                    )
                };
                ca = _mm_crc32_u64(ca, u64::from_le(wa));
                cb = _mm_crc32_u64(cb, u64::from_le(wb));
                cd = _mm_crc32_u64(cd, u64::from_le(wd));
            }
            // crc(A || B) = shift(crc(A), |B|) ^ crc0(B), with crc0 started from 0.
            let (ca, cb, cd) = (ca as u32, cb as u32, cd as u32);
            c = super::gf2::apply(op, super::gf2::apply(op, ca) ^ cb) ^ cd;
        }
        // SAFETY: same CPU requirement as this function's.
        unsafe { serial(c, blocks.remainder()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers() {
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        let inc: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&inc), 0x46DD_794E);
    }

    #[test]
    fn hardware_streams_equal_the_table_and_appending_is_concatenation() {
        let data: Vec<u8> = (0..(3 * 4096 * 3 + 1234))
            .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let want = !sw_update(!0, &data);
        for len in [0, 1, 7, 8, 4095, 3 * 4096, 3 * 4096 + 9, data.len()] {
            assert_eq!(crc32c(&data[..len]), !sw_update(!0, &data[..len]), "{len}");
        }
        let (a, b) = data.split_at(5000);
        assert_eq!(crc32c_append(crc32c(a), b), want);
        let mut flipped = data.clone();
        flipped[20_000] ^= 0x10;
        assert_ne!(crc32c(&flipped), want);
    }
}
