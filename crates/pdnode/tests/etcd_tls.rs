//! `pdnode start`, `pdnode nodes` and `pdnode check-config` with `registry.etcd_*`: a prefill
//! node (simulated engine) registers in a real etcd with TLS (`--client-cert-auth`) and auth on,
//! `pdnode nodes` lists it as a read-only user; a node whose etcd user may only read does not
//! start (exit 1, naming the key); a missing etcd file is a config error (exit 2, naming the key).

use pdnode_nodeapi::certs::{self, CertsInit};
use pdnode_testkit::{
    ChildGuard, EtcdAccess, EtcdOptions, EtcdServer, EtcdTls, EtcdUser, skip_etcd_tests, wait_for,
};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_pdnode");

fn pki(dir: &Path) {
    certs::init(&CertsInit {
        dir: dir.join("certs"),
        cluster: "sec".into(),
        nodes: ["p1:prefill", "d1:decode", "r1:router"]
            .iter()
            .map(|n| n.parse().unwrap())
            .collect(),
        force: false,
        days: 30,
    })
    .unwrap();
    certs::etcd_server(
        &dir.join("certs"),
        "sec",
        &["127.0.0.1".to_string()],
        30,
        false,
    )
    .unwrap();
    std::fs::write(dir.join("writer.pw"), "writer-secret\n").unwrap();
    std::fs::write(dir.join("reader.pw"), "reader-secret\n").unwrap();
}

fn etcd(dir: &Path) -> EtcdServer {
    let c = dir.join("certs");
    let etcd = EtcdServer::start_with(EtcdOptions {
        tls: Some(EtcdTls {
            ca: c.join("ca.pem"),
            cert: c.join("etcd-server.pem"),
            key: c.join("etcd-server.key"),
            client_cert_auth: true,
            server_ca: c.join("ca.pem"),
            admin_cert: Some((c.join("r1.pem"), c.join("r1.key"))),
        }),
        auth_token_ttl_s: None,
    })
    .expect("etcd with TLS");
    let user = |name: &str, pw: &str, access| EtcdUser {
        name: name.into(),
        password: pw.into(),
        prefix: "pdnode/".into(),
        access,
    };
    etcd.enable_auth(
        "root-secret",
        &[
            user("writer", "writer-secret", EtcdAccess::ReadWrite),
            user("reader", "reader-secret", EtcdAccess::Read),
        ],
    )
    .expect("etcd auth");
    etcd
}

/// A config of node `id` (role `role`) reaching `endpoint` as `user` (password file
/// `{user}.pw`) with the node's own certificate.
fn config(dir: &Path, endpoint: &str, role: &str, id: &str, user: &str) -> PathBuf {
    let c = dir.join("certs");
    let engine = if role == "router" {
        "[engine]\nbackend = \"mock\"\n"
    } else {
        "[engine]\nbackend = \"mock\"\n[transfer]\nkind = \"ucx\"\n"
    };
    let text = format!(
        "[node]\nrole = \"{role}\"\ncluster = \"sec\"\nid = \"{id}\"\nlisten = \"127.0.0.1:0\"\n\
         drain_timeout_s = 2\n\
         [registry]\nkind = \"etcd\"\nendpoints = [\"{endpoint}\"]\nlease_ttl_s = 3\ntimeout_ms = 1000\n\
         etcd_tls_ca = {ca:?}\netcd_tls_cert = {cert:?}\netcd_tls_key = {key:?}\n\
         etcd_user = \"{user}\"\netcd_password_file = {pw:?}\n\
         [model]\nformat = \"dummy\"\npreset = \"smollm2-135m\"\n{engine}",
        ca = c.join("ca.pem").display().to_string(),
        cert = c.join(format!("{id}.pem")).display().to_string(),
        key = c.join(format!("{id}.key")).display().to_string(),
        pw = dir.join(format!("{user}.pw")).display().to_string(),
    );
    let p = dir.join(format!("{id}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn start(dir: &Path, cfg: &Path, name: &str) -> (ChildGuard, PathBuf) {
    let log = dir.join(format!("{name}.log"));
    let f = std::fs::File::create(&log).unwrap();
    let child = Command::new(BIN)
        .arg("start")
        .arg("--config")
        .arg(cfg)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .spawn()
        .expect("spawn pdnode start");
    (ChildGuard::new(name, child), log)
}

fn listed(router_cfg: &Path) -> Vec<String> {
    let out = Command::new(BIN)
        .args(["nodes", "--json", "--config"])
        .arg(router_cfg)
        .env_remove("RUST_LOG")
        .output()
        .expect("pdnode nodes");
    if !out.status.success() {
        return Vec::new();
    }
    serde_json::from_slice::<serde_json::Value>(&out.stdout)
        .ok()
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|c| c["id"].as_str().map(String::from))
        .collect()
}

#[test]
fn only_a_credentialed_writer_registers_over_etcd_tls_and_auth() {
    if skip_etcd_tests() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    pki(d);
    let etcd = etcd(d);
    let e = etcd.endpoint();
    let router = config(d, &e, "router", "r1", "reader");

    let (_p1, p1_log) = start(d, &config(d, &e, "prefill", "p1", "writer"), "p1");
    let seen = wait_for("p1 listed by pdnode nodes", Duration::from_secs(30), || {
        listed(&router) == ["p1"]
    });
    assert!(
        seen.is_ok(),
        "{seen:?}; p1 log:\n{}",
        std::fs::read_to_string(&p1_log).unwrap_or_default()
    );

    // A node whose etcd user may only read: refused at registration, exit 1, naming the key.
    let (mut d1, d1_log) = start(d, &config(d, &e, "decode", "d1", "reader"), "d1");
    let st = d1
        .wait_timeout(Duration::from_secs(30))
        .unwrap()
        .unwrap_or_else(|| {
            panic!(
                "d1 kept running; log:\n{}",
                std::fs::read_to_string(&d1_log).unwrap_or_default()
            )
        });
    let log = std::fs::read_to_string(&d1_log).unwrap_or_default();
    assert_eq!(st.code(), Some(1), "{log}");
    assert!(log.contains("registry.etcd_user"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    eprintln!("d1 refused as expected:\n{log}");
    assert_eq!(listed(&router), ["p1"]);
}

#[test]
fn a_missing_etcd_file_is_a_config_error_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    pki(d);
    let cfg = config(d, "https://127.0.0.1:2379", "prefill", "p1", "writer");
    std::fs::remove_file(d.join("certs/ca.pem")).unwrap();
    for cmd in ["check-config", "start"] {
        let out = Command::new(BIN)
            .args([cmd, "--config"])
            .arg(&cfg)
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{cmd}: {err}");
        assert!(err.contains("registry.etcd_tls_ca"), "{cmd}: {err}");
    }
}

/// `pdnode certs init --etcd`: without a CA (and no --node) a usage error that writes nothing;
/// with --node, the CA, the node and etcd's server certificate, which etcd then serves with.
#[test]
fn certs_init_etcd_writes_a_server_certificate_of_the_cluster_ca() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("certs");
    let init = |args: &[&str]| {
        Command::new(BIN)
            .args(["certs", "init", "--cluster", "sec", "--dir"])
            .arg(&d)
            .args(args)
            .output()
            .unwrap()
    };
    let out = init(&["--etcd", "127.0.0.1"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(!d.join("etcd-server.pem").exists());
    let out = init(&["--node", "p1:prefill", "--etcd", "127.0.0.1,localhost"]);
    assert!(out.status.success(), "{out:?}");
    for f in ["ca.pem", "p1.pem", "etcd-server.pem", "etcd-server.key"] {
        assert!(d.join(f).is_file(), "{f}");
    }
    // Existing files are kept without --force.
    let out = init(&["--etcd", "127.0.0.1"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    if skip_etcd_tests() {
        return;
    }
    // etcd starts with it, and a node client of the same CA gets through its TLS.
    let etcd = EtcdServer::start_with(EtcdOptions {
        tls: Some(EtcdTls {
            ca: d.join("ca.pem"),
            cert: d.join("etcd-server.pem"),
            key: d.join("etcd-server.key"),
            client_cert_auth: true,
            server_ca: d.join("ca.pem"),
            admin_cert: Some((d.join("p1.pem"), d.join("p1.key"))),
        }),
        auth_token_ttl_s: None,
    })
    .expect("etcd with the certs init server certificate");
    let cfg = dir.path().join("nodes.toml");
    std::fs::write(
        &cfg,
        format!(
            "[node]\nrole = \"router\"\ncluster = \"sec\"\n[registry]\nkind = \"etcd\"\nendpoints = [\"{}\"]\n\
             etcd_tls_ca = {:?}\netcd_tls_cert = {:?}\netcd_tls_key = {:?}\n",
            etcd.endpoint(),
            d.join("ca.pem").display().to_string(),
            d.join("p1.pem").display().to_string(),
            d.join("p1.key").display().to_string(),
        ),
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["nodes", "--json", "--config"])
        .arg(&cfg)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "[]");
}
