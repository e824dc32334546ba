//! Runs the built `pdnode` binary: subcommands, exit codes, and messages that name the key and
//! the file.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn pdnode(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pdnode"))
        .args(args)
        // Keep the process environment from changing what a config means.
        .env_remove("RUST_LOG")
        .env_remove("PDNODE_ENGINE__BACKEND")
        .output()
        .expect("runs pdnode")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn configs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs")
}

fn write(dir: &tempfile::TempDir, name: &str, body: &str) -> String {
    let p = dir.path().join(name);
    std::fs::write(&p, body).unwrap();
    p.display().to_string()
}

#[test]
fn help_lists_every_subcommand() {
    let out = pdnode(&["--help"]);
    assert!(out.status.success());
    let s = text(&out.stdout);
    for sub in [
        "start",
        "check-config",
        "version",
        "generate",
        "bench",
        "bench-transfer",
        "nodes",
        "certs",
    ] {
        assert!(s.contains(sub), "--help lacks {sub}:\n{s}");
    }
}

#[test]
fn usage_errors_exit_2() {
    assert_eq!(pdnode(&["no-such-command"]).status.code(), Some(2));
    assert_eq!(pdnode(&["check-config", "--bogus"]).status.code(), Some(2));
}

#[test]
fn version_prints_version_commit_and_features() {
    let out = pdnode(&["version"]);
    assert!(out.status.success());
    let s = text(&out.stdout);
    assert!(s.contains(env!("CARGO_PKG_VERSION")), "{s}");
    assert!(s.contains("git commit:") && s.contains("features:"), "{s}");
    let out = pdnode(&["version", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert!(v["git_commit"].is_string());
}

#[test]
fn check_config_passes_every_shipped_file_and_prints_the_effective_config() {
    let mut files = Vec::new();
    for dir in [configs_dir(), configs_dir().join("multi-host")] {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "toml") {
                files.push(p);
            }
        }
    }
    assert!(files.len() >= 10);
    // configs/multi-host/ name their TLS files under /etc/pdnode/certs: the same certificates,
    // made by `pdnode certs init`'s code, from a temporary directory.
    let certs = tempfile::tempdir().unwrap();
    pdnode_nodeapi::certs::init(&pdnode_nodeapi::certs::CertsInit {
        dir: certs.path().to_path_buf(),
        cluster: "prod".into(),
        nodes: [
            "router-a:router",
            "prefill-b:prefill",
            "prefill-c:prefill",
            "decode-d:decode",
        ]
        .iter()
        .map(|n| n.parse().unwrap())
        .collect(),
        force: false,
        days: 2,
    })
    .unwrap();
    for f in files {
        let text_of_file = std::fs::read_to_string(&f).unwrap();
        let mut args = vec![
            "check-config".to_string(),
            "--config".to_string(),
            f.display().to_string(),
        ];
        for key in ["tls_ca", "tls_cert", "tls_key"] {
            let line = text_of_file
                .lines()
                .find(|l| l.starts_with(&format!("{key} = ")));
            if let Some(line) = line {
                let shipped = line.split('"').nth(1).unwrap();
                let name = Path::new(shipped).file_name().unwrap();
                let local = certs.path().join(name).display().to_string();
                args.push("--set".into());
                args.push(format!("security.{key}={local:?}"));
            }
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = pdnode(&args);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}: {}",
            f.display(),
            text(&out.stderr)
        );
        let s = text(&out.stdout);
        assert!(s.contains("[node]") && s.contains("role = "), "{s}");
        // What it prints is itself a valid config.
        pdnode_core::config::load_from_str("printed", &s, &[])
            .unwrap_or_else(|e| panic!("{}: printed config does not load: {e:?}", f.display()));
    }
}

#[test]
fn check_config_applies_set_overrides() {
    let local = configs_dir().join("local.toml");
    let out = pdnode(&[
        "check-config",
        "--config",
        local.to_str().unwrap(),
        "--set",
        "engine.max_running_requests=7",
        "--set",
        "router.http_listen=\"127.0.0.1:9999\"",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(s.contains("max_running_requests = 7"), "{s}");
    assert!(s.contains("127.0.0.1:9999"), "{s}");
}

#[test]
fn check_config_reports_every_error_with_key_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(
        &dir,
        "bad.toml",
        "[engine]\nbackend = \"cuda\"\ngpus = [0, 1, 1, 2]\ntensor_parallel = 3\nbakend = 1\n",
    );
    let out = pdnode(&["check-config", "--config", &bad]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    for needle in [
        "bad.toml",
        "engine.bakend",
        "engine.gpus",
        "listed twice",
        "engine.tensor_parallel",
    ] {
        assert!(err.contains(needle), "stderr lacks {needle:?}:\n{err}");
    }
    assert!(out.stdout.is_empty(), "nothing on stdout on failure");
}

#[test]
fn check_config_on_a_missing_file_exits_2() {
    let out = pdnode(&["check-config", "--config", "/nonexistent/x.toml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("/nonexistent/x.toml"));
}

#[test]
fn check_config_bad_set_names_the_argument() {
    let out = pdnode(&["check-config", "--set", "router.prefill_policy=fastest"]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(err.contains("--set router.prefill_policy=fastest"), "{err}");
    assert!(err.contains("router.prefill_policy"), "{err}");
}

#[test]
fn start_with_a_bad_config_exits_2_with_the_same_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(&dir, "start-bad.toml", "[node]\nrole = \"prefill\"\n");
    let out = pdnode(&["start", "--config", &bad]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("start-bad.toml") && err.contains("transfer.kind"),
        "{err}"
    );
}

/// Runs `pdnode start` with stderr to a file; if it is still running at the deadline (it serves)
/// or once `enough` holds for its stderr, it is killed by PID. Returns (exit code if it exited by
/// itself, stderr).
fn start_with_deadline(
    args: &[&str],
    deadline: Duration,
    enough: fn(&str) -> bool,
) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("stderr.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdnode"))
        .arg("start")
        .args(args)
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawns pdnode");
    let until = Instant::now() + deadline;
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        let seen = std::fs::read_to_string(&log).unwrap_or_default();
        if Instant::now() >= until || enough(&seen) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (code, std::fs::read_to_string(&log).unwrap_or_default())
}

#[test]
fn start_with_a_good_config_never_panics() {
    let local = configs_dir().join("local.toml");
    // A model file that does not exist: with the engine wired in, start fails loading it (a clear
    // runtime error, exit 1); a node that serves anyway is stopped at the deadline. Either way:
    // no panic, and a valid config is not a usage error.
    let (code, err) = start_with_deadline(
        &[
            "--config",
            local.to_str().unwrap(),
            "--set",
            "model.path=\"/nonexistent/model.gguf\"",
            "--set",
            "router.http_listen=\"127.0.0.1:0\"",
        ],
        Duration::from_secs(15),
        |_| false,
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_ne!(code, Some(2), "a valid config is not a usage error: {err}");
    if code == Some(1) {
        assert!(err.lines().any(|l| l.starts_with("error: ")), "{err}");
    }
}

#[test]
fn json_logs_are_json_lines() {
    let local = configs_dir().join("local.toml");
    let (_code, err) = start_with_deadline(
        &[
            "--config",
            local.to_str().unwrap(),
            "--set",
            "log.format=json",
            "--set",
            "model.path=\"/nonexistent/model.gguf\"",
            "--set",
            "router.http_listen=\"127.0.0.1:0\"",
        ],
        Duration::from_secs(15),
        |s| s.contains('\n'),
    );
    let first = err.lines().next().unwrap_or("");
    let v: serde_json::Value =
        serde_json::from_str(first).unwrap_or_else(|e| panic!("{e}: {first:?}"));
    assert!(v["level"].is_string(), "{v}");
}

#[test]
fn bench_option_errors_exit_2_before_sending_anything() {
    // Port 1 is never served; option checks come first, so nothing is contacted.
    let base = ["bench", "--url", "http://127.0.0.1:1", "--model", "m"];
    for extra in [
        &["--workload", "trace"][..],
        &["--concurrency", "0"][..],
        &["--trace", "x.jsonl"][..],
        &["--request-rate", "-1"][..],
    ] {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let out = pdnode(&args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{extra:?}: {}",
            text(&out.stderr)
        );
    }
}
