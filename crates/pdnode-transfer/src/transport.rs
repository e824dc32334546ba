//! The narrow transport seam: register memory, connect to a peer's region, put spans, flush.

use crate::TransferError;
use crate::completion::Completion;
use crate::region::{LocalRegion, RemoteRegion, Span};

/// Which implementation a transport is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    Ucx,
    InProcess,
}

/// A registered local region. Dropping it deregisters the region (after the operations that use
/// it have finished).
pub struct Registration {
    pub(crate) id: u64,
    pub(crate) region: LocalRegion,
    pub(crate) descriptor: RemoteRegion,
    pub(crate) release: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Registration {
    pub fn id(&self) -> u64 {
        self.id
    }
    pub fn region(&self) -> LocalRegion {
        self.region
    }
    /// What to send the peer so that it can write this region.
    pub fn descriptor(&self) -> &RemoteRegion {
        &self.descriptor
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(f) = self.release.take() {
            f();
        }
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.id)
            .field("region", &self.region)
            .finish()
    }
}

/// A peer's region this transport can write. Dropping it releases the remote key (and the
/// endpoint when nothing else uses it).
pub struct RemoteTarget {
    pub(crate) id: u64,
    pub(crate) region: RemoteRegion,
    pub(crate) release: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl RemoteTarget {
    pub fn id(&self) -> u64 {
        self.id
    }
    pub fn region(&self) -> &RemoteRegion {
        &self.region
    }
}

impl Drop for RemoteTarget {
    fn drop(&mut self) {
        if let Some(f) = self.release.take() {
            f();
        }
    }
}

impl std::fmt::Debug for RemoteTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTarget")
            .field("id", &self.id)
            .field("base_addr", &self.region.base_addr)
            .field("len", &self.region.len)
            .finish()
    }
}

/// Moves KV bytes from registered local memory into a peer's registered memory.
///
/// Offsets in [`Span`]s are relative to the start of the local region and of the remote region.
/// A put's completion means the local bytes may be reused; only a flush's completion means the
/// bytes are visible at the peer.
pub trait KvTransport: Send + Sync {
    fn kind(&self) -> TransportKind;

    /// The address peers pass to [`KvTransport::connect`] (a UCX worker address).
    fn local_address(&self) -> Vec<u8>;

    /// Registers local memory for puts from it (source) and into it (destination).
    ///
    /// # Safety
    /// `region` must be valid memory of its kind that stays allocated until the returned
    /// registration is dropped and every operation using it has completed; while a peer may
    /// write it, nothing else may rely on its contents.
    unsafe fn register(&self, region: LocalRegion) -> Result<Registration, TransferError>;

    /// Connects to a peer's region, given the peer's address and the region's descriptor.
    fn connect(
        &self,
        peer_address: &[u8],
        region: &RemoteRegion,
    ) -> Result<RemoteTarget, TransferError>;

    /// Starts copying `spans` from `local` to `remote`; spans are checked against both regions.
    fn put(
        &self,
        local: &Registration,
        remote: &RemoteTarget,
        spans: &[Span],
    ) -> Result<Completion, TransferError>;

    /// Completes when every put issued to `remote` before it is visible at the peer.
    fn flush(&self, remote: &RemoteTarget) -> Result<Completion, TransferError>;
}
