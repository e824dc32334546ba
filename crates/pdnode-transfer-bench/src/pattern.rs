//! The bench's payload: every layer-block of a request gets words `base + k`, with `base`
//! derived from (request, layer, index in request), so a misplaced or stale block is caught.

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn base(request: u64, layer: u32, index: usize) -> u64 {
    splitmix(request ^ ((layer as u64) << 40) ^ ((index as u64) << 20))
}

/// Fills one layer-block.
pub fn fill(buf: &mut [u8], request: u64, layer: u32, index: usize) {
    let b = base(request, layer, index);
    for (k, w) in buf.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&b.wrapping_add(k as u64).to_le_bytes());
    }
}

/// Checks one layer-block; `Err` with the first wrong byte offset.
pub fn check(buf: &[u8], request: u64, layer: u32, index: usize) -> Result<(), usize> {
    let b = base(request, layer, index);
    for (k, w) in buf.chunks_exact(8).enumerate() {
        if w != b.wrapping_add(k as u64).to_le_bytes() {
            return Err(k * 8);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn fill_then_check_and_detect_swaps() {
        let mut a = vec![0u8; 64];
        super::fill(&mut a, 1, 2, 3);
        assert!(super::check(&a, 1, 2, 3).is_ok());
        assert!(super::check(&a, 1, 2, 4).is_err());
        a[17] ^= 1;
        assert_eq!(super::check(&a, 1, 2, 3), Err(16));
    }
}
