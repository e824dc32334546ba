//! Log-probabilities returned to clients.
//!
//! Like vLLM's default (`logprobs_mode = "raw_logprobs"`), these are the log-softmax of the **raw
//! model logits**: before penalties, temperature, top-k/top-p/min-p. They describe what the model
//! thinks, not the distribution the token was drawn from (which may have been truncated to one
//! token). A logit that is not finite has log-probability -9999 (OpenAI's floor), so the value is
//! always a finite JSON number.

use pdnode_core::request::TokenLogprob;

/// Log-probability given to tokens whose logit is not finite.
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// Orders logits descending with NaN last; equal logits by ascending id.
pub(crate) fn desc(logits: &[f32], a: u32, b: u32) -> std::cmp::Ordering {
    let key = |i: u32| {
        let v = logits[i as usize];
        if v.is_nan() { f32::NEG_INFINITY } else { v }
    };
    key(b).total_cmp(&key(a)).then(a.cmp(&b))
}

/// `log(sum(exp(logits)))` over the finite logits; `None` if there are none.
pub(crate) fn log_sum_exp(logits: &[f32]) -> Option<f32> {
    let m = logits
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return None;
    }
    let s: f64 = logits
        .iter()
        .filter(|v| v.is_finite())
        .map(|&v| f64::from(v - m).exp())
        .sum();
    Some(m + s.ln() as f32)
}

fn logprob(logit: f32, lse: f32) -> f32 {
    let lp = logit - lse;
    if lp.is_finite() {
        lp.max(LOGPROB_FLOOR)
    } else {
        LOGPROB_FLOOR
    }
}

/// The raw log-probability of `token` and the `top_n` most likely tokens (descending).
/// `scratch` is reused between calls to avoid allocating a vocabulary-sized index per step.
pub(crate) fn token_logprob(
    logits: &[f32],
    token: u32,
    top_n: usize,
    scratch: &mut Vec<u32>,
) -> TokenLogprob {
    let lse = log_sum_exp(logits).unwrap_or(0.0);
    let mut top = Vec::new();
    let n = top_n.min(logits.len());
    if n > 0 {
        scratch.clear();
        scratch.extend(0..logits.len() as u32);
        if n < scratch.len() {
            scratch.select_nth_unstable_by(n - 1, |&a, &b| desc(logits, a, b));
        }
        let head = &mut scratch[..n];
        head.sort_unstable_by(|&a, &b| desc(logits, a, b));
        top = head
            .iter()
            .map(|&i| (i, logprob(logits[i as usize], lse)))
            .collect();
    }
    TokenLogprob {
        token_id: token,
        logprob: logprob(logits[token as usize], lse),
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_normalized_log_softmax_with_sorted_top() {
        let logits = [1.0f32, 3.0, 2.0, f32::NEG_INFINITY, 0.5];
        let mut s = Vec::new();
        let lp = token_logprob(&logits, 2, 5, &mut s);
        let total: f32 = lp
            .top
            .iter()
            .filter(|(_, l)| *l > LOGPROB_FLOOR)
            .map(|(_, l)| l.exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 2, 0, 4, 3]);
        assert_eq!(lp.top[4].1, LOGPROB_FLOOR);
        assert_eq!(lp.logprob, lp.top[1].1);
        let expected = 2.0 - (1f32.exp() + 3f32.exp() + 2f32.exp() + 0.5f32.exp()).ln();
        assert!((lp.logprob - expected).abs() < 1e-5);
    }

    #[test]
    fn zero_top_n_gives_only_the_token() {
        let mut s = Vec::new();
        let lp = token_logprob(&[0.0, 0.0], 1, 0, &mut s);
        assert!(lp.top.is_empty());
        assert!((lp.logprob - 0.5f32.ln()).abs() < 1e-6);
    }
}
