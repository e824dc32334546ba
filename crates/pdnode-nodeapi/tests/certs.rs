//! `pdnode certs init`'s code against the TLS loader: the files it writes load as each node's
//! TLS (chain, key, identity), a node later added to the same directory is signed by the CA
//! there, nothing is overwritten without `force`, and a certificate loaded for another node is
//! refused naming the key.

use pdnode_core::{NodeId, Role};
use pdnode_nodeapi::certs::{CertsError, CertsInit, init};
use pdnode_nodeapi::tls::{NodeIdentity, NodeTls, TlsError};
use std::path::Path;

fn req(dir: &Path, cluster: &str, nodes: &[&str], force: bool) -> CertsInit {
    CertsInit {
        dir: dir.to_path_buf(),
        cluster: cluster.into(),
        nodes: nodes.iter().map(|n| n.parse().unwrap()).collect(),
        force,
        days: 30,
    }
}

fn load(dir: &Path, name: &str, cluster: &str, role: Role) -> Result<NodeTls, TlsError> {
    let p = |f: String| dir.join(f).display().to_string();
    NodeTls::load(
        &p("ca.pem".into()),
        &p(format!("{name}.pem")),
        &p(format!("{name}.key")),
        &NodeIdentity::new(cluster, role, NodeId::new(name)),
    )
}

#[test]
fn issued_files_load_as_the_nodes_they_name() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("c");
    let w = init(&req(
        &d,
        "prod",
        &["r:router@10.0.0.1,r.lan", "p:prefill", "d:decode"],
        false,
    ))
    .unwrap();
    assert!(w.new_ca);
    assert_eq!(w.files.len(), 8);
    let t = load(&d, "r", "prod", Role::Router).unwrap();
    assert_eq!(t.identity().uri(), "spiffe://pdnode/prod/router/r");
    load(&d, "p", "prod", Role::Prefill).unwrap();
    load(&d, "d", "prod", Role::Decode).unwrap();

    // The identity is checked: role, id and cluster.
    for (name, cluster, role) in [("p", "prod", Role::Decode), ("p", "test", Role::Prefill)] {
        let e = load(&d, name, cluster, role).unwrap_err();
        assert_eq!(e.key(), Some("security.tls_cert"), "{e}");
        assert!(
            matches!(&e, TlsError::WrongIdentity { issued_for, .. }
                if **issued_for == NodeIdentity::new("prod", Role::Prefill, NodeId::new("p"))),
            "{e}"
        );
    }
    // Another node's key.
    std::fs::copy(d.join("d.key"), d.join("p.key")).unwrap();
    let e = load(&d, "p", "prod", Role::Prefill).unwrap_err();
    assert!(
        matches!(e, TlsError::Config { key, .. } if key == "security.tls_key"),
        "{e}"
    );

    // Nothing is overwritten...
    let e = init(&req(&d, "prod", &["r:router"], false)).unwrap_err();
    assert!(
        matches!(&e, CertsError::Exists { paths } if paths.len() == 2),
        "{e}"
    );
    // ... a new node is signed by the CA there ...
    let ca = std::fs::read(d.join("ca.pem")).unwrap();
    let w = init(&req(&d, "prod", &["d2:decode"], false)).unwrap();
    assert!(!w.new_ca);
    assert_eq!(std::fs::read(d.join("ca.pem")).unwrap(), ca);
    load(&d, "d2", "prod", Role::Decode).unwrap();
    // ... unless it is another cluster's CA: then nothing is written.
    let e = init(&req(&d, "test", &["d3:decode"], false)).unwrap_err();
    assert!(
        matches!(&e, CertsError::CaMismatch { cluster, .. } if cluster == "test"),
        "{e}"
    );
    // With force, a new CA: the old certificates no longer load under it.
    let w = init(&req(&d, "prod", &["r:router"], true)).unwrap();
    assert!(w.new_ca);
    let e = load(&d, "d2", "prod", Role::Decode).unwrap_err();
    assert!(
        matches!(e, TlsError::Config { key, .. } if key == "security.tls_cert"),
        "{e}"
    );
}

#[test]
fn bad_requests_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("c");
    for r in [
        req(&d, "prod", &[], false),
        req(&d, "a/b", &["r:router"], false),
        req(&d, "prod", &["r:router", "r:decode"], false),
    ] {
        assert!(matches!(init(&r), Err(CertsError::Invalid(_))), "{r:?}");
    }
    let mut r = req(&d, "prod", &["r:router"], false);
    r.days = 0;
    assert!(matches!(init(&r), Err(CertsError::Invalid(_))));
    assert!(!d.exists());
}

/// A dangling symbolic link where a key goes counts as a file there (refused without `force`),
/// and no key is written through a link (with `force` either): it would land where it points.
#[cfg(unix)]
#[test]
fn no_key_is_written_through_a_symbolic_link() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let target = d.join("elsewhere.key");
    std::os::unix::fs::symlink(&target, d.join("ca.key")).unwrap();
    let e = init(&req(d, "prod", &["r:router"], false)).unwrap_err();
    assert!(
        matches!(&e, CertsError::Exists { paths } if paths.iter().any(|p| p.ends_with("ca.key"))),
        "{e:?}"
    );
    let e = init(&req(d, "prod", &["r:router"], true)).unwrap_err();
    assert!(e.to_string().contains("symbolic link"), "{e}");
    assert!(!target.exists(), "nothing written where the link points");
}

/// `certs init --etcd`: a server certificate for etcd, signed by the CA in the directory,
/// naming the hosts, for server use only; without a CA (or a host) nothing is written.
#[test]
fn etcd_server_certificate_is_signed_by_the_cluster_ca() {
    use pdnode_nodeapi::certs::{ETCD_SERVER, etcd_server};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("c");
    let hosts = vec!["127.0.0.1".to_string(), "etcd.lan".to_string()];
    let e = etcd_server(&d, "prod", &hosts, 30, false).unwrap_err();
    assert!(matches!(e, CertsError::NoCa { .. }), "{e}");
    init(&req(&d, "prod", &["r:router"], false)).unwrap();
    let e = etcd_server(&d, "prod", &[], 30, false).unwrap_err();
    assert_eq!(e, CertsError::NoEtcdHost);
    let e = etcd_server(&d, "prod", &["a b".to_string()], 30, false).unwrap_err();
    assert!(
        matches!(e, CertsError::NodeBadHost { ref host, .. } if host == "a b"),
        "{e}"
    );
    assert!(!d.join(format!("{ETCD_SERVER}.pem")).exists());

    let files = etcd_server(&d, "prod", &hosts, 30, false).unwrap();
    assert_eq!(
        files,
        [
            d.join(format!("{ETCD_SERVER}.pem")),
            d.join(format!("{ETCD_SERVER}.key"))
        ]
    );
    // It chains to the CA for server use and names the hosts; it is no node.
    let ca = pdnode_core::config::read_pem_certs(d.join("ca.pem").to_str().unwrap()).unwrap();
    let cert = pdnode_core::config::read_pem_certs(files[0].to_str().unwrap())
        .unwrap()
        .remove(0);
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca[0].clone()).unwrap();
    let ee = webpki::EndEntityCert::try_from(&cert).unwrap();
    let algs = rustls::crypto::ring::default_provider()
        .signature_verification_algorithms
        .all;
    let now = rustls::pki_types::UnixTime::now();
    ee.verify_for_usage(
        algs,
        &roots.roots,
        &[],
        now,
        webpki::KeyUsage::server_auth(),
        None,
        None,
    )
    .unwrap();
    assert!(
        ee.verify_for_usage(
            algs,
            &roots.roots,
            &[],
            now,
            webpki::KeyUsage::client_auth(),
            None,
            None
        )
        .is_err(),
        "server use only"
    );
    for host in ["127.0.0.1", "etcd.lan"] {
        let name = rustls::pki_types::ServerName::try_from(host).unwrap();
        ee.verify_is_valid_for_subject_name(&name).unwrap();
    }
    assert_eq!(
        NodeIdentity::of_cert(&cert).unwrap_err(),
        TlsError::NoIdentity
    );
    // Not replaced without force; a node may not take its file names.
    let e = etcd_server(&d, "prod", &hosts, 30, false).unwrap_err();
    assert!(matches!(e, CertsError::Exists { .. }), "{e}");
    etcd_server(&d, "prod", &hosts, 30, true).unwrap();
    assert!(matches!(
        "etcd-server:decode".parse::<pdnode_nodeapi::certs::CertNode>(),
        Err(CertsError::NodeReservedName { .. })
    ));
}
