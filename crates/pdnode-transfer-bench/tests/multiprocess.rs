//! Real processes, real UCX, loopback only (UCX_NET_DEVICES=lo): the bench's server (decode
//! role) and client (prefill role) as separate processes of `pdnode-transfer-peer`.
//! Each test skips with a message only when libucp cannot be loaded.

use pdnode_transfer_bench::{BenchRole, Faults, Options};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(60);

fn ucx_available() -> bool {
    match ucx_sys::Ucp::load(None) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIP: libucp not loadable: {e}");
            false
        }
    }
}

/// A running peer process: its output lines arrive on a channel; killed (by handle) on drop.
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Peer {
    fn start(opts: &Options, tls: &str) -> Peer {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pdnode-transfer-peer"))
            .arg(serde_json::to_string(opts).unwrap())
            .env("UCX_NET_DEVICES", "lo")
            .env("UCX_TLS", tls)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn pdnode-transfer-peer");
        let (tx, rx) = mpsc::channel();
        for out in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
        }
        Peer {
            stdin: child.stdin.take(),
            child,
            lines: rx,
            seen: Vec::new(),
        }
    }

    /// Waits for a line containing `pat`.
    fn wait_line(&mut self, pat: &str) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.contains(pat) {
                        return l;
                    }
                }
                Err(_) => panic!(
                    "no line with {pat:?}; output so far:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Waits for exit; returns the code and every output line.
    fn finish(mut self) -> (i32, String) {
        let deadline = Instant::now() + DEADLINE;
        let code = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st.code().unwrap_or(-1);
            }
            assert!(
                Instant::now() < deadline,
                "process did not exit:\n{}",
                self.seen.join("\n")
            );
            if let Ok(l) = self.lines.recv_timeout(Duration::from_millis(50)) {
                self.seen.push(l);
            }
        };
        // Drain what is left (the reader threads end with the pipes).
        while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
            self.seen.push(l);
        }
        (code, self.seen.join("\n"))
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn base(role: BenchRole) -> Options {
    Options {
        role,
        layers: 4,
        block_bytes: vec![16 << 10, 64 << 10],
        blocks_per_request: 4,
        requests: 3,
        warmup: 1,
        lease_ms: 20_000,
        ..Options::default()
    }
}

fn server(lease_tweak: impl FnOnce(&mut Options), tls: &str) -> (Peer, String) {
    let mut o = base(BenchRole::Server);
    o.serve_once = true;
    lease_tweak(&mut o);
    let mut p = Peer::start(&o, tls);
    let addr = p
        .wait_line("LISTEN ")
        .trim_start_matches("LISTEN ")
        .to_string();
    (p, addr)
}

fn client(addr: &str, tweak: impl FnOnce(&mut Options), tls: &str) -> Peer {
    let mut o = base(BenchRole::Client);
    o.connect = Some(addr.to_string());
    tweak(&mut o);
    Peer::start(&o, tls)
}

fn exchange(tls: &str, pool_placement: bool) {
    if !ucx_available() {
        return;
    }
    let (srv, addr) = server(|_| {}, tls);
    let cli = client(&addr, |o| o.pool_placement = pool_placement, tls);
    let (code, out) = cli.finish();
    assert_eq!(code, 0, "client failed:\n{out}");
    assert_eq!(out.matches("RESULT ").count(), 2, "{out}");
    let (scode, sout) = srv.finish();
    assert_eq!(scode, 0, "server failed:\n{sout}");
    // Every request was verified byte for byte by the server (a mismatch is refused).
    assert!(!sout.contains("REFUSED"), "{sout}");
    assert_eq!(sout.matches("RESERVED").count(), 8, "{sout}");
}

#[test]
fn two_processes_exchange_kv_byte_for_byte_over_tcp() {
    exchange("tcp", false);
}

#[test]
fn two_processes_exchange_kv_byte_for_byte_over_shared_memory() {
    exchange("sm,self", false);
}

#[test]
fn direct_pool_placement_moves_the_same_bytes() {
    exchange("tcp", true);
}

#[test]
fn receiver_killed_mid_transfer_fails_the_sender_and_frees_its_blocks() {
    if !ucx_available() {
        return;
    }
    let (mut srv, addr) = server(|_| {}, "tcp");
    let mut cli = client(
        &addr,
        |o| {
            o.layers = 8;
            o.faults = Faults {
                pause_after_layers: Some(2),
                ..Faults::default()
            };
        },
        "tcp",
    );
    cli.wait_line("PAUSED");
    srv.kill();
    // Let the client go on pushing into a dead peer.
    let mut stdin = cli.stdin.take().unwrap();
    let _ = stdin.write_all(b"go\n");
    drop(stdin);
    let (code, out) = cli.finish();
    assert_eq!(code, 1, "{out}");
    // Either UCX's peer-failure handling or the control channel notices first.
    assert!(out.contains("ERROR") && out.contains("gone"), "{out}");
    assert!(
        out.contains("RELEASED"),
        "source blocks not released:\n{out}"
    );
    assert!(out.contains("4 blocks"), "{out}");
}

#[test]
fn sender_killed_receiver_frees_the_reservation_at_lease_end() {
    if !ucx_available() {
        return;
    }
    let lease = Duration::from_millis(1500);
    let (mut srv, addr) = server(|_| {}, "tcp");
    let mut cli = client(
        &addr,
        |o| {
            o.lease_ms = lease.as_millis() as u64;
            o.faults.stall_after_reserve = true;
        },
        "tcp",
    );
    cli.wait_line("STALLED");
    let t = Instant::now();
    cli.kill();
    let freed = srv.wait_line("FREED");
    assert!(freed.contains("4 blocks"), "{freed}");
    assert!(
        freed.contains("expired"),
        "freed for the wrong reason: {freed}"
    );
    // Not before the lease ended (it started before STALLED was printed).
    assert!(
        t.elapsed() >= lease - Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );
    let (code, out) = srv.finish();
    assert_eq!(code, 0, "{out}");
}

#[test]
fn wrong_secret_is_refused() {
    if !ucx_available() {
        return;
    }
    let (mut srv, addr) = server(|_| {}, "tcp");
    let cli = client(
        &addr,
        |o| {
            o.lease_ms = 1000;
            o.faults.wrong_secret = true;
        },
        "tcp",
    );
    let (code, out) = cli.finish();
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("wrong secret"), "{out}");
    assert!(out.contains("RELEASED"), "{out}");
    let refused = srv.wait_line("REFUSED");
    assert!(refused.contains("wrong secret"), "{refused}");
    // The refused reservation is still freed, at its lease end.
    srv.wait_line("FREED");
}

#[test]
fn a_checksum_mismatch_is_refused_before_the_scatter_and_frees_the_blocks() {
    if !ucx_available() {
        return;
    }
    let (mut srv, addr) = server(|_| {}, "tcp");
    let cli = client(&addr, |o| o.faults.bad_checksum = true, "tcp");
    let (code, out) = cli.finish();
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("RELEASED"), "{out}");
    // The serving decode node's check (`FenceRecord::check`) names the checksum.
    let refused = srv.wait_line("REFUSED");
    assert!(refused.contains("CRC32C"), "{refused}");
    // Nothing was scattered: the server frees the blocks and keeps serving (no RESERVED
    // left open: the connection ends and the server exits cleanly).
    let (scode, sout) = srv.finish();
    assert_eq!(scode, 0, "{sout}");
    assert!(
        !sout.contains("FREED"),
        "freed twice or at the lease end:\n{sout}"
    );
}

#[test]
fn wrong_layout_is_refused_naming_the_field() {
    if !ucx_available() {
        return;
    }
    for field in ["head_dim", "block_size", "model_fingerprint"] {
        let (mut srv, addr) = server(|_| {}, "tcp");
        let cli = client(
            &addr,
            |o| o.faults.layout_mismatch = Some(field.into()),
            "tcp",
        );
        let (code, out) = cli.finish();
        assert_eq!(code, 1, "{out}");
        assert!(out.contains(&format!("mismatch in `{field}`")), "{out}");
        let refused = srv.wait_line("REFUSED");
        assert!(refused.contains(field), "{refused}");
    }
}

#[test]
fn run_local_starts_both_processes() {
    if !ucx_available() {
        return;
    }
    let mut o = base(BenchRole::Client);
    o.tls = Some("tcp".into());
    o.timeout_s = 60;
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_pdnode-transfer-peer"));
    let code = pdnode_transfer_bench::run_local(&o, exe, &[]).unwrap();
    assert_eq!(code, 0);
}
