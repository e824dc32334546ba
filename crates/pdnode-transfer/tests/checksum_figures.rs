//! Figures, not a check (`--ignored --nocapture`): what `transfer.verify` costs on the CPU — the
//! CRC32C of the KV of a 4096-token prompt of the demo model (SmolLM2-135M: 30 layers, 3 KV
//! heads of 64, f32 KV on the CPU backend: 46 080 bytes a token, 189 MB). The prefill node sums
//! its source once and the decode node the landed bytes once, so a hand-off pays it twice.

use pdnode_transfer::checksum::crc32c;
use std::time::Instant;

#[test]
#[ignore = "figures: run with --ignored --nocapture"]
fn crc32c_of_a_4k_token_prompt_of_the_demo_model() {
    let per_token = 30 * 2 * 3 * 64 * 4;
    let bytes = 4096 * per_token;
    let data: Vec<u8> = (0..bytes)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8)
        .collect();
    let _ = crc32c(&data); // warm: page faults, the shift operator
    let mut ms = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        std::hint::black_box(crc32c(std::hint::black_box(&data)));
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    println!(
        "CRC32C of {bytes} bytes: median {:.1} ms (min {:.1}, max {:.1}), {:.2} GB/s",
        ms[3],
        ms[0],
        ms[6],
        bytes as f64 / ms[3] / 1e6
    );
}
