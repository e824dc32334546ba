//! Decode-step settings compared on one backend (issue 20): graph-replayed Llama-3.1-8B decode
//! steps with each [`ops::Fusion`] setting (and PDL on or off), the settings interleaved round by
//! round so drift between them shows as spread, not as a difference.

use super::{
    DecodeStep, bench_options, decode_blocks, decode_step_bytes, llama31_8b, measure_ceilings,
    timed_steps,
};
use pdnode_cuda::CudaError;
use pdnode_cuda::backend::CudaBackend;
use pdnode_cuda::ops::{self, AttnChoice, AttnVariant, Fusion, LinearImpl};

/// One setting of the comparison: its name, the fusion limits, programmatic dependent launch,
/// the paged-attention kernel.
#[derive(Debug, Clone, PartialEq)]
pub struct StepVariant {
    pub name: String,
    pub fusion: Fusion,
    pub pdl: bool,
    pub attention: AttnVariant,
    /// Waves of resident blocks the v4 attention's partitions aim for (`engine.cuda.attention_v4_waves`).
    pub v4_waves: usize,
}

impl StepVariant {
    /// `s<N>n<M>[w<W>][p<P>][g<G>][m<K>][a<A>]` (SwiGLU fused into gate_up up to N tokens, the
    /// RMSNorm into the o/down GEMV up to M, W warps a block of the fused gate_up launch, PDL for
    /// decode steps of up to P rows, the streaming GEMVs for steps of up to G rows with at most K
    /// KiB of shared memory a block and A rows prefetched into L2 ahead; W, P, G, K and A 0 when
    /// absent: the 4-warp launch, no small-step PDL, no streaming, the most shared memory, no
    /// L2 prefetch) or
    /// `default` (`Fusion::default()`), then optionally `/<attention>` (a name of
    /// `engine.cuda.attention`, default `auto`, optionally with `@<waves>`: the v4 partitions'
    /// waves, default [`ops::V4_WAVES`]), then optionally `+pdl`.
    pub fn parse(s: &str) -> Option<StepVariant> {
        let s = s.trim();
        let (body, pdl) = match s.strip_suffix("+pdl") {
            Some(b) => (b, true),
            None => (s, false),
        };
        let (body, attention) = match body.split_once('/') {
            Some((b, a)) => (b, a),
            None => (body, "auto"),
        };
        let (attention, v4_waves) = match attention.split_once('@') {
            Some((a, w)) => (a, w.parse().ok().filter(|w| (1..=64).contains(w))?),
            None => (attention, ops::V4_WAVES),
        };
        let attention = AttnVariant::parse(attention)?;
        let fusion = if body == "default" {
            Fusion::default()
        } else {
            // letter-number pairs: s and n required, w, p, g, m and a optional (0 when absent)
            let mut vals = [None::<usize>; 7];
            let mut rest = body;
            while let Some(c) = rest.chars().next() {
                let k = "snwpgma".find(c)?;
                let digits = rest[1..].chars().take_while(char::is_ascii_digit).count();
                vals[k] = Some(rest[1..1 + digits].parse().ok()?);
                rest = &rest[1 + digits..];
            }
            Fusion {
                swiglu_max_tokens: vals[0]?,
                norm_max_tokens: vals[1]?,
                glu_warps: vals[2].unwrap_or(0),
                pdl_max_tokens: vals[3].unwrap_or(0),
                stream_max_tokens: vals[4].unwrap_or(0),
                stream_smem_kib: vals[5].unwrap_or(0),
                stream_l2_ahead: vals[6].unwrap_or(0),
            }
        };
        Some(StepVariant {
            name: s.to_string(),
            fusion,
            pdl,
            attention,
            v4_waves,
        })
    }
}

impl StepVariant {
    /// Puts this variant's settings on `be`; false where the GPU takes no programmatic launches
    /// and the variant asks for them.
    pub fn apply(&self, be: &mut CudaBackend) -> bool {
        be.set_fusion(self.fusion);
        be.set_attention(
            AttnChoice {
                variant: self.attention,
                v4_waves: self.v4_waves,
                v4_max_part: ops::V4_MAX_PART,
            },
            LinearImpl::Auto,
        );
        be.set_pdl(self.pdl) == self.pdl
    }
}

/// The backend the step benchmarks time: Llama-3.1-8B shapes, dummy weights, block size 16,
/// enough blocks for every `(batch, ctx)` of `decode`, graphs on, the KV pool filled.
pub(crate) fn step_backend(decode: &[(usize, usize)]) -> Result<CudaBackend, CudaError> {
    let num_blocks = decode_blocks(decode, STEP_BLOCK) + 8;
    let opts = bench_options(1, num_blocks, STEP_BLOCK, 64, decode, true);
    let mut be = CudaBackend::new_dummy(&llama31_8b(), 1234, &opts, "bench".into())?;
    be.fill_kv_random(99)?;
    Ok(be)
}

/// The KV block size of [`step_backend`].
pub(crate) const STEP_BLOCK: usize = 16;

/// One timing: a variant at one point, the median over the rounds.
#[derive(Debug, Clone)]
pub struct StepVariantRow {
    pub variant: String,
    pub batch: usize,
    pub ctx: usize,
    /// Median of the rounds' mean graph-step times, ms.
    pub ms: f64,
    /// Smallest and largest round, ms.
    pub min_ms: f64,
    pub max_ms: f64,
    /// The step's ceiling ([`decode_step_bytes`] at the copy rate), ms.
    pub ceiling_ms: f64,
}

/// Graph-replayed decode steps at each `(batch, ctx)`: `rounds` rounds, each timing every
/// variant once (`iters` steps after a warm-up that captures the graph). Returns the measured
/// copy rate (bytes of traffic per second) and a row per variant and point (a PDL variant is
/// left out where the GPU takes no programmatic launches).
pub fn run_step_variants(
    decode: &[(usize, usize)],
    variants: &[StepVariant],
    iters: usize,
    rounds: usize,
    mut report: impl FnMut(&StepVariantRow),
) -> Result<(f64, Vec<StepVariantRow>), CudaError> {
    let spec = llama31_8b();
    let bs = STEP_BLOCK;
    let mut be = step_backend(decode)?;
    let copy = measure_ceilings(be.gpu())?.hbm_traffic_bps;
    let wbytes = be.weight_bytes() as f64;
    let mut rows = Vec::new();
    for &(batch, ctx) in decode {
        let step = DecodeStep::new(batch, ctx, bs);
        let fb = step.batch();
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
        for _ in 0..rounds.max(1) {
            for (vi, v) in variants.iter().enumerate() {
                if !v.apply(&mut be) {
                    continue;
                }
                times[vi].push(timed_steps(&mut be, iters, &fb)? * 1e3);
            }
        }
        let ceiling_ms = decode_step_bytes(&spec, wbytes, batch, ctx) / copy * 1e3;
        for (v, mut t) in variants.iter().zip(times) {
            if t.is_empty() {
                continue;
            }
            t.sort_by(f64::total_cmp);
            let row = StepVariantRow {
                variant: v.name.clone(),
                batch,
                ctx,
                ms: t[t.len() / 2],
                min_ms: t[0],
                max_ms: t[t.len() - 1],
                ceiling_ms,
            };
            report(&row);
            rows.push(row);
        }
    }
    be.set_pdl(false);
    Ok((copy, rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_variants_parse() {
        let v = StepVariant::parse("s2n0w12").unwrap();
        assert_eq!((v.fusion.glu_warps, v.fusion.pdl_max_tokens), (12, 0));
        let v = StepVariant::parse("s8n0w8p2").unwrap();
        assert_eq!(
            (
                v.fusion.swiglu_max_tokens,
                v.fusion.norm_max_tokens,
                v.fusion.glu_warps,
                v.fusion.pdl_max_tokens
            ),
            (8, 0, 8, 2)
        );
        let v = StepVariant::parse("s8n0w8p4g4").unwrap();
        assert_eq!(
            (v.fusion.pdl_max_tokens, v.fusion.stream_max_tokens),
            (4, 4)
        );
        assert_eq!(
            StepVariant::parse("s8n0").unwrap().fusion.stream_max_tokens,
            0
        );
        let v = StepVariant::parse("s2n0/v2+pdl").unwrap();
        assert_eq!(v.fusion.glu_warps, 0);
        assert_eq!(
            (v.fusion.swiglu_max_tokens, v.fusion.norm_max_tokens),
            (2, 0)
        );
        assert!(v.pdl);
        assert_eq!(v.attention, AttnVariant::V2);
        let v = StepVariant::parse(" s0n1 ").unwrap();
        assert_eq!(
            (
                v.fusion.swiglu_max_tokens,
                v.fusion.norm_max_tokens,
                v.pdl,
                v.attention
            ),
            (0, 1, false, AttnVariant::Auto)
        );
        assert_eq!(v.name, "s0n1");
        assert_eq!(v.v4_waves, ops::V4_WAVES);
        let v = StepVariant::parse("default/v4@2").unwrap();
        assert_eq!((v.attention, v.v4_waves), (AttnVariant::V4, 2));
        assert!(StepVariant::parse("default/v4@0").is_none());
        assert!(StepVariant::parse("default/v4@x").is_none());
        assert_eq!(
            StepVariant::parse("default").unwrap().fusion,
            Fusion::default()
        );
        for bad in [
            "",
            "x",
            "s2",
            "n0",
            "s2nx",
            "s2n0wx",
            "s2n0q1",
            "s2n0/v9",
            "default+pd",
        ] {
            assert!(StepVariant::parse(bad).is_none(), "{bad}");
        }
    }
}
