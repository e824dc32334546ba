//! The `registry.etcd_*` keys: TLS, client certificates, credentials.

use super::super::pem::FileError;
use super::super::schema::*;

/// The `registry.etcd_*` keys (registry.kind = "etcd"): TLS needs a CA and `https://` (or
/// bare `host:port`) endpoints, a client certificate comes with its key, a user with a password
/// file, and a password does not cross the network in the clear. Returns the files that are
/// not what their key needs.
pub(super) fn validate_etcd_security(
    r: &RegistryConfig,
    bad: &mut dyn FnMut(&str, String),
) -> Vec<(&'static str, FileError)> {
    let mut files = Vec::new();
    let https = r.endpoints.iter().any(|e| e.starts_with("https://"));
    let http = r.endpoints.iter().any(|e| e.starts_with("http://"));
    if https && http {
        bad(
            "registry.endpoints",
            format!(
                "{:?} mixes http:// and https://: one etcd cluster is reached one way",
                r.endpoints
            ),
        );
    }
    let cert = !r.etcd_tls_cert.is_empty();
    let key = !r.etcd_tls_key.is_empty();
    if r.etcd_tls_ca.is_empty() {
        if https {
            bad(
                "registry.etcd_tls_ca",
                "empty, but registry.endpoints are https://: set the CA that etcd's server certificate chains to (system roots are not used; for a public CA name the system bundle, e.g. /etc/ssl/certs/ca-certificates.crt)".into(),
            );
        } else if cert || key {
            bad(
                "registry.etcd_tls_ca",
                "empty, but registry.etcd_tls_cert/etcd_tls_key are set: etcd TLS needs the CA that etcd's server certificate chains to, and https:// endpoints".into(),
            );
        }
    } else {
        if http {
            bad(
                "registry.endpoints",
                format!(
                    "{:?}: http:// with registry.etcd_tls_ca set; use https:// endpoints for etcd TLS",
                    r.endpoints
                ),
            );
        }
        if let Err(e) = super::super::pem::read_pem_certs(&r.etcd_tls_ca) {
            files.push(("registry.etcd_tls_ca", e));
        }
    }
    if cert != key {
        let (missing, set) = if cert {
            ("registry.etcd_tls_key", "registry.etcd_tls_cert")
        } else {
            ("registry.etcd_tls_cert", "registry.etcd_tls_key")
        };
        bad(
            missing,
            format!("missing: {set} is set; the client certificate for etcd needs both"),
        );
    }
    if cert && let Err(e) = super::super::pem::read_pem_certs(&r.etcd_tls_cert) {
        files.push(("registry.etcd_tls_cert", e));
    }
    if key && let Err(e) = super::super::pem::read_pem_key(&r.etcd_tls_key) {
        files.push(("registry.etcd_tls_key", e));
    }
    let user = !r.etcd_user.is_empty();
    let password = !r.etcd_password_file.is_empty();
    if user && !password {
        bad(
            "registry.etcd_password_file",
            "missing: registry.etcd_user needs the file holding its password".into(),
        );
    }
    if password && !user {
        bad(
            "registry.etcd_user",
            "missing: registry.etcd_password_file is set, but not the user it is the password of"
                .into(),
        );
    }
    if password && let Err(e) = super::super::pem::read_secret_file(&r.etcd_password_file) {
        files.push(("registry.etcd_password_file", e));
    }
    // etcd's Authenticate carries the password as is: over plaintext only on loopback.
    if user && !r.etcd_tls() && !r.endpoints.iter().all(|e| endpoint_is_loopback(e)) {
        bad(
            "registry.etcd_user",
            format!(
                "set with plaintext endpoints {:?}: the password would cross the network in the clear; use https:// endpoints with registry.etcd_tls_ca (or etcd on loopback)",
                r.endpoints
            ),
        );
    }
    files
}

/// Whether an etcd endpoint URL (`http://host:port`, `host:port`) names a loopback host.
fn endpoint_is_loopback(e: &str) -> bool {
    let rest = e
        .strip_prefix("http://")
        .or_else(|| e.strip_prefix("https://"))
        .unwrap_or(e);
    let host_port = rest.split('/').next().unwrap_or(rest);
    is_loopback_listen(host_port)
}
