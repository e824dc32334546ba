//! Paged KV writes and GQA attention over the f32 pool of the CPU backend.
//!
//! The pool is `[layer][block][K,V][slot][kv_head][head_dim]` (see `backend` module docs).

use rayon::prelude::*;

/// Geometry of the pool.
#[derive(Debug, Clone, Copy)]
pub struct PoolDims {
    pub num_blocks: usize,
    pub block_size: usize,
    /// 2 (K then V) or 1 (a latent: one "head" of `head_dim` values).
    pub planes: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl PoolDims {
    /// f32 elements of one K (or V) slab of a block: `block_size * kv_heads * head_dim`.
    pub fn slab(&self) -> usize {
        self.block_size * self.kv_heads * self.head_dim
    }
    /// f32 elements of one layer-block (K and V, or the latent).
    pub fn layer_block(&self) -> usize {
        self.planes * self.slab()
    }
    /// Offset of K (`kv = 0`) or V (`kv = 1`) of `(layer, block, slot)`, head 0.
    pub fn at(&self, layer: usize, block: usize, kv: usize, slot: usize) -> usize {
        (layer * self.num_blocks + block) * self.layer_block()
            + kv * self.slab()
            + slot * self.kv_heads * self.head_dim
    }
}

/// One sequence of the batch as the kernels see it.
#[derive(Debug, Clone, Copy)]
pub struct SeqView<'a> {
    /// Row of this sequence's first new token in the batch's activation matrices.
    pub row: usize,
    pub len: usize,
    pub start_pos: usize,
    pub blocks: &'a [usize],
}

/// Writes the new tokens' K and V (`[tokens][kv_heads*head_dim]`) into the pool for `layer`.
pub fn write_kv(
    pool: &mut [f32],
    d: PoolDims,
    layer: usize,
    seqs: &[SeqView<'_>],
    k: &[f32],
    v: &[f32],
) {
    let kvd = d.kv_heads * d.head_dim;
    for s in seqs {
        for i in 0..s.len {
            let p = s.start_pos + i;
            let blk = s.blocks[p / d.block_size];
            let slot = p % d.block_size;
            let r = (s.row + i) * kvd;
            let ko = d.at(layer, blk, 0, slot);
            pool[ko..ko + kvd].copy_from_slice(&k[r..r + kvd]);
            let vo = d.at(layer, blk, 1, slot);
            pool[vo..vo + kvd].copy_from_slice(&v[r..r + kvd]);
        }
    }
}

/// Causal GQA attention for every new token of every sequence: queries `q`
/// (`[tokens][heads][head_dim]`, RoPE applied) against the pool's K/V of positions
/// `0..=position` (with a `window`, only the last `window` of them: `position + 1 - window
/// ..= position`), writing `[tokens][heads][head_dim]` into `out`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    out: &mut [f32],
    pool: &[f32],
    d: PoolDims,
    layer: usize,
    seqs: &[SeqView<'_>],
    q: &[f32],
    heads: usize,
    window: Option<usize>,
) {
    let hd = d.head_dim;
    let group = heads / d.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    // One task per (token, head): each writes its own head_dim slice of `out`.
    let mut tasks: Vec<(usize, usize, &SeqView<'_>)> = Vec::new();
    for s in seqs {
        for i in 0..s.len {
            tasks.push((s.row + i, s.start_pos + i, s));
        }
    }
    out.par_chunks_mut(heads * hd)
        .zip(q.par_chunks(heads * hd))
        .enumerate()
        .for_each(|(row, (o_row, q_row))| {
            // Rows are in sequence order; find this row's task.
            let Ok(ti) = tasks.binary_search_by(|t| t.0.cmp(&row)) else {
                return;
            };
            let (_, pos, s) = tasks[ti];
            let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let n = pos + 1 - first;
            let mut scores = vec![0f32; n];
            for h in 0..heads {
                let g = h / group;
                let qh = &q_row[h * hd..(h + 1) * hd];
                let mut max = f32::NEG_INFINITY;
                for (j, sc) in (first..).zip(scores.iter_mut()) {
                    let ko = d.at(layer, s.blocks[j / d.block_size], 0, j % d.block_size) + g * hd;
                    let kj = &pool[ko..ko + hd];
                    let dot: f32 = dot(qh, kj);
                    *sc = dot * scale;
                    max = max.max(*sc);
                }
                let inv = exp_shifted(&mut scores, max);
                let oh = &mut o_row[h * hd..(h + 1) * hd];
                oh.fill(0.0);
                for (j, &p) in (first..).zip(scores.iter()) {
                    let vo = d.at(layer, s.blocks[j / d.block_size], 1, j % d.block_size) + g * hd;
                    let vj = &pool[vo..vo + hd];
                    let w = p * inv;
                    for (o, &v) in oh.iter_mut().zip(vj) {
                        *o += w * v;
                    }
                }
            }
        });
}

/// Softmax's numerators in place (`exp(score - max)`); returns one over their sum.
#[inline]
pub fn exp_shifted(scores: &mut [f32], max: f32) -> f32 {
    let mut sum = 0f32;
    for sc in scores.iter_mut() {
        *sc = (*sc - max).exp();
        sum += *sc;
    }
    1.0 / sum
}

/// Dot product with 8 independent accumulators (vectorizes without reassociation flags).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}
