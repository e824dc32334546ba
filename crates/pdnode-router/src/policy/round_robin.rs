//! `round_robin`: the candidates in turn.

use super::{Policy, PolicyContext};

#[derive(Default)]
pub struct RoundRobinPolicy {
    next: usize,
}

impl Policy for RoundRobinPolicy {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn select(&mut self, ctx: &PolicyContext<'_>) -> Option<usize> {
        if ctx.workers.is_empty() {
            return None;
        }
        let i = self.next % ctx.workers.len();
        self.next = self.next.wrapping_add(1);
        Some(i)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::*;

    #[test]
    fn cycles_through_workers() {
        let ws = workers(&[5, 0, 9]);
        let mut p = RoundRobinPolicy::default();
        let xs: Vec<_> = (0..6).map(|_| p.select(&ctx(&ws, &[])).unwrap()).collect();
        assert_eq!(xs, vec![0, 1, 2, 0, 1, 2]);
    }
}
