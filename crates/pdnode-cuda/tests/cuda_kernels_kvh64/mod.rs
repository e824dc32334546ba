//! KVH64 on the device (`ops::kvh64`, kernels/kvh64.cu) against the CPU definition
//! (`pdnode_core::kvh64`): the one-pass hash of ranges of many sizes, partial sums of separate
//! launches adding up, and the gather / scatter copies that hash the staging words they move
//! (bytes moved exactly as `kv_copy` moves them, the sum equal to the CPU hash of the staging
//! span). Also times, at Llama-3.1-8B's 4096-token hand-off (512 MiB), the plain copies, the
//! hashing copies, the one-pass hash and the CRC32C (printed, not asserted). Part of the
//! `cuda_kernels` test binary.

use super::cuda_support::*;
use super::gpu;
use pdnode_core::kvh64;
use pdnode_cuda::ops;
use rand::Rng;
use rand::seq::SliceRandom;

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn kvh64_on_the_device_equals_the_cpu_definition() {
    let g = gpu();
    let mut r = rng("kvh64");
    let total = (64 << 20) + 16 * 37;
    let host: Vec<u8> = (0..total).map(|_| r.random()).collect();
    let dev = g.alloc(total).unwrap();
    g.upload(&dev, 0, &host).unwrap();
    let mut failed = Vec::new();
    for (off, len) in [
        (0usize, 0usize),
        (0, 16),
        (16, 32),
        (48, 4096),
        (0, 1 << 20),
        (160, (16 << 20) + 16 * 5),
        (0, total),
    ] {
        let want = kvh64::kvh64(&host[off..off + len]).unwrap();
        let got = ops::kvh64::kvh64(&g, &dev, off, len).unwrap();
        let ok = got == want;
        println!(
            "{} kvh64 {len} bytes at {off}: device {got:#018x}, host {want:#018x}",
            if ok { "PASS" } else { "FAIL" }
        );
        if !ok {
            failed.push((off, len));
        }
    }
    // two launches over halves of one span add up to the whole
    let sum = g.alloc(8).unwrap();
    g.memset(&sum, 0).unwrap();
    let half = (8 << 20) + 16 * 3;
    ops::kvh64::add_words(&g, &dev, 0, half, 0, sum.ptr()).unwrap();
    ops::kvh64::add_words(&g, &dev, half, half, (half / 16) as u64, sum.ptr()).unwrap();
    let split = ops::kvh64::read_sum(&g, &sum, 0, 2 * half as u64).unwrap();
    assert_eq!(split, kvh64::kvh64(&host[..2 * half]).unwrap());
    // ranges that are not whole words, or outside the buffer, are typed errors
    assert!(ops::kvh64::kvh64(&g, &dev, 0, 17).is_err());
    assert!(ops::kvh64::kvh64(&g, &dev, 8, 16).is_err());
    assert!(ops::kvh64::kvh64(&g, &dev, total - 16, 32).is_err());
    assert!(failed.is_empty(), "device KVH64 differs at {failed:?}");
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn hashing_copies_move_the_bytes_and_hash_the_staging_span() {
    let g = gpu();
    let mut r = rng("kvh64-copy");
    let (nlayers, num_blocks, lb) = (4usize, 50usize, 4096usize);
    let pool_bytes = nlayers * num_blocks * lb;
    let pool_host: Vec<u8> = (0..pool_bytes).map(|_| r.random()).collect();
    let pool = g.alloc(pool_bytes).unwrap();
    g.upload(&pool, 0, &pool_host).unwrap();
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    ids.shuffle(&mut r);
    ids.truncate(20);
    let nblocks = ids.len();
    let ids_dev = g.alloc(4 * nblocks).unwrap();
    g.upload(&ids_dev, 0, &ids).unwrap();
    let span = nlayers * nblocks * lb;
    let staging = g.alloc(span).unwrap();
    let sum = g.alloc(8).unwrap();
    g.memset(&sum, 0).unwrap();
    // two launches (layers 0-1, then 2-3) into one span and one sum, as a hand-off's layer
    // groups do
    let per_group = 2 * nblocks * lb;
    let groups = [(0usize, 0usize), (2, per_group)];
    for (layer0, off) in groups {
        ops::kvh64::kv_copy_h64(
            &g,
            true,
            &pool,
            &staging,
            off,
            ids_dev.ptr(),
            nblocks,
            layer0,
            2,
            num_blocks,
            lb,
            (off / 16) as u64,
            sum.ptr(),
        )
        .unwrap();
    }
    let mut got = vec![0u8; span];
    g.download(&mut got, &staging, 0).unwrap();
    // the expected staging: [layer][block] layer-blocks of the pool
    let mut want = Vec::with_capacity(span);
    for l in 0..nlayers {
        for &b in &ids {
            let at = (l * num_blocks + b as usize) * lb;
            want.extend_from_slice(&pool_host[at..at + lb]);
        }
    }
    assert!(got == want, "gather_h64 moved the wrong bytes");
    let gathered = ops::kvh64::read_sum(&g, &sum, 0, span as u64).unwrap();
    assert_eq!(gathered, kvh64::kvh64(&want).unwrap(), "gather hash");
    println!("PASS kv_gather_h64: {span} bytes, hash {gathered:#018x}");

    // scatter the span into a zeroed pool: same hash, bytes where they belong
    let pool2 = g.alloc(pool_bytes).unwrap();
    g.memset(&pool2, 0).unwrap();
    g.memset(&sum, 0).unwrap();
    ops::kvh64::kv_copy_h64(
        &g,
        false,
        &pool2,
        &staging,
        0,
        ids_dev.ptr(),
        nblocks,
        0,
        nlayers,
        num_blocks,
        lb,
        0,
        sum.ptr(),
    )
    .unwrap();
    let scattered = ops::kvh64::read_sum(&g, &sum, 0, span as u64).unwrap();
    assert_eq!(scattered, gathered, "scatter hash");
    let mut p2 = vec![0u8; pool_bytes];
    g.download(&mut p2, &pool2, 0).unwrap();
    for l in 0..nlayers {
        for &b in &ids {
            let at = (l * num_blocks + b as usize) * lb;
            assert!(
                p2[at..at + lb] == pool_host[at..at + lb],
                "layer {l} block {b}"
            );
        }
    }
    // one flipped staging bit changes the scatter's hash
    let mut flipped = want.clone();
    flipped[span / 3] ^= 0x10;
    g.upload(&staging, 0, &flipped).unwrap();
    g.memset(&sum, 0).unwrap();
    ops::kvh64::kv_copy_h64(
        &g,
        false,
        &pool2,
        &staging,
        0,
        ids_dev.ptr(),
        nblocks,
        0,
        nlayers,
        num_blocks,
        lb,
        0,
        sum.ptr(),
    )
    .unwrap();
    let bad = ops::kvh64::read_sum(&g, &sum, 0, span as u64).unwrap();
    assert_ne!(bad, gathered, "a flipped bit went unnoticed");
    println!("PASS kv_scatter_h64: bytes in place, hash equal; a flipped bit changes it");
}

/// Milliseconds per call of `f`, over 10 calls after 2, the stream synchronized around them.
fn time_ms(g: &pdnode_cuda::device::Gpu, mut f: impl FnMut()) -> f64 {
    for _ in 0..2 {
        f();
    }
    g.sync().unwrap();
    let iters = 10;
    let t0 = std::time::Instant::now();
    for _ in 0..iters {
        f();
    }
    g.sync().unwrap();
    t0.elapsed().as_secs_f64() * 1e3 / iters as f64
}

#[test]
#[ignore = "needs a CUDA GPU: run scripts/gpu/run-all.sh on the GPU host"]
fn bench_kvh64_at_a_4096_token_llama31_8b_handoff() {
    let g = gpu();
    // Llama-3.1-8B: 32 layers, 8 KV heads x 128 x bf16, K and V, blocks of 16 tokens: a
    // layer-block is 64 KiB; 4096 tokens = 256 blocks, 512 MiB of staging.
    let (nlayers, nblocks, lb) = (32usize, 256usize, 64usize << 10);
    let num_blocks = 320;
    let span = nlayers * nblocks * lb;
    let pool = g.alloc(nlayers * num_blocks * lb).unwrap();
    g.memset(&pool, 0x3C).unwrap();
    let staging = g.alloc(span).unwrap();
    let mut r = rng("kvh64-bench");
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    ids.shuffle(&mut r);
    ids.truncate(nblocks);
    let ids_dev = g.alloc(4 * nblocks).unwrap();
    g.upload(&ids_dev, 0, &ids).unwrap();
    let sum = g.alloc(8).unwrap();
    g.memset(&sum, 0).unwrap();
    let copy = |gather: bool| {
        ops::kv_copy(
            &g,
            gather,
            &pool,
            &staging,
            ids_dev.ptr(),
            nblocks,
            0,
            nlayers,
            num_blocks,
            lb,
        )
        .unwrap()
    };
    let copy_h = |gather: bool| {
        ops::kvh64::kv_copy_h64(
            &g,
            gather,
            &pool,
            &staging,
            0,
            ids_dev.ptr(),
            nblocks,
            0,
            nlayers,
            num_blocks,
            lb,
            0,
            sum.ptr(),
        )
        .unwrap()
    };
    let gather = time_ms(&g, || copy(true));
    let gather_h = time_ms(&g, || copy_h(true));
    let scatter = time_ms(&g, || copy(false));
    let scatter_h = time_ms(&g, || copy_h(false));
    let one_pass = time_ms(&g, || {
        ops::kvh64::add_words(&g, &staging, 0, span, 0, sum.ptr()).unwrap()
    });
    let crc = time_ms(&g, || {
        ops::crc32c::crc32c(&g, &staging, 0, span).unwrap();
    });
    let gbs = |ms: f64, bytes: f64| bytes / (ms * 1e-3) / 1e9;
    let s = span as f64;
    println!(
        "BENCH kvh64 512 MiB hand-off (32 layers x 256 blocks x 64 KiB), ms: gather {gather:.3} \
         ({:.0} GB/s moved), gather+hash {gather_h:.3} (+{:.1} %), scatter {scatter:.3}, \
         scatter+hash {scatter_h:.3} (+{:.1} %), one-pass hash {one_pass:.3} ({:.0} GB/s read), \
         crc32c {crc:.3} ({:.0} GB/s)",
        gbs(gather, 2.0 * s),
        (gather_h / gather - 1.0) * 100.0,
        (scatter_h / scatter - 1.0) * 100.0,
        gbs(one_pass, s),
        gbs(crc, s),
    );
}
