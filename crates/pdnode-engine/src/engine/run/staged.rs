//! The engine loop's side of a staged prefill's KV (the hand-off's staging-arena span): armed
//! inside the step that ends the prompt (layer groups), gathered after the other steps.

use super::Loop;
use crate::engine::handle::StagedReady;

impl Loop {
    /// Before a prefill-only step: the staged prefills this step ends (their last chunk) whose
    /// backend stages inside a step get the rest of their blocks gathered layer group by layer
    /// group as the step writes their KV ([`crate::backend::StepStaging`]); each group is
    /// reported with its gate at once, so the node puts it while later layers compute. Those
    /// blocks count as gathered ([`Self::gather_staged`] skips them).
    pub(super) fn arm_step_staging(&mut self, plan: &crate::scheduler::StepPlan) {
        let lb = self.backend.kv_layout().block_layer_bytes();
        let layers = self.backend.kv_layout().num_layers;
        if !self
            .backend
            .kv_staging()
            .is_some_and(|st| st.supports_step_staging())
        {
            return;
        }
        let mut seqs = Vec::new();
        let mut sinks = Vec::new();
        let mut group = 0;
        for s in &plan.seqs {
            let Some(a) = self.active.get_mut(&s.id) else {
                continue;
            };
            let prompt_len = a.prompt_len;
            let Some((g, sent)) = a.staged.as_mut() else {
                continue;
            };
            if g.layer_group == 0 || s.start_pos + s.tokens.len() < prompt_len {
                continue; // not its last chunk: gathered after the step
            }
            let done = g.blocks.min(s.block_table.len());
            if done <= *sent {
                continue;
            }
            let per_rank = layers as usize * g.blocks * lb;
            let Some(offset) = span_offset(g, per_rank, self.backend.kv_staging()) else {
                continue; // no room: the node gathers after prefill
            };
            group = if group == 0 {
                g.layer_group
            } else {
                group.min(g.layer_group)
            };
            seqs.push(crate::backend::StageSeq {
                blocks: s.block_table[*sent..done].to_vec(),
                offset: offset + *sent * lb,
                layer_stride: g.blocks * lb,
            });
            sinks.push((g.ready.clone(), *sent..done));
            *sent = done;
        }
        if seqs.is_empty() {
            return;
        }
        let notify = Box::new(
            move |i: usize, layers: std::ops::Range<u32>, gate: crate::backend::LayerGate| {
                if let Some((tx, blocks)) = sinks.get(i) {
                    let _ = tx.try_send(StagedReady::Layers {
                        blocks: blocks.clone(),
                        layers,
                        gate,
                    });
                }
            },
        );
        let plan = crate::backend::StepStaging {
            seqs,
            group,
            notify,
        };
        let armed = match self.backend.kv_staging() {
            Some(st) => st.stage_next_step(plan),
            None => Err(crate::backend::BackendError::NoStaging),
        };
        if let Err(e) = armed {
            // Counts stay short of the span: the node gathers the rest after prefill.
            tracing::warn!(error = %e, "in-step KV staging refused; the hand-off gathers after prefill");
        }
    }

    /// After a step: each staged prefill's blocks that became final (every whole block below
    /// the chunk's end; all of them after the last chunk) go to its arena span, and the count is
    /// reported. A failed gather ends the staging of that request (logged); its count stays short.
    pub(super) fn gather_staged(&mut self, plan: &crate::scheduler::StepPlan) {
        let layout = self.backend.kv_layout();
        let (bs, lb, layers) = (
            layout.block_size.max(1) as usize,
            layout.block_layer_bytes(),
            layout.num_layers,
        );
        for s in &plan.seqs {
            let Some(a) = self.active.get_mut(&s.id) else {
                continue;
            };
            let Some((g, sent)) = a.staged.as_mut() else {
                continue;
            };
            let end = s.start_pos + s.tokens.len();
            let ended = end >= a.prompt_len;
            let done = if ended { g.blocks } else { end / bs };
            let done = done.min(g.blocks).min(s.block_table.len());
            if done > *sent {
                let per_rank = layers as usize * g.blocks * lb;
                let Some(offset) = span_offset(g, per_rank, self.backend.kv_staging()) else {
                    // No room in the arena yet: asked again after the next chunk.
                    continue;
                };
                let r = match self.backend.kv_staging() {
                    Some(st) => st.gather_kv_layers_to_staging(
                        0..layers,
                        &s.block_table[*sent..done],
                        offset + *sent * lb,
                        g.blocks * lb,
                    ),
                    None => Err(crate::backend::BackendError::NoStaging),
                };
                match r {
                    Ok(()) => {
                        *sent = done;
                        let _ = g.ready.try_send(StagedReady::Blocks(done));
                    }
                    Err(e) => {
                        tracing::warn!(request = %s.id, error = %e, "staged KV gather failed; the hand-off gathers after prefill");
                        a.staged = None;
                        continue;
                    }
                }
            }
            // Every block is in the span (gathered now, or inside the step that ended the
            // prompt, on this stream before what follows): its records go behind it.
            if ended
                && *sent == g.blocks
                && let (Some(offset), Some(seal)) = (g.offset, g.seal.take())
            {
                let per_rank = layers as usize * g.blocks * lb;
                let t0 = std::time::Instant::now();
                let written = match self.backend.kv_staging() {
                    Some(st) => seal_span(st, offset, per_rank, seal),
                    None => Err(crate::backend::BackendError::NoStaging),
                };
                tracing::debug!(request = %s.id, bytes = per_rank, ok = written.is_ok(),
                    seal_us = t0.elapsed().as_micros() as u64,
                    "staged span sealed (KVH64 and fence records behind it)");
                if let Err(e) = &written {
                    tracing::warn!(request = %s.id, error = %e,
                        "writing the staged span's fence records failed; the hand-off writes them");
                }
                let _ = g.ready.try_send(StagedReady::Sealed {
                    written: written.is_ok(),
                });
            }
        }
    }
}

/// The request's arena span (`per_rank` bytes a rank), taken from the arena the first time it
/// is asked for; a span that will be sealed with a hash is registered so the gathers filling it
/// hash what they write ([`crate::backend::KvStaging::staging_hash_begin`]).
fn span_offset(
    g: &mut crate::engine::handle::StagedGather,
    per_rank: usize,
    st: Option<&mut dyn crate::backend::KvStaging>,
) -> Option<usize> {
    if g.offset.is_none() {
        g.offset = (g.alloc)();
        if let (Some(offset), Some(st)) = (g.offset, st)
            && g.seal.as_ref().is_some_and(|s| s.hash)
            && let Err(e) = st.staging_hash_begin(offset, per_rank)
        {
            // The seal reads the span instead.
            tracing::debug!(error = %e, "hashing the span inside its gathers refused");
        }
    }
    g.offset
}

/// The [`crate::engine::StagingSeal`] of a span of `per_rank` bytes a rank at `offset`: each
/// rank's KVH64 when asked, then each rank's record right behind its bytes.
fn seal_span(
    st: &mut dyn crate::backend::KvStaging,
    offset: usize,
    per_rank: usize,
    seal: crate::engine::StagingSeal,
) -> Result<(), crate::backend::BackendError> {
    let sums = if seal.hash {
        Some(st.staging_kvh64(offset, per_rank)?)
    } else {
        None
    };
    let records = (seal.make)(st.staging_regions().len(), sums.as_deref());
    let at = offset
        .checked_add(per_rank)
        .ok_or(crate::backend::BackendError::StagingRange {
            offset,
            len: per_rank,
            arena: 0,
        })?;
    for (rank, rec) in records.iter().enumerate() {
        st.staging_write(rank, at, rec)?;
    }
    Ok(())
}
