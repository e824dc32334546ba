//! Feed-forward layers of the DeepSeek family on the CPU: a SwiGLU MLP, and a mixture of
//! experts (routing as transformers' `DeepseekV2TopkRouter` / `DeepseekV3TopkRouter` do; the
//! routed experts run on the rows routed to them, the shared experts on every row).

use super::ops;
use crate::spec::{MoeScoring, MoeSpec};
use crate::weights::{Expert, MoeWeights};

/// `x += down(silu(gate xn) * up xn)` over `t` rows of width `h`.
pub(super) fn swiglu_add(x: &mut [f32], xn: &[f32], e: &Expert, t: usize, h: usize) {
    let inter = e.w_gate.shape[0];
    let mut gate = vec![0f32; t * inter];
    let mut up = vec![0f32; t * inter];
    ops::matmul_wt(&mut gate, xn, &e.w_gate.data, t, inter, h, false);
    ops::matmul_wt(&mut up, xn, &e.w_up.data, t, inter, h, false);
    ops::silu_mul(&mut gate, &up);
    ops::matmul_wt(x, &gate, &e.w_down.data, t, h, inter, true);
}

/// The experts one row is routed to, with their weights (the CUDA routing kernel's reference
/// too: `backend::cpu::route_experts`).
pub fn route(logits: &[f32], bias: Option<&[f32]>, e: &MoeSpec) -> Vec<(usize, f32)> {
    let keep = group_scores(logits, bias, e).map(|g| top_k(&g, e.topk_groups));
    route_in_groups(logits, bias, e, keep.as_deref())
}

/// `scores`: the weights' source; `choice`: what picks the experts.
fn scores_and_choice(logits: &[f32], bias: Option<&[f32]>, e: &MoeSpec) -> (Vec<f32>, Vec<f32>) {
    match e.scoring {
        MoeScoring::Softmax { .. } => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let ex: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
            let sum: f32 = ex.iter().sum();
            let p: Vec<f32> = ex.iter().map(|v| v / sum).collect();
            (p.clone(), p)
        }
        MoeScoring::SigmoidBiased => {
            let p: Vec<f32> = logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect();
            let c = match bias {
                Some(b) => p.iter().zip(b).map(|(s, b)| s + b).collect(),
                None => p.clone(),
            };
            (p, c)
        }
    }
}

/// The groups' scores where the routing keeps only some groups (`None` where it keeps every
/// expert): a group's best expert (V2) or the sum of its best two (V3).
pub fn group_scores(logits: &[f32], bias: Option<&[f32]>, e: &MoeSpec) -> Option<Vec<f32>> {
    let grouped = e.scoring
        != MoeScoring::Softmax {
            group_limited: false,
        };
    if !grouped || e.topk_groups >= e.num_groups {
        return None;
    }
    let per_group = logits.len() / e.num_groups;
    let (_, choice) = scores_and_choice(logits, bias, e);
    Some(
        choice
            .chunks(per_group)
            .map(|g| {
                let mut v = g.to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                match e.scoring {
                    MoeScoring::SigmoidBiased => v[0] + v[1],
                    MoeScoring::Softmax { .. } => v[0],
                }
            })
            .collect(),
    )
}

/// [`route`] with the kept groups given (`None`: every expert may be picked). A test of another
/// implementation uses it where two groups' scores tie in exact arithmetic and round apart.
pub fn route_in_groups(
    logits: &[f32],
    bias: Option<&[f32]>,
    e: &MoeSpec,
    keep: Option<&[usize]>,
) -> Vec<(usize, f32)> {
    let per_group = logits.len() / e.num_groups;
    let (scores, mut choice) = scores_and_choice(logits, bias, e);
    if let Some(keep) = keep {
        // Experts outside the kept groups: 0 under softmax (V2 masks with 0), -inf (V3).
        let masked = match e.scoring {
            MoeScoring::SigmoidBiased => f32::NEG_INFINITY,
            MoeScoring::Softmax { .. } => 0.0,
        };
        for (g, chunk) in choice.chunks_mut(per_group).enumerate() {
            if !keep.contains(&g) {
                chunk.fill(masked);
            }
        }
    }
    let picked = top_k(&choice, e.top_k);
    let mut out: Vec<(usize, f32)> = picked
        .into_iter()
        .map(|i| {
            let w = match e.scoring {
                // V2's weights are the (masked) scores it chose by.
                MoeScoring::Softmax { .. } => choice[i],
                MoeScoring::SigmoidBiased => scores[i],
            };
            (i, w)
        })
        .collect();
    if e.norm_topk_prob && e.top_k > 1 {
        let denom: f32 = out.iter().map(|(_, w)| w).sum::<f32>() + 1e-20;
        for (_, w) in out.iter_mut() {
            *w /= denom;
        }
    }
    for (_, w) in out.iter_mut() {
        *w *= e.routed_scaling_factor;
    }
    out
}

/// Indices of the `k` largest values (the lowest index first among equals).
fn top_k(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// `x += shared(xn) + sum over the routed experts of weight * expert(xn)`, per row.
pub(super) fn moe_add(x: &mut [f32], xn: &[f32], w: &MoeWeights, e: &MoeSpec, t: usize, h: usize) {
    let mut logits = vec![0f32; t * e.num_experts];
    ops::matmul_wt(&mut logits, xn, &w.router.data, t, e.num_experts, h, false);
    let bias = w.score_bias.as_ref().map(|b| b.data.as_slice());
    // Rows routed to each expert, with their weights.
    let mut per_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e.num_experts];
    for (row, l) in logits.chunks(e.num_experts).enumerate() {
        for (ex, wt) in route(l, bias, e) {
            per_expert[ex].push((row, wt));
        }
    }
    let mut routed = vec![0f32; t * h];
    for (ex, rows) in per_expert.iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        let n = rows.len();
        let mut xs = Vec::with_capacity(n * h);
        for &(row, _) in rows {
            xs.extend_from_slice(&xn[row * h..(row + 1) * h]);
        }
        let mut ys = vec![0f32; n * h];
        swiglu_add(&mut ys, &xs, &w.experts[ex], n, h);
        for (&(row, wt), y) in rows.iter().zip(ys.chunks(h)) {
            for (o, &v) in routed[row * h..(row + 1) * h].iter_mut().zip(y) {
                *o += wt * v;
            }
        }
    }
    if let Some(shared) = &w.shared {
        swiglu_add(&mut routed, xn, shared, t, h);
    }
    for (o, r) in x.iter_mut().zip(&routed) {
        *o += r;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(scoring: MoeScoring, groups: usize, topk_groups: usize, norm: bool) -> MoeSpec {
        MoeSpec {
            num_experts: 8,
            top_k: 2,
            num_shared: 0,
            expert_intermediate: 4,
            first_dense_layers: 0,
            num_groups: groups,
            topk_groups,
            scoring,
            norm_topk_prob: norm,
            routed_scaling_factor: 2.0,
        }
    }

    #[test]
    fn softmax_greedy_takes_the_two_best_scores_scaled() {
        let l = [0.0, 3.0, 0.5, 2.0, -1.0, 0.0, 0.0, 0.0];
        let e = spec(
            MoeScoring::Softmax {
                group_limited: false,
            },
            1,
            1,
            false,
        );
        let r = route(&l, None, &e);
        let ex: Vec<f32> = l.iter().map(|v: &f32| v.exp()).collect();
        let sum: f32 = ex.iter().sum();
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
        assert!((r[0].1 - 2.0 * ex[1] / sum).abs() < 1e-6);
        assert!((r[1].1 - 2.0 * ex[3] / sum).abs() < 1e-6);
    }

    #[test]
    fn group_limits_exclude_experts_outside_the_best_groups() {
        // Groups of two: {0,1} {2,3} {4,5} {6,7}. Expert 7 is the single best, but group 3's
        // sum of two (V3) is below group 0's and group 1's.
        let l = [2.0, 1.9, 1.8, 1.7, -5.0, -5.0, 2.5, -9.0];
        let v2 = spec(
            MoeScoring::Softmax {
                group_limited: true,
            },
            4,
            2,
            false,
        );
        // V2: group score = best expert: groups 3 (2.5) and 0 (2.0) win -> experts 6, 0.
        let r: Vec<usize> = route(&l, None, &v2).iter().map(|x| x.0).collect();
        assert_eq!(r, vec![6, 0]);
        let v3 = spec(MoeScoring::SigmoidBiased, 4, 2, true);
        // V3: group score = sum of the best two sigmoids: groups 0 and 1 -> experts 0, 1.
        let r = route(&l, None, &v3);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1]);
        // Normalized, then scaled: the weights sum to the scaling factor.
        assert!((r[0].1 + r[1].1 - 2.0).abs() < 1e-5);
        // The bias changes the choice, not the weights' source.
        let mut bias = [0f32; 8];
        bias[3] = 1.0;
        let r = route(&l, Some(&bias), &v3);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3, 0]);
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        let want = 2.0 * s(1.7) / (s(1.7) + s(2.0));
        assert!((r[0].1 - want).abs() < 1e-5, "{} vs {want}", r[0].1);
    }

    #[test]
    fn group_scores_and_a_given_keep_set_make_the_route() {
        let l = [2.0, 1.9, 1.8, 1.7, -5.0, -5.0, 2.5, -9.0];
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        let v3 = spec(MoeScoring::SigmoidBiased, 4, 2, true);
        let g = group_scores(&l, None, &v3).expect("grouped");
        assert_eq!(g.len(), 4);
        assert!((g[0] - (s(2.0) + s(1.9))).abs() < 1e-6);
        assert!((g[3] - (s(2.5) + s(-9.0))).abs() < 1e-6);
        // The same keep set gives the same route; another keeps its own groups' experts.
        assert_eq!(
            route_in_groups(&l, None, &v3, Some(&[0, 1])),
            route(&l, None, &v3)
        );
        let r: Vec<usize> = route_in_groups(&l, None, &v3, Some(&[2, 3]))
            .iter()
            .map(|x| x.0)
            .collect();
        assert_eq!(r, vec![6, 4]);
        // Every expert kept: no group stage.
        let greedy = spec(
            MoeScoring::Softmax {
                group_limited: false,
            },
            4,
            2,
            false,
        );
        assert_eq!(group_scores(&l, None, &greedy), None);
        let all = spec(MoeScoring::SigmoidBiased, 4, 4, false);
        assert_eq!(group_scores(&l, None, &all), None);
    }
}
