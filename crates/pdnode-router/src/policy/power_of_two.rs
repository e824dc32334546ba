//! `power_of_two`: sample two distinct candidates at random, take the less loaded.

use super::{Policy, PolicyContext};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

pub struct PowerOfTwoPolicy {
    rng: ChaCha8Rng,
}

impl PowerOfTwoPolicy {
    pub fn new(rng: ChaCha8Rng) -> Self {
        Self { rng }
    }
}

impl Policy for PowerOfTwoPolicy {
    fn name(&self) -> &'static str {
        "power_of_two"
    }

    fn select(&mut self, ctx: &PolicyContext<'_>) -> Option<usize> {
        let n = ctx.workers.len();
        match n {
            0 => None,
            1 => Some(0),
            _ => {
                let a = self.rng.random_range(0..n);
                let mut b = self.rng.random_range(0..n - 1);
                if b >= a {
                    b += 1;
                }
                let (wa, wb) = (&ctx.workers[a], &ctx.workers[b]);
                let ka = (wa.load(), std::cmp::Reverse(wa.kv_blocks_free));
                let kb = (wb.load(), std::cmp::Reverse(wb.kv_blocks_free));
                Some(if kb < ka { b } else { a })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn never_picks_the_most_loaded_of_three_and_always_the_lighter_of_two() {
        let mut p = PowerOfTwoPolicy::new(ChaCha8Rng::seed_from_u64(1));
        let ws = workers(&[10, 0, 5]);
        for _ in 0..200 {
            assert_ne!(p.select(&ctx(&ws, &[])).unwrap(), 0);
        }
        let ws = workers(&[4, 3]);
        for _ in 0..50 {
            assert_eq!(p.select(&ctx(&ws, &[])).unwrap(), 1);
        }
    }

    #[test]
    fn deterministic_under_a_seed() {
        let ws = workers(&[1, 1, 1, 1, 1]);
        let run = |seed| {
            let mut p = PowerOfTwoPolicy::new(ChaCha8Rng::seed_from_u64(seed));
            (0..50)
                .map(|_| p.select(&ctx(&ws, &[])).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(9), run(9));
    }
}
