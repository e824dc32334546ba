//! The logits landing on the host.

/// Copies the landed logits into the fresh host `Vec` the step returns. Past a few MiB (batch
/// 64 x 128k vocab is 33 MB) the copy is split over the rayon pool: a single thread spends
/// milliseconds in the page faults of the fresh allocation (zero pages from calloc, first
/// touched here) and in the copy itself; split, both run on several cores.
pub(super) fn copy_logits(src: &[f32], dst: &mut [f32]) {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 20; // f32 elements: 4 MiB
    if dst.len() <= CHUNK {
        dst.copy_from_slice(src);
    } else {
        dst.par_chunks_mut(CHUNK)
            .zip(src.par_chunks(CHUNK))
            .for_each(|(d, s)| d.copy_from_slice(s));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn logits_copy_is_exact_small_and_split() {
        for n in [0usize, 5, (1 << 20) + 3, 5 * (1 << 20) + 17] {
            let src: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
            let mut dst = vec![0f32; n];
            super::copy_logits(&src, &mut dst);
            assert!(dst == src, "{n} elements");
        }
    }
}
