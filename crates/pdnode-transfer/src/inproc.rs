//! The in-process transport (role = "all": prefill and decode in one process): a put is a
//! memory copy between two registered host regions of the same transport.

use crate::TransferError;
use crate::completion::Completion;
use crate::region::{LocalRegion, MemKind, RemoteRegion, Span, check_spans};
use crate::transport::{KvTransport, Registration, RemoteTarget, TransportKind};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const NAME: &str = "in-process";

#[derive(Default)]
struct Regions {
    by_id: HashMap<u64, LocalRegion>,
}

/// Copies between regions registered with the same instance.
pub struct InProcessTransport {
    instance: u64,
    next_id: AtomicU64,
    regions: Arc<Mutex<Regions>>,
}

impl Default for InProcessTransport {
    fn default() -> Self {
        Self::new()
    }
}

impl InProcessTransport {
    pub fn new() -> Self {
        InProcessTransport {
            instance: rand::random(),
            next_id: AtomicU64::new(1),
            regions: Arc::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Regions> {
        self.regions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn parse_key(&self, rkey: &[u8]) -> Result<u64, TransferError> {
        let bytes: [u8; 16] = rkey
            .try_into()
            .map_err(|_| TransferError::InvalidDescriptor {
                reason: format!("in-process key of {} bytes, expected 16", rkey.len()),
            })?;
        let (inst, id) = bytes.split_at(8);
        let inst = u64::from_le_bytes(inst.try_into().unwrap_or_default());
        if inst != self.instance {
            return Err(TransferError::InvalidDescriptor {
                reason: "region of another in-process transport".into(),
            });
        }
        Ok(u64::from_le_bytes(id.try_into().unwrap_or_default()))
    }
}

impl KvTransport for InProcessTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::InProcess
    }

    fn local_address(&self) -> Vec<u8> {
        self.instance.to_le_bytes().to_vec()
    }

    unsafe fn register(&self, region: LocalRegion) -> Result<Registration, TransferError> {
        if region.mem != MemKind::Host {
            return Err(TransferError::UnsupportedMemory {
                transport: NAME,
                mem: region.mem.to_string(),
            });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.lock().by_id.insert(id, region);
        let mut rkey = self.instance.to_le_bytes().to_vec();
        rkey.extend_from_slice(&id.to_le_bytes());
        let regions = self.regions.clone();
        Ok(Registration {
            id,
            region,
            descriptor: RemoteRegion {
                base_addr: region.addr as u64,
                len: region.len as u64,
                rkey,
            },
            release: Some(Box::new(move || {
                regions
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .by_id
                    .remove(&id);
            })),
        })
    }

    fn connect(
        &self,
        peer_address: &[u8],
        region: &RemoteRegion,
    ) -> Result<RemoteTarget, TransferError> {
        if peer_address != self.local_address() {
            return Err(TransferError::InvalidDescriptor {
                reason: "in-process peer address is not this transport".into(),
            });
        }
        let id = self.parse_key(&region.rkey)?;
        let g = self.lock();
        let r = g
            .by_id
            .get(&id)
            .ok_or(TransferError::UnknownTarget { id })?;
        if r.addr as u64 != region.base_addr || r.len as u64 != region.len {
            return Err(TransferError::InvalidDescriptor {
                reason: format!("region {id} does not match its descriptor"),
            });
        }
        Ok(RemoteTarget {
            id,
            region: region.clone(),
            release: None,
        })
    }

    fn put(
        &self,
        local: &Registration,
        remote: &RemoteTarget,
        spans: &[Span],
    ) -> Result<Completion, TransferError> {
        // Holding the lock keeps both regions registered while copying.
        let g = self.lock();
        let src = *g
            .by_id
            .get(&local.id)
            .filter(|r| **r == local.region)
            .ok_or(TransferError::UnknownRegion { id: local.id })?;
        let dst = *g.by_id.get(&remote.id).ok_or(TransferError::PeerGone {
            peer: format!("in-process region {}", remote.id),
            reason: "deregistered".into(),
        })?;
        check_spans(spans, src.len as u64, dst.len as u64)?;
        for s in spans {
            // SAFETY: both regions are registered (the caller promised they stay valid while
            // registered) and the span lies inside both (checked above); `copy` allows overlap.
            unsafe {
                std::ptr::copy(
                    (src.addr as *const u8).add(s.local_offset as usize),
                    (dst.addr as *mut u8).add(s.remote_offset as usize),
                    s.len as usize,
                );
            }
        }
        Ok(Completion::ready("in-process put", Ok(())))
    }

    fn flush(&self, remote: &RemoteTarget) -> Result<Completion, TransferError> {
        if !self.lock().by_id.contains_key(&remote.id) {
            return Err(TransferError::UnknownTarget { id: remote.id });
        }
        Ok(Completion::ready("in-process flush", Ok(())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn put_copies_and_deregistered_target_is_refused() {
        let t = InProcessTransport::new();
        let mut a: Vec<u8> = (0..64).collect();
        let mut b = vec![0u8; 64];
        // SAFETY: a and b outlive the registrations (dropped first).
        let ra = unsafe { t.register(LocalRegion::host(&mut a)) }.unwrap();
        let rb = unsafe { t.register(LocalRegion::host(&mut b)) }.unwrap();
        let target = t.connect(&t.local_address(), rb.descriptor()).unwrap();
        let spans = [Span {
            local_offset: 8,
            remote_offset: 16,
            len: 8,
        }];
        let deadline = Instant::now() + Duration::from_secs(1);
        t.put(&ra, &target, &spans).unwrap().wait(deadline).unwrap();
        t.flush(&target).unwrap().wait(deadline).unwrap();
        let bad = [Span {
            local_offset: 60,
            remote_offset: 0,
            len: 8,
        }];
        assert!(matches!(
            t.put(&ra, &target, &bad),
            Err(TransferError::SpanOutOfRange { .. })
        ));
        drop(rb);
        assert!(matches!(
            t.put(&ra, &target, &spans),
            Err(TransferError::PeerGone { .. })
        ));
        drop(ra);
        assert_eq!(&b[16..24], &a[8..16]);
        assert!(b[..16].iter().all(|x| *x == 0));
    }

    #[test]
    fn foreign_descriptors_and_device_memory_are_refused() {
        let t1 = InProcessTransport::new();
        let t2 = InProcessTransport::new();
        let mut a = vec![0u8; 8];
        // SAFETY: a outlives the registration.
        let r1 = unsafe { t1.register(LocalRegion::host(&mut a)) }.unwrap();
        assert!(t2.connect(&t2.local_address(), r1.descriptor()).is_err());
        assert!(t1.connect(&t2.local_address(), r1.descriptor()).is_err());
        let dev = LocalRegion {
            addr: 4096,
            len: 8,
            mem: MemKind::Cuda(0),
        };
        // SAFETY: refused before any access.
        assert!(matches!(
            unsafe { t1.register(dev) },
            Err(TransferError::UnsupportedMemory { .. })
        ));
    }
}
