//! `pdnode certs init`: a cluster CA and one certificate per node, for a quick secure start
//! (tests generate theirs through the same code).
//!
//! Each node certificate carries the URI SAN `spiffe://pdnode/{cluster}/{role}/{name}` (its
//! identity, [`crate::tls::NodeIdentity`]; `name` is the node's `node.id`), the DNS names and IP
//! addresses given after `@` (for tools that check a host name; pdnode itself checks the URI
//! SAN), and both extended key usages (every node is a server and, as a router, a client).
//! Keys are ECDSA P-256, written with mode 0600.

use crate::tls::NodeIdentity;
use pdnode_core::{NodeId, Role};
use rcgen::string::Ia5String;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use std::fmt;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// Default validity of the CA and the node certificates, days.
pub const DEFAULT_DAYS: u32 = 3650;

/// The syntax `--node` takes, for the errors that quote it.
const NODE_SYNTAX: &str = "expected NAME:ROLE[@HOST[,HOST...]], e.g. prefill-b:prefill@10.0.0.2";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CertsError {
    #[error("{0}")]
    Invalid(String),
    #[error(
        "would overwrite {}: pass --force to replace them",
        .paths.iter().map(|p| format!("{:?}", p.display().to_string())).collect::<Vec<_>>().join(", ")
    )]
    Exists { paths: Vec<PathBuf> },
    #[error("{path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{source}")]
    Pem {
        #[from]
        source: pdnode_core::config::FileError,
    },
    #[error("cannot generate a certificate: {0}")]
    Generate(String),
    /// `--etcd` without a CA in the directory (and no `--node` to make one).
    #[error(
        "no cluster CA in {}: {} and {} are needed to sign the etcd certificate (pass --node too, to make them)",
        .dir.display(),
        .dir.join("ca.pem").display(),
        .dir.join("ca.key").display()
    )]
    NoCa { dir: PathBuf },
    /// `--etcd` with no host: etcd's certificate must name the address clients dial.
    #[error("--etcd: no host given (expected HOST[,HOST...], e.g. 10.0.0.10,etcd.lan)")]
    NoEtcdHost,
    /// A `--node` without `:ROLE`.
    #[error("{spec:?}: no role: {NODE_SYNTAX}")]
    NodeNoRole { spec: String },
    #[error(
        "{spec:?}: node name {name:?}: expected 1-128 of [A-Za-z0-9._-] (it is the node's node.id)"
    )]
    NodeBadName { spec: String, name: String },
    /// A node name that would collide with the CA's (or another set's) file names.
    #[error("{spec:?}: {name:?} names other files in the directory; pick another node name")]
    NodeReservedName { spec: String, name: String },
    #[error("{spec:?}: {reason}")]
    NodeBadRole { spec: String, reason: String },
    #[error("{spec:?}: host {host:?} is neither an IP address nor a DNS name: {NODE_SYNTAX}")]
    NodeBadHost { spec: String, host: String },
    /// A certificate the CA in the directory signed does not verify under that CA's
    /// certificate (the key and the certificate are not a pair, or `--cluster` is not theirs).
    #[error(
        "{} and {} do not sign for cluster {cluster:?} (made for another cluster, or not by pdnode certs init?): {reason}",
        .ca_pem.display(),
        .ca_key.display()
    )]
    CaMismatch {
        ca_pem: PathBuf,
        ca_key: PathBuf,
        cluster: String,
        reason: String,
    },
}

fn io_err(path: &Path, e: impl fmt::Display) -> CertsError {
    CertsError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

fn gen_err(e: impl fmt::Display) -> CertsError {
    CertsError::Generate(e.to_string())
}

/// One node to certify: `NAME:ROLE[@HOST[,HOST...]]`, e.g. `router-a:router@10.0.0.1,router-a.lan`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertNode {
    /// The node's `node.id`; also the file names `NAME.pem`, `NAME.key`.
    pub name: NodeId,
    pub role: Role,
    /// DNS names and IP addresses added as SANs.
    pub hosts: Vec<String>,
}

impl FromStr for CertNode {
    type Err = CertsError;
    fn from_str(s: &str) -> Result<Self, CertsError> {
        let spec = || s.to_string();
        let (node, hosts) = match s.split_once('@') {
            Some((n, h)) => (n, Some(h)),
            None => (s, None),
        };
        let (name, role) = node
            .split_once(':')
            .ok_or_else(|| CertsError::NodeNoRole { spec: spec() })?;
        let name = NodeId::new(name);
        if !name.is_valid() {
            return Err(CertsError::NodeBadName {
                spec: spec(),
                name: name.as_str().to_string(),
            });
        }
        if RESERVED_NAMES.contains(&name.as_str()) {
            return Err(CertsError::NodeReservedName {
                spec: spec(),
                name: name.as_str().to_string(),
            });
        }
        let role: Role = role.parse().map_err(|reason| CertsError::NodeBadRole {
            spec: spec(),
            reason,
        })?;
        let mut out = Vec::new();
        if let Some(h) = hosts {
            for host in h.split(',') {
                if !is_host(host) {
                    return Err(CertsError::NodeBadHost {
                        spec: spec(),
                        host: host.to_string(),
                    });
                }
                out.push(host.to_string());
            }
        }
        Ok(CertNode {
            name,
            role,
            hosts: out,
        })
    }
}

/// Node names whose files would be other files of the directory (`ca.pem`, ...).
const RESERVED_NAMES: &[&str] = &["ca", ETCD_SERVER];

/// The file stem of the etcd server certificate [`etcd_server`] writes.
pub const ETCD_SERVER: &str = "etcd-server";

/// An IP address or a DNS name (letters, digits, `-`, `.`; at most 253).
fn is_host(host: &str) -> bool {
    host.parse::<std::net::IpAddr>().is_ok()
        || (!host.is_empty()
            && host.len() <= 253
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.'))
}

/// What `pdnode certs init` does.
#[derive(Debug, Clone)]
pub struct CertsInit {
    pub dir: PathBuf,
    pub cluster: String,
    pub nodes: Vec<CertNode>,
    /// Replace files that exist (a new CA too).
    pub force: bool,
    /// Validity of new certificates, days from today (they are valid from yesterday: clocks
    /// differ).
    pub days: u32,
}

/// What [`init`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertsWritten {
    /// The CA was made now (`false`: an existing `ca.pem`/`ca.key` signed the new nodes).
    pub new_ca: bool,
    pub files: Vec<PathBuf>,
}

/// Writes `DIR/ca.pem`, `DIR/ca.key` and `DIR/NAME.pem`, `DIR/NAME.key` per node. Without
/// `force` no existing file is replaced: a CA already in `DIR` (both files) signs the new
/// nodes instead of a new one (to add nodes to a cluster later), and a node whose files exist
/// is an error.
pub fn init(req: &CertsInit) -> Result<CertsWritten, CertsError> {
    if !NodeId::new(req.cluster.clone()).is_valid() {
        return Err(CertsError::Invalid(format!(
            "cluster {:?}: expected 1-128 of [A-Za-z0-9._-] (node.cluster)",
            req.cluster
        )));
    }
    if req.nodes.is_empty() {
        return Err(CertsError::Invalid(
            "no --node given: nothing to certify".into(),
        ));
    }
    if req.days == 0 || req.days > 36_500 {
        return Err(CertsError::Invalid(format!(
            "--days {}: expected 1 to 36500",
            req.days
        )));
    }
    let mut seen = std::collections::HashSet::new();
    for n in &req.nodes {
        if !seen.insert(n.name.as_str()) {
            return Err(CertsError::Invalid(format!(
                "node {} is given twice",
                n.name
            )));
        }
    }
    let dir = &req.dir;
    let ca_pem = dir.join("ca.pem");
    let ca_key = dir.join("ca.key");
    let reuse_ca = !req.force && ca_pem.exists() && ca_key.exists();
    if !req.force {
        let mut exists: Vec<PathBuf> = req
            .nodes
            .iter()
            .flat_map(|n| node_files(dir, n))
            .filter(|p| present(p))
            .collect();
        if !reuse_ca {
            exists.extend(
                [&ca_pem, &ca_key]
                    .into_iter()
                    .filter(|p| present(p))
                    .cloned(),
            );
        }
        if !exists.is_empty() {
            return Err(CertsError::Exists { paths: exists });
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;

    let validity = Validity::days(req.days)?;
    let ca_params = ca_params(&req.cluster, validity);
    let mut files = Vec::new();
    let issuer = if reuse_ca {
        let key_text = std::fs::read_to_string(&ca_key).map_err(|e| io_err(&ca_key, e))?;
        let key = KeyPair::from_pem(&key_text)
            .map_err(|e| io_err(&ca_key, format!("not a key rcgen can use: {e}")))?;
        Issuer::new(ca_params, key)
    } else {
        let key = KeyPair::generate().map_err(gen_err)?;
        let ca = ca_params.self_signed(&key).map_err(gen_err)?;
        write_file(&ca_pem, ca.pem().as_bytes(), 0o644)?;
        write_file(&ca_key, key.serialize_pem().as_bytes(), 0o600)?;
        files.extend([ca_pem.clone(), ca_key.clone()]);
        Issuer::new(ca_params, key)
    };
    let ca_certs = if reuse_ca {
        Some(pdnode_core::config::read_pem_certs(
            &ca_pem.display().to_string(),
        )?)
    } else {
        None
    };

    for n in &req.nodes {
        let identity = NodeIdentity::new(req.cluster.clone(), n.role, n.name.clone());
        let params = node_params(n, &identity, validity)?;
        let key = KeyPair::generate().map_err(gen_err)?;
        let cert = params.signed_by(&key, &issuer).map_err(gen_err)?;
        if let Some(ca) = &ca_certs {
            // The CA's key and the name rebuilt from --cluster must be those of ca.pem.
            check_signed_by(cert.der(), ca, webpki::KeyUsage::client_auth(), |reason| {
                CertsError::CaMismatch {
                    ca_pem: ca_pem.clone(),
                    ca_key: ca_key.clone(),
                    cluster: req.cluster.clone(),
                    reason,
                }
            })?;
        }
        let [pem, keyf] = node_files(dir, n);
        write_file(&pem, cert.pem().as_bytes(), 0o644)?;
        write_file(&keyf, key.serialize_pem().as_bytes(), 0o600)?;
        files.extend([pem, keyf]);
    }
    Ok(CertsWritten {
        new_ca: !reuse_ca,
        files,
    })
}

/// Writes `DIR/etcd-server.pem` and `DIR/etcd-server.key`: a certificate for etcd's client
/// port (`--cert-file`, `--key-file`; `--trusted-ca-file DIR/ca.pem` then accepts the nodes'
/// certificates as client certificates), signed by the cluster CA already in `DIR` ([`init`]
/// makes it), naming `hosts` (IP addresses and DNS names clients dial), for server use only.
/// Existing files are replaced only with `force`.
pub fn etcd_server(
    dir: &Path,
    cluster: &str,
    hosts: &[String],
    days: u32,
    force: bool,
) -> Result<Vec<PathBuf>, CertsError> {
    if hosts.is_empty() {
        return Err(CertsError::NoEtcdHost);
    }
    for h in hosts {
        if !is_host(h) {
            return Err(CertsError::NodeBadHost {
                spec: format!("--etcd {}", hosts.join(",")),
                host: h.clone(),
            });
        }
    }
    if days == 0 || days > 36_500 {
        return Err(CertsError::Invalid(format!(
            "--days {days}: expected 1 to 36500"
        )));
    }
    let (ca_pem, ca_key) = (dir.join("ca.pem"), dir.join("ca.key"));
    if !ca_pem.exists() || !ca_key.exists() {
        return Err(CertsError::NoCa {
            dir: dir.to_path_buf(),
        });
    }
    let pem = dir.join(format!("{ETCD_SERVER}.pem"));
    let keyf = dir.join(format!("{ETCD_SERVER}.key"));
    if !force {
        let exists: Vec<PathBuf> = [&pem, &keyf]
            .into_iter()
            .filter(|p| p.exists())
            .cloned()
            .collect();
        if !exists.is_empty() {
            return Err(CertsError::Exists { paths: exists });
        }
    }
    let validity = Validity::days(days)?;
    let key_text = std::fs::read_to_string(&ca_key).map_err(|e| io_err(&ca_key, e))?;
    let ca_keypair = KeyPair::from_pem(&key_text)
        .map_err(|e| io_err(&ca_key, format!("not a key rcgen can use: {e}")))?;
    let issuer = Issuer::new(ca_params(cluster, validity), ca_keypair);
    let ca_certs = pdnode_core::config::read_pem_certs(&ca_pem.display().to_string())?;

    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "pdnode");
    dn.push(
        DnType::CommonName,
        format!("etcd of pdnode cluster {cluster}"),
    );
    p.distinguished_name = dn;
    for h in hosts {
        p.subject_alt_names
            .push(match h.parse::<std::net::IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(Ia5String::try_from(h.clone()).map_err(gen_err)?),
            });
    }
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    validity.apply(&mut p);
    let key = KeyPair::generate().map_err(gen_err)?;
    let cert = p.signed_by(&key, &issuer).map_err(gen_err)?;
    check_signed_by(
        cert.der(),
        &ca_certs,
        webpki::KeyUsage::server_auth(),
        |reason| CertsError::CaMismatch {
            ca_pem: ca_pem.clone(),
            ca_key: ca_key.clone(),
            cluster: cluster.to_string(),
            reason,
        },
    )?;
    write_file(&pem, cert.pem().as_bytes(), 0o644)?;
    write_file(&keyf, key.serialize_pem().as_bytes(), 0o600)?;
    Ok(vec![pem, keyf])
}

fn node_files(dir: &Path, n: &CertNode) -> [PathBuf; 2] {
    [
        dir.join(format!("{}.pem", n.name)),
        dir.join(format!("{}.key", n.name)),
    ]
}

fn ca_params(cluster: &str, validity: Validity) -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "pdnode");
    dn.push(DnType::CommonName, format!("pdnode cluster {cluster} CA"));
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity.apply(&mut p);
    p
}

fn node_params(
    n: &CertNode,
    identity: &NodeIdentity,
    validity: Validity,
) -> Result<CertificateParams, CertsError> {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "pdnode");
    dn.push(DnType::CommonName, n.name.as_str());
    p.distinguished_name = dn;
    let uri = Ia5String::try_from(identity.uri()).map_err(gen_err)?;
    p.subject_alt_names.push(SanType::URI(uri));
    for h in &n.hosts {
        p.subject_alt_names
            .push(match h.parse::<std::net::IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(Ia5String::try_from(h.clone()).map_err(gen_err)?),
            });
    }
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    validity.apply(&mut p);
    Ok(p)
}

/// Whether `cert` chains to `ca` for client use; `mismatch` turns webpki's reason into the
/// error that names the files ([`CertsError::CaMismatch`]).
fn check_signed_by(
    cert: &rustls::pki_types::CertificateDer<'_>,
    ca: &[rustls::pki_types::CertificateDer<'static>],
    usage: webpki::KeyUsage,
    mismatch: impl Fn(String) -> CertsError,
) -> Result<(), CertsError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in ca {
        roots.add(c.clone()).map_err(|e| mismatch(e.to_string()))?;
    }
    let ee = webpki::EndEntityCert::try_from(cert).map_err(|e| mismatch(e.to_string()))?;
    ee.verify_for_usage(
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .all,
        &roots.roots,
        &[],
        rustls::pki_types::UnixTime::now(),
        usage,
        None,
        None,
    )
    .map(|_| ())
    .map_err(|e| mismatch(e.to_string()))
}

/// The validity of new certificates: UTC dates, from yesterday (clocks differ) to `days` after
/// today.
#[derive(Debug, Clone, Copy)]
struct Validity {
    from: (i32, u8, u8),
    to: (i32, u8, u8),
}

impl Validity {
    fn days(days: u32) -> Result<Self, CertsError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_err(|e| CertsError::Generate(format!("the clock is before 1970: {e}")))?;
        let today = (now.as_secs() / 86_400) as i64;
        Ok(Self {
            from: civil_from_days(today - 1),
            to: civil_from_days(today + i64::from(days)),
        })
    }

    fn apply(self, p: &mut CertificateParams) {
        p.not_before = rcgen::date_time_ymd(self.from.0, self.from.1, self.from.2);
        p.not_after = rcgen::date_time_ymd(self.to.0, self.to.1, self.to.2);
    }
}

/// The proleptic Gregorian date of day `z` since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i32, u8, u8) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    (y as i32, m as u8, d as u8)
}

/// Something is at `path`: a file, or a symbolic link even when it points nowhere
/// (`Path::exists` says no for a dangling one, and a write would follow it).
fn present(path: &Path) -> bool {
    path.symlink_metadata().is_ok()
}

fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), CertsError> {
    // A key written through a link would land wherever it points.
    if path
        .symlink_metadata()
        .is_ok_and(|m| m.file_type().is_symlink())
    {
        return Err(io_err(
            path,
            std::io::Error::other("a symbolic link: not written through"),
        ));
    }
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        o.mode(mode);
    }
    let mut f = o.open(path).map_err(|e| io_err(path, e))?;
    // `mode` applies to new files only: a replaced (--force) file gets it here.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        f.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(|e| io_err(path, e))?;
    }
    #[cfg(not(unix))]
    let _ = mode;
    f.write_all(bytes).map_err(|e| io_err(path, e))?;
    f.sync_all().map_err(|e| io_err(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_syntax() {
        let n: CertNode = "r1:router@127.0.0.1,r1.lan,::1".parse().unwrap();
        assert_eq!(n.name, NodeId::new("r1"));
        assert_eq!(n.role, Role::Router);
        assert_eq!(n.hosts, ["127.0.0.1", "r1.lan", "::1"]);
        let n: CertNode = "p-1:prefill".parse().unwrap();
        assert!(n.hosts.is_empty());
        let err = |s: &str| s.parse::<CertNode>().unwrap_err();
        assert!(matches!(err("p1"), CertsError::NodeNoRole { spec } if spec == "p1"));
        assert!(matches!(err("p1:boss"), CertsError::NodeBadRole { .. }));
        assert!(matches!(err(":prefill"), CertsError::NodeBadName { name, .. } if name.is_empty()));
        assert!(
            matches!(err("a/b:prefill"), CertsError::NodeBadName { name, .. } if name == "a/b")
        );
        assert!(
            matches!(err("ca:router"), CertsError::NodeReservedName { name, .. } if name == "ca")
        );
        assert!(
            matches!(err("p1:prefill@"), CertsError::NodeBadHost { host, .. } if host.is_empty())
        );
        assert!(
            matches!(err("p1:prefill@a b"), CertsError::NodeBadHost { host, .. } if host == "a b")
        );
        assert!(
            matches!(err("p1:prefill@x,,y"), CertsError::NodeBadHost { host, .. } if host.is_empty())
        );
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_454), (2026, 1, 1));
    }
}
