use super::*;

#[test]
fn mma_launch_covers_rows_and_fits_one_wave_when_it_can() {
    let llama = [
        (6144, 4096),
        (4096, 4096),
        (28672, 4096),
        (4096, 14336),
        (128256, 4096),
    ];
    for &(out, inp) in &llama {
        for t in 1..=8 {
            let l = mma_launch(132, out, t, inp);
            assert!(l.blocks * 16 * l.tiles >= out, "{out} rows covered");
            assert!((l.blocks - 1) * 16 * l.tiles < out, "no empty block");
            assert!((1..=16).contains(&l.warps));
            let per_sm = RESIDENT_WARPS / l.warps.max(4);
            if out <= 6144 {
                assert!(
                    l.blocks <= per_sm * 132,
                    "{out}x{inp} t{t}: {l:?} in one wave"
                );
                assert!(l.warps >= 8, "{out}x{inp} t{t}: {l:?} splits K");
            }
        }
    }
    // x re-reads halved at 8 tokens where the grid still covers the SMs
    assert_eq!(mma_launch(132, 6144, 8, 4096).tiles, 2);
    assert_eq!(mma_launch(132, 4096, 8, 4096).tiles, 1);
    assert_eq!(mma_launch(132, 6144, 1, 4096).tiles, 1);
    // tiny shapes: one warp per chunk batch at most, never zero
    let l = mma_launch(132, 3, 1, 8);
    assert_eq!((l.blocks, l.warps, l.tiles), (1, 1, 1));
    assert_eq!(mma_launch(0, 0, 0, 0).warps, 1);
}

#[test]
fn table_follows_the_measurements() {
    let t = |out, tok, inp| table_launch(132, out, tok, inp);
    for tok in 1..=8 {
        // gate_up (and its TP = 2 shard): cuBLAS
        assert_eq!(t(28672, tok, 4096), None);
        assert_eq!(t(14336, tok, 4096), None);
        // qkv, o, down: 16-row blocks with the prefetch (m1 w8 b384, m1 w12 b256)
        for (out, inp, warps) in [(6144, 4096, 8), (4096, 4096, 12), (4096, 14336, 12)] {
            let l = t(out, tok, inp).expect("a GEMV launch");
            assert_eq!(
                (l.tiles, l.warps, l.l2_prefetch),
                (1, warps, true),
                "{out}x{inp}"
            );
        }
        // lm_head: m1 up to 2 tokens, m2 after
        let l = t(128256, tok, 4096).expect("lm_head launch");
        assert_eq!(l.tiles, if tok <= 2 { 1 } else { 2 });
        assert!(l.l2_prefetch);
    }
    assert_eq!(t(4096, 9, 4096), None);
    assert_eq!(t(4096, 0, 4096), None);
    // the fused gate_up launch is the unfused m1 one on 2 inter rows: a block per 8 outputs
    let g = glu_launch(132, 14336, 4096);
    assert_eq!(g.blocks * 8, 14336);
    assert_eq!(
        MmaLaunch {
            l2_prefetch: false,
            ..g
        },
        mma_launch_tiles(132, 28672, 4096, 1)
    );
    assert_eq!(glu_launch(132, 13, 64).blocks, 2);
    // the block width the fused launch can be given: same blocks, the asked warps
    assert_eq!(glu_launch_warps(132, 14336, 4096, 0), g);
    assert_eq!(glu_launch_warps(132, 14336, 4096, 17), g);
    let w12 = glu_launch_warps(132, 14336, 4096, 12);
    assert_eq!(
        (w12.blocks, w12.warps, w12.l2_prefetch),
        (g.blocks, 12, true)
    );
    // never more warps than chunk batches (64 inputs: one)
    assert_eq!(glu_launch_warps(132, 13, 64, 12).warps, 1);
}

#[test]
fn impls_parse() {
    for (s, i) in [
        ("auto", LinearImpl::Auto),
        ("cublas", LinearImpl::Cublas),
        ("gemv", LinearImpl::Gemv),
        ("mma", LinearImpl::GemvMma),
        ("table", LinearImpl::Auto),
    ] {
        assert_eq!(LinearImpl::parse(s), Some(i));
    }
    assert_eq!(LinearImpl::parse("x"), None);
}

#[test]
fn a_gemv_choice_takes_cublas_for_calls_the_gemv_cannot_take() {
    let (w, x) = (1u64 << 20, 1u64 << 21);
    for how in [LinearImpl::Gemv, LinearImpl::GemvMma] {
        // decode-sized calls keep the GEMV
        for tokens in [1, 2, 8] {
            assert_eq!(how.for_operands(tokens, 4096, w, x), how);
        }
        // prefill steps, odd inputs and misaligned operands take cuBLAS
        assert_eq!(how.for_operands(9, 4096, w, x), LinearImpl::Cublas);
        assert_eq!(how.for_operands(2048, 4096, w, x), LinearImpl::Cublas);
        assert_eq!(how.for_operands(1, 4100, w, x), LinearImpl::Cublas);
        assert_eq!(how.for_operands(1, 4096, w + 8, x), LinearImpl::Cublas);
        assert_eq!(how.for_operands(1, 4096, w, x + 2), LinearImpl::Cublas);
    }
    for how in [LinearImpl::Auto, LinearImpl::Cublas] {
        assert_eq!(how.for_operands(1, 4096, w, x), how);
        assert_eq!(how.for_operands(2048, 4100, w + 2, x), how);
    }
}

#[test]
fn lt_picks_only_measured_shapes_past_the_gemv_range() {
    let llama = [
        (6144, 4096, OutType::Bf16),
        (4096, 4096, OutType::F32),
        (28672, 4096, OutType::Bf16),
        (4096, 14336, OutType::F32),
        (128256, 4096, OutType::F32),
    ];
    let mut picks = 0;
    for &(out, inp, ty) in &llama {
        for t in 1..=256 {
            if let Some(c) = lt_pick(out, t, inp, ty) {
                picks += 1;
                // only where Auto takes cuBLAS anyway
                assert!(t > GEMV_MAX_TOKENS && table_launch(132, out, t, inp).is_none());
                assert!(c.split_k >= 1 && (c.split_k > 1) == (c.reduction != 0));
            }
        }
    }
    assert_eq!(picks, 7);
    // gate_up at 64 rows: the 128x64 tile; other output types and shards keep GemmEx
    assert_eq!(
        lt_pick(28672, 64, 4096, OutType::Bf16).map(|c| c.tile),
        Some(18)
    );
    assert!(lt_pick(28672, 64, 4096, OutType::F32).is_none());
    assert!(lt_pick(14336, 64, 4096, OutType::Bf16).is_none());
    assert!(lt_pick(4096, 32, 14336, OutType::F32).is_none());
}
