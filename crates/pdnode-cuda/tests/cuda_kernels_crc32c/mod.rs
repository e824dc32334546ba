//! The device CRC32C (`ops::crc32c::crc32c`, kernels/crc32c.cu) against the CPU CRC32C the KV
//! hand-off uses (`pdnode_transfer::checksum::crc32c`): random bytes of many sizes (0 bytes, sizes
//! that are not multiples of 4 or 8, one chunk, a partial first chunk, 64 MiB over every SM),
//! ranges starting at unaligned offsets, and one flipped bit changing the sum. Also times 256 MiB
//! (printed, not asserted). Part of the `cuda_kernels` test binary; prints one PASS/FAIL line a
//! case.

use super::cuda_support::*;
use super::gpu;
use pdnode_cuda::ops::crc32c::{self, chunking};
use pdnode_transfer::checksum;
use rand::Rng;

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn crc32c_on_the_device_equals_the_host_checksum() {
    let g = gpu();
    let mut r = rng("crc32c");
    let total = (64 << 20) + 4099;
    let host: Vec<u8> = (0..total).map(|_| r.random()).collect();
    let dev = g.alloc(total).unwrap();
    g.upload(&dev, 0, &host).unwrap();
    let sms = g.sm_count as usize;
    let mut failed = Vec::new();
    let mut cases: Vec<(usize, usize)> = vec![
        (0, 0),
        (0, 1),
        (1, 3),
        (3, 5),
        (0, 7),
        (5, 9),
        (0, 255),
        (0, 256),
        (7, 257),
        (0, 4096),
        (13, 4097),
        (0, 1_000_003),
        (3, 16 << 20),
        (0, 64 << 20),
        (1, (64 << 20) + 4097),
    ];
    for _ in 0..8 {
        let len = r.random_range(0..(2 << 20));
        cases.push((r.random_range(0..64), len));
    }
    for (off, len) in cases {
        let want = checksum::crc32c(&host[off..off + len]);
        let got = crc32c::crc32c(&g, &dev, off, len).unwrap();
        let (chunk, n) = chunking(len, sms);
        let ok = got == want;
        println!(
            "{} crc32c {len} bytes at {off} ({n} chunks of {chunk}): device {got:#010x}, host {want:#010x}",
            if ok { "PASS" } else { "FAIL" }
        );
        if !ok {
            failed.push((off, len));
        }
    }
    // one flipped bit changes the sum; flipping it back restores it
    let len = 1 << 20;
    let before = crc32c::crc32c(&g, &dev, 0, len).unwrap();
    let mut flipped = host[..len].to_vec();
    flipped[len / 3] ^= 0x04;
    g.upload(&dev, 0, &flipped).unwrap();
    let after = crc32c::crc32c(&g, &dev, 0, len).unwrap();
    assert_ne!(before, after, "a flipped bit went unnoticed");
    assert_eq!(after, checksum::crc32c(&flipped));
    g.upload(&dev, 0, &host[..len]).unwrap();
    // a range outside the buffer is a typed error, never a launch
    assert!(crc32c::crc32c(&g, &dev, total - 3, 4).is_err());
    assert!(crc32c::crc32c(&g, &dev, usize::MAX, 2).is_err());
    assert!(failed.is_empty(), "device CRC32C differs at {failed:?}");

    // throughput (printed): 256 MiB, after a warm-up
    let big = 256usize << 20;
    let buf = g.alloc(big).unwrap();
    g.memset(&buf, 0xA5).unwrap();
    crc32c::crc32c(&g, &buf, 0, big).unwrap();
    let iters = 10;
    let t0 = std::time::Instant::now();
    for _ in 0..iters {
        crc32c::crc32c(&g, &buf, 0, big).unwrap();
    }
    let s = t0.elapsed().as_secs_f64() / iters as f64;
    println!(
        "BENCH crc32c 256 MiB: {:.3} ms, {:.0} GB/s (host round trip per call included)",
        s * 1e3,
        big as f64 / s / 1e9
    );
}
