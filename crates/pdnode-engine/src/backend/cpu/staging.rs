//! The CPU backend's KV staging arena ([`KvStaging`]): host memory that the node allocated
//! through its transport (on UCX 1.13 a region UCX allocated itself is mapped by the shared-memory
//! transports; a plain user buffer goes through emulated RMA, several times slower), handed to
//! the backend as a [`HostArena`]. Gather and scatter are the pool copies of `read_kv` /
//! `write_kv`, straight into and out of the arena.

use super::CpuBackend;
use crate::backend::{
    Backend, BackendError, KvRegion, KvStaging, LayerGate, MemKind, StepStaging, check_staging_io,
    check_staging_span, check_staging_strided,
};
use pdnode_core::BlockId;
use std::any::Any;
use std::ops::Range;
use std::sync::Arc;

/// Host memory lent to a backend as its staging arena, kept alive by `owner`.
pub struct HostArena {
    ptr: *mut u8,
    len: usize,
    _owner: Arc<dyn Any + Send + Sync>,
}

// SAFETY: the arena is plain host memory owned by `_owner` (Send + Sync); `HostArena::new`'s
// contract makes the backend the only one touching the spans it is asked to copy.
unsafe impl Send for HostArena {}

impl std::fmt::Debug for HostArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostArena({:p}, {} bytes)", self.ptr, self.len)
    }
}

impl HostArena {
    /// # Safety
    /// `ptr..ptr + len` must be host memory valid for reads and writes for as long as `owner`
    /// lives (it is kept alive by the arena), and while the backend gathers into or scatters
    /// from a span of it nobody else may write that span (the node's range allocator gives
    /// each span to one request).
    pub unsafe fn new(ptr: *mut u8, len: usize, owner: Arc<dyn Any + Send + Sync>) -> Self {
        Self {
            ptr,
            len,
            _owner: owner,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn region(&self) -> KvRegion {
        KvRegion {
            ptr: self.ptr as u64,
            len: self.len,
            mem: MemKind::Host,
        }
    }
}

impl CpuBackend {
    /// Lends the backend its staging arena (replaces any earlier one).
    pub fn attach_staging(&mut self, arena: HostArena) {
        self.staging = Some(arena);
    }

    fn arena(&self) -> Result<(*mut u8, usize), BackendError> {
        self.staging
            .as_ref()
            .map(|a| (a.ptr, a.len))
            .ok_or(BackendError::NoStaging)
    }

    /// The arena and the bytes a copy of `layers` of `blocks` at `offset` moves, checked
    /// against the pool and the arena (`check_staging_io`).
    fn arena_span(
        &self,
        layers: &Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<(*mut u8, usize), BackendError> {
        let (ptr, len) = self.arena()?;
        let n = check_staging_io(
            &self.layout,
            self.dims.num_blocks,
            layers,
            blocks,
            offset,
            len,
        )?;
        Ok((ptr, n))
    }
}

impl CpuBackend {
    /// `gather_kv_layers_to_staging` through `&self` (the forward pass calls it mid-step).
    fn gather_strided(
        &self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
        layer_stride: usize,
    ) -> Result<(), BackendError> {
        let (ptr, len) = self.arena()?;
        let per_layer = check_staging_strided(
            &self.layout,
            self.dims.num_blocks,
            &layers,
            blocks,
            offset,
            layer_stride,
            len,
        )?;
        for (i, layer) in layers.enumerate() {
            let at = offset + i * layer_stride;
            // SAFETY: `at + per_layer <= len` for every layer (check_staging_strided); the
            // arena is valid and this span unshared (HostArena::new), and it is not the pool.
            let out = unsafe { std::slice::from_raw_parts_mut(ptr.add(at), per_layer) };
            self.read_kv(layer..layer + 1, blocks, out)?;
        }
        Ok(())
    }

    /// In-step staging: `layers` of every planned sequence into its span, then `notify` each
    /// (the copy is done when this returns, so the gate is open; a failed copy's gate fails).
    pub(super) fn stage_layers(&self, plan: &mut StepStaging, layers: Range<u32>) {
        for (i, sq) in plan.seqs.iter().enumerate() {
            let offset = sq.offset + layers.start as usize * sq.layer_stride;
            let r = self.gather_strided(layers.clone(), &sq.blocks, offset, sq.layer_stride);
            let gate: LayerGate = match r {
                Ok(()) => Box::new(|| Ok(true)),
                Err(e) => {
                    let mut e = Some(e);
                    // the copy's own error the first time, then that it failed before
                    Box::new(move || {
                        Err(e.take().unwrap_or_else(|| BackendError::DeviceFailure {
                            kind: pdnode_core::ErrorKind::Internal,
                            message: "the KV gather behind this gate failed".into(),
                        }))
                    })
                }
            };
            (plan.notify)(i, layers.clone(), gate);
        }
    }
}

impl KvStaging for CpuBackend {
    fn staging_regions(&self) -> Vec<KvRegion> {
        self.staging.iter().map(HostArena::region).collect()
    }

    fn gather_kv_to_staging(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<(), BackendError> {
        let (ptr, n) = self.arena_span(&layers, blocks, offset)?;
        // SAFETY: `offset + n <= len` (checked) inside the arena, which `HostArena::new`'s
        // contract keeps valid and unshared for this span; it is not the pool (`read_kv` reads
        // `self.pool`), so the two slices do not overlap.
        let out = unsafe { std::slice::from_raw_parts_mut(ptr.add(offset), n) };
        self.read_kv(layers, blocks, out)
    }

    fn gather_kv_layers_to_staging(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
        layer_stride: usize,
    ) -> Result<(), BackendError> {
        self.gather_strided(layers, blocks, offset, layer_stride)
    }

    fn scatter_kv_from_staging(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<(), BackendError> {
        let (ptr, n) = self.arena_span(&layers, blocks, offset)?;
        // SAFETY: as in `gather_kv_to_staging`; the arena span is only read here.
        let data = unsafe { std::slice::from_raw_parts(ptr.add(offset).cast_const(), n) };
        self.write_kv(layers, blocks, data)
    }

    fn staging_read(
        &mut self,
        rank: usize,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), BackendError> {
        let (ptr, len) = self.arena()?;
        check_staging_span(rank, 1, offset, out.len(), len)?;
        // SAFETY: `offset + out.len() <= len` (checked) inside the arena, valid while it is
        // attached (HostArena::new); `out` is the caller's own buffer, not the arena.
        unsafe { std::ptr::copy_nonoverlapping(ptr.add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn staging_write(
        &mut self,
        rank: usize,
        offset: usize,
        data: &[u8],
    ) -> Result<(), BackendError> {
        let (ptr, len) = self.arena()?;
        check_staging_span(rank, 1, offset, data.len(), len)?;
        // SAFETY: as in `staging_read`; the span is the caller's (HostArena::new's contract).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr.add(offset), data.len()) };
        Ok(())
    }

    fn staging_kvh64(&mut self, offset: usize, len: usize) -> Result<Vec<u64>, BackendError> {
        let (ptr, arena_len) = self.arena()?;
        check_staging_span(0, 1, offset, len, arena_len)?;
        // SAFETY: in bounds (checked); only read.
        let bytes = unsafe { std::slice::from_raw_parts(ptr.add(offset).cast_const(), len) };
        let h = pdnode_core::kvh64::kvh64(bytes).ok_or(BackendError::StagingRange {
            offset,
            len,
            arena: arena_len,
        })?;
        Ok(vec![h])
    }

    fn scatter_kv_from_staging_h64(
        &mut self,
        layers: Range<u32>,
        blocks: &[BlockId],
        offset: usize,
    ) -> Result<Vec<u64>, BackendError> {
        let (ptr, n) = self.arena_span(&layers, blocks, offset)?;
        // SAFETY: as in `scatter_kv_from_staging`; the arena span is only read here.
        let data = unsafe { std::slice::from_raw_parts(ptr.add(offset).cast_const(), n) };
        let h = pdnode_core::kvh64::kvh64(data).ok_or(BackendError::StagingRange {
            offset,
            len: n,
            arena: n,
        })?;
        self.write_kv(layers, blocks, data)?;
        Ok(vec![h])
    }

    fn supports_step_staging(&self) -> bool {
        self.staging.is_some()
    }

    fn stage_next_step(&mut self, plan: StepStaging) -> Result<(), BackendError> {
        self.arena()?;
        self.step_staging = Some(plan);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ForwardBatch;
    use crate::backend::cpu::CpuBackendConfig;
    use crate::backend::{STAGING_ALIGN, SeqStep};

    fn backend() -> CpuBackend {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_gqa");
        let model = crate::loader::load_path(&dir).unwrap();
        CpuBackend::from_loaded(
            model,
            CpuBackendConfig {
                block_size: 4,
                num_blocks: 16,
                threads: 1,
            },
        )
        .unwrap()
    }

    #[test]
    fn gather_and_scatter_match_read_and_write_kv() {
        let mut be = backend();
        assert!(be.kv_staging().is_none(), "no arena until one is attached");
        let tokens: Vec<u32> = (0..10).map(|i| (i * 5 + 1) % 50).collect();
        let table = [BlockId(3), BlockId(7), BlockId(1)];
        be.forward(&ForwardBatch {
            seqs: vec![SeqStep {
                tokens: &tokens,
                start_pos: 0,
                block_table: &table,
                want_logits: true,
            }],
        })
        .unwrap();
        let layers = be.kv_layout().num_layers;
        let per = layers as usize * table.len() * be.kv_layout().block_layer_bytes();
        let mut want = vec![0u8; per];
        be.read_kv(0..layers, &table, &mut want).unwrap();
        assert!(want.iter().any(|b| *b != 0));

        let len = 2 * STAGING_ALIGN + 2 * per;
        let mut mem = vec![0u8; len].into_boxed_slice();
        let ptr = mem.as_mut_ptr();
        let owner: Arc<dyn Any + Send + Sync> = Arc::new(std::sync::Mutex::new(mem));
        // SAFETY: `mem`'s heap block lives inside `owner`, which the arena keeps; only the
        // backend touches it during this test.
        be.attach_staging(unsafe { HostArena::new(ptr, len, owner) });
        let s = be.kv_staging().expect("arena attached");
        assert_eq!(s.staging_regions().len(), 1);
        assert_eq!(s.staging_regions()[0].len, len);
        s.gather_kv_to_staging(0..layers, &table, STAGING_ALIGN)
            .unwrap();
        // SAFETY: as above; nothing writes the arena now.
        let got = unsafe { std::slice::from_raw_parts(ptr.add(STAGING_ALIGN), per) };
        assert_eq!(got, &want[..]);
        // What a fenced hand-off does around the span: its KVH64, a record behind it.
        assert_eq!(
            s.staging_kvh64(STAGING_ALIGN, per).unwrap(),
            vec![pdnode_core::kvh64::kvh64(&want).unwrap()]
        );
        let record = [7u8; 64];
        s.staging_write(0, STAGING_ALIGN + per, &record).unwrap();
        let mut back = [0u8; 64];
        s.staging_read(0, STAGING_ALIGN + per, &mut back).unwrap();
        assert_eq!(back, record);
        assert!(matches!(
            s.staging_read(0, len - 10, &mut back),
            Err(BackendError::StagingRange { .. })
        ));
        assert!(matches!(
            s.staging_write(1, 0, &record),
            Err(BackendError::StagingRank { rank: 1, ranks: 1 })
        ));
        assert!(
            s.staging_kvh64(STAGING_ALIGN, 15).is_err(),
            "not whole words"
        );

        // The same span filled in two parts (blocks 0..2, then 2..3, layer by layer).
        let lb = be.kv_layout().block_layer_bytes();
        let stride = table.len() * lb;
        let s = be.kv_staging().unwrap();
        s.gather_kv_layers_to_staging(0..layers, &table[..2], STAGING_ALIGN + per, stride)
            .unwrap();
        s.gather_kv_layers_to_staging(0..layers, &table[2..], STAGING_ALIGN + per + 2 * lb, stride)
            .unwrap();
        // SAFETY: as above.
        let parts = unsafe { std::slice::from_raw_parts(ptr.add(STAGING_ALIGN + per), per) };
        assert_eq!(
            parts,
            &want[..],
            "strided gather fills the span like one gather"
        );

        // Scatter into other blocks: they read back equal.
        let other = [BlockId(0), BlockId(2), BlockId(9)];
        let s = be.kv_staging().unwrap();
        s.scatter_kv_from_staging(0..layers, &other, STAGING_ALIGN)
            .unwrap();
        let mut back = vec![0u8; per];
        be.read_kv(0..layers, &other, &mut back).unwrap();
        assert_eq!(back, want);

        // Out of the arena, misaligned, or a block outside the pool: typed errors.
        let s = be.kv_staging().unwrap();
        assert!(matches!(
            s.gather_kv_to_staging(0..layers, &table, 2 * STAGING_ALIGN + per + 256),
            Err(BackendError::StagingRange { .. })
        ));
        assert!(matches!(
            s.gather_kv_to_staging(0..layers, &table, 8),
            Err(BackendError::StagingRange { .. })
        ));
        assert!(matches!(
            s.scatter_kv_from_staging(0..layers, &[BlockId(16)], 0),
            Err(BackendError::BlockOutOfRange { .. })
        ));
    }

    /// In-step staging's gates: open at once after a good copy; a failed copy's gate reports
    /// that copy's typed error (its class kept), then that it failed, never `Ok`.
    #[test]
    fn a_failed_in_step_gather_fails_its_gate_with_the_typed_error() {
        use crate::backend::{StageSeq, StepStaging};
        use pdnode_core::ErrorKind;
        use pdnode_core::error::Classify;
        let mut be = backend();
        let layers = be.kv_layout().num_layers;
        let lb = be.kv_layout().block_layer_bytes();
        let len = 4 * STAGING_ALIGN + 4 * layers as usize * lb;
        let mut mem = vec![0u8; len].into_boxed_slice();
        let ptr = mem.as_mut_ptr();
        let owner: Arc<dyn Any + Send + Sync> = Arc::new(std::sync::Mutex::new(mem));
        // SAFETY: `mem`'s heap block lives inside `owner`, which the arena keeps.
        be.attach_staging(unsafe { HostArena::new(ptr, len, owner) });
        let gates = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = gates.clone();
        let mut plan = StepStaging {
            seqs: vec![
                StageSeq {
                    blocks: vec![BlockId(1)],
                    offset: STAGING_ALIGN,
                    layer_stride: lb,
                },
                StageSeq {
                    blocks: vec![BlockId(16)], // outside the pool of 16
                    offset: 2 * STAGING_ALIGN,
                    layer_stride: lb,
                },
            ],
            group: layers,
            notify: Box::new(move |i, r, gate| sink.lock().unwrap().push((i, r, gate))),
        };
        be.stage_layers(&mut plan, 0..layers);
        let mut got = std::mem::take(&mut *gates.lock().unwrap());
        assert_eq!(got.len(), 2);
        assert!(
            matches!((got[0].2)(), Ok(true)),
            "the good copy's gate is open"
        );
        let first = (got[1].2)();
        assert!(
            matches!(first, Err(BackendError::BlockOutOfRange { .. })),
            "{first:?}"
        );
        let again = (got[1].2)();
        assert!(
            matches!(&again, Err(e) if e.kind() == ErrorKind::Internal),
            "{again:?}"
        );
    }
}
