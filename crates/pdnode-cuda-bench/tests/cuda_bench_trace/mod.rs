//! `bench_decode_trace`: one replayed decode step's kernel timelines (cuda_bench's module, in a
//! file of its own so cuda_bench.rs stays readable).

use super::{ONE_AT_A_TIME, batch_ctx_list, bench, env_list};

/// One graph-replayed decode step seen from inside the GPU (issue 20): the traced kernel builds
/// record each block's arrival, release from `griddepcontrol.wait` and return; per kernel name,
/// how long it ran, how far it moved the step's end, how early its blocks were resident and how
/// long after the previous kernel's end they were released, plus a middle layer's launches.
/// `PDNODE_BENCH_STEPS` (default "1x512"), `PDNODE_BENCH_STEP_VARIANTS` (the first one is
/// traced; `StepVariant::parse`, default "default").
#[test]
#[ignore = "needs a CUDA GPU (about 30 GB free): run scripts/gpu/session.sh trace on the GPU host"]
fn bench_decode_trace() {
    let _gpu = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let decode = batch_ctx_list("PDNODE_BENCH_STEPS", "1x512");
    let name = env_list("PDNODE_BENCH_STEP_VARIANTS", "default");
    let variant = name
        .split(',')
        .find_map(bench::StepVariant::parse)
        .expect("a step variant");
    let traces = bench::run_step_trace(&decode, &variant, 20).expect("traced step");
    for t in &traces {
        let l = &t.launches;
        assert!(!l.is_empty(), "no kernel recorded");
        assert_eq!(t.dropped, 0, "trace buffer overflowed");
        let t0 = l[0].first_start;
        let rel = |x: u64| (x as f64 - t0 as f64) / 1e3;
        for (i, x) in l.iter().enumerate() {
            assert!(x.first_start <= x.first_waited && x.first_waited <= x.last_end);
            eprintln!(
                "TRACE {} batch={} ctx={} i={i} kernel={} blocks={} start_us={:.2} waited_us={:.2} first_end_us={:.2} last_end_us={:.2}",
                t.variant,
                t.batch,
                t.ctx,
                x.name,
                x.blocks,
                rel(x.first_start),
                rel(x.first_waited),
                rel(x.first_end),
                rel(x.last_end)
            );
        }
        println!(
            "traced replay {} batch {} ctx {}: {} launches, {:.3} ms from the first block's arrival to the last return (timed loop of the traced build: {:.3} ms a step)",
            t.variant,
            t.batch,
            t.ctx,
            l.len(),
            t.span_ns() as f64 / 1e6,
            t.step_ms
        );
        println!(
            "| kernel | calls | span us (release -> last return) | advance us (end - previous end) | x calls, ms | lead us (resident before previous end) | release us (after previous end) |"
        );
        println!("|---|---|---|---|---|---|---|");
        for s in bench::kernel_shares(l) {
            println!(
                "| {} | {} | {:.2} | {:.2} | {:.3} | {:.2} | {:.2} |",
                s.name,
                s.calls,
                s.span_us,
                s.advance_us,
                s.advance_us * s.calls as f64 / 1e3,
                s.lead_us,
                s.release_us
            );
        }
        // a middle layer: from the middle, one period of the repeating sequence of names
        let mid = l.len() / 2;
        let period = (1..=40)
            .find(|&p| {
                mid + 2 * p <= l.len() && (0..p).all(|i| l[mid + i].name == l[mid + p + i].name)
            })
            .unwrap_or(10);
        let next = l.len().min(mid + period);
        let m0 = l[mid].first_start;
        let relm = |x: u64| (x as f64 - m0 as f64) / 1e3;
        println!(
            "| launch {mid}.. | blocks | resident us | released us | first return us | last return us |"
        );
        println!("|---|---|---|---|---|---|");
        for x in &l[mid..next] {
            println!(
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} |",
                x.name,
                x.blocks,
                relm(x.first_start),
                relm(x.first_waited),
                relm(x.first_end),
                relm(x.last_end)
            );
        }
    }
}
