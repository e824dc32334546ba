//! The fence record of the KV hand-off (docs/protocol.md, "Fencing and verification"): 64
//! bytes the prefill node writes behind each rank's KV in the decode node's staging span, after
//! the KV puts were flushed. Generation, request, length, a checksum of the rank's bytes when
//! asked for (CRC32C of host staging, KVH64 of device staging: [`Sum`]), a tag under the reservation's KV capability (only a holder of the capability
//! writes a record the decode node accepts: `crate::capability`), and a CRC32C of the record
//! itself (a torn record is no record). One format for serving (`pdnode-node`'s hand-off) and
//! for `pdnode bench-transfer`.

use crate::capability::record_tag;
use crate::checksum::crc32c;
use crate::{MemKind, Registration, Secret};

/// Bytes of a fence record (a multiple of 8; the staging allocator aligns spans anyway).
pub const RECORD_LEN: usize = 64;
const MAGIC: [u8; 8] = *b"PDKVFNC3";
/// Bytes the capability tag covers (magic to checksum), and where the tag lies; the record's
/// own CRC32C takes the last 4 bytes.
const TAGGED: usize = 44;
const TAG: std::ops::Range<usize> = 44..60;
/// Flag: the record carries a checksum of the rank's bytes (at 36..44).
const HAS_SUM: u32 = 1;
/// Flag: the writer abandoned the push (its puts are over, the bytes are not the whole KV).
const ABORTED: u32 = 2;
/// Flag: the checksum is KVH64 (else CRC32C in the low 32 bits).
const KVH64: u32 = 4;

/// A checksum of one rank's KV bytes: CRC32C where they lie in host memory (the CPU computes
/// it at memory speed), KVH64 ([`pdnode_core::kvh64`]) where they lie in device memory (a
/// kernel reads it at HBM speed; CRC32C on the GPU is compute-bound). Which one a hand-off
/// uses follows from the decode node's staging: its rank regions' `device_memory`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sum {
    Crc32c(u32),
    Kvh64(u64),
}

impl std::fmt::Display for Sum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Sum::Crc32c(c) => write!(f, "CRC32C {c:08x}"),
            Sum::Kvh64(h) => write!(f, "KVH64 {h:016x}"),
        }
    }
}

/// Which checksum a hand-off's staging asks for ([`Sum`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SumKind {
    Crc32c,
    Kvh64,
}

impl SumKind {
    /// KVH64 for device staging, CRC32C for host staging.
    pub fn for_staging(device_memory: bool) -> Self {
        if device_memory {
            SumKind::Kvh64
        } else {
            SumKind::Crc32c
        }
    }
}

/// What the prefill node writes behind one rank's KV in the decode node's staging span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FenceRecord {
    pub generation: u64,
    pub request: u64,
    /// Bytes of KV in front of the record.
    pub len: u64,
    /// The checksum of those bytes, when the decode node asked for it.
    pub sum: Option<Sum>,
    /// The writer gave the push up; its puts are all over (the span may be freed, never
    /// scattered).
    pub aborted: bool,
}

/// What lies where a fence record should.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landed {
    /// No intact record (never written, torn, or too short).
    Nothing,
    /// An intact record whose tag does not verify under the reservation's capability: written
    /// by someone who was not given this reservation.
    Forged,
    Record(FenceRecord),
}

impl Landed {
    /// The record, if an intact and genuine one is there.
    pub fn record(self) -> Option<FenceRecord> {
        match self {
            Landed::Record(r) => Some(r),
            _ => None,
        }
    }
}

/// Why landed KV is not scattered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FenceError {
    #[error(
        "rank {rank}: no intact fence record (the writer never finished, or the record is torn)"
    )]
    Missing { rank: usize },
    #[error(
        "rank {rank}: fence record of generation {found}, the span's is {want} (a put of another reservation)"
    )]
    Generation { rank: usize, found: u64, want: u64 },
    #[error(
        "rank {rank}: fence record for request {found_request:x} with {found_len} bytes, expected {want_request:x} with {want_len}"
    )]
    Describes {
        rank: usize,
        found_request: u64,
        found_len: u64,
        want_request: u64,
        want_len: u64,
    },
    #[error(
        "rank {rank}: the fence record's tag does not verify under this reservation's capability (written by a node that was not given it)"
    )]
    Forged { rank: usize },
    #[error("rank {rank}: the writer abandoned this push")]
    Aborted { rank: usize },
    #[error("rank {rank}: the fence record carries no checksum but transfer.verify is on")]
    NoChecksum { rank: usize },
    #[error("rank {rank}: {found} of the landed bytes, the sender's is {want}")]
    Checksum { rank: usize, found: Sum, want: Sum },
    #[error("the landed span in device memory could not be checked ({what}): {message}")]
    Device { what: &'static str, message: String },
    #[error("KVH64 of {len} bytes: not a whole number of 16-byte words")]
    NotWords { len: usize },
    #[error("staging of {len} bytes at {offset} is outside or not host memory ({what})")]
    NotHost {
        what: &'static str,
        offset: usize,
        len: usize,
    },
}

impl FenceError {
    /// Whether the bytes were there but wrong (counted as an integrity failure).
    pub fn is_checksum(&self) -> bool {
        matches!(self, FenceError::Checksum { .. })
    }
}

impl FenceRecord {
    /// The record's bytes, tagged under `capability` (the reservation's `KvTarget.secret`).
    pub fn encode(&self, capability: &Secret) -> [u8; RECORD_LEN] {
        let mut b = [0u8; RECORD_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b[16..24].copy_from_slice(&self.request.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        let (mut flags, sum) = match self.sum {
            Some(Sum::Crc32c(c)) => (HAS_SUM, u64::from(c)),
            Some(Sum::Kvh64(h)) => (HAS_SUM | KVH64, h),
            None => (0, 0),
        };
        if self.aborted {
            flags |= ABORTED;
        }
        b[32..36].copy_from_slice(&flags.to_le_bytes());
        b[36..44].copy_from_slice(&sum.to_le_bytes());
        let tag = record_tag(capability, &b[..TAGGED]);
        b[TAG].copy_from_slice(&tag);
        let own = crc32c(&b[..RECORD_LEN - 4]);
        b[RECORD_LEN - 4..].copy_from_slice(&own.to_le_bytes());
        b
    }

    /// What `b` holds, the tag checked under `capability`.
    pub fn decode(b: &[u8], capability: &Secret) -> Landed {
        let Some(b) = b.get(..RECORD_LEN) else {
            return Landed::Nothing;
        };
        let Some(rec) = Self::decode_intact(b) else {
            return Landed::Nothing;
        };
        let tag = record_tag(capability, &b[..TAGGED]);
        // Constant-time: a tag is compared like a secret.
        let diff = tag
            .iter()
            .zip(&b[TAG])
            .fold(0u8, |acc, (x, y)| acc | (x ^ y));
        if diff != 0 {
            return Landed::Forged;
        }
        Landed::Record(rec)
    }

    /// The record in `b` if it is intact (magic and its own checksum), its tag unchecked.
    fn decode_intact(b: &[u8]) -> Option<Self> {
        let b: &[u8; RECORD_LEN] = b.get(..RECORD_LEN)?.try_into().ok()?;
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let u32_at = |i: usize| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&b[i..i + 4]);
            u32::from_le_bytes(w)
        };
        if b[0..8] != MAGIC || u32_at(RECORD_LEN - 4) != crc32c(&b[..RECORD_LEN - 4]) {
            return None;
        }
        let flags = u32_at(32);
        let sum = match (flags & HAS_SUM != 0, flags & KVH64 != 0) {
            (false, _) => None,
            (true, true) => Some(Sum::Kvh64(u64_at(36))),
            // A CRC32C uses the low half only: anything in the high half is no record of ours.
            (true, false) => Some(Sum::Crc32c(u32::try_from(u64_at(36)).ok()?)),
        };
        Some(FenceRecord {
            generation: u64_at(8),
            request: u64_at(16),
            len: u64_at(24),
            sum,
            aborted: flags & ABORTED != 0,
        })
    }

    /// Checks this record (of `rank`) against what the decode node handed out; `sum` is the
    /// checksum of the landed bytes when verification is on (of the kind the staging asks for:
    /// a record with the other kind does not match).
    pub fn check(
        &self,
        rank: usize,
        generation: u64,
        request: u64,
        len: u64,
        sum: Option<Sum>,
    ) -> Result<(), FenceError> {
        if self.aborted {
            return Err(FenceError::Aborted { rank });
        }
        if self.generation != generation {
            return Err(FenceError::Generation {
                rank,
                found: self.generation,
                want: generation,
            });
        }
        if self.request != request || self.len != len {
            return Err(FenceError::Describes {
                rank,
                found_request: self.request,
                found_len: self.len,
                want_request: request,
                want_len: len,
            });
        }
        match (sum, self.sum) {
            (None, _) => Ok(()),
            (Some(_), None) => Err(FenceError::NoChecksum { rank }),
            (Some(found), Some(want)) if found != want => {
                Err(FenceError::Checksum { rank, found, want })
            }
            _ => Ok(()),
        }
    }
}

/// `len` bytes at `offset` of a registered host region, bounds-checked.
fn host_ptr(reg: &Registration, offset: usize, len: usize) -> Result<*mut u8, FenceError> {
    let r = reg.region();
    let end = offset.checked_add(len);
    if r.mem != MemKind::Host || end.is_none_or(|e| e > r.len) {
        return Err(FenceError::NotHost {
            what: "staging region",
            offset,
            len,
        });
    }
    Ok((r.addr + offset) as *mut u8)
}

/// CRC32C of `len` bytes at `offset` of a registered host region.
pub fn crc_at(reg: &Registration, offset: usize, len: usize) -> Result<u32, FenceError> {
    let p = host_ptr(reg, offset, len)?;
    // SAFETY: `host_ptr` checked that the range lies inside the registration's host memory,
    // which stays allocated while `reg` lives. A remote writer (a late put) may change these
    // bytes while they are read: any bit pattern is a valid `u8`, and a changed byte only
    // changes the checksum, which is what the check is for.
    let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
    Ok(crc32c(bytes))
}

/// The checksum of `kind` of `len` bytes at `offset` of a registered host region.
pub fn sum_at(
    reg: &Registration,
    offset: usize,
    len: usize,
    kind: SumKind,
) -> Result<Sum, FenceError> {
    match kind {
        SumKind::Crc32c => crc_at(reg, offset, len).map(Sum::Crc32c),
        SumKind::Kvh64 => {
            let p = host_ptr(reg, offset, len)?;
            // SAFETY: as in `crc_at`.
            let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
            pdnode_core::kvh64::kvh64(bytes)
                .map(Sum::Kvh64)
                .ok_or(FenceError::NotWords { len })
        }
    }
}

/// What lies at `offset` of a registered host region where a fence record should, its tag
/// checked under `capability`.
pub fn read_record(
    reg: &Registration,
    offset: usize,
    capability: &Secret,
) -> Result<Landed, FenceError> {
    let p = host_ptr(reg, offset, RECORD_LEN)?;
    let mut b = [0u8; RECORD_LEN];
    // SAFETY: in bounds of the registration's host memory (checked by `host_ptr`); copied out
    // before it is parsed, so a concurrent remote write can only make the record torn, which
    // its own checksum detects.
    unsafe { std::ptr::copy_nonoverlapping(p as *const u8, b.as_mut_ptr(), RECORD_LEN) };
    Ok(FenceRecord::decode(&b, capability))
}

/// Writes `record` at `offset` of a registered host region (the prefill node's put source).
pub fn write_record(
    reg: &Registration,
    offset: usize,
    record: &FenceRecord,
    capability: &Secret,
) -> Result<(), FenceError> {
    let p = host_ptr(reg, offset, RECORD_LEN)?;
    let b = record.encode(capability);
    // SAFETY: in bounds of the registration's host memory (checked by `host_ptr`); this range
    // belongs to the caller's span (or fresh region) and no put reads it yet.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), p, RECORD_LEN) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trip_torn_and_forged_records() {
        let cap = Secret::from_array([7; 16]);
        let r = FenceRecord {
            generation: 7,
            request: 0xabc,
            len: 4096,
            sum: Some(Sum::Crc32c(0xdead_beef)),
            aborted: false,
        };
        let b = r.encode(&cap);
        assert_eq!(FenceRecord::decode(&b, &cap), Landed::Record(r));
        let gone = FenceRecord { aborted: true, ..r };
        assert_eq!(
            FenceRecord::decode(&gone.encode(&cap), &cap),
            Landed::Record(gone)
        );
        assert!(matches!(
            gone.check(0, 7, 0xabc, 4096, None),
            Err(FenceError::Aborted { rank: 0 })
        ));
        for i in [0, 9, 20, 33, 37, 45, 63] {
            let mut t = b;
            t[i] ^= 1;
            assert_eq!(
                FenceRecord::decode(&t, &cap),
                Landed::Nothing,
                "byte {i} flipped"
            );
        }
        assert_eq!(FenceRecord::decode(&b[..10], &cap), Landed::Nothing);
        assert_eq!(
            FenceRecord::decode(&[0u8; RECORD_LEN], &cap),
            Landed::Nothing
        );
        let plain = FenceRecord { sum: None, ..r };
        assert_eq!(
            FenceRecord::decode(&plain.encode(&cap), &cap).record(),
            Some(plain)
        );
        let device = FenceRecord {
            sum: Some(Sum::Kvh64(0x0123_4567_89ab_cdef)),
            ..r
        };
        assert_eq!(
            FenceRecord::decode(&device.encode(&cap), &cap).record(),
            Some(device)
        );
        // Intact, but written under another capability (or none): forged, not missing.
        let other = Secret::from_array([8; 16]);
        assert_eq!(FenceRecord::decode(&r.encode(&other), &cap), Landed::Forged);
        assert_eq!(FenceRecord::decode(&b, &other), Landed::Forged);
        assert_eq!(Landed::Forged.record(), None);
    }

    #[test]
    fn checks_name_what_differs() {
        let r = FenceRecord {
            generation: 3,
            request: 9,
            len: 100,
            sum: Some(Sum::Crc32c(5)),
            aborted: false,
        };
        assert_eq!(r.check(0, 3, 9, 100, Some(Sum::Crc32c(5))), Ok(()));
        assert_eq!(r.check(0, 3, 9, 100, None), Ok(()));
        assert!(matches!(
            r.check(1, 4, 9, 100, None),
            Err(FenceError::Generation {
                rank: 1,
                found: 3,
                want: 4
            })
        ));
        assert!(matches!(
            r.check(0, 3, 8, 100, None),
            Err(FenceError::Describes { .. })
        ));
        assert!(matches!(
            r.check(0, 3, 9, 100, Some(Sum::Crc32c(6))),
            Err(FenceError::Checksum { .. })
        ));
        // The same value under the other algorithm is no match.
        assert!(matches!(
            r.check(0, 3, 9, 100, Some(Sum::Kvh64(5))),
            Err(FenceError::Checksum { .. })
        ));
        let plain = FenceRecord { sum: None, ..r };
        assert!(matches!(
            plain.check(0, 3, 9, 100, Some(Sum::Crc32c(6))),
            Err(FenceError::NoChecksum { .. })
        ));
    }
}
