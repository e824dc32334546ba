//! The wgmma prefill attention kernels (`kernels/prefill_flash_wg.cu`: the plain and the
//! warp-specialized one) and the descriptor probe run on the CPU in the SIMT emulator
//! (`emu/wg/run.sh`: wgmma, mbarriers, named barriers and cp.async emulated from their PTX
//! semantics) against an f64 reference, with cp.async copies landing late and at once. No GPU:
//! this is what checks the kernels' indexing, masking and barrier protocol on every test run; the
//! GPU tests (`cuda_kernels`) check them on the H200.

use std::process::Command;

#[test]
fn wgmma_prefill_kernels_match_reference_in_the_emulator() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/emu/wg/run.sh");
    let out = Command::new("bash")
        .arg(script)
        .env_remove("EMU_TMP")
        .env_remove("EMU_SYNC")
        .output()
        .expect("bash runs emu/wg/run.sh");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "emulator run failed:\n{text}");
    // both modes ran every case: the probe and 12 attention cases x 2 kernels
    for mode in [
        "deferred cp.async: 25 cases, 0 failed",
        "immediate cp.async: 25 cases, 0 failed",
    ] {
        assert!(text.contains(mode), "{mode:?} not in:\n{text}");
    }
}
