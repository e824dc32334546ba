//! `cost` (prefill only): the candidate with the lowest predicted time to first token
//! ([`WorkerLoad::predicted_ttft_us`], which the router fills from its measurements:
//! `router::cost`); ties go to the least loaded, then the first.

use super::{Policy, PolicyContext};

#[derive(Debug, Default)]
pub struct CostPolicy;

impl Policy for CostPolicy {
    fn name(&self) -> &'static str {
        "cost"
    }

    fn select(&mut self, ctx: &PolicyContext<'_>) -> Option<usize> {
        (0..ctx.workers.len()).min_by_key(|&i| {
            let w = &ctx.workers[i];
            (w.predicted_ttft_us, w.load(), i)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::*;

    #[test]
    fn picks_the_lowest_predicted_ttft_then_the_least_loaded() {
        let mut ws = workers(&[0, 5, 1]);
        ws[0].predicted_ttft_us = 900;
        ws[1].predicted_ttft_us = 100;
        ws[2].predicted_ttft_us = 100;
        let mut p = CostPolicy;
        // w1 and w2 tie on time; w2 is less loaded.
        assert_eq!(p.select(&ctx(&ws, &[1])), Some(2));
        ws[1].predicted_ttft_us = 99;
        assert_eq!(p.select(&ctx(&ws, &[1])), Some(1));
        // Nothing measured: the least loaded.
        let ws = workers(&[3, 1, 2]);
        assert_eq!(p.select(&ctx(&ws, &[1])), Some(1));
    }
}
