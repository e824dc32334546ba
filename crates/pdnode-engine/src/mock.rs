//! The simulated engine, `engine.backend = "mock"`: a [`Backend`] with no model, for router
//! benchmarks and fault tests (the role Dynamo's mocker plays). Never a default; `name()` is
//! `"mock"` so logs and `/v1/models` say so.
//!
//! What is real: the KV pool (host memory, a small layout of 2 layers x 1 head x 2 dims, f32), so
//! blocks are really allocated, written, read, reserved and handed off; and the data dependency
//! of each output on the KV cache. Each position's KV holds a 64-bit *state*,
//! `state(p) = mix(state(p-1), token(p), p)`, written redundantly into every layer's K and V;
//! a step reads `state(start_pos - 1)` back from the cache, so a sequence whose KV was not
//! computed or not transferred correctly gives different tokens or a loud
//! [`BackendError::Device`] ("inconsistent KV"). Logits are a pure function of the state, so greedy
//! outputs are reproducible and identical between colocated and PD runs (and independent of
//! batching, chunking, preemption or prefix-cache hits).
//!
//! Logits: all zeros except 8 tokens chosen from the state (values 8, 7, ..., 1); the top one is
//! the greedy choice. Token [`MockBackend::EOS_TOKEN`] (0) is never chosen; the output length
//! comes from `engine.mock.output_len`, applied by the engine loop as a cap on `max_tokens`
//! (finish reason `length`).
//!
//! Timing (per forward step, slept on the engine thread): `prefill_us_per_token` times the tokens
//! of prefill sequences (compute-bound: prefill cost adds up per token), plus one
//! `decode_us_per_token` if the step has any decode sequence (memory-bound: a batch of decodes
//! costs about one token's time, the usual first-order model and what Dynamo's mocker does for
//! small batches). A decode is a sequence running one token after cached positions.

use crate::backend::{
    Backend, BackendError, ForwardBatch, KvMemory, KvRegion, Logits, MemKind, check_kv_io,
    layer_block_offset,
};
use pdnode_core::config::{EngineConfig, MockEngineConfig};
use pdnode_core::{BlockId, DType, KvLayout};
use std::ops::Range;
use std::time::Duration;

const LAYERS: u32 = 2;
const HEAD_DIM: u32 = 2;
const SEED: u64 = 0x6d6f_636b_2d6b_7631; // "mock-kv1"

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn key(layer: u32, v: bool) -> u64 {
    mix(u64::from(layer) * 2 + u64::from(v) + 1)
}

#[derive(Debug)]
pub struct MockBackend {
    timing: MockEngineConfig,
    layout: KvLayout,
    num_blocks: usize,
    pool: Vec<u8>,
}

impl MockBackend {
    /// The EOS id the mock reports (it never samples it under greedy decoding).
    pub const EOS_TOKEN: u32 = 0;

    /// From the engine config: `engine.mock` timings, `engine.block_size`, and
    /// `engine.num_kv_blocks` (0: enough for `max_running_requests` full contexts).
    pub fn new(cfg: &EngineConfig) -> Result<Self, BackendError> {
        let bs = cfg.block_size.max(1);
        let blocks = if cfg.num_kv_blocks > 0 {
            cfg.num_kv_blocks
        } else {
            cfg.max_running_requests
                .saturating_mul(cfg.context_length.div_ceil(bs))
                .max(1)
        };
        Self::with_pool(&cfg.mock, bs, blocks)
    }

    /// A mock with an explicit pool size.
    pub fn with_pool(
        timing: &MockEngineConfig,
        block_size: u32,
        num_blocks: u32,
    ) -> Result<Self, BackendError> {
        if timing.vocab_size < 2 || block_size == 0 {
            return Err(BackendError::InvalidBatch {
                reason: format!(
                    "mock needs vocab_size >= 2 and block_size >= 1 (got {}, {block_size})",
                    timing.vocab_size
                ),
            });
        }
        let layout = KvLayout {
            dtype: DType::F32,
            num_layers: LAYERS,
            block_size,
            kv_heads_per_rank: 1,
            head_dim: HEAD_DIM,
            tp_size: 1,
            model_fingerprint: format!("mock-v{}", timing.vocab_size),
            kind: pdnode_core::KvKind::KeyValue,
        };
        let bytes = layout.block_bytes() * num_blocks as usize;
        Ok(Self {
            timing: timing.clone(),
            layout,
            num_blocks: num_blocks as usize,
            pool: vec![0; bytes],
        })
    }

    /// The mock's timing and output length settings.
    pub fn timing(&self) -> &MockEngineConfig {
        &self.timing
    }

    /// Byte offset of (layer, block, slot, K or V) in the pool.
    fn slot(&self, layer: u32, block: BlockId, slot: usize, v: bool) -> usize {
        let half = self.layout.block_layer_bytes() / 2;
        layer_block_offset(&self.layout, self.num_blocks, layer, block)
            + usize::from(v) * half
            + slot * (HEAD_DIM as usize * 4)
    }

    fn locate(&self, table: &[BlockId], pos: usize) -> Result<(BlockId, usize), BackendError> {
        let bs = self.layout.block_size as usize;
        let b = *table
            .get(pos / bs)
            .ok_or_else(|| BackendError::InvalidBatch {
                reason: format!(
                    "block table of {} blocks does not cover position {pos}",
                    table.len()
                ),
            })?;
        if b.0 as usize >= self.num_blocks {
            return Err(BackendError::BlockOutOfRange {
                block: b,
                num_blocks: self.num_blocks,
            });
        }
        Ok((b, pos % bs))
    }

    fn write_state(
        &mut self,
        table: &[BlockId],
        pos: usize,
        state: u64,
    ) -> Result<(), BackendError> {
        let (b, s) = self.locate(table, pos)?;
        for l in 0..LAYERS {
            for v in [false, true] {
                let o = self.slot(l, b, s, v);
                self.pool[o..o + 8].copy_from_slice(&(state ^ key(l, v)).to_le_bytes());
            }
        }
        Ok(())
    }

    fn read_state(&self, table: &[BlockId], pos: usize) -> Result<u64, BackendError> {
        let (b, s) = self.locate(table, pos)?;
        let mut state = None;
        for l in 0..LAYERS {
            for v in [false, true] {
                let o = self.slot(l, b, s, v);
                let mut w = [0u8; 8];
                w.copy_from_slice(&self.pool[o..o + 8]);
                let got = u64::from_le_bytes(w) ^ key(l, v);
                if *state.get_or_insert(got) != got {
                    return Err(BackendError::Device(format!(
                        "mock: inconsistent KV at position {pos} ({b} slot {s}, layer {l}): \
                         the cache was not computed or not transferred"
                    )));
                }
            }
        }
        state.ok_or_else(|| BackendError::Device("mock: no layers".into()))
    }

    fn logits_row(&self, state: u64, row: &mut [f32]) {
        let v = row.len() as u64;
        for k in 0..8u64 {
            let idx = 1 + mix(state ^ (k + 1).wrapping_mul(0xa076_1d64_78bd_642f)) % (v - 1);
            let val = 8.0 - k as f32;
            let r = &mut row[idx as usize];
            if *r == 0.0 {
                *r = val;
            }
        }
    }
}

impl Backend for MockBackend {
    fn name(&self) -> String {
        "mock".into()
    }

    fn kv_layout(&self) -> &KvLayout {
        &self.layout
    }

    fn num_kv_blocks(&self) -> usize {
        self.num_blocks
    }

    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Logits, BackendError> {
        let vocab = self.timing.vocab_size as usize;
        let rows = batch.seqs.iter().filter(|s| s.want_logits).count();
        let mut data = vec![0.0f32; rows * vocab];
        let (mut prefill_tokens, mut decodes) = (0u64, 0u64);
        let mut row = 0;
        for seq in &batch.seqs {
            if seq.tokens.is_empty() {
                return Err(BackendError::InvalidBatch {
                    reason: "a sequence with no tokens".into(),
                });
            }
            if let Some(t) = seq.tokens.iter().find(|t| **t as usize >= vocab) {
                return Err(BackendError::InvalidBatch {
                    reason: format!("token {t} outside the mock vocabulary of {vocab}"),
                });
            }
            if seq.tokens.len() == 1 && seq.start_pos > 0 {
                decodes += 1;
            } else {
                prefill_tokens += seq.tokens.len() as u64;
            }
            let mut state = if seq.start_pos == 0 {
                SEED
            } else {
                self.read_state(seq.block_table, seq.start_pos - 1)?
            };
            for (i, &t) in seq.tokens.iter().enumerate() {
                let pos = seq.start_pos + i;
                state = mix(state ^ mix(u64::from(t) << 32 | pos as u64));
                self.write_state(seq.block_table, pos, state)?;
            }
            if seq.want_logits {
                self.logits_row(state, &mut data[row * vocab..(row + 1) * vocab]);
                row += 1;
            }
        }
        let us = self.timing.prefill_us_per_token * prefill_tokens
            + if decodes > 0 {
                self.timing.decode_us_per_token
            } else {
                0
            };
        if us > 0 {
            std::thread::sleep(Duration::from_micros(us));
        }
        Ok(Logits { vocab, data })
    }

    fn read_kv(
        &self,
        layers: Range<u32>,
        blocks: &[BlockId],
        out: &mut [u8],
    ) -> Result<(), BackendError> {
        check_kv_io(&self.layout, self.num_blocks, &layers, blocks, out.len(), 1)?;
        let n = self.layout.block_layer_bytes();
        let mut o = 0;
        for l in layers {
            for &b in blocks {
                let src = layer_block_offset(&self.layout, self.num_blocks, l, b);
                out[o..o + n].copy_from_slice(&self.pool[src..src + n]);
                o += n;
            }
        }
        Ok(())
    }

    fn write_kv(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        data: &[u8],
    ) -> Result<(), BackendError> {
        check_kv_io(
            &self.layout,
            self.num_blocks,
            &layers,
            blocks,
            data.len(),
            1,
        )?;
        let n = self.layout.block_layer_bytes();
        let mut o = 0;
        for l in layers {
            for &b in blocks {
                let dst = layer_block_offset(&self.layout, self.num_blocks, l, b);
                self.pool[dst..dst + n].copy_from_slice(&data[o..o + n]);
                o += n;
            }
        }
        Ok(())
    }
}

impl KvMemory for MockBackend {
    fn kv_regions(&self) -> Vec<KvRegion> {
        vec![KvRegion {
            ptr: self.pool.as_ptr() as u64,
            len: self.pool.len(),
            mem: MemKind::Host,
        }]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqStep;

    fn mock(blocks: u32) -> MockBackend {
        let t = MockEngineConfig {
            prefill_us_per_token: 0,
            decode_us_per_token: 0,
            output_len: 8,
            vocab_size: 100,
        };
        MockBackend::with_pool(&t, 4, blocks).unwrap()
    }

    fn argmax(r: &[f32]) -> usize {
        (0..r.len()).fold(0, |b, i| if r[i] > r[b] { i } else { b })
    }

    fn run(
        m: &mut MockBackend,
        tokens: &[u32],
        start: usize,
        table: &[BlockId],
    ) -> Result<usize, BackendError> {
        let b = ForwardBatch {
            seqs: vec![SeqStep {
                tokens,
                start_pos: start,
                block_table: table,
                want_logits: true,
            }],
        };
        Ok(argmax(m.forward(&b)?.row(0)))
    }

    #[test]
    fn chunked_equals_whole_and_outputs_depend_on_the_kv() {
        let mut m = mock(8);
        let p: Vec<u32> = (1..=9).collect();
        let t = [BlockId(0), BlockId(1), BlockId(2)];
        let whole = run(&mut m, &p, 0, &t).unwrap();
        let t2 = [BlockId(3), BlockId(4), BlockId(5)];
        run(&mut m, &p[..5], 0, &t2).unwrap();
        assert_eq!(run(&mut m, &p[5..], 5, &t2).unwrap(), whole);
        assert_ne!(whole, 0, "never EOS");
        // Copy the KV of the first table into fresh blocks: same continuation.
        let mut buf = vec![0u8; 2 * 3 * m.kv_layout().block_layer_bytes()];
        m.read_kv(0..2, &t, &mut buf).unwrap();
        let t3 = [BlockId(6), BlockId(7), BlockId(5)];
        m.write_kv(0..2, &t3[..2], &buf[..0]).unwrap_err();
        let mut m2 = mock(8);
        m2.write_kv(0..2, &t, &buf).unwrap();
        assert_eq!(
            run(&mut m2, &[42], 9, &t).unwrap(),
            run(&mut m, &[42], 9, &t).unwrap()
        );
        // KV never written: a loud error, not a silent wrong answer.
        let mut m3 = mock(8);
        assert!(matches!(
            run(&mut m3, &[42], 9, &t),
            Err(BackendError::Device(_))
        ));
        // Bad input is a typed error.
        assert!(run(&mut m, &[1000], 0, &t).is_err());
        assert!(run(&mut m, &p, 0, &t[..1]).is_err());
        assert!(run(&mut m, &p, 0, &[BlockId(99)]).is_err());
        assert_eq!(m.name(), "mock");
    }
}
