//! Mutual TLS of the node plane (router -> node, node -> node gRPC), with rustls.
//!
//! Every node holds a certificate signed by the cluster CA (`security.tls_ca`) whose URI SAN is
//! its identity: `spiffe://pdnode/{cluster}/{role}/{node_id}` ([`NodeIdentity`]; `pdnode certs
//! init` issues them, [`crate::certs`]). Both ends check the other against the CA:
//!
//! - the server ([`NodeTls::server_config`]) requires a client certificate that chains to the
//!   CA; each RPC then reads the caller's identity ([`peer_identity`]) and checks its role
//!   ([`NodeRpc::allowed`], [`NodeTls::authorize`]);
//! - a client ([`NodeTls::client_tls`]) presents its certificate and accepts the server only if
//!   its chain ends at the CA and its URI SAN names the node the card describes (cluster, node
//!   id, role). Addresses play no part: a card's `grpc` address may be an IP, a name or a
//!   proxy, and the certificate need not list it (DNS/IP SANs are for other tools).

use pdnode_core::config::{Config, pem_certs, pem_key, read_pem_file};
use pdnode_core::{NodeId, Role};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, TrustAnchor, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// The SPIFFE trust domain of every pdnode identity.
pub const TRUST_DOMAIN: &str = "pdnode";

/// Longest TLS handshake, both ways: a peer that stalls it holds a task no longer.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// What is wrong with the node plane's TLS setup. Each names the config key at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsError {
    #[error("key `{key}`: {reason}")]
    Config { key: &'static str, reason: String },
    /// A PEM file a key names is missing or holds the wrong thing.
    #[error("key `{key}`: {error}")]
    Pem {
        key: &'static str,
        error: pdnode_core::config::FileError,
    },
    /// `security.tls_cert` names another node than this node's config.
    #[error(
        "key `security.tls_cert`: {}",
        wrong_identity(.path, .issued_for, .this_node)
    )]
    WrongIdentity {
        path: String,
        issued_for: Box<NodeIdentity>,
        this_node: Box<NodeIdentity>,
    },
    /// A certificate that is not X.509 rustls can parse.
    #[error("not a certificate rustls can read: {reason}")]
    Unparsable { reason: String },
    /// A certificate with no `spiffe://pdnode/...` URI SAN.
    #[error(
        "names no pdnode node (no URI SAN spiffe://{TRUST_DOMAIN}/{{cluster}}/{{role}}/{{node-id}})"
    )]
    NoIdentity,
    /// A certificate with more than one `spiffe://pdnode/...` URI SAN.
    #[error("names more than one pdnode node (several spiffe://{TRUST_DOMAIN}/ URI SANs)")]
    SeveralIdentities,
    /// A `spiffe://pdnode/` URI SAN not of the form `{cluster}/{role}/{node-id}`.
    #[error("URI SAN {uri:?} is not spiffe://{TRUST_DOMAIN}/{{cluster}}/{{role}}/{{node-id}}")]
    BadIdentity { uri: String },
    /// A certificate chain that does not verify under the CA for a use (`server`, `client`).
    #[error("not valid for {usage} use: {reason}")]
    Chain { usage: &'static str, reason: String },
}

/// Why a certificate is not this node's (the message of [`TlsError::WrongIdentity`] after
/// its key).
pub fn wrong_identity(path: &str, issued_for: &NodeIdentity, this_node: &NodeIdentity) -> String {
    format!(
        "{path:?} was issued for {issued_for} ({}), but this node is {this_node} ({}): node.cluster, node.role and node.id must be what the certificate names",
        issued_for.uri(),
        this_node.uri()
    )
}

impl TlsError {
    /// The config key at fault, where the error is about one.
    pub fn key(&self) -> Option<&'static str> {
        match self {
            TlsError::Config { key, .. } | TlsError::Pem { key, .. } => Some(key),
            TlsError::WrongIdentity { .. } => Some("security.tls_cert"),
            _ => None,
        }
    }
}

impl pdnode_core::error::Classify for TlsError {
    /// Every one is a setup or a peer certificate that is wrong; retrying does not help.
    fn kind(&self) -> pdnode_core::error::ErrorKind {
        pdnode_core::error::ErrorKind::InvalidRequest
    }
}

fn cfg_err(key: &'static str, reason: impl Into<String>) -> TlsError {
    TlsError::Config {
        key,
        reason: reason.into(),
    }
}

/// A node's identity as its certificate states it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeIdentity {
    pub cluster: String,
    pub role: Role,
    pub node_id: NodeId,
}

impl NodeIdentity {
    pub fn new(cluster: impl Into<String>, role: Role, node_id: NodeId) -> Self {
        Self {
            cluster: cluster.into(),
            role,
            node_id,
        }
    }

    /// `spiffe://pdnode/{cluster}/{role}/{node_id}`.
    pub fn uri(&self) -> String {
        format!(
            "spiffe://{TRUST_DOMAIN}/{}/{}/{}",
            self.cluster, self.role, self.node_id
        )
    }

    /// Parses [`Self::uri`]'s form: `None` for anything else (another trust domain, a missing or
    /// extra segment, a segment that is not a valid cluster or node id, an unknown role).
    pub fn parse(uri: &str) -> Option<Self> {
        let rest = uri.strip_prefix("spiffe://")?.strip_prefix(TRUST_DOMAIN)?;
        let rest = rest.strip_prefix('/')?;
        let mut parts = rest.split('/');
        let (cluster, role, id) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let cluster_ok = NodeId::new(cluster).is_valid();
        let node_id = NodeId::new(id);
        if !cluster_ok || !node_id.is_valid() {
            return None;
        }
        Some(Self {
            cluster: cluster.to_string(),
            role: role.parse().ok()?,
            node_id,
        })
    }

    /// The identity a certificate names: its one `spiffe://pdnode/...` URI SAN. Checks nothing
    /// else (the chain is checked by the TLS handshake).
    pub fn of_cert(der: &CertificateDer<'_>) -> Result<Self, TlsError> {
        let cert = webpki::EndEntityCert::try_from(der).map_err(|e| TlsError::Unparsable {
            reason: e.to_string(),
        })?;
        let prefix = format!("spiffe://{TRUST_DOMAIN}/");
        let mut found = cert.valid_uri_names().filter(|u| u.starts_with(&prefix));
        let uri = found.next().ok_or(TlsError::NoIdentity)?;
        if found.next().is_some() {
            return Err(TlsError::SeveralIdentities);
        }
        Self::parse(uri).ok_or_else(|| TlsError::BadIdentity {
            uri: uri.to_string(),
        })
    }
}

impl fmt::Display for NodeIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} node {} of cluster {}",
            self.role, self.node_id, self.cluster
        )
    }
}

/// The RPCs of `pdnode.v1.Node`, for the role check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeRpc {
    ReserveKv,
    Prefill,
    Decode,
    KvDone,
    Abort,
    Migrate,
    Drain,
    Stats,
    Health,
}

impl NodeRpc {
    pub fn name(self) -> &'static str {
        match self {
            NodeRpc::ReserveKv => "ReserveKv",
            NodeRpc::Prefill => "Prefill",
            NodeRpc::Decode => "Decode",
            NodeRpc::KvDone => "KvDone",
            NodeRpc::Abort => "Abort",
            NodeRpc::Migrate => "Migrate",
            NodeRpc::Drain => "Drain",
            NodeRpc::Stats => "Stats",
            NodeRpc::Health => "Health",
        }
    }

    /// Who may call it. The data path (ReserveKv, Prefill, Decode, KvDone, Abort, Migrate) is driven by
    /// the router alone: routers and all-in-one nodes (which hold a router). No node calls
    /// another node's API: prefill pushes KV to decode over UCX, decode never calls prefill.
    /// Drain (a graceful shutdown, `pdnode drain`) is an operator's call, made with a router's
    /// identity. Stats and Health (load and liveness, no request data) are open to every
    /// cluster node.
    pub fn allowed(self, caller: Role) -> bool {
        match self {
            NodeRpc::ReserveKv
            | NodeRpc::Prefill
            | NodeRpc::Decode
            | NodeRpc::KvDone
            | NodeRpc::Abort
            | NodeRpc::Migrate
            | NodeRpc::Drain => matches!(caller, Role::Router | Role::All),
            NodeRpc::Stats | NodeRpc::Health => true,
        }
    }
}

/// The identity of the caller of a request that came over mutual TLS: `UNAUTHENTICATED` when
/// the connection carried no client certificate (not TLS), or one that names no node.
pub fn peer_identity<T>(req: &tonic::Request<T>) -> Result<NodeIdentity, tonic::Status> {
    let certs = req.peer_certs().ok_or_else(|| {
        tonic::Status::unauthenticated("no client certificate: the node API needs mutual TLS")
    })?;
    let leaf = certs.first().ok_or_else(|| {
        tonic::Status::unauthenticated("no client certificate: the node API needs mutual TLS")
    })?;
    NodeIdentity::of_cert(leaf)
        .map_err(|e| tonic::Status::unauthenticated(format!("the client certificate {e}")))
}

/// A node's TLS material, checked: the CA, its certificate chain and key, and the identity the
/// certificate names (which is this node's config: cluster, role, id). Cheap to clone.
#[derive(Clone)]
pub struct NodeTls {
    inner: Arc<Inner>,
}

struct Inner {
    identity: NodeIdentity,
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
}

impl fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeTls")
            .field("identity", &self.inner.identity)
            .finish_non_exhaustive()
    }
}

impl NodeTls {
    /// The node plane's TLS from `security.tls_*`, or `None` when they are not set. Checks what
    /// config validation cannot: the CA is a usable trust anchor, the certificate chains to it
    /// and is valid now for both server and client use, the key is the certificate's, and the
    /// certificate names this node (`node.cluster`, `node.role`, `node.id`).
    pub fn from_config(cfg: &Config) -> Result<Option<Self>, TlsError> {
        let s = &cfg.security;
        if !s.node_tls() {
            return Ok(None);
        }
        let expect = NodeIdentity::new(
            cfg.node.cluster.clone(),
            cfg.node.role,
            NodeId::new(cfg.node.id.clone()),
        );
        Self::load(&s.tls_ca, &s.tls_cert, &s.tls_key, &expect).map(Some)
    }

    /// [`Self::from_config`] from the three paths and the identity the certificate must name.
    pub fn load(
        ca_path: &str,
        cert_path: &str,
        key_path: &str,
        expect: &NodeIdentity,
    ) -> Result<Self, TlsError> {
        const CA: &str = "security.tls_ca";
        const CERT: &str = "security.tls_cert";
        const KEY: &str = "security.tls_key";
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        // tonic's server builds its rustls config with the process default provider; make it
        // ring (the one compiled in) unless the process chose one already.
        let _ = rustls::crypto::ring::default_provider().install_default();

        let pem = |key| move |error| TlsError::Pem { key, error };
        let ca_pem = read_pem_file(ca_path).map_err(pem(CA))?;
        let cert_pem = read_pem_file(cert_path).map_err(pem(CERT))?;
        let key_pem = read_pem_file(key_path).map_err(pem(KEY))?;
        let ca = pem_certs(ca_path, &ca_pem).map_err(pem(CA))?;
        let chain = pem_certs(cert_path, &cert_pem).map_err(pem(CERT))?;
        let key = pem_key(key_path, &key_pem).map_err(pem(KEY))?;

        let mut roots = RootCertStore::empty();
        for c in ca {
            roots
                .add(c)
                .map_err(|e| cfg_err(CA, format!("{ca_path:?}: not a CA certificate: {e}")))?;
        }
        let leaf = &chain[0];
        let identity =
            NodeIdentity::of_cert(leaf).map_err(|e| cfg_err(CERT, format!("{cert_path:?} {e}")))?;
        if &identity != expect {
            return Err(TlsError::WrongIdentity {
                path: cert_path.to_string(),
                issued_for: Box::new(identity),
                this_node: Box::new(expect.clone()),
            });
        }
        verify_chain(&provider, &roots.roots, leaf, &chain[1..], "server")
            .and_then(|()| verify_chain(&provider, &roots.roots, leaf, &chain[1..], "client"))
        .map_err(|e| {
            cfg_err(
                CERT,
                format!("{cert_path:?} is not valid under the CA {ca_path:?} for a node (server and client use): {e}"),
            )
        })?;
        rustls::sign::CertifiedKey::from_der(chain.clone(), key, &provider).map_err(|e| {
            cfg_err(
                KEY,
                format!("{key_path:?} is not the key of {cert_path:?}: {e}"),
            )
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                identity,
                ca_pem,
                cert_pem,
                key_pem,
                roots: Arc::new(roots),
                provider,
            }),
        })
    }

    /// This node's identity (what its certificate names).
    pub fn identity(&self) -> &NodeIdentity {
        &self.inner.identity
    }

    /// For the node gRPC server: present this node's certificate, require a client certificate
    /// that chains to the CA.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(
                &self.inner.cert_pem,
                &self.inner.key_pem,
            ))
            .client_ca_root(Certificate::from_pem(&self.inner.ca_pem))
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// For a channel to the node `expect` (from its card): present this node's certificate;
    /// accept the server only if it chains to the CA and names `expect`'s cluster and id and a
    /// role [`role_serves`] `expect.role`. Use with `Endpoint::tls_config_with_verifier` and an
    /// `https://` URI.
    pub fn client_tls(
        &self,
        expect: NodeIdentity,
    ) -> (ClientTlsConfig, Arc<dyn ServerCertVerifier>) {
        let cfg = ClientTlsConfig::new()
            .identity(Identity::from_pem(
                &self.inner.cert_pem,
                &self.inner.key_pem,
            ))
            .timeout(HANDSHAKE_TIMEOUT);
        let v = NodeServerVerifier {
            roots: self.inner.roots.clone(),
            provider: self.inner.provider.clone(),
            expect,
        };
        (cfg, Arc::new(v))
    }

    /// Whether `caller` may call `rpc` on this node: same cluster and a role
    /// [`NodeRpc::allowed`] lets in. `PERMISSION_DENIED` naming the caller's role otherwise.
    pub fn authorize(&self, rpc: NodeRpc, caller: &NodeIdentity) -> Result<(), tonic::Status> {
        if caller.cluster != self.inner.identity.cluster {
            return Err(tonic::Status::permission_denied(format!(
                "pdnode.v1.Node/{}: the caller's certificate names cluster {:?} ({caller}); this node serves cluster {:?}",
                rpc.name(),
                caller.cluster,
                self.inner.identity.cluster
            )));
        }
        if !rpc.allowed(caller.role) {
            return Err(tonic::Status::permission_denied(format!(
                "pdnode.v1.Node/{}: the caller's certificate names role {} ({caller}); only routers (role router or all) may call it",
                rpc.name(),
                caller.role
            )));
        }
        Ok(())
    }
}

/// Whether a certificate of role `cert` may answer for a card of role `card`: the same role, or
/// `all` for a `router` card (an in-process all-in-one node registers as a router).
pub fn role_serves(cert: Role, card: Role) -> bool {
    cert == card || (card == Role::Router && cert == Role::All)
}

/// Whether `leaf` (with `intermediates`) chains to `roots` for `usage` (`"server"` or
/// `"client"`).
fn verify_chain(
    provider: &CryptoProvider,
    roots: &[TrustAnchor<'static>],
    leaf: &CertificateDer<'_>,
    intermediates: &[CertificateDer<'_>],
    usage: &'static str,
) -> Result<(), TlsError> {
    let chain_err = |e: webpki::Error| TlsError::Chain {
        usage,
        reason: e.to_string(),
    };
    let key_usage = if usage == "server" {
        webpki::KeyUsage::server_auth()
    } else {
        webpki::KeyUsage::client_auth()
    };
    let ee = webpki::EndEntityCert::try_from(leaf).map_err(chain_err)?;
    ee.verify_for_usage(
        provider.signature_verification_algorithms.all,
        roots,
        intermediates,
        UnixTime::now(),
        key_usage,
        None,
        None,
    )
    .map(|_| ())
    .map_err(chain_err)
}

/// Accepts a node server whose chain ends at the cluster CA and whose certificate names the
/// node the client meant to reach. The TLS server name (the card's address) is not used.
#[derive(Debug)]
struct NodeServerVerifier {
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
    expect: NodeIdentity,
}

impl ServerCertVerifier for NodeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        let got = NodeIdentity::of_cert(end_entity)
            .map_err(|e| rustls::Error::General(format!("the node's certificate {e}")))?;
        let e = &self.expect;
        if got.cluster != e.cluster || got.node_id != e.node_id || !role_serves(got.role, e.role) {
            return Err(rustls::Error::General(format!(
                "the server's certificate names {got}, not the {e} this connection is for"
            )));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_uri_round_trips_and_rejects_the_rest() {
        let id = NodeIdentity::new("prod", Role::Prefill, NodeId::new("p-1"));
        assert_eq!(id.uri(), "spiffe://pdnode/prod/prefill/p-1");
        assert_eq!(NodeIdentity::parse(&id.uri()), Some(id));
        for bad in [
            "spiffe://other/prod/prefill/p-1",
            "spiffe://pdnode/prod/prefill",
            "spiffe://pdnode/prod/prefill/p-1/x",
            "spiffe://pdnode/prod/boss/p-1",
            "spiffe://pdnode//prefill/p-1",
            "spiffe://pdnode/prod/prefill/",
            "spiffe://pdnodex/prod/prefill/p-1",
            "https://pdnode/prod/prefill/p-1",
            "",
        ] {
            assert_eq!(NodeIdentity::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn only_routers_drive_the_data_path() {
        for rpc in [
            NodeRpc::ReserveKv,
            NodeRpc::Prefill,
            NodeRpc::Decode,
            NodeRpc::KvDone,
            NodeRpc::Abort,
            NodeRpc::Migrate,
            NodeRpc::Drain,
        ] {
            assert!(
                rpc.allowed(Role::Router) && rpc.allowed(Role::All),
                "{rpc:?}"
            );
            assert!(
                !rpc.allowed(Role::Prefill) && !rpc.allowed(Role::Decode),
                "{rpc:?}"
            );
        }
        for rpc in [NodeRpc::Stats, NodeRpc::Health] {
            for r in [Role::Router, Role::All, Role::Prefill, Role::Decode] {
                assert!(rpc.allowed(r), "{rpc:?} {r}");
            }
        }
        assert!(role_serves(Role::All, Role::Router));
        assert!(!role_serves(Role::Router, Role::All));
        assert!(!role_serves(Role::Prefill, Role::Decode));
    }
}
