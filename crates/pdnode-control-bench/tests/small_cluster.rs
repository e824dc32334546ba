//! The benchmark itself at a small scale: 20 nodes from 2 registrar processes against a real
//! etcd, 2 routers; every view converges, the bursts and the crashed registrar are seen, and
//! the figures come out in its JSON.

use std::process::Command;
use std::time::Duration;

#[test]
fn twenty_nodes_converge_and_every_burst_is_seen() {
    if pdnode_testkit::skip_etcd_tests() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("figures.json");
    let child = Command::new(env!("CARGO_BIN_EXE_pdnode-control-bench"))
        .args([
            "run",
            "--nodes",
            "20",
            "--registrars",
            "2",
            "--routers",
            "2",
        ])
        .args([
            "--burst",
            "6",
            "--bursts",
            "1",
            "--ttl-s",
            "2",
            "--window-s",
            "1",
        ])
        .args(["--new-routers", "2", "--candidates", "20", "--iters", "50"])
        .args(["--warmup", "5", "--prompt-tokens", "32", "--json"])
        .arg(&json)
        .spawn()
        .expect("start the bench");
    let mut guard = pdnode_testkit::ChildGuard::new("pdnode-control-bench", child);
    let status = guard
        .wait_timeout(Duration::from_secs(120))
        .expect("wait")
        .expect("the bench ends within 120 s");
    assert!(status.success(), "the bench failed: {status}");
    let text = std::fs::read_to_string(&json).expect("the JSON figures");
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert!(
        v["register_all_ms"].as_f64().is_some_and(|m| m > 0.0),
        "{v}"
    );
    let conv = v["new_router_ms"].as_array().expect("new router samples");
    assert_eq!(conv.len(), 2, "{v}");
    for key in ["join_bursts", "leave_bursts"] {
        let b = v[key].as_array().expect(key);
        assert_eq!(b.len(), 1, "{v}");
        assert!(b[0]["all_routers_ms"].as_f64().is_some(), "{key}: {v}");
    }
    // The crashed registrar's 10 nodes go once their 2 s leases expire, not before.
    let gone = v["crash_gone_ms"].as_f64().expect("crash figure");
    assert!(
        gone >= 1000.0,
        "leases expire, they are not revoked: {gone} ms"
    );
    let steady = &v["steady_idle_nodes"];
    assert!(
        steady["keepalives_per_s_per_node"]
            .as_f64()
            .is_some_and(|k| k > 0.5 && k < 5.0),
        "a 2 s TTL keeps alive every 0.67 s: {steady}"
    );
    let busy = &v["steady_busy_nodes"];
    assert!(
        busy["by_method_per_s"]["Put"]
            .as_f64()
            .is_some_and(|p| p > 10.0),
        "20 busy nodes put their cards about 20 times a second: {busy}"
    );
    for key in ["busy_join_burst", "busy_leave_burst"] {
        assert!(v[key]["all_routers_ms"].as_f64().is_some(), "{key}: {v}");
    }
    assert_eq!(
        v["placement"].as_array().map(Vec::len),
        Some(18),
        "6 policies x 3 depths: {v}"
    );
}
