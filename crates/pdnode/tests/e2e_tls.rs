//! The node plane over mutual TLS with real processes: `pdnode certs init` (the binary), then
//! etcd (testkit) + `pdnode start` router, prefill and decode (simulated engine, KV over UCX on
//! loopback) with `security.tls_*` set: requests go router -> prefill -> decode over mTLS,
//! and a plaintext client of a node's API gets nothing. `check-config` refuses a certificate
//! that names another node (exit 2, naming the key).

use crate::e2e_support;

use e2e_support::{BIN, Node, dump, free_addr, repo_root};
use pdnode_proto::v1::{StatsRequest, node_client::NodeClient};
use pdnode_testkit::{EtcdServer, skip_etcd_tests};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const CLUSTER: &str = "e2e-tls";

fn certs_init(dir: &Path, extra: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(BIN);
    cmd.args(["certs", "init", "--dir"])
        .arg(dir)
        .args(["--cluster", CLUSTER]);
    for n in [
        "e2e-tls-router:router@127.0.0.1",
        "e2e-tls-prefill:prefill@127.0.0.1",
        "e2e-tls-decode:decode@127.0.0.1,localhost",
    ] {
        cmd.args(["--node", n]);
    }
    cmd.args(extra);
    cmd.output().expect("run pdnode certs init")
}

fn tls_sets(dir: &Path, name: &str) -> Vec<String> {
    let p = |f: &str| dir.join(f).display().to_string();
    vec![
        format!("security.tls_ca={:?}", p("ca.pem")),
        format!("security.tls_cert={:?}", p(&format!("{name}.pem"))),
        format!("security.tls_key={:?}", p(&format!("{name}.key"))),
    ]
}

#[test]
fn certs_init_writes_private_keys_and_refuses_to_overwrite() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("certs");
    let out = certs_init(&d, &[]);
    assert!(out.status.success(), "{out:?}");
    for f in ["ca", "e2e-tls-router", "e2e-tls-prefill", "e2e-tls-decode"] {
        let key = std::fs::metadata(d.join(format!("{f}.key"))).unwrap();
        assert_eq!(key.permissions().mode() & 0o777, 0o600, "{f}.key");
        assert!(d.join(format!("{f}.pem")).is_file(), "{f}.pem");
    }
    let ca = std::fs::read(d.join("ca.pem")).unwrap();
    // Again: every node file exists, so nothing is written and the CLI says why (exit 2).
    let out = certs_init(&d, &[]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--force"), "{err}");
    assert_eq!(std::fs::read(d.join("ca.pem")).unwrap(), ca);
    // A new node is signed by the CA already there.
    let out = Command::new(BIN)
        .args(["certs", "init", "--dir"])
        .arg(&d)
        .args(["--cluster", CLUSTER, "--node", "e2e-tls-decode-2:decode"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(std::fs::read(d.join("ca.pem")).unwrap(), ca);
    let check = |name: &str, role: &str| {
        let mut cmd = Command::new(BIN);
        cmd.current_dir(repo_root())
            .args(["check-config", "--config", "configs/cpu-decode.toml"])
            .args(["--set", &format!("node.cluster=\"{CLUSTER}\"")])
            .args(["--set", &format!("node.id=\"{name}\"")])
            .args(["--set", &format!("node.role=\"{role}\"")]);
        for s in tls_sets(&d, name) {
            cmd.args(["--set", &s]);
        }
        cmd.output().unwrap()
    };
    let ok = check("e2e-tls-decode-2", "decode");
    assert!(ok.status.success(), "{ok:?}");
    // The decode certificate on a node that calls itself a prefill node.
    let bad = check("e2e-tls-decode-2", "prefill");
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("security.tls_cert"), "{err}");
    // --force replaces everything, the CA included.
    let out = certs_init(&d, &["--force"]);
    assert!(out.status.success(), "{out:?}");
    assert_ne!(std::fs::read(d.join("ca.pem")).unwrap(), ca);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_prefill_decode_over_mutual_tls() {
    if skip_etcd_tests() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let out = certs_init(&certs, &[]);
    assert!(out.status.success(), "{out:?}");
    let etcd = EtcdServer::start().expect("etcd");
    let mock = [
        "engine.backend=\"mock\"",
        "model.format=\"dummy\"",
        "model.preset=\"smollm2-135m\"",
        "model.path=\"\"",
    ]
    .map(String::from);
    let common = |role: &str, listen: &str| {
        let name = format!("{CLUSTER}-{role}");
        let mut v = vec![
            format!("registry.endpoints=[\"{}\"]", etcd.endpoint()),
            format!("node.cluster=\"{CLUSTER}\""),
            format!("node.id=\"{name}\""),
            format!("node.listen=\"{listen}\""),
            "registry.lease_ttl_s=3".to_string(),
        ];
        v.extend(mock.iter().cloned());
        v.extend(tls_sets(&certs, &name));
        v
    };
    let http = free_addr();
    let mut r = common("router", &free_addr());
    r.push(format!("router.http_listen=\"{http}\""));
    let prefill_grpc = free_addr();
    let p = common("prefill", &prefill_grpc);
    let d = common("decode", &free_addr());
    let dir = dir.path();
    let prefill = Node::start(dir, "prefill", "configs/cpu-prefill.toml", &p);
    let decode = Node::start(dir, "decode", "configs/cpu-decode.toml", &d);
    let router = Node::start(dir, "router", "configs/cpu-router.toml", &r);
    let nodes = [&router, &prefill, &decode];
    e2e_support::wait_healthy(&http, Duration::from_secs(120), &nodes).await;

    for i in 0..3 {
        let (st, v) = e2e_support::post_json(
            &http,
            "/v1/completions",
            &serde_json::json!({"prompt": format!("request {i} over mutual TLS"), "max_tokens": 5}),
        )
        .await;
        assert_eq!(st, 200, "{v}{}", dump(&nodes));
        assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
    }
    let resp = e2e_support::client()
        .get(format!("http://{http}/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let h: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(h["insecure_node_plane"], false, "{h}");
    assert!(
        prefill.log().contains("node API over mutual TLS"),
        "{}",
        dump(&nodes)
    );

    // A plaintext client of the prefill node's API is not served.
    let plain = async {
        let mut c = NodeClient::connect(format!("http://{prefill_grpc}")).await?;
        c.stats(StatsRequest {})
            .await
            .map_err(|s| -> Box<dyn std::error::Error> { format!("{s:?}").into() })
    };
    let e = tokio::time::timeout(Duration::from_secs(10), plain)
        .await
        .expect("the plaintext client got no answer within 10 s")
        .expect_err("a plaintext client was served");
    println!("plaintext client: {e}");
}
