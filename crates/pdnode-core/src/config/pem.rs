//! The PEM files the config names (`security.tls_*`): read once, checked for what they must
//! hold. Plain parsing only (no TLS stack): whether a certificate chains to the CA and names
//! the node is checked where TLS is set up (`pdnode_nodeapi::tls`).

use crate::error::{Classify, ErrorKind};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;

/// Larger than any certificate chain or key file: a bigger file is not what the key names.
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// What is wrong with a PEM file a key names. Each variant carries the path as the config
/// gives it; the caller adds the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PemError {
    #[error("{path:?}: cannot read: {reason}")]
    Unreadable { path: String, reason: String },
    #[error("{path:?}: not a regular file")]
    NotAFile { path: String },
    #[error(
        "{path:?}: {bytes} bytes, larger than a PEM file of certificates or a key can be ({max})"
    )]
    TooLarge { path: String, bytes: u64, max: u64 },
    #[error("{path:?}: not valid PEM: {reason}")]
    Malformed { path: String, reason: String },
    #[error("{path:?}: holds no certificate (expected a -----BEGIN CERTIFICATE----- section)")]
    NoCertificate { path: String },
    #[error("{path:?}: holds no private key (expected a -----BEGIN PRIVATE KEY----- section)")]
    NoPrivateKey { path: String },
}

impl PemError {
    /// The path the error is about.
    pub fn path(&self) -> &str {
        match self {
            PemError::Unreadable { path, .. }
            | PemError::NotAFile { path }
            | PemError::TooLarge { path, .. }
            | PemError::Malformed { path, .. }
            | PemError::NoCertificate { path }
            | PemError::NoPrivateKey { path } => path,
        }
    }
}

impl Classify for PemError {
    /// A file the configuration names is wrong: fixing the file or the key helps, retrying not.
    fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidRequest
    }
}

/// The bytes of a PEM file named by a key (`path` as the config gives it), at most 1 MiB.
pub fn read_pem_file(path: &str) -> Result<Vec<u8>, PemError> {
    let p = Path::new(path);
    let unreadable = |e: std::io::Error| PemError::Unreadable {
        path: path.to_string(),
        reason: e.to_string(),
    };
    let meta = std::fs::metadata(p).map_err(unreadable)?;
    if !meta.is_file() {
        return Err(PemError::NotAFile {
            path: path.to_string(),
        });
    }
    if meta.len() > MAX_PEM_BYTES {
        return Err(PemError::TooLarge {
            path: path.to_string(),
            bytes: meta.len(),
            max: MAX_PEM_BYTES,
        });
    }
    std::fs::read(p).map_err(unreadable)
}

/// The certificates of a PEM file (`-----BEGIN CERTIFICATE-----` sections, in order; other
/// sections are skipped). At least one.
pub fn read_pem_certs(path: &str) -> Result<Vec<CertificateDer<'static>>, PemError> {
    pem_certs(path, &read_pem_file(path)?)
}

/// [`read_pem_certs`] of bytes already read from `path`.
pub fn pem_certs(path: &str, bytes: &[u8]) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PemError::Malformed {
            path: path.to_string(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(PemError::NoCertificate {
            path: path.to_string(),
        });
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1: the first key section).
pub fn read_pem_key(path: &str) -> Result<PrivateKeyDer<'static>, PemError> {
    pem_key(path, &read_pem_file(path)?)
}

/// [`read_pem_key`] of bytes already read from `path`.
pub fn pem_key(path: &str, bytes: &[u8]) -> Result<PrivateKeyDer<'static>, PemError> {
    PrivateKeyDer::from_pem_slice(bytes).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => PemError::NoPrivateKey {
            path: path.to_string(),
        },
        e => PemError::Malformed {
            path: path.to_string(),
            reason: e.to_string(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    #[test]
    fn missing_empty_and_wrong_kind_are_errors() {
        let e = read_pem_certs("/nonexistent/ca.pem").unwrap_err();
        assert!(
            matches!(&e, PemError::Unreadable { path, .. } if path == "/nonexistent/ca.pem"),
            "{e:?}"
        );
        let empty = file("");
        let e = read_pem_certs(empty.path().to_str().unwrap()).unwrap_err();
        assert!(matches!(e, PemError::NoCertificate { .. }), "{e:?}");
        let key_only = file("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n");
        let e = read_pem_certs(key_only.path().to_str().unwrap()).unwrap_err();
        assert!(matches!(e, PemError::NoCertificate { .. }), "{e:?}");
        let cert_only = file("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
        assert_eq!(
            read_pem_certs(cert_only.path().to_str().unwrap())
                .unwrap()
                .len(),
            1
        );
        let e = read_pem_key(cert_only.path().to_str().unwrap()).unwrap_err();
        assert!(matches!(e, PemError::NoPrivateKey { .. }), "{e:?}");
        let broken = file("-----BEGIN CERTIFICATE-----\nAAAA\n");
        let e = read_pem_certs(broken.path().to_str().unwrap()).unwrap_err();
        assert!(matches!(e, PemError::Malformed { .. }), "{e:?}");
        let e = read_pem_certs("/").unwrap_err();
        assert_eq!(e, PemError::NotAFile { path: "/".into() });
        assert_eq!(e.path(), "/");
    }

    #[test]
    fn a_file_past_the_limit_is_refused_unread() {
        let big = file(&"x".repeat(MAX_PEM_BYTES as usize + 1));
        let e = read_pem_file(big.path().to_str().unwrap()).unwrap_err();
        assert!(
            matches!(e, PemError::TooLarge { bytes, max, .. } if bytes == MAX_PEM_BYTES + 1 && max == MAX_PEM_BYTES),
            "{e:?}"
        );
    }
}
