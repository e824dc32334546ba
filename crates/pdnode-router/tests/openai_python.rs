//! The official `openai` Python client (pip install openai) against the router with fake nodes:
//! runs `examples/openai_client.py --check`. If `python3 -c "import openai"` fails the test
//! says so and passes WITHOUT checking anything (marked SKIPPED in its output); set
//! `PDNODE_REQUIRE_OPENAI=1` to make a missing package a failure instead.

use crate::common;

use common::Harness;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

#[tokio::test]
async fn openai_python_client() {
    let has_openai = std::process::Command::new("python3")
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_openai {
        assert!(
            std::env::var("PDNODE_REQUIRE_OPENAI").is_err(),
            "python3 with the openai package is required (pip install openai)"
        );
        eprintln!("SKIPPED openai_python_client: python3 cannot import openai");
        return;
    }
    let h = Harness::start(1, 1).await;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/openai_client.py");
    let child = tokio::process::Command::new("python3")
        .arg(script)
        .args(["--base-url", &h.url("/v1"), "--check", "--max-tokens", "8"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("the python client finishes within 60 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("completion: 'Hello fr'"), "{stdout}");
    assert!(stdout.contains("chat stream: 'Hello fr'"), "{stdout}");
    assert!(stdout.contains("n=2 refused as expected: 400"), "{stdout}");
    h.stop().await;
}
