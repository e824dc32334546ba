//! One graph-replayed decode step seen from inside the GPU (issue 20's profile of where a
//! step's time goes): the traced kernel builds ([`pdnode_cuda::trace`]) record every block's
//! arrival, release from `griddepcontrol.wait` and return, so the launches of one replay show
//! how far each overlaps the one before it under programmatic dependent launch.

use super::{DecodeStep, timed_steps};
use crate::StepVariant;
use crate::fusion_sweep::{STEP_BLOCK, step_backend};
use pdnode_cuda::CudaError;
use pdnode_cuda::trace::{LaunchSpan, launches, set_trace_kernels};

/// What one traced replay showed.
#[derive(Debug, Clone)]
pub struct StepTrace {
    pub batch: usize,
    pub ctx: usize,
    pub variant: String,
    /// The launches of the replay, in launch order.
    pub launches: Vec<LaunchSpan>,
    /// Records that did not fit the buffers.
    pub dropped: usize,
    /// Mean wall time of a step of the same graph, untraced timing loop (ms; the traced build's
    /// records cost a little).
    pub step_ms: f64,
}

impl StepTrace {
    /// First block's arrival to last block's return over the whole replay, ns.
    pub fn span_ns(&self) -> u64 {
        match (self.launches.first(), self.launches.last()) {
            (Some(a), Some(_)) => {
                let end = self.launches.iter().map(|l| l.last_end).max().unwrap_or(0);
                end.saturating_sub(a.first_start)
            }
            _ => 0,
        }
    }
}

/// Per kernel name over a replay: how often, and means (us) of its span (earliest release from
/// the wait to the last block's return), of how much the step's frontier moved while it was the
/// last kernel (`last_end` minus the previous launch's), of how early its blocks were resident
/// (the previous launch's `last_end` minus this one's `first_start`; negative: later), and of the
/// release lag (`first_waited` minus the previous `last_end`).
#[derive(Debug, Clone, PartialEq)]
pub struct KernelShare {
    pub name: String,
    pub calls: usize,
    pub span_us: f64,
    pub advance_us: f64,
    pub lead_us: f64,
    pub release_us: f64,
}

/// Folds a replay's launches per kernel name, in order of first appearance.
pub fn kernel_shares(l: &[LaunchSpan]) -> Vec<KernelShare> {
    let mut out: Vec<(KernelShare, [f64; 4])> = Vec::new();
    for (i, x) in l.iter().enumerate() {
        let prev_end = if i == 0 {
            x.first_start
        } else {
            l[i - 1].last_end
        };
        let us = |a: u64, b: u64| (a as f64 - b as f64) / 1e3;
        let v = [
            us(x.last_end, x.first_waited),
            us(x.last_end, prev_end),
            us(prev_end, x.first_start),
            us(x.first_waited, prev_end),
        ];
        match out.iter_mut().find(|(s, _)| s.name == x.name) {
            Some((s, sum)) => {
                s.calls += 1;
                for k in 0..4 {
                    sum[k] += v[k];
                }
            }
            None => out.push((
                KernelShare {
                    name: x.name.clone(),
                    calls: 1,
                    span_us: 0.0,
                    advance_us: 0.0,
                    lead_us: 0.0,
                    release_us: 0.0,
                },
                v,
            )),
        }
    }
    out.into_iter()
        .map(|(mut s, sum)| {
            let n = s.calls as f64;
            s.span_us = sum[0] / n;
            s.advance_us = sum[1] / n;
            s.lead_us = sum[2] / n;
            s.release_us = sum[3] / n;
            s
        })
        .collect()
}

/// Traces one graph replay of a Llama-3.1-8B decode step (dummy weights) at each `(batch, ctx)`
/// with `variant`'s settings, after `warm` untraced-timing steps (the first captures the graph).
/// Opens its own GPU with the traced kernel builds and restores the normal builds for later
/// GPUs.
pub fn run_step_trace(
    decode: &[(usize, usize)],
    variant: &StepVariant,
    warm: usize,
) -> Result<Vec<StepTrace>, CudaError> {
    set_trace_kernels(true);
    let r = trace_inner(decode, variant, warm);
    set_trace_kernels(false);
    r
}

fn trace_inner(
    decode: &[(usize, usize)],
    variant: &StepVariant,
    warm: usize,
) -> Result<Vec<StepTrace>, CudaError> {
    let mut be = step_backend(decode)?;
    if !variant.apply(&mut be) {
        return Err(CudaError::Unsupported {
            reason: format!(
                "{}: no programmatic dependent launch on this GPU",
                variant.name
            ),
        });
    }
    let mut out = Vec::new();
    for &(batch, ctx) in decode {
        let step = DecodeStep::new(batch, ctx, STEP_BLOCK);
        let fb = step.batch();
        let step_ms = timed_steps(&mut be, warm.max(1), &fb)? * 1e3;
        be.gpu().trace_reset()?;
        be.forward_device(&fb).map_err(super::err)?;
        let dump = be.gpu().trace_take()?;
        out.push(StepTrace {
            batch,
            ctx,
            variant: variant.name.clone(),
            launches: launches(&dump.records),
            dropped: dump.dropped,
            step_ms,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(name: &str, s: u64, w: u64, e: u64) -> LaunchSpan {
        LaunchSpan {
            grid: s,
            name: name.into(),
            blocks: 1,
            first_start: s,
            first_waited: w,
            first_end: e,
            last_end: e,
        }
    }

    #[test]
    fn shares_average_per_kernel_against_the_launch_before() {
        // a: 0..10; b resident at 8, released at 11, ends 20; a again resident 21, ends 30
        let l = [
            span("a", 0, 1, 10_000),
            span("b", 8_000, 11_000, 20_000),
            span("a", 21_000, 21_500, 30_000),
        ];
        let s = kernel_shares(&l);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].name.as_str(), s[0].calls), ("a", 2));
        assert_eq!((s[1].name.as_str(), s[1].calls), ("b", 1));
        // b: span 9, advance 10, lead 2, release 1
        assert!((s[1].span_us - 9.0).abs() < 1e-9);
        assert!((s[1].advance_us - 10.0).abs() < 1e-9);
        assert!((s[1].lead_us - 2.0).abs() < 1e-9);
        assert!((s[1].release_us - 1.0).abs() < 1e-9);
        // a: first (advance 10 from its own start, lead 0, release 0.001) and second
        // (advance 10, lead -1, release 1.5)
        assert!((s[0].advance_us - 10.0).abs() < 1e-9);
        assert!((s[0].lead_us + 0.5).abs() < 1e-9);
        assert!((s[0].release_us - (0.001 + 1.5) / 2.0).abs() < 1e-9);
    }
}
