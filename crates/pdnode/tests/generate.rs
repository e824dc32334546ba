//! `pdnode generate` end to end with the built binary. The SmolLM2 checks run when
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf` exists (otherwise they print that they skipped); the
//! error checks always run.

use std::path::PathBuf;
use std::process::{Command, Output};

fn pdnode(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pdnode"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run pdnode")
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn smollm2() -> Option<String> {
    let p = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.is_file() {
        Some(p.display().to_string())
    } else {
        eprintln!("SKIPPED: {} not present", p.display());
        None
    }
}

#[test]
fn chat_greedy_answers_paris_with_json_and_logits() {
    let Some(model) = smollm2() else { return };
    let logits_path =
        std::env::temp_dir().join(format!("pdnode-gen-logits-{}.json", std::process::id()));
    let logits_arg = logits_path.display().to_string();
    let out = pdnode(&[
        "generate",
        "--model",
        &model,
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--temperature",
        "0",
        "--json",
        "--logits-out",
        &logits_arg,
        "--set",
        "engine.cpu_threads=2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["text"].as_str().unwrap().contains("Paris"), "{v}");
    assert_eq!(v["finish_reason"], "stop");
    // The same prompt ids as transformers' GGUF tokenizer + chat template.
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            root().join("crates/pdnode-engine/tests/fixtures/smollm2_q4_1_reference.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(v["prompt_token_ids"], reference["prompt_ids"]);
    let greedy = reference["greedy_ids"].as_array().unwrap();
    let got = v["token_ids"].as_array().unwrap();
    assert_eq!(got[..], greedy[..got.len()]);
    assert!(v["timings"]["prefill_ms"].as_f64().unwrap() > 0.0);
    let logits: Vec<f32> =
        serde_json::from_str(&std::fs::read_to_string(&logits_path).unwrap()).unwrap();
    std::fs::remove_file(&logits_path).ok();
    assert_eq!(logits.len(), 49152);
    let top = reference["first_top_ids"][0].as_u64().unwrap() as usize;
    let want = reference["first_top_values"][0].as_f64().unwrap() as f32;
    assert!(
        (logits[top] - want).abs() < 1e-3,
        "{} vs {want}",
        logits[top]
    );
}

#[test]
fn bad_inputs_are_clear_errors() {
    // A missing model file: exit 1, the path in the message.
    let out = pdnode(&[
        "generate",
        "--model",
        "/nonexistent/x.gguf",
        "--prompt",
        "hi",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/x.gguf"));
    // An out-of-range sampling value: exit 2, naming the parameter.
    let out = pdnode(&[
        "generate",
        "--model",
        "/nonexistent/x.gguf",
        "--prompt",
        "hi",
        "--top-p",
        "1.5",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("top_p"));
    let Some(model) = smollm2() else { return };
    // A prompt longer than the context: exit 2.
    let out = pdnode(&[
        "generate",
        "--model",
        &model,
        "--prompt",
        "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen",
        "--set",
        "engine.context_length=16",
    ]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("context length"));
}
