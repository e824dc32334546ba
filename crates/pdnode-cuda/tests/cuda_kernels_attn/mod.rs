//! Decode attention (the v4 kernel, attention_v4.cu) against an f64
//! host reference: head_dim 64
//! and 128, GQA groups 1 / 4 / 8 / 12, contexts 1 to 8192, batches up to 64, partitions past
//! every context (the launch's max context above the real ones), the direct path (one partition),
//! a block table too long for shared memory, a workspace too small to split, and sliding windows
//! (every kernel variant: v1, v2, v2 narrow, v4). Part of the
//! `cuda_kernels` test binary (scripts/gpu/run-all.sh kernels); prints one PASS/FAIL line a case.

use super::cuda_support::*;
use super::{gpu, poisoned, up_i32};
use pdnode_cuda::ops::{self, AttnChoice, AttnDims, AttnMeta, AttnVariant, AttnWorkspace};
use rand::Rng;
use rand::seq::SliceRandom;

/// Softmax attention of one query head over keys `0..ctx` of one sequence (the last `window` of
/// them when `window` is not 0), straight from a host copy of the pool
/// (`[layers][blocks][2][bs][nkv][hd]`), in f64.
#[allow(clippy::too_many_arguments)]
pub fn reference_decode(
    pool: &[f32],
    d: &AttnDims,
    layer: usize,
    table: &[i32],
    ctx: usize,
    q: &[f32],
    kv_head: usize,
    window: usize,
) -> Vec<f32> {
    let (hd, bs) = (d.head_dim, d.block_size);
    let at = |p: usize, kv: usize| -> &[f32] {
        let blk = table[p / bs] as usize;
        let o = layer * d.layer_elems()
            + (((blk * 2 + kv) * bs + p % bs) * d.num_kv_heads + kv_head) * hd;
        &pool[o..o + hd]
    };
    let scale = 1.0 / (hd as f64).sqrt();
    let lo = if window > 0 {
        ctx.saturating_sub(window)
    } else {
        0
    };
    let s: Vec<f64> = (lo..ctx)
        .map(|p| {
            let k = at(p, 0);
            q.iter()
                .zip(k)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
                * scale
        })
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let l: f64 = w.iter().sum();
    let mut o = vec![0f64; hd];
    for (p, wp) in (lo..).zip(&w) {
        for (od, vd) in o.iter_mut().zip(at(p, 1)) {
            *od += wp / l * *vd as f64;
        }
    }
    o.into_iter().map(|x| x as f32).collect()
}

/// The reference itself: one key gives its value; equal keys give the mean of the values; a
/// dominant key wins; the pool indexing follows the block table.
#[test]
fn reference_decode_is_softmax_attention() {
    let d = AttnDims {
        num_heads: 2,
        num_kv_heads: 2,
        head_dim: 4,
        block_size: 2,
        num_blocks: 3,
    };
    let mut pool = vec![0f32; 2 * d.layer_elems()];
    let put = |pool: &mut Vec<f32>, blk: usize, kv: usize, slot: usize, h: usize, v: [f32; 4]| {
        let o = d.layer_elems() + (((blk * 2 + kv) * 2 + slot) * 2 + h) * 4;
        pool[o..o + 4].copy_from_slice(&v);
    };
    // sequence table [2, 0]: position 0 -> block 2 slot 0, position 2 -> block 0 slot 0
    put(&mut pool, 2, 1, 0, 1, [1.0, 2.0, 3.0, 4.0]);
    put(&mut pool, 2, 1, 1, 1, [3.0, 2.0, 1.0, 0.0]);
    put(&mut pool, 0, 1, 0, 1, [5.0, 5.0, 5.0, 5.0]);
    let table = [2, 0];
    let q = [1.0f32, 0.0, 0.0, 0.0];
    assert_eq!(
        reference_decode(&pool, &d, 1, &table, 1, &q, 1, 0),
        vec![1.0, 2.0, 3.0, 4.0]
    );
    // all keys zero: uniform weights
    let o = reference_decode(&pool, &d, 1, &table, 3, &q, 1, 0);
    let want = [3.0f32, 3.0, 3.0, 3.0];
    assert!(
        o.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6),
        "{o:?}"
    );
    // a large key at position 1 dominates
    put(&mut pool, 2, 0, 1, 1, [100.0, 0.0, 0.0, 0.0]);
    let o = reference_decode(&pool, &d, 1, &table, 3, &q, 1, 0);
    assert!(
        o.iter()
            .zip([3.0f32, 2.0, 1.0, 0.0])
            .all(|(a, b)| (a - b).abs() < 1e-4),
        "{o:?}"
    );
    // a window of 2 drops position 0; of 1 keeps the last position only (block 0, slot 0)
    assert_eq!(
        reference_decode(&pool, &d, 1, &table, 3, &q, 1, 1),
        vec![5.0, 5.0, 5.0, 5.0]
    );
    let o = reference_decode(&pool, &d, 1, &table, 3, &q, 1, 2);
    assert!(
        o.iter()
            .zip([3.0f32, 2.0, 1.0, 0.0])
            .all(|(a, b)| (a - b).abs() < 1e-4),
        "{o:?}"
    );
    // a window past the context is the whole context
    assert_eq!(
        reference_decode(&pool, &d, 1, &table, 3, &q, 1, 9),
        reference_decode(&pool, &d, 1, &table, 3, &q, 1, 0)
    );
}

struct Case {
    name: &'static str,
    nh: usize,
    nkv: usize,
    hd: usize,
    bs: usize,
    ctxs: Vec<usize>,
    /// The launch's max context (>= every ctx); partitions past a token's context exit early.
    max_ctx: usize,
    /// Workspace rows x splits (None: 64 MiB like the backend).
    ws_rows_splits: Option<usize>,
    /// Sliding window (0: the whole context).
    window: usize,
}

fn run_case(c: &Case, r: &mut rand_chacha::ChaCha8Rng, variant: AttnChoice) -> Result<f32, String> {
    let g = gpu();
    let (bs, hd) = (c.bs, c.hd);
    let max_blocks = c.max_ctx.div_ceil(bs);
    let used: usize = c.ctxs.iter().map(|x| x.div_ceil(bs)).sum();
    let nb = used + 5;
    let d = AttnDims {
        num_heads: c.nh,
        num_kv_heads: c.nkv,
        head_dim: hd,
        block_size: bs,
        num_blocks: nb,
    };
    let layer = 1;
    let pool_h = randv(r, 2 * d.layer_elems(), 1.0);
    let pool = g.upload_bf16(&pool_h).unwrap();
    // each sequence gets its blocks in random order; unused table entries point at block 0
    let mut ids: Vec<i32> = (0..nb as i32).collect();
    ids.shuffle(r);
    let mut tables = vec![0i32; c.ctxs.len() * max_blocks];
    let mut next = 0;
    for (si, &ctx) in c.ctxs.iter().enumerate() {
        for j in 0..ctx.div_ceil(bs) {
            tables[si * max_blocks + j] = ids[next];
            next += 1;
        }
    }
    let t = c.ctxs.len();
    let tok_seq: Vec<i32> = (0..t as i32).collect();
    let tok_pos: Vec<i32> = c.ctxs.iter().map(|&x| x as i32 - 1).collect();
    let q = randv(r, t * c.nh * hd, 3.0);
    let dq = g.upload_bf16(&q).unwrap();
    let (dseq, dpos, dtab) = (
        up_i32(&g, &tok_seq),
        up_i32(&g, &tok_pos),
        up_i32(&g, &tables),
    );
    let meta = AttnMeta {
        tok_seq: dseq.ptr(),
        tok_pos: dpos.ptr(),
        block_tables: dtab.ptr(),
        max_blocks,
        max_ctx: c.max_ctx,
        window: c.window,
    };
    let rs = c.ws_rows_splits.unwrap_or((64 << 20) / (hd * 4));
    let (ml, acc) = (poisoned(&g, rs * 2 * 4), poisoned(&g, rs * hd * 4));
    let ws = AttnWorkspace {
        part_ml: &ml,
        part_acc: &acc,
    };
    let out = poisoned(&g, t * c.nh * hd * 2);
    ops::paged_attention_ex(
        &g, &d, &dq, &pool, layer, &meta, t, None, &out, &ws, variant,
    )
    .map_err(|e| format!("launch: {e}"))?;
    let got = g.download_bf16(&out, t * c.nh * hd).unwrap();
    let grp = c.nh / c.nkv;
    let mut worst = 0f32;
    for ti in 0..t {
        let row = ti * c.nh * hd;
        let mut want = Vec::with_capacity(c.nh * hd);
        for h in 0..c.nh {
            let qq = &q[row + h * hd..row + (h + 1) * hd];
            let tbl = &tables[ti * max_blocks..(ti + 1) * max_blocks];
            want.extend(reference_decode(
                &pool_h,
                &d,
                layer,
                tbl,
                c.ctxs[ti],
                qq,
                h / grp,
                c.window,
            ));
        }
        let e = rel_err(&got[row..row + c.nh * hd], &want);
        if e >= 1e-2 {
            return Err(format!("token {ti} (ctx {}): rel err {e}", c.ctxs[ti]));
        }
        worst = worst.max(e);
    }
    Ok(worst)
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn paged_attention_v4_decode_matches_reference() {
    decode_matches_reference(AttnVariant::V4.into(), "attention_v4");
}

/// `engine.cuda.attention_v4_waves` / `attention_v4_max_part` change only how the context is
/// partitioned: many short partitions (4 waves, 128 keys at most) and few long ones (64 waves,
/// no cap) give the reference's result on every case.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn paged_attention_v4_tuning_keys_change_partitions_not_results() {
    for (waves, max_part, label) in [
        (4, 128, "attention_v4 w4 p128"),
        (64, 1 << 20, "attention_v4 w64"),
    ] {
        let choice = AttnChoice {
            variant: AttnVariant::V4,
            v4_waves: waves,
            v4_max_part: max_part,
        };
        decode_matches_reference(choice, label);
    }
}

fn decode_matches_reference(variant: AttnChoice, label: &str) {
    let mut r = rng(label);
    let edge = vec![1, 15, 16, 17, 511, 2049];
    let mut cases = Vec::new();
    for hd in [64, 128] {
        for grp in [1, 4, 5, 8] {
            cases.push(Case {
                name: "edges",
                nh: 2 * grp,
                nkv: 2,
                hd,
                bs: 16,
                ctxs: edge.clone(),
                max_ctx: 4096,
                ws_rows_splits: None,
                window: 0,
            });
        }
        cases.push(Case {
            name: "G=12: two head groups",
            nh: 24,
            nkv: 2,
            hd,
            bs: 16,
            ctxs: vec![300, 5, 129],
            max_ctx: 300,
            ws_rows_splits: None,
            window: 0,
        });
        cases.push(Case {
            name: "one partition (direct output)",
            nh: 8,
            nkv: 2,
            hd,
            bs: 16,
            ctxs: vec![1, 15, 16, 17, 100],
            max_ctx: 100,
            ws_rows_splits: None,
            window: 0,
        });
        cases.push(Case {
            name: "8k, G=8",
            nh: 16,
            nkv: 2,
            hd,
            bs: 16,
            ctxs: vec![8192, 17],
            max_ctx: 8192,
            ws_rows_splits: None,
            window: 0,
        });
    }
    cases.push(Case {
        name: "Llama-3.1-8B heads, 8k",
        nh: 32,
        nkv: 8,
        hd: 128,
        bs: 16,
        ctxs: vec![8192, 1, 4000],
        max_ctx: 8192,
        ws_rows_splits: None,
        window: 0,
    });
    let b64: Vec<usize> = (0..64).map(|_| r.random_range(1..=700)).collect();
    cases.push(Case {
        name: "batch 64",
        nh: 8,
        nkv: 2,
        hd: 128,
        bs: 16,
        ctxs: b64,
        max_ctx: 1024,
        ws_rows_splits: None,
        window: 0,
    });
    cases.push(Case {
        name: "block table past smem (bs 8), workspace for one split",
        nh: 4,
        nkv: 1,
        hd: 64,
        bs: 8,
        ctxs: vec![5000, 3],
        max_ctx: 5000,
        ws_rows_splits: Some(8),
        window: 0,
    });
    cases.push(Case {
        name: "block size 24 (partitions not block-aligned)",
        nh: 8,
        nkv: 2,
        hd: 128,
        bs: 24,
        ctxs: vec![2049, 23, 24, 25],
        max_ctx: 2100,
        ws_rows_splits: None,
        window: 0,
    });
    // more (token, KV head) blocks than two an SM: v4 runs its two-warp kernel (one wave)
    let sms = gpu().sm_count as usize;
    let many = 2 * sms / 8 + 8;
    assert!(ops::v4_two_warps(sms, 128, 8, many * 8, 1));
    assert!(!ops::v4_two_warps(sms, 128, 8, 2 * sms, 1));
    cases.push(Case {
        name: "Llama-3.1-8B heads, batch past two blocks an SM (v4 two warps)",
        nh: 32,
        nkv: 8,
        hd: 128,
        bs: 16,
        ctxs: (0..many).map(|_| r.random_range(1..=700)).collect(),
        max_ctx: 1024,
        ws_rows_splits: None,
        window: 0,
    });
    cases.push(Case {
        name: "G=8, batch past two blocks an SM, 2k (v4 two warps)",
        nh: 16,
        nkv: 2,
        hd: 128,
        bs: 16,
        ctxs: (0..4 * many)
            .map(|i| [2049, 1, 16, 17, 700][i % 5])
            .collect(),
        max_ctx: 2049,
        ws_rows_splits: None,
        window: 0,
    });
    cases.push(Case {
        name: "block size 32, G=20 (v4: two blocks of 16 heads)",
        nh: 40,
        nkv: 2,
        hd: 128,
        bs: 32,
        ctxs: vec![3000, 31, 32, 33],
        max_ctx: 3000,
        ws_rows_splits: None,
        window: 0,
    });
    run_cases(&cases, &mut r, variant, label);
}

/// Runs every case with `variant`, printing one PASS/FAIL line a case; fails after all ran.
fn run_cases(cases: &[Case], r: &mut rand_chacha::ChaCha8Rng, variant: AttnChoice, label: &str) {
    let mut failed = Vec::new();
    for c in cases {
        let tag = format!(
            "{} nh={} nkv={} hd={} bs={} ctxs={}{} max_ctx={} window={}",
            c.name,
            c.nh,
            c.nkv,
            c.hd,
            c.bs,
            c.ctxs.len(),
            if c.ctxs.len() <= 6 {
                format!("{:?}", c.ctxs)
            } else {
                String::new()
            },
            c.max_ctx,
            c.window
        );
        match run_case(c, r, variant) {
            Ok(e) => println!("PASS {label} {tag}: worst rel err {e:.2e}"),
            Err(e) => {
                println!("FAIL {label} {tag}: {e}");
                failed.push(tag);
            }
        }
    }
    assert!(failed.is_empty(), "failed: {failed:?}");
}

/// Sliding windows on every decode kernel (v1, v2, v2 narrow, v4) against the reference: windows
/// smaller than a block (1, 5) and than a v4 tile, of a block (16), not a multiple of the block
/// size (37, 100, 1000) and longer than every context (9000); contexts on both sides of the
/// window, long contexts whose splits must cover the window only, block sizes 8, 16, 24 and 32,
/// GQA groups 1 to 12 (two v4 head groups), a workspace for one split.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn paged_attention_windows_match_reference_every_variant() {
    let mut cases = Vec::new();
    let ctxs = vec![1, 5, 15, 16, 17, 100, 511, 2049];
    for hd in [64, 128] {
        for grp in [1, 4, 12] {
            for window in [1, 5, 16, 37, 100, 1000, 9000] {
                cases.push(Case {
                    name: "window",
                    nh: 2 * grp,
                    nkv: 2,
                    hd,
                    bs: 16,
                    ctxs: ctxs.clone(),
                    max_ctx: 4096,
                    ws_rows_splits: None,
                    window,
                });
            }
        }
    }
    for (bs, window) in [(8, 21), (24, 50), (32, 70), (32, 32)] {
        cases.push(Case {
            name: "window, block size",
            nh: 8,
            nkv: 2,
            hd: 128,
            bs,
            ctxs: vec![3000, 23, 24, 25, 31, 32, 33, 600],
            max_ctx: 3000,
            ws_rows_splits: None,
            window,
        });
    }
    cases.push(Case {
        name: "window, 8k context, Llama-3.1-8B heads",
        nh: 32,
        nkv: 8,
        hd: 128,
        bs: 16,
        ctxs: vec![8192, 1, 4000],
        max_ctx: 8192,
        ws_rows_splits: None,
        window: 4096,
    });
    cases.push(Case {
        name: "window, workspace for one split",
        nh: 4,
        nkv: 1,
        hd: 64,
        bs: 8,
        ctxs: vec![5000, 3],
        max_ctx: 5000,
        ws_rows_splits: Some(8),
        window: 4200,
    });
    for variant in [
        AttnVariant::V1,
        AttnVariant::V2,
        AttnVariant::V2Narrow,
        AttnVariant::V4,
    ] {
        let label = format!("attention {variant:?}");
        let mut r = rng(&label);
        let runs: Vec<Case> = cases
            .iter()
            .filter(|c| variant.runs(c.hd))
            .map(|c| Case {
                ctxs: c.ctxs.clone(),
                ..*c
            })
            .collect();
        run_cases(&runs, &mut r, variant.into(), &label);
    }
}

/// The same launch serves shorter contexts: one max context, contexts changed in device memory
/// between launches (as a captured graph replays it), every output right each time.
#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn paged_attention_v4_one_max_context_serves_growing_contexts() {
    one_max_context_serves_growing_contexts(AttnVariant::V4, "attention_v4");
}

fn one_max_context_serves_growing_contexts(variant: AttnVariant, label: &str) {
    let g = gpu();
    let mut r = rng(&format!("{label}_grow"));
    let (nh, nkv, hd, bs, max_ctx) = (32, 8, 128, 16, 2048);
    let max_blocks = max_ctx / bs;
    let t = 4;
    let nb = t * max_blocks;
    let d = AttnDims {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        block_size: bs,
        num_blocks: nb,
    };
    let pool_h = randv(&mut r, d.layer_elems(), 1.0);
    let pool = g.upload_bf16(&pool_h).unwrap();
    let tables: Vec<i32> = (0..nb as i32).rev().collect();
    let q = randv(&mut r, t * nh * hd, 3.0);
    let dq = g.upload_bf16(&q).unwrap();
    let dseq = up_i32(&g, &(0..t as i32).collect::<Vec<_>>());
    let dpos = up_i32(&g, &[0; 4]);
    let dtab = up_i32(&g, &tables);
    let meta = AttnMeta {
        tok_seq: dseq.ptr(),
        tok_pos: dpos.ptr(),
        block_tables: dtab.ptr(),
        max_blocks,
        max_ctx,
        window: 0,
    };
    let (ml, acc) = (poisoned(&g, 1 << 20), poisoned(&g, 64 << 20));
    let ws = AttnWorkspace {
        part_ml: &ml,
        part_acc: &acc,
    };
    for step in [1usize, 2, 17, 300, 1023, 2048] {
        let ctxs: Vec<usize> = (0..t).map(|i| (step + i * 37).min(max_ctx)).collect();
        let pos: Vec<i32> = ctxs.iter().map(|&c| c as i32 - 1).collect();
        g.upload(&dpos, 0, &pos).unwrap();
        let out = poisoned(&g, t * nh * hd * 2);
        ops::paged_attention_ex(&g, &d, &dq, &pool, 0, &meta, t, None, &out, &ws, variant).unwrap();
        let got = g.download_bf16(&out, t * nh * hd).unwrap();
        let mut want = Vec::new();
        for (ti, &ctx) in ctxs.iter().enumerate() {
            let tbl = &tables[ti * max_blocks..(ti + 1) * max_blocks];
            for h in 0..nh {
                let qq = &q[(ti * nh + h) * hd..(ti * nh + h + 1) * hd];
                want.extend(reference_decode(
                    &pool_h,
                    &d,
                    0,
                    tbl,
                    ctx,
                    qq,
                    h / (nh / nkv),
                    0,
                ));
            }
        }
        let e = rel_err(&got, &want);
        let verdict = if e < 1e-2 { "PASS" } else { "FAIL" };
        println!("{verdict} {label} max_ctx {max_ctx}, contexts {ctxs:?}: rel err {e:.2e}");
        assert!(e < 1e-2, "contexts {ctxs:?}: rel err {e}");
    }
}
