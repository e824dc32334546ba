//! Sampling on the host: one [`SequenceSampler`] and one [`OutputAssembler`] per request.
//!
//! [`SequenceSampler::sample`] turns a logits row into the next token:
//! 1. penalties on the raw logits (`penalties`: repetition over prompt + output, HF semantics;
//!    presence/frequency over the output, OpenAI semantics);
//! 2. temperature 0 is greedy: the arg-max of the penalized logits (the lowest id on ties), and
//!    top-k/top-p/min-p are ignored;
//! 3. otherwise, as vLLM: divide by the temperature, drop tokens below `min_p` times the top
//!    probability, keep the `top_k` most likely, keep the smallest most-likely set whose mass
//!    reaches `top_p` (renormalized after min-p and top-k), and draw from what is left with a
//!    ChaCha20 RNG seeded per request (`seed`, or a random seed when the request has none; same
//!    seed, same params, same logits: same tokens).
//!
//! Log-probabilities are those of the raw model logits (`logprobs`, vLLM's default).
//!
//! A device may sample instead (`device`): for a request with temperature > 0 and no penalties or
//! logprobs, [`SequenceSampler::device_draw`] takes the step's uniform from the same stream at the
//! same point as the host draw, the device picks the token with [`device::sample_row`]'s
//! semantics (same kept set and probabilities as step 3), and
//! [`SequenceSampler::accept_sampled`] records it.
//!
//! Cost per step is O(vocab) when top-k/top-p are off (no sort); top-k uses a selection
//! (`select_nth_unstable`) and sorts only the k kept; top-p alone finds its set with a quickselect
//! on probability mass (expected O(vocab), no sort).
//!
//! [`OutputAssembler`] (in `stop`) turns sampled tokens into text deltas and decides when the
//! request finishes (EOS, stop ids, stop strings, `max_tokens`, context length).

pub mod device;
mod logprobs;
mod penalties;
mod stop;

pub use device::{RowDraw, sample_row};
pub use logprobs::LOGPROB_FLOOR;
pub use stop::{OutputAssembler, StepOutput, StopCause};

use crate::text::TextError;
use logprobs::desc;
use pdnode_core::error::Classify;
use pdnode_core::request::{InvalidParam, TokenLogprob};
use pdnode_core::{ErrorKind, SamplingParams};
use penalties::Penalties;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

#[derive(Debug, thiserror::Error)]
pub enum SamplingError {
    #[error(transparent)]
    InvalidParam(#[from] InvalidParam),
    #[error("a logits row of {got} values for a vocabulary of {vocab_size}")]
    LogitsSize { got: usize, vocab_size: usize },
    #[error("token id {id} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfRange { id: u32, vocab_size: usize },
    #[error("the logits row has no finite value")]
    NoFiniteLogits,
    #[error("the request already finished ({reason})")]
    AlreadyFinished { reason: &'static str },
    #[error("stop strings need a tokenizer; this model has none")]
    StopStringsWithoutTokenizer,
    #[error(transparent)]
    Text(#[from] TextError),
}

impl Classify for SamplingError {
    fn kind(&self) -> ErrorKind {
        match self {
            SamplingError::InvalidParam(e) => e.kind(),
            SamplingError::TokenOutOfRange { .. } | SamplingError::StopStringsWithoutTokenizer => {
                ErrorKind::InvalidRequest
            }
            SamplingError::LogitsSize { .. }
            | SamplingError::NoFiniteLogits
            | SamplingError::AlreadyFinished { .. } => ErrorKind::Internal,
            SamplingError::Text(e) => e.kind(),
        }
    }
}

/// What one sampling step produced.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOut {
    pub token: u32,
    /// The raw log-probability of `token` and the requested top alternatives, when the request
    /// asked for logprobs.
    pub logprob: Option<TokenLogprob>,
}

/// Where a sampler's random stream stands, to continue a request elsewhere (PD hand-off) with the
/// same draws it would have made locally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplerState {
    pub seed: u64,
    /// ChaCha20 word position.
    pub word_pos: u128,
}

/// Per-request sampler. Plain data; one per running sequence.
#[derive(Debug, Clone)]
pub struct SequenceSampler {
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
    logprobs: Option<usize>,
    vocab_size: usize,
    penalties: Penalties,
    seed: u64,
    rng: ChaCha20Rng,
    /// Penalized logits (only when penalties are active).
    work: Vec<f32>,
    /// Candidate ids.
    idx: Vec<u32>,
    /// Per-token sampling weights of the current step.
    weights: Vec<f32>,
}

impl SequenceSampler {
    /// A sampler for a request over `vocab_size` logits, after `prompt_ids`. Validates `params`;
    /// a request without a seed gets a random one (see [`SequenceSampler::seed`]).
    pub fn new(
        params: &SamplingParams,
        vocab_size: usize,
        prompt_ids: &[u32],
    ) -> Result<Self, SamplingError> {
        let seed = params.seed.unwrap_or_else(rand::random);
        Self::with_seed(params, vocab_size, prompt_ids, seed)
    }

    /// As [`SequenceSampler::new`] with an explicit seed (overrides `params.seed`).
    pub fn with_seed(
        params: &SamplingParams,
        vocab_size: usize,
        prompt_ids: &[u32],
        seed: u64,
    ) -> Result<Self, SamplingError> {
        params.validate()?;
        if vocab_size == 0 || vocab_size > u32::MAX as usize {
            return Err(SamplingError::LogitsSize { got: 0, vocab_size });
        }
        let top_k = match params.top_k as usize {
            k if k >= vocab_size => 0,
            k => k,
        };
        Ok(Self {
            temperature: params.temperature,
            top_k,
            top_p: params.top_p,
            min_p: params.min_p,
            logprobs: params.logprobs.map(|n| n as usize),
            vocab_size,
            penalties: Penalties::new(params, vocab_size, prompt_ids)?,
            seed,
            rng: ChaCha20Rng::seed_from_u64(seed),
            work: Vec::new(),
            idx: Vec::new(),
            weights: Vec::new(),
        })
    }

    /// Rebuilds a sampler that already produced `output_ids`, with its random stream where
    /// [`SequenceSampler::state`] left it.
    pub fn restore(
        params: &SamplingParams,
        vocab_size: usize,
        prompt_ids: &[u32],
        output_ids: &[u32],
        state: SamplerState,
    ) -> Result<Self, SamplingError> {
        let mut s = Self::with_seed(params, vocab_size, prompt_ids, state.seed)?;
        s.rng.set_word_pos(state.word_pos);
        for &id in output_ids {
            s.penalties.record(id)?;
        }
        Ok(s)
    }

    /// The seed in use (the request's, or the random one drawn for it).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn state(&self) -> SamplerState {
        SamplerState {
            seed: self.seed,
            word_pos: self.rng.get_word_pos(),
        }
    }

    /// Records a token produced elsewhere (e.g. the first token a prefill node sampled) so the
    /// penalties see it. [`SequenceSampler::sample`] records its own tokens.
    pub fn accept(&mut self, token: u32) -> Result<(), SamplingError> {
        self.penalties.record(token)
    }

    /// Whether [`SequenceSampler::sample`] of a row is exactly [`argmax`] of that raw row with
    /// nothing else computed from it: temperature 0, no penalties, no logprobs. Then the row
    /// itself is not needed: [`SequenceSampler::accept_argmax`] takes its arg-max instead (a
    /// device computes it).
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0 && self.logprobs.is_none() && !self.penalties.is_active()
    }

    /// What [`SequenceSampler::sample`] returns for a row whose [`argmax`] is `token` (`None`:
    /// the row had no finite value), when [`SequenceSampler::is_plain_greedy`]; otherwise the
    /// row is needed and this is an error.
    pub fn accept_argmax(&mut self, token: Option<u32>) -> Result<SampleOut, SamplingError> {
        let allowed = self.is_plain_greedy();
        self.accept_device_token(allowed, token)
    }

    /// A token picked without the row (on a device): recorded as [`SequenceSampler::sample`]
    /// records its own; the row was needed (`!allowed`) or had no finite value: the host
    /// path's errors.
    fn accept_device_token(
        &mut self,
        allowed: bool,
        token: Option<u32>,
    ) -> Result<SampleOut, SamplingError> {
        if !allowed {
            return Err(SamplingError::LogitsSize {
                got: 0,
                vocab_size: self.vocab_size,
            });
        }
        let token = token.ok_or(SamplingError::NoFiniteLogits)?;
        self.penalties.record(token)?;
        Ok(SampleOut {
            token,
            logprob: None,
        })
    }

    /// Whether a device may sample this request's rows ([`device::sample_row`] semantics):
    /// temperature > 0, no penalties, no logprobs (the row itself is then not needed).
    pub fn is_device_sampleable(&self) -> bool {
        self.temperature > 0.0 && self.logprobs.is_none() && !self.penalties.is_active()
    }

    /// For a request whose next token a device may sample ([`Self::is_device_sampleable`]):
    /// draws the step's uniform from the request's stream, exactly the draw
    /// [`SequenceSampler::sample`] would make, and returns the row's [`RowDraw`]; finish with
    /// [`SequenceSampler::accept_sampled`]. `None` (nothing drawn) for any other request.
    pub fn device_draw(&mut self) -> Option<RowDraw> {
        if !self.is_device_sampleable() {
            return None;
        }
        Some(RowDraw {
            temperature: self.temperature,
            top_k: self.top_k as u32,
            top_p: self.top_p,
            min_p: self.min_p,
            u: self.rng.random(),
        })
    }

    /// What [`SequenceSampler::sample`] returns for a token a device sampled under
    /// [`SequenceSampler::device_draw`] (`None`: the row had no finite value, the host path's
    /// error). An error for a request a device may not sample.
    pub fn accept_sampled(&mut self, token: Option<u32>) -> Result<SampleOut, SamplingError> {
        let allowed = self.is_device_sampleable();
        self.accept_device_token(allowed, token)
    }

    /// Picks the next token from one logits row of `vocab_size` values.
    pub fn sample(&mut self, logits: &[f32]) -> Result<SampleOut, SamplingError> {
        if logits.len() != self.vocab_size {
            return Err(SamplingError::LogitsSize {
                got: logits.len(),
                vocab_size: self.vocab_size,
            });
        }
        let mut work = std::mem::take(&mut self.work);
        let row: &[f32] = if self.penalties.is_active() {
            work.clear();
            work.extend_from_slice(logits);
            self.penalties.apply(&mut work);
            &work
        } else {
            logits
        };
        let picked = if self.temperature == 0.0 {
            argmax(row)
        } else {
            self.draw(row)
        };
        self.work = work;
        let token = picked?;
        let logprob = self
            .logprobs
            .map(|n| logprobs::token_logprob(logits, token, n, &mut self.idx));
        self.penalties.record(token)?;
        Ok(SampleOut { token, logprob })
    }

    /// Temperature, min-p, top-k, top-p, then one draw.
    fn draw(&mut self, row: &[f32]) -> Result<u32, SamplingError> {
        let max = finite_max(row).ok_or(SamplingError::NoFiniteLogits)?;
        let u: f64 = self.rng.random();
        let (kept, mass) = self.keep(row, max);
        let w = &self.weights[..];
        match kept {
            // Plain (min-p) sampling: no sort.
            None => pick(w, 0..w.len() as u32, u * mass),
            Some(n) => pick(w, self.idx[..n].iter().copied(), u * mass),
        }
    }

    /// The tokens `draw` picks from (temperature, min-p, top-k, top-p over `row`, whose largest
    /// finite value is `max`): `None` for every token, `Some(n)` for `self.idx[..n]`, with their
    /// weights in `self.weights` (by id) and their mass.
    fn keep(&mut self, row: &[f32], max: f32) -> (Option<usize>, f64) {
        // Weight of a token relative to the top one: exp((l - max) / T), 0 below min-p and for
        // non-finite logits.
        let inv_t = 1.0 / self.temperature;
        let min_w = self.min_p;
        let weight = |l: f32| -> f32 {
            if !l.is_finite() {
                return 0.0;
            }
            let x = ((l - max) * inv_t).exp();
            if x < min_w { 0.0 } else { x }
        };
        let idx = &mut self.idx;
        idx.clear();
        let w = &mut self.weights;
        w.clear();
        if self.top_k > 0 {
            // Select on the logits (same order as the weights) and weigh only the k kept.
            let k = self.top_k;
            idx.extend(0..row.len() as u32);
            idx.select_nth_unstable_by(k - 1, |&a, &b| desc(row, a, b));
            idx.truncate(k);
            idx.sort_unstable_by(|&a, &b| desc(row, a, b));
            w.extend(row.iter().map(|_| 0.0));
            for &i in idx.iter() {
                w[i as usize] = weight(row[i as usize]);
            }
        } else {
            w.extend(row.iter().map(|&l| weight(l)));
        }
        let w = &self.weights[..];
        let total: f64 = if self.top_k > 0 {
            idx.iter().map(|&i| f64::from(w[i as usize])).sum()
        } else {
            w.iter().map(|&x| f64::from(x)).sum()
        };

        if self.top_p >= 1.0 {
            return if self.top_k > 0 {
                (Some(idx.len()), total)
            } else {
                (None, total)
            };
        }

        // Top-p: the most likely tokens whose mass first reaches top_p (at least one token).
        let need = f64::from(self.top_p) * total;
        let keep = if self.top_k > 0 {
            // The k candidates are sorted: cut the prefix.
            let mut acc = 0.0;
            idx.iter()
                .position(|&i| {
                    acc += f64::from(w[i as usize]);
                    acc >= need
                })
                .map_or(idx.len(), |j| j + 1)
        } else {
            idx.extend(0..w.len() as u32);
            top_mass(w, idx, need)
        };
        let kept = &idx[..keep];
        let kept_mass: f64 = kept.iter().map(|&i| f64::from(w[i as usize])).sum();
        (Some(keep), kept_mass)
    }
}

/// The largest finite value of `row`, if any.
fn finite_max(row: &[f32]) -> Option<f32> {
    let max = row
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    max.is_finite().then_some(max)
}

/// Moves the most likely tokens that together hold at least `need` of the weight to the front of
/// `idx` and returns how many they are: the shortest such set, ties broken toward lower ids (the
/// same set as cutting the sorted order). A quickselect on mass with three-way partitions:
/// expected O(len), no sort of the vocabulary.
fn top_mass(w: &[f32], idx: &mut [u32], mut need: f64) -> usize {
    let (mut lo, mut hi) = (0, idx.len());
    while lo < hi {
        let win = &mut idx[lo..hi];
        let (a, b, c) = (
            w[win[0] as usize],
            w[win[win.len() / 2] as usize],
            w[win[win.len() - 1] as usize],
        );
        let pivot = a.max(b).min(a.min(b).max(c)); // median of three
        // Three-way partition: [> pivot][== pivot][< pivot].
        let (mut gt, mut i, mut lt) = (0, 0, win.len());
        while i < lt {
            let x = w[win[i] as usize];
            if x > pivot {
                win.swap(gt, i);
                gt += 1;
                i += 1;
            } else if x < pivot {
                lt -= 1;
                win.swap(i, lt);
            } else {
                i += 1;
            }
        }
        let mass_gt: f64 = win[..gt].iter().map(|&j| f64::from(w[j as usize])).sum();
        if gt > 0 && mass_gt >= need {
            hi = lo + gt;
            continue;
        }
        need -= mass_gt;
        let eq = &mut win[gt..lt];
        let mass_eq = f64::from(pivot) * eq.len() as f64;
        if mass_eq >= need && pivot > 0.0 {
            eq.sort_unstable();
            let k = ((need / f64::from(pivot)).ceil() as usize).clamp(1, eq.len());
            return lo + gt + k;
        }
        need -= mass_eq;
        lo += lt;
    }
    lo.max(1).min(idx.len())
}

/// The first candidate at which the running sum of weights passes `target`; the last candidate
/// with weight if rounding leaves the target at the very end.
fn pick(
    w: &[f32],
    candidates: impl Iterator<Item = u32>,
    target: f64,
) -> Result<u32, SamplingError> {
    let mut acc = 0.0;
    let mut last = None;
    for i in candidates {
        let x = f64::from(w[i as usize]);
        if x > 0.0 {
            acc += x;
            last = Some(i);
            if acc > target {
                return Ok(i);
            }
        }
    }
    last.ok_or(SamplingError::NoFiniteLogits)
}

/// The id of the largest finite logit (the lowest id on ties).
pub fn argmax(row: &[f32]) -> Result<u32, SamplingError> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() || v == f32::NEG_INFINITY {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i as u32)
        .ok_or(SamplingError::NoFiniteLogits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    /// The reference: sort descending (ties by id) and cut the shortest prefix reaching `need`.
    fn by_sort(w: &[f32], need: f64) -> Vec<u32> {
        let mut idx: Vec<u32> = (0..w.len() as u32).collect();
        idx.sort_by(|&a, &b| desc(w, a, b));
        let mut acc = 0.0;
        let n = idx
            .iter()
            .position(|&i| {
                acc += f64::from(w[i as usize]);
                acc >= need
            })
            .map_or(idx.len(), |j| j + 1);
        let mut v = idx[..n].to_vec();
        v.sort_unstable();
        v
    }

    #[test]
    fn top_mass_keeps_the_same_set_as_sorting() {
        let mut rng = ChaCha20Rng::seed_from_u64(1);
        for case in 0..500 {
            let n = rng.random_range(1..300);
            // Few distinct values (ties), some zeros.
            let levels = [1, 2, 4, 8][rng.random_range(0..4)];
            let w: Vec<f32> = (0..n)
                .map(|_| rng.random_range(0..=levels) as f32 / levels as f32)
                .collect();
            let total: f64 = w.iter().map(|&x| f64::from(x)).sum();
            if total == 0.0 {
                continue;
            }
            // Dyadic top_p values keep the float sums exact, so both cuts agree exactly.
            let p = [0.25, 0.5, 0.75, 0.875, 1.0][rng.random_range(0..5)];
            let need = p * total;
            let mut idx: Vec<u32> = (0..n as u32).collect();
            let k = top_mass(&w, &mut idx, need);
            let mut got = idx[..k].to_vec();
            got.sort_unstable();
            let want = by_sort(&w, need);
            // Same mass; the same set unless the cut falls inside a run of equal weights with
            // float rounding, which the dyadic values above avoid.
            assert_eq!(got, want, "case {case}: w {w:?} p {p}");
        }
    }
}
