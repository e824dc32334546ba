//! The kernels that have a CPU emulator harness (`emu/*/run.sh`: each compiles kernel files as C++
//! against the fiber SIMT emulator of `emu/attn/prelude.h`, the inline-PTX helpers replaced by
//! emulations of their PTX semantics) run against their references on every test run. No GPU:
//! this checks the kernels' indexing, masking and synchronization; the GPU tests
//! (`pdnode-cuda`'s `cuda_kernels`) check them on the H200.

use std::process::Command;

/// Runs `emu/<dir>/run.sh` and returns what it printed; panics (with that output) if it failed.
fn run_emu(dir: &str) -> String {
    let script = format!("{}/emu/{dir}/run.sh", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash")
        .arg(&script)
        .env_remove("EMU_TMP")
        .env_remove("EMU_SYNC")
        .output()
        .unwrap_or_else(|e| panic!("bash {script}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{script} failed:\n{text}");
    text
}

/// The number right after `prefix` on the first line of `text` that contains `marker` and starts
/// with `prefix`, if there is one.
fn count_on_line(text: &str, marker: &str, prefix: &str) -> Option<usize> {
    text.lines()
        .filter(|l| l.contains(marker))
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// The number in `"<prefix><N> cases"` of `text`'s line starting with `prefix`.
fn cases(text: &str, prefix: &str) -> usize {
    count_on_line(text, prefix, prefix).unwrap_or_else(|| panic!("no {prefix:?} line in:\n{text}"))
}

/// The wgmma prefill attention kernels (plain and warp-specialized), the descriptor probe and
/// the streaming decode GEMV (gemv_stream): wgmma, mbarriers, named barriers, cp.async, TMA and
/// bulk copies emulated, copies landing late and at once, NaN in the pool past every context.
#[test]
fn wgmma_prefill_kernels_match_reference_in_the_emulator() {
    let text = run_emu("wg");
    // both modes ran every case (the probe, 10 gemv_stream cases, 12 attention cases with the
    // plain kernel, the 11 of them with block size 8 or more with the warp-specialized one) and
    // none failed
    for mode in ["deferred", "immediate"] {
        let line = format!("{mode} cp.async: 34 cases, 0 failed");
        assert!(text.contains(&line), "{line:?} not in:\n{text}");
    }
}

/// The v4 decode attention kernel (ldmatrix, mma.sync and cp.async emulated) on GQA groups,
/// head dims, partitions, token lists and block sizes against an f64 reference.
#[test]
fn decode_attention_v4_matches_reference_in_the_emulator() {
    let text = run_emu("attn");
    for mode in ["deferred", "immediate"] {
        let prefix = format!("{mode} cp.async: ");
        assert!(
            cases(&text, &prefix) >= 175,
            "{mode}: too few cases:\n{text}"
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with(&prefix) && l.ends_with("EMU ALL PASS")),
            "{mode}: not every case passed:\n{text}"
        );
    }
}

/// The MLA (DeepSeek latent attention, RoPE, both attention kernels) and MoE routing kernels
/// against a C++ reference.
#[test]
fn mla_and_moe_kernels_match_reference_in_the_emulator() {
    let text = run_emu("mla");
    assert!(cases(&text, "all ") >= 75, "too few cases:\n{text}");
    assert!(text.contains("cases PASS"), "{text}");
}

/// The elementwise kernels: swiglu_v8 bit-identical to swiglu, add_rmsnorm_v4 (its norm weight
/// loaded with the row since session 24) and add_rmsnorm against an f64 reference, every output
/// written and nothing past the buffers.
#[test]
fn elementwise_kernels_match_reference_in_the_emulator() {
    let text = run_emu("elementwise");
    let passed = count_on_line(&text, " cases passed; all passed: 0 failed", "");
    assert!(
        passed.is_some_and(|n| n >= 39),
        "not every case passed:\n{text}"
    );
}

/// The device CRC32C kernel (a KV hand-off through a device arena verified without copying it
/// to the host, `ops::crc32c`) against a bitwise reference (136 cases, a few seconds). The
/// sampling harness (`emu/sample`, about 4.5 minutes here) is not run by this test: too slow for
/// every test run.
#[test]
fn crc32c_kernel_matches_reference_in_the_emulator() {
    let text = run_emu("crc32c");
    let n = count_on_line(&text, "EMU ALL PASS (", "EMU ALL PASS (");
    assert!(
        n.is_some_and(|n| n >= 136),
        "not every case passed:\n{text}"
    );
}
