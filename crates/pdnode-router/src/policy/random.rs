//! `random`: uniform over the candidates.

use super::{Policy, PolicyContext};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

pub struct RandomPolicy {
    rng: ChaCha8Rng,
}

impl RandomPolicy {
    pub fn new(rng: ChaCha8Rng) -> Self {
        Self { rng }
    }
}

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }

    fn select(&mut self, ctx: &PolicyContext<'_>) -> Option<usize> {
        if ctx.workers.is_empty() {
            return None;
        }
        Some(self.rng.random_range(0..ctx.workers.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn same_seed_same_choices_and_all_workers_used() {
        let ws = workers(&[0, 0, 0, 0]);
        let mut a = RandomPolicy::new(ChaCha8Rng::seed_from_u64(5));
        let mut b = RandomPolicy::new(ChaCha8Rng::seed_from_u64(5));
        let xs: Vec<_> = (0..200)
            .map(|_| a.select(&ctx(&ws, &[])).unwrap())
            .collect();
        let ys: Vec<_> = (0..200)
            .map(|_| b.select(&ctx(&ws, &[])).unwrap())
            .collect();
        assert_eq!(xs, ys);
        for w in 0..4 {
            let n = xs.iter().filter(|&&x| x == w).count();
            assert!(n > 20, "worker {w} chosen {n} times of 200");
        }
    }
}
