//! Test helpers shared by the kvcache tests.

use pdnode_kvcache::KvCache;

/// Asserts the accounting invariant, printing every violation.
#[track_caller]
pub fn assert_accounting(kv: &KvCache) {
    if let Err(e) = kv.check_accounting() {
        panic!("{e}");
    }
}

/// A small seeded RNG (splitmix64) so property tests replay exactly.
#[allow(dead_code)] // used by some test binaries only
pub struct Rng(pub u64);

#[allow(dead_code)]
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}
