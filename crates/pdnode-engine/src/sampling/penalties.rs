//! Repetition (HF semantics) and presence/frequency (OpenAI semantics) penalties.
//!
//! Applied to the raw logits in vLLM's order, before temperature:
//! 1. repetition penalty `r` on every token seen in the prompt or the output: a positive logit is
//!    divided by `r`, a negative one multiplied by `r` (HF `RepetitionPenaltyLogitsProcessor`);
//! 2. frequency penalty: `logit -= frequency * count` for each token generated `count` times;
//! 3. presence penalty: `logit -= presence` once for each token generated at least once.
//!
//! Presence and frequency count only generated tokens (OpenAI, vLLM); repetition counts the prompt
//! too (HF, vLLM).

use super::SamplingError;
use pdnode_core::SamplingParams;
use std::collections::HashMap;

#[derive(Debug, Clone)]
pub(crate) struct Penalties {
    repetition: f32,
    presence: f32,
    frequency: f32,
    vocab_size: usize,
    /// Bitset over the vocabulary of tokens seen in prompt or output (repetition penalty only).
    seen: Vec<u64>,
    /// The set bits of `seen`, to visit them without scanning the bitset.
    seen_list: Vec<u32>,
    /// Output token counts (presence/frequency only).
    counts: HashMap<u32, u32>,
}

impl Penalties {
    pub(crate) fn new(
        params: &SamplingParams,
        vocab_size: usize,
        prompt_ids: &[u32],
    ) -> Result<Self, SamplingError> {
        let mut p = Self {
            repetition: params.repetition_penalty,
            presence: params.presence_penalty,
            frequency: params.frequency_penalty,
            vocab_size,
            seen: Vec::new(),
            seen_list: Vec::new(),
            counts: HashMap::new(),
        };
        if p.repetition != 1.0 {
            p.seen = vec![0; vocab_size.div_ceil(64)];
        }
        for &id in prompt_ids {
            p.check(id)?;
            p.mark_seen(id);
        }
        Ok(p)
    }

    fn check(&self, id: u32) -> Result<(), SamplingError> {
        if id as usize >= self.vocab_size {
            return Err(SamplingError::TokenOutOfRange {
                id,
                vocab_size: self.vocab_size,
            });
        }
        Ok(())
    }

    fn mark_seen(&mut self, id: u32) {
        if self.seen.is_empty() {
            return;
        }
        let (w, b) = (id as usize / 64, id % 64);
        if self.seen[w] & (1 << b) == 0 {
            self.seen[w] |= 1 << b;
            self.seen_list.push(id);
        }
    }

    /// Whether any penalty changes the logits.
    pub(crate) fn is_active(&self) -> bool {
        self.repetition != 1.0 || self.presence != 0.0 || self.frequency != 0.0
    }

    /// Records a generated token.
    pub(crate) fn record(&mut self, id: u32) -> Result<(), SamplingError> {
        self.check(id)?;
        self.mark_seen(id);
        if self.presence != 0.0 || self.frequency != 0.0 {
            *self.counts.entry(id).or_insert(0) += 1;
        }
        Ok(())
    }

    /// Applies the penalties in place (`logits.len() == vocab_size`, checked by the caller).
    pub(crate) fn apply(&self, logits: &mut [f32]) {
        if self.repetition != 1.0 {
            let r = self.repetition;
            for &id in &self.seen_list {
                let l = &mut logits[id as usize];
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
        }
        if self.presence != 0.0 || self.frequency != 0.0 {
            for (&id, &n) in &self.counts {
                logits[id as usize] -= self.frequency * n as f32 + self.presence;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(rep: f32, pres: f32, freq: f32) -> SamplingParams {
        SamplingParams {
            repetition_penalty: rep,
            presence_penalty: pres,
            frequency_penalty: freq,
            ..Default::default()
        }
    }

    #[test]
    fn repetition_divides_positive_and_multiplies_negative_logits_of_seen_tokens() {
        let mut p = Penalties::new(&params(2.0, 0.0, 0.0), 4, &[0, 1, 1]).unwrap();
        p.record(2).unwrap();
        let mut l = vec![4.0, -4.0, 1.0, 3.0];
        p.apply(&mut l);
        // Applied once per token however often it was seen.
        assert_eq!(l, vec![2.0, -8.0, 0.5, 3.0]);
    }

    #[test]
    fn frequency_counts_output_occurrences_and_presence_counts_once() {
        let mut p = Penalties::new(&params(1.0, 0.5, 0.25), 4, &[3]).unwrap();
        for id in [0, 0, 0, 1] {
            p.record(id).unwrap();
        }
        let mut l = vec![1.0; 4];
        p.apply(&mut l);
        // Prompt token 3 is not penalized by presence/frequency.
        assert_eq!(l, vec![1.0 - 0.75 - 0.5, 1.0 - 0.25 - 0.5, 1.0, 1.0]);
    }

    #[test]
    fn out_of_range_ids_are_errors() {
        assert!(matches!(
            Penalties::new(&params(1.5, 0.0, 0.0), 4, &[4]),
            Err(SamplingError::TokenOutOfRange { id: 4, .. })
        ));
        let mut p = Penalties::new(&params(1.0, 0.0, 0.0), 4, &[]).unwrap();
        assert!(!p.is_active());
        assert!(p.record(9).is_err());
    }
}
