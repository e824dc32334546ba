//! `pdnode bench-transfer`: the user-facing command over real UCX on loopback (the protocol's
//! failure paths are tested with real processes in crates/pdnode-transfer/tests/multiprocess.rs).

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs pdnode with a deadline; returns (exit code, stdout, stderr).
fn run(args: &[&str]) -> (i32, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdnode"))
        .args(args)
        .env("UCX_NET_DEVICES", "lo")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs pdnode");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let o = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let e = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code().unwrap_or(-1);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("pdnode {args:?} did not finish");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (code, o.join().unwrap(), e.join().unwrap())
}

#[test]
fn bench_transfer_local_prints_a_verified_table() {
    if let Err(e) = ucx_sys_probe() {
        eprintln!("SKIP: libucp not loadable: {e}");
        return;
    }
    let (code, out, err) = run(&[
        "bench-transfer",
        "--local",
        "--tls",
        "tcp",
        "--layers",
        "4",
        "--block-bytes",
        "16K,64K",
        "--requests",
        "2",
        "--warmup",
        "0",
        "--timeout-s",
        "100",
    ]);
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("verified every byte"), "{out}");
    assert_eq!(out.matches("RESULT ").count(), 2, "{out}");
}

#[test]
fn bench_transfer_with_a_missing_library_says_so() {
    let (code, _out, err) = run(&[
        "bench-transfer",
        "--local",
        "--ucx-lib",
        "/nonexistent/libucp.so.0",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("UCX library not found"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Whether libucp loads here (the same lookup as the command's default).
fn ucx_sys_probe() -> Result<(), String> {
    let ok = ["libucp.so.0", "libucp.so"].iter().any(|n| {
        std::path::Path::new("/usr/lib/x86_64-linux-gnu")
            .join(n)
            .exists()
            || std::env::var("LD_LIBRARY_PATH")
                .unwrap_or_default()
                .split(':')
                .any(|d| !d.is_empty() && std::path::Path::new(d).join(n).exists())
    });
    if ok {
        Ok(())
    } else {
        Err("libucp.so.0 not found".into())
    }
}
