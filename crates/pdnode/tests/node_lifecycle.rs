//! `pdnode start` processes against a real etcd: registration, `pdnode nodes`, health, etcd
//! restart, SIGTERM (gone at once), kill -9 (gone within the lease TTL), duplicate ids.
//!
//! Prefill/decode nodes here run the simulated engine (`engine.backend = "mock"`, dummy model
//! preset): their cards carry the mock's KV layout and load.

use pdnode_testkit::{ChildGuard, EtcdServer, skip_etcd_tests, wait_for};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_pdnode");
const TTL_S: u64 = 3;

struct Proc {
    guard: ChildGuard,
    log: PathBuf,
}

impl Proc {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    fn running(&mut self) -> bool {
        matches!(self.guard.try_wait(), Ok(None))
    }
}

fn config(dir: &Path, etcd: &str, role: &str, id: &str) -> PathBuf {
    config_waiting(dir, etcd, role, id, 2)
}

fn config_waiting(dir: &Path, etcd: &str, role: &str, id: &str, start_wait_s: u64) -> PathBuf {
    let model = if role == "router" {
        // A router over simulated nodes serves with the mock's tokenizer (no model file needed).
        "[model]\nformat = \"dummy\"\npreset = \"smollm2-135m\"\n[engine]\nbackend = \"mock\"\n\
         [router]\nhttp_listen = \"127.0.0.1:0\"\ngrpc_listen = \"127.0.0.1:0\"\n"
            .to_string()
    } else {
        "[model]\nformat = \"dummy\"\npreset = \"smollm2-135m\"\n[engine]\nbackend = \"mock\"\n\
         [transfer]\nkind = \"ucx\"\n"
            .to_string()
    };
    let text = format!(
        "[node]\nrole = \"{role}\"\ncluster = \"life\"\nid = \"{id}\"\nlisten = \"127.0.0.1:0\"\n\
         http_listen = \"127.0.0.1:0\"\ndrain_timeout_s = 2\n\
         [registry]\nkind = \"etcd\"\nendpoints = [\"{etcd}\"]\nlease_ttl_s = {TTL_S}\ntimeout_ms = 1000\n\
         start_wait_s = {start_wait_s}\n{model}"
    );
    let p = dir.join(format!("{id}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn start(dir: &Path, cfg: &Path, name: &str) -> Proc {
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
    Proc {
        guard: ChildGuard::new(name, child),
        log,
    }
}

fn nodes_json(etcd: &str) -> Vec<serde_json::Value> {
    let out = Command::new(BIN)
        .args(["nodes", "--etcd", etcd, "--cluster", "life", "--json"])
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
}

fn ids(etcd: &str) -> Vec<String> {
    let mut v: Vec<String> = nodes_json(etcd)
        .iter()
        .filter_map(|c| c["id"].as_str().map(String::from))
        .collect();
    v.sort();
    v
}

fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    Some(body)
}

fn must<T>(r: Result<T, pdnode_testkit::TestkitError>, procs: &[&Proc]) -> T {
    match r {
        Ok(v) => v,
        Err(e) => {
            for p in procs {
                eprintln!("---- {} log ----\n{}", p.guard.name(), p.log());
            }
            panic!("{e}");
        }
    }
}

#[test]
fn three_nodes_register_survive_an_etcd_restart_and_leave_on_sigterm_and_kill() {
    if skip_etcd_tests() {
        return;
    }
    let mut etcd = EtcdServer::start().expect("etcd");
    let e = etcd.endpoint();
    let dir = tempfile::tempdir().unwrap();
    let mut p0 = start(dir.path(), &config(dir.path(), &e, "prefill", "p0"), "p0");
    let mut d0 = start(dir.path(), &config(dir.path(), &e, "decode", "d0"), "d0");
    let mut r0 = start(dir.path(), &config(dir.path(), &e, "router", "r0"), "r0");

    must(
        wait_for("three nodes registered", Duration::from_secs(60), || {
            ids(&e) == ["d0", "p0", "r0"]
        }),
        &[&p0, &d0, &r0],
    );

    // The main thread of a node only waits on the thread that runs the command (main.rs: UCX
    // moves the program break while it starts, and the break is the main thread's heap).
    let pid = d0.guard.pid().expect("d0 pid");
    let comm = |tid: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let threads: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|e| Some(comm(e.ok()?.file_name().to_str()?)))
        .collect();
    assert!(
        threads.iter().any(|t| t == "pdnode-main"),
        "d0's threads: {threads:?}"
    );

    // The table lists role, id, model, address, load.
    let out = Command::new(BIN)
        .args(["nodes", "--etcd", &e, "--cluster", "life"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let table = String::from_utf8_lossy(&out.stdout);
    for want in [
        "ROLE",
        "prefill",
        "decode",
        "router",
        "smollm2-135m",
        "127.0.0.1:",
    ] {
        assert!(table.contains(want), "missing {want:?} in:\n{table}");
    }

    // The engine's layout and load reach the card (the Registrar publishes load changes).
    must(
        wait_for(
            "p0 publishes its KV capacity",
            Duration::from_secs(10),
            || {
                nodes_json(&e).iter().any(|c| {
                    c["id"] == "p0"
                        && c["capacity"]["kv_blocks_total"].as_u64().unwrap_or(0) > 0
                        && c["kv_layout"]["model_fingerprint"] == "mock-v32000"
                })
            },
        ),
        &[&p0],
    );

    // Health over HTTP on the prefill node (its address is in its card).
    let cards = nodes_json(&e);
    let p0_card = cards.iter().find(|c| c["id"] == "p0").unwrap();
    let http = p0_card["addresses"]["http"]
        .as_str()
        .expect("p0 http address");
    let health = http_get(http, "/health").unwrap_or_default();
    assert!(
        health.starts_with("HTTP/1.0 200") || health.starts_with("HTTP/1.1 200"),
        "{health}"
    );
    assert!(health.contains("\"serving\""), "{health}");

    // etcd goes away and comes back: the nodes keep running and are listed again.
    etcd.stop();
    must(
        wait_for("p0 notices the outage", Duration::from_secs(15), || {
            p0.log().contains("registry keepalive failed")
        }),
        &[&p0],
    );
    assert!(http_get(http, "/health").is_some_and(|h| h.contains("\"serving\"")));
    etcd.restart().expect("etcd restarts");
    must(
        wait_for("p0 registration restored", Duration::from_secs(20), || {
            p0.log().contains("registration restored")
        }),
        &[&p0],
    );
    must(
        wait_for("membership back", Duration::from_secs(20), || {
            ids(&e) == ["d0", "p0", "r0"]
        }),
        &[&p0, &d0, &r0],
    );
    assert!(p0.running() && d0.running() && r0.running());

    // SIGTERM: the lease is revoked first, so the key goes at once (well before the TTL).
    let t0 = Instant::now();
    d0.guard.signal("TERM").unwrap();
    must(
        wait_for("d0 gone after SIGTERM", Duration::from_secs(TTL_S), || {
            ids(&e) == ["p0", "r0"]
        }),
        &[&d0],
    );
    let gone_after = t0.elapsed();
    let st = d0
        .guard
        .wait_timeout(Duration::from_secs(10))
        .unwrap()
        .expect("d0 exits after SIGTERM");
    assert!(st.success(), "d0 exit status {st}; log:\n{}", d0.log());
    assert!(
        gone_after < Duration::from_millis(2000),
        "SIGTERM took {gone_after:?} to remove the key"
    );
    assert!(d0.log().contains("lease revoked"), "{}", d0.log());

    // kill -9: nobody revokes; the key expires within the lease TTL.
    let t0 = Instant::now();
    r0.guard.signal("KILL").unwrap();
    must(
        wait_for(
            "r0 expires after kill -9",
            Duration::from_secs(TTL_S + 3),
            || ids(&e) == ["p0"],
        ),
        &[&r0],
    );
    assert!(t0.elapsed() <= Duration::from_secs(TTL_S + 3));
    assert!(p0.running());
}

#[test]
fn a_second_node_with_the_same_id_fails_with_a_clear_error() {
    if skip_etcd_tests() {
        return;
    }
    let etcd = EtcdServer::start().expect("etcd");
    let e = etcd.endpoint();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), &e, "decode", "same");
    let first = start(dir.path(), &cfg, "first");
    must(
        wait_for("first registered", Duration::from_secs(60), || {
            ids(&e) == ["same"]
        }),
        &[&first],
    );
    let mut second = start(dir.path(), &cfg, "second");
    let st = second
        .guard
        .wait_timeout(Duration::from_secs(TTL_S + 15))
        .unwrap()
        .unwrap_or_else(|| panic!("the duplicate kept running; log:\n{}", second.log()));
    assert!(!st.success());
    let log = second.log();
    assert!(
        log.contains("already registered") && log.contains("must be unique"),
        "{log}"
    );
    // The first one is untouched.
    assert_eq!(ids(&e), ["same"]);
    drop(first);
}

#[test]
fn an_unreachable_etcd_at_start_is_a_clear_error() {
    let port = pdnode_testkit::free_port().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        dir.path(),
        &format!("http://127.0.0.1:{port}"),
        "decode",
        "lonely",
    );
    let mut p = start(dir.path(), &cfg, "lonely");
    let st = p
        .guard
        .wait_timeout(Duration::from_secs(20))
        .unwrap()
        .unwrap_or_else(|| panic!("kept running without etcd; log:\n{}", p.log()));
    assert_eq!(st.code(), Some(1), "{}", p.log());
    assert!(p.log().contains("cannot reach"), "{}", p.log());
}

/// A node started while etcd is down loads its engine and keeps trying the registry (once a
/// second, `registry.start_wait_s`) instead of exiting; once etcd is back it registers, without a
/// restart (and so without loading its model again).
#[test]
fn a_node_started_in_an_etcd_outage_registers_when_etcd_returns() {
    if skip_etcd_tests() {
        return;
    }
    let mut etcd = EtcdServer::start().expect("etcd");
    let e = etcd.endpoint();
    etcd.stop();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_waiting(dir.path(), &e, "decode", "late", 60);
    let mut p = start(dir.path(), &cfg, "late");
    must(
        wait_for(
            "late tries the registry twice",
            Duration::from_secs(30),
            || p.log().matches("registry unreachable").count() >= 2,
        ),
        &[&p],
    );
    assert!(p.running(), "exited during the outage:\n{}", p.log());
    etcd.restart().expect("etcd restart");
    must(
        wait_for("late registered", Duration::from_secs(30), || {
            ids(&e) == ["late"]
        }),
        &[&p],
    );
    assert!(p.running(), "{}", p.log());
    assert!(p.log().contains("registry reachable"), "{}", p.log());
}
