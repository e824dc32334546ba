//! The canonical "device sampling" of one logits row: what `kernels/sample.cu` `sample_rows`
//! computes, as a plain function (the reference of the GPU tests, and what a backend without
//! device sampling computes for a [`crate::backend::LogitsWant::Sample`] row).
//!
//! Inputs: the row, temperature `T > 0`, `top_k` (0 = off), `top_p` (>= 1 = off), `min_p`, and
//! one uniform `u` in `[0, 1)` that the request's [`super::SequenceSampler`] draws from its
//! ChaCha20 stream exactly where its host `draw` draws it (one draw per token), so seeds and the
//! prefill -> decode sampler hand-off are unchanged.
//!
//! Semantics, identical in distribution to the host `draw`:
//! 1. `max` = the largest finite logit (none: no token);
//! 2. weight = `exp((l - max) / T)` in f32, 0 when below `min_p` or when `l` is not finite;
//! 3. top-k keeps the `k` largest logits (NaN ordered as -inf, ties toward lower ids);
//! 4. top-p keeps, among those with weight, the shortest most-likely set whose mass reaches
//!    `top_p` x their total (ordered by weight, ties at the boundary weight toward lower ids: the
//!    number of boundary ties is `ceil(remaining need / weight)`, as the host `top_mass`);
//! 5. the token: walk the kept tokens in ascending id order until the running weight (f64)
//!    exceeds `u` x the kept mass; the last kept token if rounding runs past the end.
//!
//! The host `draw` walks its candidates in another order, so one `u` may give another token
//! there; the kept set and each kept token's probability are the same. (With top-k on, the host
//! orders the top-p cut by logit, this by weight: they differ only when two different logits
//! round to the same f32 weight exactly at the cut.)

use super::logprobs::desc;

/// How one row is sampled on a device: the request's parameters and its uniform draw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowDraw {
    /// > 0 (temperature 0 is greedy: [`crate::backend::LogitsWant::Argmax`]).
    pub temperature: f32,
    /// 0: off.
    pub top_k: u32,
    /// >= 1: off.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    /// Uniform in `[0, 1)`.
    pub u: f64,
}

/// The tokens a row keeps under a [`RowDraw`] (its `u` aside).
#[derive(Debug, Clone, PartialEq)]
pub struct KeptSet {
    /// Kept ids (weight > 0), ascending.
    pub ids: Vec<u32>,
    /// Their weights, in the order of `ids`.
    pub weights: Vec<f32>,
    /// Sum of `weights` in id order (f64).
    pub mass: f64,
    /// Smallest relative distance of a decision to its threshold: the top-p cut's mass to its
    /// need (over the candidates' total) and a weight to `min_p` (over `min_p`); `f64::MAX`
    /// when neither applies. Tests use it to tell rounding apart from a wrong answer.
    pub margin: f64,
}

/// The token [`sample_row`] picks and how close it came to a boundary.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowPick {
    pub token: u32,
    /// The smaller of the kept set's `margin` and the relative distance (over the kept mass) of
    /// `u` x mass to the running sums just before and after the picked token.
    pub margin: f64,
}

/// The kept set of `row` under `d`; `None` when the row has no finite logit.
pub fn kept_set(row: &[f32], d: &RowDraw) -> Option<KeptSet> {
    let max = row
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return None;
    }
    let inv_t = 1.0 / d.temperature;
    let mut margin = f64::MAX;
    let mut weight = |l: f32| -> f32 {
        if !l.is_finite() {
            return 0.0;
        }
        let x = ((l - max) * inv_t).exp();
        if d.min_p > 0.0 {
            margin = margin.min(f64::from((x - d.min_p).abs()) / f64::from(d.min_p));
        }
        if x < d.min_p { 0.0 } else { x }
    };
    let n = row.len();
    let k = d.top_k as usize;
    let mut cand: Vec<u32> = (0..n as u32).collect();
    if k > 0 && k < n {
        cand.select_nth_unstable_by(k - 1, |&a, &b| desc(row, a, b));
        cand.truncate(k);
    }
    let mut c: Vec<(u32, f32)> = cand
        .iter()
        .map(|&i| (i, weight(row[i as usize])))
        .filter(|&(_, w)| w > 0.0)
        .collect();
    if d.top_p < 1.0 && !c.is_empty() {
        let total: f64 = c.iter().map(|&(_, w)| f64::from(w)).sum();
        let need = f64::from(d.top_p) * total;
        c.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let (mut above, mut j, mut keep) = (0.0f64, 0, c.len());
        while j < c.len() {
            let wv = c[j].1;
            let e = j + c[j..].iter().take_while(|x| x.1 == wv).count();
            let w = f64::from(wv);
            let group = w * (e - j) as f64;
            if above + group >= need {
                let nt = (((need - above) / w).ceil() as usize).clamp(1, e - j);
                keep = j + nt;
                let after = above + nt as f64 * w;
                let before = above + (nt - 1) as f64 * w;
                margin = margin.min((after - need).abs().min((need - before).abs()) / total);
                break;
            }
            above += group;
            j = e;
        }
        c.truncate(keep);
    }
    c.sort_unstable_by_key(|x| x.0);
    let mass = c.iter().map(|&(_, w)| f64::from(w)).sum();
    Some(KeptSet {
        ids: c.iter().map(|x| x.0).collect(),
        weights: c.iter().map(|x| x.1).collect(),
        mass,
        margin,
    })
}

/// The token of `kept` for the uniform `u`: the first kept id (ascending) at which the running
/// weight exceeds `u * kept.mass`, the last one if rounding runs past the end. `None` when
/// nothing is kept.
pub fn pick_kept(kept: &KeptSet, u: f64) -> Option<RowPick> {
    let target = u * kept.mass;
    let mut acc = 0.0f64;
    for (&id, &w) in kept.ids.iter().zip(&kept.weights) {
        let before = acc;
        acc += f64::from(w);
        if acc > target {
            let m = (target - before).min(acc - target) / kept.mass;
            return Some(RowPick {
                token: id,
                margin: m.min(kept.margin),
            });
        }
    }
    kept.ids.last().map(|&token| RowPick { token, margin: 0.0 })
}

/// [`kept_set`] then [`pick_kept`] with `d.u`.
pub fn sample_row_detail(row: &[f32], d: &RowDraw) -> Option<RowPick> {
    pick_kept(&kept_set(row, d)?, d.u)
}

/// The token the canonical device sampling picks from `row`; `None` when the row has no finite
/// logit.
pub fn sample_row(row: &[f32], d: &RowDraw) -> Option<u32> {
    sample_row_detail(row, d).map(|p| p.token)
}

#[cfg(test)]
mod tests;
