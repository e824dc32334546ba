//! The per-request secret: 128 random bits minted by decode with the reservation; every later
//! message about the reservation must present it.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Secret([u8; 16]);

impl Secret {
    pub fn random() -> Self {
        Secret(rand::random())
    }

    /// A secret from exactly 16 bytes (a capability, `crate::capability`).
    pub fn from_array(b: [u8; 16]) -> Self {
        Secret(b)
    }

    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        b.try_into().ok().map(Secret)
    }

    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Constant-time comparison with presented bytes (any length).
    pub fn matches(&self, presented: &[u8]) -> bool {
        if presented.len() != self.0.len() {
            return false;
        }
        self.0
            .iter()
            .zip(presented)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_random_and_compared_exactly() {
        let a = Secret::random();
        let b = Secret::random();
        assert_ne!(a, b);
        assert!(a.matches(a.as_bytes()));
        assert!(!a.matches(b.as_bytes()));
        assert!(!a.matches(&a.as_bytes()[..15]));
        assert_eq!(format!("{a:?}"), "Secret(..)");
        assert_eq!(Secret::from_bytes(a.as_bytes()), Some(a));
        assert!(Secret::from_bytes(&[1, 2]).is_none());
    }
}
