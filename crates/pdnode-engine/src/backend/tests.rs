//! Tests of the backend contract types: logits wishes, `StepLogits`, KV and staging checks.

use super::*;
use pdnode_core::DType;

fn layout() -> KvLayout {
    KvLayout {
        dtype: DType::F32,
        num_layers: 2,
        block_size: 4,
        kv_heads_per_rank: 1,
        head_dim: 8,
        tp_size: 1,
        model_fingerprint: "t".into(),
        kind: pdnode_core::KvKind::KeyValue,
    }
}

#[test]
fn logits_wants_must_match_the_logits_rows() {
    use LogitsWant::{Argmax as A, Full as F};
    assert!(check_logits_wants(&[A, F], 2).is_ok());
    assert!(check_logits_wants(&[], 0).is_ok());
    for (want, rows) in [(&[A][..], 2), (&[A, F][..], 1), (&[][..], 1)] {
        match check_logits_wants(want, rows) {
            Err(BackendError::InvalidBatch { reason }) => {
                assert!(reason.contains("logits wishes"), "{reason}")
            }
            other => panic!("{} wishes for {rows} rows: {other:?}", want.len()),
        }
    }
}

fn sample(temperature: f32, u: f64) -> LogitsWant {
    LogitsWant::Sample(RowDraw {
        temperature,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        u,
    })
}

#[test]
fn sample_wishes_need_sane_parameters() {
    assert!(check_logits_wants(&[sample(1.0, 0.0), sample(0.5, 0.999)], 2).is_ok());
    for bad in [
        sample(0.0, 0.5),
        sample(-1.0, 0.5),
        sample(f32::NAN, 0.5),
        sample(f32::INFINITY, 0.5),
        sample(1.0, 1.0),
        sample(1.0, -0.1),
        sample(1.0, f64::NAN),
        LogitsWant::Sample(RowDraw {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.0,
            min_p: 0.0,
            u: 0.5,
        }),
        LogitsWant::Sample(RowDraw {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 1.5,
            u: 0.5,
        }),
    ] {
        assert!(
            matches!(
                check_logits_wants(&[LogitsWant::Full, bad], 2),
                Err(BackendError::InvalidBatch { .. })
            ),
            "{bad:?}"
        );
    }
}

#[test]
fn step_logits_sample_rows_on_the_host_are_the_reference() {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let rows: [[f32; 4]; 4] = [
        [1.0, 3.0, 3.0, 2.0],
        [nan, -inf, nan, inf], // nothing finite
        [9.0, 8.0, 7.0, 6.0],  // a full row
        [0.0, 0.0, 0.0, 0.0],
    ];
    let data: Vec<f32> = rows.iter().flatten().copied().collect();
    let want = [
        sample(1.0, 0.7),
        sample(2.0, 0.2),
        LogitsWant::Full,
        sample(1.0, 0.6),
    ];
    let mut out = StepLogits::default();
    out.fill_from(Logits { vocab: 4, data }, &want).unwrap();
    for (i, (w, r)) in want.iter().zip(out.rows()).enumerate() {
        assert!(r.answers(w), "row {i}: {r:?} for {w:?}");
        if let LogitsWant::Sample(d) = w {
            assert_eq!(
                *r,
                RowOut::Sampled(crate::sampling::sample_row(&rows[i], d)),
                "row {i}"
            );
        }
    }
    assert_eq!(out.rows()[1], RowOut::Sampled(None));
    assert_eq!(out.rows()[3], RowOut::Sampled(Some(2)), "u 0.6 of 4 equal");
    assert_eq!(out.full_rows(), 1);
    assert_eq!(out.full_row(0), Some(&rows[2][..]));
    // the begin/set path
    out.begin(4, &want);
    assert_eq!(out.rows()[0], RowOut::Sampled(None));
    assert!(out.set_sampled(0, Some(3)));
    assert!(!out.set_sampled(2, Some(3)), "row 2 is a full row");
    assert!(!out.set_argmax(0, Some(3)), "row 0 is a sampled row");
    assert_eq!(out.rows()[0], RowOut::Sampled(Some(3)));
    assert!(!RowOut::Sampled(None).answers(&LogitsWant::Argmax));
    assert!(!RowOut::Argmax(None).answers(&want[0]));
}

#[test]
fn step_logits_from_full_rows_matches_host_argmax_and_keeps_full_rows() {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let rows: [[f32; 4]; 6] = [
        [1.0, 3.0, 3.0, 2.0],    // tie: lowest id
        [nan, -inf, nan, -inf],  // nothing finite
        [nan, -5.0, -inf, -7.0], // NaN and -inf skipped
        [0.5, inf, 1.0, inf],    // +inf counts, lowest of equal
        [9.0, 8.0, 7.0, 6.0],    // a full row
        [-0.0, 0.0, -1.0, -2.0], // -0 == 0: lowest id
    ];
    let data: Vec<f32> = rows.iter().flatten().copied().collect();
    use LogitsWant::{Argmax as A, Full as F};
    let want = [A, A, F, A, F, A];
    let mut out = StepLogits::default();
    out.fill_from(Logits { vocab: 4, data }, &want).unwrap();
    assert_eq!(out.vocab(), 4);
    assert_eq!(
        out.rows(),
        &[
            RowOut::Argmax(Some(1)),
            RowOut::Argmax(None),
            RowOut::Full(0),
            RowOut::Argmax(Some(1)),
            RowOut::Full(1),
            RowOut::Argmax(Some(0)),
        ]
    );
    for (i, r) in rows.iter().enumerate() {
        if want[i] == A {
            assert_eq!(
                out.rows()[i],
                RowOut::Argmax(crate::sampling::argmax(r).ok()),
                "row {i}"
            );
        }
    }
    assert_eq!(out.full_rows(), 2);
    assert_eq!(out.full_row(1), Some(&rows[4][..]));
    let r0: Vec<u32> = out
        .full_row(0)
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect();
    let e0: Vec<u32> = rows[2].iter().map(|x| x.to_bits()).collect();
    assert_eq!(r0, e0, "NaN bits kept");
    assert_eq!(out.full_row(2), None);
    // wrong shapes are typed errors
    assert!(matches!(
        out.fill_from(
            Logits {
                vocab: 4,
                data: vec![0.0; 8]
            },
            &[A]
        ),
        Err(BackendError::InvalidBatch { .. })
    ));
}

#[test]
fn step_logits_begin_reuses_its_buffer() {
    use LogitsWant::{Argmax as A, Full as F};
    let mut out = StepLogits::default();
    let buf = out.begin(1000, &[F, F, F]);
    assert_eq!(buf.len(), 3000);
    buf.fill(1.5);
    let ptr = out.full.as_ptr();
    let buf = out.begin(1000, &[A, F, A]);
    assert_eq!(buf.len(), 1000);
    assert_eq!(out.full.as_ptr(), ptr, "same allocation");
    assert_eq!(
        out.rows(),
        &[RowOut::Argmax(None), RowOut::Full(0), RowOut::Argmax(None)]
    );
    assert!(out.set_argmax(2, Some(7)));
    assert!(!out.set_argmax(1, Some(7)), "row 1 is a full row");
    assert!(!out.set_argmax(3, Some(7)), "no row 3");
    assert_eq!(out.rows()[2], RowOut::Argmax(Some(7)));
    out.begin(1000, &[F, F]);
    assert_eq!(out.full.as_ptr(), ptr, "grows within its capacity");
    assert_eq!(out.full_rows(), 2);
}

/// A backend's buffer, as a CUDA backend lends its page-locked memory.
struct Store(Vec<f32>);
impl RowStore for Store {
    fn as_slice(&self) -> &[f32] {
        &self.0
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

#[test]
fn step_logits_lend_a_backend_store_and_give_it_back() {
    use LogitsWant::{Argmax as A, Full as F};
    let mut out = StepLogits::default();
    let (full, old) = out.begin_store(3, &[F, A, F]);
    assert_eq!((full, old.is_none()), (2, true));
    let data: Vec<f32> = (0..12).map(|i| i as f32).collect();
    out.set_store(Box::new(Store(data))).unwrap();
    assert!(out.set_argmax(1, Some(2)));
    assert_eq!(out.full_rows(), 2, "the store's first 2 x 3 values");
    assert_eq!(out.full_row(1), Some(&[3.0, 4.0, 5.0][..]));
    assert_eq!(out.full_row(2), None);
    // next step: the same store comes back for reuse, downcast by its maker
    let (full, old) = out.begin_store(3, &[A]);
    assert_eq!(full, 0);
    let s = old.unwrap().into_any().downcast::<Store>().unwrap();
    assert_eq!(s.0.len(), 12);
    // a store too short for the full rows is refused
    out.begin_store(3, &[F, F, F, F, F]);
    assert!(matches!(
        out.set_store(s),
        Err(BackendError::InvalidBatch { .. })
    ));
    assert_eq!(out.full_rows(), 0);
    // the Vec path drops a lent store
    out.begin_store(3, &[F]);
    out.set_store(Box::new(Store(vec![1.0; 3]))).unwrap();
    out.begin(3, &[F]).copy_from_slice(&[7.0, 8.0, 9.0]);
    assert_eq!(out.full_row(0), Some(&[7.0, 8.0, 9.0][..]));
    assert!(out.begin_store(3, &[]).1.is_none());
}

#[test]
fn staging_io_is_bounded_and_aligned() {
    let l = layout();
    let lb = l.block_layer_bytes();
    let blocks = [BlockId(0), BlockId(3)];
    assert_eq!(
        check_staging_io(&l, 4, &(0..2), &blocks, 0, 4 * lb).unwrap(),
        4 * lb
    );
    assert!(matches!(
        check_staging_io(&l, 4, &(0..2), &blocks, 0, 4 * lb - 1),
        Err(BackendError::StagingRange { .. })
    ));
    assert!(matches!(
        check_staging_io(&l, 4, &(0..2), &blocks, 16, 1 << 20),
        Err(BackendError::StagingRange { .. })
    ));
    assert!(matches!(
        check_staging_io(&l, 4, &(0..2), &blocks, usize::MAX - 255, 1 << 20),
        Err(BackendError::StagingRange { .. })
    ));
    assert!(matches!(
        check_staging_io(&l, 4, &(0..2), &[BlockId(4)], 0, 1 << 20),
        Err(BackendError::BlockOutOfRange { .. })
    ));
    assert!(matches!(
        check_staging_io(&l, 4, &(1..3), &blocks, 0, 1 << 20),
        Err(BackendError::InvalidBatch { .. })
    ));
}

#[test]
fn strided_staging_is_bounded() {
    let l = layout();
    let lb = l.block_layer_bytes();
    let blocks = [BlockId(1)];
    // Two layers of one block each, in a span with room for 3 blocks per layer.
    assert_eq!(
        check_staging_strided(&l, 4, &(0..2), &blocks, 2 * lb, 3 * lb, 6 * lb).unwrap(),
        lb
    );
    assert!(check_staging_strided(&l, 4, &(0..2), &blocks, 3 * lb, 3 * lb, 6 * lb).is_err());
    assert!(
        check_staging_strided(&l, 4, &(0..2), &[BlockId(1), BlockId(2)], 0, lb, 1 << 20).is_err()
    );
    assert!(check_staging_strided(&l, 4, &(0..2), &blocks, 8, 3 * lb, 1 << 20).is_err());
    assert!(check_staging_strided(&l, 4, &(0..2), &blocks, 0, usize::MAX, 1 << 20).is_err());
}

/// Records the steps a warm-up runs.
struct Recorder {
    layout: KvLayout,
    blocks: usize,
    /// Per step: (sequences, new tokens of each, start position, block-table length).
    steps: Vec<(usize, usize, usize, usize)>,
}

impl Backend for Recorder {
    fn name(&self) -> String {
        "recorder".into()
    }
    fn kv_layout(&self) -> &KvLayout {
        &self.layout
    }
    fn num_kv_blocks(&self) -> usize {
        self.blocks
    }
    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Logits, BackendError> {
        let s = &batch.seqs[0];
        let bs = self.layout.block_size as usize;
        let mut written = std::collections::HashSet::new();
        for x in &batch.seqs {
            assert_eq!((x.tokens.len(), x.start_pos), (s.tokens.len(), s.start_pos));
            assert_eq!(x.block_table.len(), s.block_table.len());
            assert!(
                x.block_table.len() * bs >= x.start_pos + x.tokens.len(),
                "the table covers the step"
            );
            assert!(x.block_table.iter().all(|b| (b.0 as usize) < self.blocks));
            for p in x.start_pos..x.start_pos + x.tokens.len() {
                let slot = (x.block_table[p / bs], p % bs);
                assert!(written.insert(slot), "two tokens write {slot:?}");
            }
        }
        self.steps.push((
            batch.seqs.len(),
            s.tokens.len(),
            s.start_pos,
            s.block_table.len(),
        ));
        Ok(Logits {
            vocab: 4,
            data: vec![0.0; 4 * batch.logits_rows()],
        })
    }
    fn read_kv(&self, _: Range<u32>, _: &[BlockId], _: &mut [u8]) -> Result<(), BackendError> {
        Ok(())
    }
    fn write_kv(&mut self, _: Range<u32>, _: &[BlockId], _: &[u8]) -> Result<(), BackendError> {
        Ok(())
    }
}

#[test]
fn a_warm_up_runs_its_prefill_then_each_decode_shape_that_fits_the_pool() {
    let mut r = Recorder {
        layout: layout(),
        blocks: 5, // 20 positions of 4-token blocks
        steps: Vec::new(),
    };
    // The prefill of 0 tokens is nothing, the one of 21 needs 6 blocks: skipped.
    // Context 8 at batch 3: one shared block and one of its own per sequence (4 of the 5);
    // batch 5 at context 8 would need 6 blocks: skipped, as is context 100 (25 blocks).
    let plan = WarmUpPlan {
        prefill_lengths: vec![10, 0, 21],
        decode_batches: vec![1, 3, 5],
        decode_contexts: vec![4, 8, 100],
    };
    let steps = run_warm_up(&mut r, &plan).unwrap();
    assert_eq!(
        r.steps,
        vec![
            (1, 10, 0, 3),
            (1, 1, 3, 1),
            (3, 1, 3, 1),
            (5, 1, 3, 1),
            (1, 1, 7, 2),
            (3, 1, 7, 2),
        ]
    );
    assert_eq!(steps, 6);
    assert_eq!(run_warm_up(&mut r, &WarmUpPlan::default()).unwrap(), 0);
}
