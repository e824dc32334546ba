//! The files the config names: PEM certificates and keys (`security.tls_*`,
//! `registry.etcd_tls_*`) and secrets (`registry.etcd_password_file`): read once, checked for
//! what they must hold. Plain parsing only (no TLS stack): whether a certificate chains to the
//! CA and names the node is checked where TLS is set up (`pdnode_nodeapi::tls`, etcd-client).

use crate::error::{Classify, ErrorKind};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;

/// Larger than any certificate chain or key file: a bigger file is not what the key names.
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// What is wrong with a file a key names (PEM certificates or a key, a secret). Each variant
/// carries the path as the config gives it; the caller adds the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileError {
    #[error("{path:?}: cannot read: {reason}")]
    Unreadable { path: String, reason: String },
    #[error("{path:?}: not a regular file")]
    NotAFile { path: String },
    #[error(
        "{path:?}: {bytes} bytes, larger than such a file can be ({max}): is it the right file?"
    )]
    TooLarge { path: String, bytes: u64, max: u64 },
    #[error("{path:?}: not valid PEM: {reason}")]
    Malformed { path: String, reason: String },
    #[error("{path:?}: holds no certificate (expected a -----BEGIN CERTIFICATE----- section)")]
    NoCertificate { path: String },
    #[error("{path:?}: holds no private key (expected a -----BEGIN PRIVATE KEY----- section)")]
    NoPrivateKey { path: String },
    /// A secret file whose first line is empty.
    #[error("{path:?}: empty (expected the secret on its first line)")]
    EmptySecret { path: String },
    /// A secret file that is not UTF-8 text.
    #[error("{path:?}: not UTF-8 text")]
    NotText { path: String },
}

impl FileError {
    /// The path the error is about.
    pub fn path(&self) -> &str {
        match self {
            FileError::Unreadable { path, .. }
            | FileError::NotAFile { path }
            | FileError::TooLarge { path, .. }
            | FileError::Malformed { path, .. }
            | FileError::NoCertificate { path }
            | FileError::NoPrivateKey { path }
            | FileError::EmptySecret { path }
            | FileError::NotText { path } => path,
        }
    }
}

impl Classify for FileError {
    /// A file the configuration names is wrong: fixing the file or the key helps, retrying not.
    fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidRequest
    }
}

/// Longest secret file (a password on its first line).
const MAX_SECRET_BYTES: u64 = 4096;

/// The secret on the first line of a file named by a key (a password), without its line end.
/// At most 4 KiB, UTF-8, not empty. A secret is never inline in the config: the effective
/// config is logged.
pub fn read_secret_file(path: &str) -> Result<String, FileError> {
    let bytes = read_limited(path, MAX_SECRET_BYTES)?;
    let text = String::from_utf8(bytes).map_err(|_| FileError::NotText {
        path: path.to_string(),
    })?;
    let line = text.lines().next().unwrap_or("").trim_end_matches('\r');
    if line.is_empty() {
        return Err(FileError::EmptySecret {
            path: path.to_string(),
        });
    }
    Ok(line.to_string())
}

/// The bytes of a PEM file named by a key (`path` as the config gives it), at most 1 MiB.
pub fn read_pem_file(path: &str) -> Result<Vec<u8>, FileError> {
    read_limited(path, MAX_PEM_BYTES)
}

/// The bytes of a regular file of at most `max` bytes (also when the file grows while it is
/// read: at most `max + 1` bytes are read).
pub(crate) fn read_limited(path: &str, max: u64) -> Result<Vec<u8>, FileError> {
    let p = Path::new(path);
    let unreadable = |e: std::io::Error| FileError::Unreadable {
        path: path.to_string(),
        reason: e.to_string(),
    };
    let meta = std::fs::metadata(p).map_err(unreadable)?;
    if !meta.is_file() {
        return Err(FileError::NotAFile {
            path: path.to_string(),
        });
    }
    if meta.len() > max {
        return Err(FileError::TooLarge {
            path: path.to_string(),
            bytes: meta.len(),
            max,
        });
    }
    let mut bytes = Vec::new();
    std::fs::File::open(p)
        .and_then(|f| std::io::Read::read_to_end(&mut std::io::Read::take(f, max + 1), &mut bytes))
        .map_err(unreadable)?;
    if bytes.len() as u64 > max {
        return Err(FileError::TooLarge {
            path: path.to_string(),
            bytes: bytes.len() as u64,
            max,
        });
    }
    Ok(bytes)
}

/// The certificates of a PEM file (`-----BEGIN CERTIFICATE-----` sections, in order; other
/// sections are skipped). At least one.
pub fn read_pem_certs(path: &str) -> Result<Vec<CertificateDer<'static>>, FileError> {
    pem_certs(path, &read_pem_file(path)?)
}

/// [`read_pem_certs`] of bytes already read from `path`.
pub fn pem_certs(path: &str, bytes: &[u8]) -> Result<Vec<CertificateDer<'static>>, FileError> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| FileError::Malformed {
            path: path.to_string(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(FileError::NoCertificate {
            path: path.to_string(),
        });
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1: the first key section).
pub fn read_pem_key(path: &str) -> Result<PrivateKeyDer<'static>, FileError> {
    pem_key(path, &read_pem_file(path)?)
}

/// [`read_pem_key`] of bytes already read from `path`.
pub fn pem_key(path: &str, bytes: &[u8]) -> Result<PrivateKeyDer<'static>, FileError> {
    PrivateKeyDer::from_pem_slice(bytes).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => FileError::NoPrivateKey {
            path: path.to_string(),
        },
        e => FileError::Malformed {
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
            matches!(&e, FileError::Unreadable { path, .. } if path == "/nonexistent/ca.pem"),
            "{e:?}"
        );
        let empty = file("");
        let e = read_pem_certs(empty.path().to_str().unwrap()).unwrap_err();
        assert!(matches!(e, FileError::NoCertificate { .. }), "{e:?}");
        let key_only = file("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n");
        let e = read_pem_certs(key_only.path().to_str().unwrap()).unwrap_err();
        assert!(matches!(e, FileError::NoCertificate { .. }), "{e:?}");
        let cert_only = file("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
        assert_eq!(
            read_pem_certs(cert_only.path().to_str().unwrap())
                .unwrap()
                .len(),
            1
        );
        let e = read_pem_key(cert_only.path().to_str().unwrap()).unwrap_err();
        assert!(matches!(e, FileError::NoPrivateKey { .. }), "{e:?}");
        let broken = file("-----BEGIN CERTIFICATE-----\nAAAA\n");
        let e = read_pem_certs(broken.path().to_str().unwrap()).unwrap_err();
        assert!(matches!(e, FileError::Malformed { .. }), "{e:?}");
        let e = read_pem_certs("/").unwrap_err();
        assert_eq!(e, FileError::NotAFile { path: "/".into() });
        assert_eq!(e.path(), "/");
    }

    #[test]
    fn secrets_are_the_first_line() {
        let f = file("s3cret\nignored\n");
        assert_eq!(
            read_secret_file(f.path().to_str().unwrap()).unwrap(),
            "s3cret"
        );
        let f = file("pw with spaces \r\n");
        assert_eq!(
            read_secret_file(f.path().to_str().unwrap()).unwrap(),
            "pw with spaces "
        );
        for text in ["", "\n", "\nsecond"] {
            let f = file(text);
            let e = read_secret_file(f.path().to_str().unwrap()).unwrap_err();
            assert!(
                matches!(e, FileError::EmptySecret { .. }),
                "{text:?}: {e:?}"
            );
        }
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), [0xff, 0xfe, b'\n']).unwrap();
        let e = read_secret_file(f.path().to_str().unwrap()).unwrap_err();
        assert!(matches!(e, FileError::NotText { .. }), "{e:?}");
        let big = file(&"x".repeat(5000));
        let e = read_secret_file(big.path().to_str().unwrap()).unwrap_err();
        assert!(matches!(e, FileError::TooLarge { max: 4096, .. }), "{e:?}");
    }

    #[test]
    fn a_file_past_the_limit_is_refused_unread() {
        let big = file(&"x".repeat(MAX_PEM_BYTES as usize + 1));
        let e = read_pem_file(big.path().to_str().unwrap()).unwrap_err();
        assert!(
            matches!(e, FileError::TooLarge { bytes, max, .. } if bytes == MAX_PEM_BYTES + 1 && max == MAX_PEM_BYTES),
            "{e:?}"
        );
    }
}
