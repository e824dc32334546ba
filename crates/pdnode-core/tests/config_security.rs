//! The security keys: the node API's TLS files and `allow_insecure`, and etcd's TLS and auth
//! (`registry.etcd_*`): each checked, naming its key and file.

use crate::common;

use common::{FILE, errors};
use pdnode_core::config::{ConfigError, FileError, load_from_str};

/// Without the TLS keys a `node.listen` beyond loopback needs `security.allow_insecure` (the
/// node API would be plaintext and unauthenticated); on loopback it does not.
#[test]
fn a_node_api_beyond_loopback_needs_allow_insecure() {
    let node = |listen: &str| {
        format!(
            "[node]\nrole = \"prefill\"\nlisten = \"{listen}\"\n[registry]\nkind = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\n[transfer]\nkind = \"ucx\"\n"
        )
    };
    for ok in [
        "127.0.0.1:7001",
        "127.1.2.3:0",
        "[::1]:7001",
        "localhost:7001",
    ] {
        load_from_str(FILE, &node(ok), &[]).unwrap_or_else(|e| panic!("{ok}: {e:?}"));
    }
    for open in [
        "0.0.0.0:7001",
        "10.0.0.5:7001",
        "[::]:7001",
        "node-b.example:7001",
    ] {
        let errs = errors(&node(open), &[]);
        assert!(
            errs.iter().any(|e| e.key() == Some("node.listen")
                && e.to_string().contains("security.allow_insecure")),
            "{open}: {errs:?}"
        );
        load_from_str(
            FILE,
            &node(open),
            &["security.allow_insecure=true".to_string()],
        )
        .unwrap_or_else(|e| panic!("{open} with allow_insecure: {e:?}"));
    }
    // A router in front of SGLang workers serves no node API: nothing to refuse.
    let sg = "[node]\nrole = \"router\"\nlisten = \"0.0.0.0:7000\"\n[registry]\nkind = \"memory\"\n\
              [[router.sglang.prefill]]\nurl = \"http://10.0.0.1:30000\"\n\
              [[router.sglang.decode]]\nurl = \"http://10.0.0.2:30000\"\n";
    load_from_str(FILE, sg, &[]).unwrap();
}

/// `security.tls_ca/tls_cert/tls_key`: all three or none, each a readable PEM file of its kind;
/// with them the node needs an id (the certificate names it), may listen beyond loopback, and
/// `allow_insecure` would do nothing (refused).
#[test]
fn tls_keys_come_together_and_name_readable_pem_files() {
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("node.pem");
    std::fs::write(
        &cert,
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let key = dir.path().join("node.key");
    std::fs::write(
        &key,
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let node = "[node]\nrole = \"prefill\"\nlisten = \"0.0.0.0:7001\"\n[registry]\nkind = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\n[transfer]\nkind = \"ucx\"\n";
    let tls = |ca: &str, c: &str, k: &str| {
        vec![
            format!("security.tls_ca={ca:?}"),
            format!("security.tls_cert={c:?}"),
            format!("security.tls_key={k:?}"),
        ]
    };
    let keys_of = |errs: &[ConfigError]| -> Vec<String> {
        errs.iter()
            .filter_map(|e| e.key().map(String::from))
            .collect()
    };

    // One of three: the other two are named as missing.
    let errors = |text: &str, v: Vec<String>| {
        let v: Vec<&str> = v.iter().map(String::as_str).collect();
        errors(text, &v)
    };
    let errs = errors(
        node,
        vec![
            format!("security.tls_cert={cert:?}"),
            "node.id=\"p\"".into(),
        ],
    );
    let keys = keys_of(&errs);
    assert!(keys.contains(&"security.tls_ca".to_string()), "{errs:?}");
    assert!(keys.contains(&"security.tls_key".to_string()), "{errs:?}");
    assert!(
        errs.iter().any(|e| e.to_string().contains("missing")),
        "{errs:?}"
    );

    // All three, well formed, with an id: a node beyond loopback starts without allow_insecure.
    let mut ok = tls(&cert, &cert, &key);
    ok.push("node.id=\"prefill-b\"".into());
    let l = load_from_str(FILE, node, &ok).unwrap_or_else(|e| panic!("{e:?}"));
    assert!(l.config.security.node_tls());

    // Files that are missing or of the wrong kind: each named by its key.
    let mut bad = tls("/nonexistent/ca.pem", &key, &cert);
    bad.push("node.id=\"prefill-b\"".into());
    let errs = errors(node, bad);
    let file_error = |k: &str| {
        errs.iter().find_map(|e| match e {
            ConfigError::BadFile { key, error, .. } if key == k => Some(error.clone()),
            _ => None,
        })
    };
    assert!(
        matches!(file_error("security.tls_ca"), Some(FileError::Unreadable { path, .. }) if path == "/nonexistent/ca.pem"),
        "{errs:?}"
    );
    assert!(
        matches!(
            file_error("security.tls_cert"),
            Some(FileError::NoCertificate { .. })
        ),
        "{errs:?}"
    );
    assert!(
        matches!(
            file_error("security.tls_key"),
            Some(FileError::NoPrivateKey { .. })
        ),
        "{errs:?}"
    );

    // No node.id: the certificate names one.
    let errs = errors(node, tls(&cert, &cert, &key));
    assert!(keys_of(&errs).contains(&"node.id".to_string()), "{errs:?}");

    // allow_insecure beside TLS would do nothing.
    let mut both = ok.clone();
    both.push("security.allow_insecure=true".into());
    let errs = errors(node, both);
    assert_eq!(keys_of(&errs), ["security.allow_insecure"], "{errs:?}");
}

/// A hand-off's stall allowance divides by the minimum rate: 0 is refused, naming the key.
#[test]
fn the_stall_rate_must_be_positive() {
    let errs = errors("[transfer]\nstall_min_rate_mibps = 0\n", &[]);
    assert!(
        errs.iter()
            .any(|e| matches!(e, ConfigError::Invalid { key, .. }
            if key == "transfer.stall_min_rate_mibps")),
        "{errs:?}"
    );
    let l = load_from_str(
        FILE,
        "[transfer]\nstall_ms = 250\nstall_min_rate_mibps = 40\n",
        &[],
    )
    .unwrap();
    assert_eq!(
        (
            l.config.transfer.stall_ms,
            l.config.transfer.stall_min_rate_mibps
        ),
        (250, 40)
    );
}

/// `registry.etcd_*`: TLS needs a CA and https:// endpoints, a client certificate its key, a
/// user its password file (never inline), a password no plaintext link beyond loopback; every
/// file is read and checked, each error names its key; with `memory` they are refused.
#[test]
fn etcd_tls_and_auth_keys_are_checked_and_name_their_key() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let cert = write(
        "c.pem",
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
    );
    let key = write(
        "c.key",
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    );
    let pw = write("pw", "s3cret\n");
    let empty_pw = write("empty", "\n");
    let router = |endpoints: &str| {
        format!("[node]\nrole = \"router\"\n[registry]\nkind = \"etcd\"\nendpoints = {endpoints}\n")
    };
    let https = router("[\"https://10.0.0.10:2379\"]");
    let keys = |errs: &[ConfigError]| -> Vec<String> {
        errs.iter()
            .filter_map(|e| e.key().map(String::from))
            .collect()
    };

    // The full set loads, and every key lands where it says.
    let full = [
        format!("registry.etcd_tls_ca={cert:?}"),
        format!("registry.etcd_tls_cert={cert:?}"),
        format!("registry.etcd_tls_key={key:?}"),
        "registry.etcd_user=\"pdnode\"".to_string(),
        format!("registry.etcd_password_file={pw:?}"),
    ];
    let l = load_from_str(FILE, &https, &full).unwrap_or_else(|e| panic!("{e:?}"));
    let r = &l.config.registry;
    assert_eq!(
        (r.etcd_tls_ca.as_str(), r.etcd_tls_cert.as_str()),
        (cert.as_str(), cert.as_str())
    );
    assert_eq!(r.etcd_tls_key, key);
    assert_eq!(r.etcd_user, "pdnode");
    assert_eq!(r.etcd_password_file, pw);
    assert!(r.etcd_tls());
    // The password itself is in no key: the effective config does not show it.
    assert!(!l.effective_toml().contains("s3cret"));
    let e = errors(&https, &["registry.etcd_password=\"x\""]);
    assert!(
        matches!(&e[0], ConfigError::UnknownKey { key, .. } if key == "registry.etcd_password"),
        "{e:?}"
    );

    // https:// without a CA; a CA with http://; mixed schemes.
    let e = errors(&https, &[]);
    assert_eq!(keys(&e), ["registry.etcd_tls_ca"], "{e:?}");
    let e = errors(
        &router("[\"http://10.0.0.10:2379\"]"),
        &[&format!("registry.etcd_tls_ca={cert:?}")],
    );
    assert_eq!(keys(&e), ["registry.endpoints"], "{e:?}");
    let e = errors(
        &router("[\"https://10.0.0.10:2379\", \"http://10.0.0.11:2379\"]"),
        &[&format!("registry.etcd_tls_ca={cert:?}")],
    );
    assert!(keys(&e).iter().all(|k| k == "registry.endpoints"), "{e:?}");
    // A certificate without its key (and the other way round), or without a CA.
    let e = errors(
        &https,
        &[
            &format!("registry.etcd_tls_ca={cert:?}"),
            &format!("registry.etcd_tls_cert={cert:?}"),
        ],
    );
    assert_eq!(keys(&e), ["registry.etcd_tls_key"], "{e:?}");
    let e = errors(
        &https,
        &[
            &format!("registry.etcd_tls_ca={cert:?}"),
            &format!("registry.etcd_tls_key={key:?}"),
        ],
    );
    assert_eq!(keys(&e), ["registry.etcd_tls_cert"], "{e:?}");
    // Files that are missing or of the wrong kind: BadFile naming the key.
    let e = errors(
        &https,
        &[
            "registry.etcd_tls_ca=\"/nonexistent/ca.pem\"",
            &format!("registry.etcd_tls_cert={key:?}"),
            &format!("registry.etcd_tls_key={cert:?}"),
            "registry.etcd_user=\"pdnode\"",
            &format!("registry.etcd_password_file={empty_pw:?}"),
        ],
    );
    let bad_file = |k: &str| {
        e.iter().find_map(|x| match x {
            ConfigError::BadFile { key, error, .. } if key == k => Some(error.clone()),
            _ => None,
        })
    };
    assert!(
        matches!(
            bad_file("registry.etcd_tls_ca"),
            Some(FileError::Unreadable { .. })
        ),
        "{e:?}"
    );
    assert!(
        matches!(
            bad_file("registry.etcd_tls_cert"),
            Some(FileError::NoCertificate { .. })
        ),
        "{e:?}"
    );
    assert!(
        matches!(
            bad_file("registry.etcd_tls_key"),
            Some(FileError::NoPrivateKey { .. })
        ),
        "{e:?}"
    );
    assert!(
        matches!(
            bad_file("registry.etcd_password_file"),
            Some(FileError::EmptySecret { .. })
        ),
        "{e:?}"
    );
    assert_eq!(e.len(), 4, "{e:?}");
    // A user needs its password file, and a password file its user.
    let e = errors(
        &router("[\"http://127.0.0.1:2379\"]"),
        &["registry.etcd_user=\"pdnode\""],
    );
    assert_eq!(keys(&e), ["registry.etcd_password_file"], "{e:?}");
    let e = errors(
        &router("[\"http://127.0.0.1:2379\"]"),
        &[&format!("registry.etcd_password_file={pw:?}")],
    );
    assert_eq!(keys(&e), ["registry.etcd_user"], "{e:?}");
    // A password over plaintext: on loopback only.
    let creds = [
        "registry.etcd_user=\"pdnode\"".to_string(),
        format!("registry.etcd_password_file={pw:?}"),
    ];
    load_from_str(FILE, &router("[\"http://127.0.0.1:2379\"]"), &creds)
        .unwrap_or_else(|e| panic!("{e:?}"));
    let creds: Vec<&str> = creds.iter().map(String::as_str).collect();
    let e = errors(&router("[\"http://10.0.0.10:2379\"]"), &creds);
    assert_eq!(keys(&e), ["registry.etcd_user"], "{e:?}");
    // With the memory registry they would do nothing.
    let e = errors(
        "[node]\nrole = \"all\"\n",
        &["registry.etcd_user=\"pdnode\""],
    );
    assert_eq!(keys(&e), ["registry.etcd_user"], "{e:?}");
}

/// A KV plane on a network (UCX beyond loopback) needs `security.trusted_kv_network`: UCX
/// authenticates no one. Loopback needs nothing, and the key where there is no such plane would do
/// nothing (refused).
#[test]
fn a_kv_plane_beyond_loopback_needs_trusted_kv_network() {
    let node = |role: &str, devices: &str| {
        format!(
            "[node]\nrole = \"{role}\"\nlisten = \"127.0.0.1:7001\"\n[registry]\nkind = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\n[transfer]\nkind = \"ucx\"\nucx_net_devices = \"{devices}\"\n"
        )
    };
    let trusted = ["security.trusted_kv_network=true".to_string()];
    let keys = |errs: &[ConfigError]| -> Vec<String> {
        errs.iter()
            .filter_map(|e| e.key().map(str::to_string))
            .collect()
    };
    for role in ["prefill", "decode"] {
        load_from_str(FILE, &node(role, "lo"), &[]).unwrap_or_else(|e| panic!("{role}: {e:?}"));
        load_from_str(FILE, &node(role, " lo , lo"), &[]).unwrap();
        for open in ["eth0", "mlx5_0:1", "lo,eth0", "all", ""] {
            let errs = errors(&node(role, open), &[]);
            assert!(
                errs.iter()
                    .any(|e| e.key() == Some("transfer.ucx_net_devices")
                        && e.to_string().contains("security.trusted_kv_network")),
                "{role} {open:?}: {errs:?}"
            );
            load_from_str(FILE, &node(role, open), &trusted)
                .unwrap_or_else(|e| panic!("{role} {open:?} trusted: {e:?}"));
        }
        let errs = errors(&node(role, "lo"), &["security.trusted_kv_network=true"]);
        assert_eq!(keys(&errs), ["security.trusted_kv_network"], "{errs:?}");
    }
    // One process (in-process hand-off): no KV plane at all.
    let all = "[node]\nrole = \"all\"\n";
    load_from_str(FILE, all, &[]).unwrap();
    assert_eq!(
        keys(&errors(all, &["security.trusted_kv_network=true"])),
        ["security.trusted_kv_network"]
    );
}
