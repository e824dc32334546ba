//! The PEM files the config names (`security.tls_*`): read once, checked for what they must
//! hold. Plain parsing only (no TLS stack): whether a certificate chains to the CA and names
//! the node is checked where TLS is set up (`pdnode_nodeapi::tls`).

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;

/// Larger than any certificate chain or key file: a bigger file is not what the key names.
const MAX_PEM_BYTES: u64 = 1 << 20;

/// The bytes of a PEM file named by a key (`path` as the config gives it), at most 1 MiB.
pub fn read_pem_file(path: &str) -> Result<Vec<u8>, String> {
    let p = Path::new(path);
    let meta = std::fs::metadata(p).map_err(|e| format!("{path:?}: cannot read: {e}"))?;
    if !meta.is_file() {
        return Err(format!("{path:?}: not a regular file"));
    }
    if meta.len() > MAX_PEM_BYTES {
        return Err(format!(
            "{path:?}: {} bytes, larger than a PEM file of certificates or a key can be ({MAX_PEM_BYTES})",
            meta.len()
        ));
    }
    std::fs::read(p).map_err(|e| format!("{path:?}: cannot read: {e}"))
}

/// The certificates of a PEM file (`-----BEGIN CERTIFICATE-----` sections, in order; other
/// sections are skipped). At least one.
pub fn read_pem_certs(path: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    pem_certs(path, &read_pem_file(path)?)
}

/// [`read_pem_certs`] of bytes already read from `path`.
pub fn pem_certs(path: &str, bytes: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{path:?}: not valid PEM: {e}"))?;
    if certs.is_empty() {
        return Err(format!(
            "{path:?}: holds no certificate (expected a -----BEGIN CERTIFICATE----- section)"
        ));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1: the first key section).
pub fn read_pem_key(path: &str) -> Result<PrivateKeyDer<'static>, String> {
    pem_key(path, &read_pem_file(path)?)
}

/// [`read_pem_key`] of bytes already read from `path`.
pub fn pem_key(path: &str, bytes: &[u8]) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(bytes).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => format!(
            "{path:?}: holds no private key (expected a -----BEGIN PRIVATE KEY----- section)"
        ),
        e => format!("{path:?}: not valid PEM: {e}"),
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
        assert!(e.contains("cannot read"), "{e}");
        let empty = file("");
        let e = read_pem_certs(empty.path().to_str().unwrap()).unwrap_err();
        assert!(e.contains("no certificate"), "{e}");
        let key_only = file("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n");
        let e = read_pem_certs(key_only.path().to_str().unwrap()).unwrap_err();
        assert!(e.contains("no certificate"), "{e}");
        let cert_only = file("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
        assert_eq!(
            read_pem_certs(cert_only.path().to_str().unwrap())
                .unwrap()
                .len(),
            1
        );
        let e = read_pem_key(cert_only.path().to_str().unwrap()).unwrap_err();
        assert!(e.contains("no private key"), "{e}");
        let broken = file("-----BEGIN CERTIFICATE-----\nAAAA\n");
        let e = read_pem_certs(broken.path().to_str().unwrap()).unwrap_err();
        assert!(e.contains("not valid PEM"), "{e}");
        let e = read_pem_certs("/").unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
    }
}
