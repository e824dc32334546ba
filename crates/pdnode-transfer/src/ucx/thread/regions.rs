//! The worker thread's memory registrations: regions the node registers (its arenas, host
//! staging), memory UCX allocates, and their place in the active-message receiver.

use super::super::am;
use super::super::memory_type;
use super::State;
use crate::TransferError;
use crate::region::{LocalRegion, MemKind};
use std::rc::Rc;
use ucx_sys::MemHandle;

impl State {
    /// Drops registration `id` (a region or an allocation) and its place in the receiver.
    pub(super) fn deregister(&mut self, id: u64) {
        self.regions.remove(&id);
        if let Some(addr) = self.host_regions.remove(&id) {
            self.receiver.borrow_mut().remove_region(addr);
        }
    }

    pub(super) fn register(
        &mut self,
        id: u64,
        region: LocalRegion,
    ) -> Result<Vec<u8>, TransferError> {
        // SAFETY: the caller of `KvTransport::register` promised the region stays valid until
        // the registration is dropped and its operations finished; in-flight operations hold an
        // Rc of the handle, so it is unmapped only after them.
        let mh = unsafe {
            MemHandle::map(
                &self.ctx,
                region.addr as *mut u8,
                region.len,
                memory_type(region.mem),
            )
        }?;
        let rkey = mh.pack_rkey()?;
        self.regions.insert(id, Rc::new(mh));
        Ok(self.describe(id, region.addr as u64, region.len as u64, region.mem, rkey))
    }

    /// The descriptor key of a region: for host memory, the active-message token before the
    /// UCX rkey (peers put host memory as messages this worker places, and device memory by RMA
    /// with the rkey); for device memory the rkey alone.
    fn describe(&mut self, id: u64, addr: u64, len: u64, mem: MemKind, rkey: Vec<u8>) -> Vec<u8> {
        match mem {
            MemKind::Host => {
                self.receiver.borrow_mut().add_region(addr, len);
                self.host_regions.insert(id, addr);
                let mut d = am::AM_TOKEN.to_vec();
                d.extend_from_slice(&rkey);
                d
            }
            MemKind::Cuda(_) => rkey,
        }
    }

    pub(super) fn allocate(
        &mut self,
        id: u64,
        len: usize,
    ) -> Result<(usize, Vec<u8>), TransferError> {
        let mh = MemHandle::allocate(&self.ctx, len)?;
        let rkey = mh.pack_rkey()?;
        let addr = mh.addr() as usize;
        self.regions.insert(id, Rc::new(mh));
        let d = self.describe(id, addr as u64, len as u64, MemKind::Host, rkey);
        Ok((addr, d))
    }
}
