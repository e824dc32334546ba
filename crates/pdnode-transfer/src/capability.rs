//! KV capabilities (docs/protocol.md, "Capabilities"): what a decode node's `ReserveKv` hands
//! out as `KvTarget.secret`. A capability is HMAC-SHA256, truncated to 128 bits, under a key
//! only this decode node process knows, over the reservation it grants: request, staging
//! generation, span (offset and length of one rank) and expiry. Whoever presents it later
//! (`Decode`, `KvDone`, and the prefill node inside each fence record it writes) shows it was
//! given this very reservation; a capability for another request, span, generation or an
//! earlier process does not verify, and one past its expiry is refused however it was made.

use crate::Secret;
use ring::hmac;

const DOMAIN: &[u8] = b"pdnode/kv-capability/v1";

/// The reservation a capability grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub request: u64,
    pub generation: u64,
    /// Where the span starts in each rank's staging (0 for per-request regions).
    pub offset: u64,
    /// Bytes of one rank's span (KV, plus the fence record's room when asked for).
    pub len: u64,
    /// Unix time (ms) after which the capability is refused.
    pub expires_ms: u64,
}

/// Why a presented capability is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CapabilityError {
    #[error("the KV capability does not verify (forged, or for another reservation)")]
    Forged,
    #[error("the KV capability expired at {expires_ms} ms (now {now_ms} ms)")]
    Expired { expires_ms: u64, now_ms: u64 },
}

/// A decode node's capability key: random per process, never leaves it.
pub struct CapabilityKey(hmac::Key);

impl CapabilityKey {
    /// A fresh random key.
    pub fn random() -> Self {
        let bytes: [u8; 32] = rand::random();
        Self::from_bytes(&bytes)
    }

    /// A key from fixed bytes (tests).
    pub fn from_bytes(bytes: &[u8; 32]) -> Self {
        Self(hmac::Key::new(hmac::HMAC_SHA256, bytes))
    }

    /// The capability for `g`.
    pub fn mint(&self, g: &Grant) -> Secret {
        let mut ctx = hmac::Context::with_key(&self.0);
        ctx.update(DOMAIN);
        for v in [g.request, g.generation, g.offset, g.len, g.expires_ms] {
            ctx.update(&v.to_le_bytes());
        }
        let tag = ctx.sign();
        let mut out = [0u8; 16];
        out.copy_from_slice(&tag.as_ref()[..16]);
        Secret::from_array(out)
    }

    /// Checks `presented` against `g` at `now_ms` (constant-time comparison).
    pub fn verify(&self, g: &Grant, presented: &[u8], now_ms: u64) -> Result<(), CapabilityError> {
        if !self.mint(g).matches(presented) {
            return Err(CapabilityError::Forged);
        }
        if now_ms > g.expires_ms {
            return Err(CapabilityError::Expired {
                expires_ms: g.expires_ms,
                now_ms,
            });
        }
        Ok(())
    }
}

impl std::fmt::Debug for CapabilityKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CapabilityKey(..)")
    }
}

/// The 128-bit tag a fence record carries: HMAC-SHA256 of the record's bytes under the
/// reservation's capability, so that only a holder of the capability writes a record the decode
/// node accepts.
pub fn record_tag(capability: &Secret, record: &[u8]) -> [u8; 16] {
    let key = hmac::Key::new(hmac::HMAC_SHA256, capability.as_bytes());
    let tag = hmac::sign(&key, record);
    let mut out = [0u8; 16];
    out.copy_from_slice(&tag.as_ref()[..16]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant() -> Grant {
        Grant {
            request: 7,
            generation: 3,
            offset: 4096,
            len: 1 << 20,
            expires_ms: 1_000_000,
        }
    }

    #[test]
    fn a_capability_verifies_only_for_its_grant_key_and_time() {
        let key = CapabilityKey::from_bytes(&[1; 32]);
        let cap = key.mint(&grant());
        assert_eq!(key.verify(&grant(), cap.as_bytes(), 999_999), Ok(()));
        assert_eq!(key.verify(&grant(), cap.as_bytes(), 1_000_000), Ok(()));
        // Any field of the grant changed: another reservation's capability.
        for g in [
            Grant {
                request: 8,
                ..grant()
            },
            Grant {
                generation: 4,
                ..grant()
            },
            Grant {
                offset: 0,
                ..grant()
            },
            Grant { len: 1, ..grant() },
            Grant {
                expires_ms: 2_000_000,
                ..grant()
            },
        ] {
            assert_eq!(
                key.verify(&g, cap.as_bytes(), 0),
                Err(CapabilityError::Forged),
                "{g:?}"
            );
        }
        // Another process's key (a restarted node) or a flipped bit: forged.
        let other = CapabilityKey::from_bytes(&[2; 32]);
        assert_eq!(
            other.verify(&grant(), cap.as_bytes(), 0),
            Err(CapabilityError::Forged)
        );
        let mut flipped = *cap.as_bytes();
        flipped[15] ^= 1;
        assert_eq!(
            key.verify(&grant(), &flipped, 0),
            Err(CapabilityError::Forged)
        );
        assert_eq!(
            key.verify(&grant(), &cap.as_bytes()[..8], 0),
            Err(CapabilityError::Forged)
        );
        // Past its expiry: refused even though genuine.
        assert_eq!(
            key.verify(&grant(), cap.as_bytes(), 1_000_001),
            Err(CapabilityError::Expired {
                expires_ms: 1_000_000,
                now_ms: 1_000_001
            })
        );
        // Random keys differ.
        let (a, b) = (CapabilityKey::random(), CapabilityKey::random());
        assert_ne!(a.mint(&grant()), b.mint(&grant()));
        assert_eq!(format!("{a:?}"), "CapabilityKey(..)");
    }

    #[test]
    fn a_record_tag_depends_on_the_capability_and_every_byte() {
        let key = CapabilityKey::from_bytes(&[1; 32]);
        let cap = key.mint(&grant());
        let other = key.mint(&Grant {
            request: 9,
            ..grant()
        });
        let rec = [5u8; 40];
        let t = record_tag(&cap, &rec);
        assert_eq!(t, record_tag(&cap, &rec));
        assert_ne!(t, record_tag(&other, &rec));
        let mut changed = rec;
        changed[39] ^= 0x80;
        assert_ne!(t, record_tag(&cap, &changed));
    }
}
