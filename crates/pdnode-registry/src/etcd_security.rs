//! How the etcd client checks etcd and proves itself to it: TLS (the CA etcd's certificate
//! must chain to, a client certificate for etcd's `--client-cert-auth`) and an etcd user whose
//! password is read from a file, all from `registry.etcd_*`.
//!
//! Auth tokens: etcd hands out a token at `Authenticate` that expires (simple tokens after
//! `--auth-token-ttl`, 300 s by default, counted from their last use). The client asks
//! etcd-client to re-authenticate and retry a call refused for an expired token
//! (`with_auto_token_refresh`); lease keepalives are not checked against the token by etcd,
//! and a watch is checked when it is created (a re-created watch goes through the refresh).

use crate::RegistryError;
use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};
use pdnode_core::config::{RegistryConfig, pem_certs, pem_key, read_pem_file, read_secret_file};
use std::fmt;

const ENDPOINTS: &str = "registry.endpoints";
const CA: &str = "registry.etcd_tls_ca";
const CERT: &str = "registry.etcd_tls_cert";
const KEY: &str = "registry.etcd_tls_key";
const USER: &str = "registry.etcd_user";
const PASSWORD_FILE: &str = "registry.etcd_password_file";

/// TLS material and credentials of the etcd client, read and checked. Cheap to clone; `Debug`
/// never shows the password.
#[derive(Clone, Default)]
pub struct EtcdSecurity {
    tls: Option<TlsFiles>,
    user: Option<(String, String)>,
}

#[derive(Clone)]
struct TlsFiles {
    ca_pem: Vec<u8>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for EtcdSecurity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdSecurity")
            .field("tls", &self.tls.is_some())
            .field(
                "client_cert",
                &self.tls.as_ref().is_some_and(|t| t.identity.is_some()),
            )
            .field("user", &self.user.as_ref().map(|(u, _)| u.as_str()))
            .finish()
    }
}

impl EtcdSecurity {
    /// No TLS, no credentials: plaintext `http://` etcd without auth.
    pub fn none() -> Self {
        Self::default()
    }

    /// Reads and checks the files `registry.etcd_*` name. Errors name the key: a file that
    /// is missing or holds the wrong thing, a certificate without its key, a user without a
    /// password, `https://` endpoints without a CA, TLS keys with `http://` endpoints.
    pub fn from_config(c: &RegistryConfig) -> Result<Self, RegistryError> {
        let file = |key| move |error| RegistryError::BadFile { key, error };
        let bad = |key, reason: &str| RegistryError::BadConfig {
            key,
            reason: reason.to_string(),
        };
        let https = c.endpoints.iter().any(|e| e.starts_with("https://"));
        let http = c.endpoints.iter().any(|e| e.starts_with("http://"));
        let tls = if c.etcd_tls_ca.is_empty() {
            if !c.etcd_tls_cert.is_empty() || !c.etcd_tls_key.is_empty() {
                return Err(bad(
                    CA,
                    "empty, but registry.etcd_tls_cert/etcd_tls_key are set: etcd TLS needs the CA that etcd's certificate chains to",
                ));
            }
            if https {
                return Err(bad(
                    CA,
                    "empty, but registry.endpoints are https://: set the CA that etcd's certificate chains to (system roots are not used; for a public CA name the system bundle, e.g. /etc/ssl/certs/ca-certificates.crt)",
                ));
            }
            None
        } else {
            if http {
                return Err(bad(
                    ENDPOINTS,
                    "http:// endpoints with registry.etcd_tls_ca set: use https:// (or host:port) endpoints for etcd TLS",
                ));
            }
            let ca_pem = read_pem_file(&c.etcd_tls_ca).map_err(file(CA))?;
            pem_certs(&c.etcd_tls_ca, &ca_pem).map_err(file(CA))?;
            let identity = match (c.etcd_tls_cert.is_empty(), c.etcd_tls_key.is_empty()) {
                (true, true) => None,
                (false, false) => {
                    let cert = read_pem_file(&c.etcd_tls_cert).map_err(file(CERT))?;
                    pem_certs(&c.etcd_tls_cert, &cert).map_err(file(CERT))?;
                    let key = read_pem_file(&c.etcd_tls_key).map_err(file(KEY))?;
                    pem_key(&c.etcd_tls_key, &key).map_err(file(KEY))?;
                    Some((cert, key))
                }
                (true, false) => {
                    return Err(bad(CERT, "missing: registry.etcd_tls_key is set"));
                }
                (false, true) => {
                    return Err(bad(KEY, "missing: registry.etcd_tls_cert is set"));
                }
            };
            Some(TlsFiles { ca_pem, identity })
        };
        let user = match (c.etcd_user.is_empty(), c.etcd_password_file.is_empty()) {
            (true, true) => None,
            (false, false) => {
                let password =
                    read_secret_file(&c.etcd_password_file).map_err(file(PASSWORD_FILE))?;
                Some((c.etcd_user.clone(), password))
            }
            (false, true) => {
                return Err(bad(
                    PASSWORD_FILE,
                    "missing: registry.etcd_user needs the file holding its password",
                ));
            }
            (true, false) => {
                return Err(bad(USER, "missing: registry.etcd_password_file is set"));
            }
        };
        Ok(Self { tls, user })
    }

    /// The etcd user the client authenticates as; empty: none.
    pub fn user(&self) -> &str {
        self.user.as_ref().map_or("", |(u, _)| u.as_str())
    }

    /// Whether the client uses TLS.
    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }

    /// `co` with the TLS options and the credentials (and the token refresh they need).
    pub(crate) fn apply(&self, mut co: ConnectOptions) -> ConnectOptions {
        if let Some(t) = &self.tls {
            let mut o = TlsOptions::new().ca_certificate(Certificate::from_pem(&t.ca_pem));
            if let Some((cert, key)) = &t.identity {
                o = o.identity(Identity::from_pem(cert, key));
            }
            co = co.with_tls(o);
        }
        if let Some((user, password)) = &self.user {
            co = co
                .with_user(user.clone(), password.clone())
                .with_auto_token_refresh(true);
        }
        co
    }
}
