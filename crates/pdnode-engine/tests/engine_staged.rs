//! A staged prefill's seal (`EngineHandle::add_request_staged` with a `StagingSeal`), on the
//! CPU backend with a host arena: once every block of the prompt is in the span the loop sums
//! each rank's span (KVH64), builds the records from the sums and writes each right behind its
//! rank's bytes, and reports `Sealed` before the request leaves. Both ways the span fills: the
//! whole blocks gathered after each chunk's step, and layer groups inside the prompt's last
//! step.

use pdnode_core::request::GenerateRequest;
use pdnode_core::{RequestId, SamplingParams};
use pdnode_engine::backend::STAGING_ALIGN;
use pdnode_engine::backend::cpu::{CpuBackend, CpuBackendConfig, HostArena};
use pdnode_engine::engine::{EngineEvent, EngineLoopConfig, StagingSeal, spawn_with_regions};
use pdnode_engine::loader::load_path;
use pdnode_engine::scheduler::Mode;
use std::any::Any;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(60);
const ARENA: usize = 1 << 20;
const RECORD: usize = 64;

/// What the test's `make` writes for rank `r`: its index, then its sum (or zeros), padded.
fn record(r: usize, sum: Option<u64>) -> Vec<u8> {
    let mut b = vec![0xeeu8; RECORD];
    b[0] = r as u8;
    b[8..16].copy_from_slice(&sum.unwrap_or(0).to_le_bytes());
    b
}

/// A CPU engine in `mode` over the fixture model (block size 4, 32 blocks) with a host arena of
/// `ARENA` bytes the test can read (the arena's memory), and the KV layout.
fn engine(
    mode: Mode,
    max_batch_tokens: usize,
) -> (
    pdnode_engine::engine::EngineHandle,
    Arc<Mutex<Box<[u8]>>>,
    pdnode_core::KvLayout,
) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_gqa");
    let model = load_path(&dir).unwrap();
    let vocab = model.spec.vocab_size;
    let mut be = CpuBackend::from_loaded(
        model,
        CpuBackendConfig {
            block_size: 4,
            num_blocks: 32,
            threads: 1,
        },
    )
    .unwrap();
    let mem = Arc::new(Mutex::new(vec![0u8; ARENA].into_boxed_slice()));
    let ptr = mem.lock().unwrap().as_mut_ptr();
    let owner: Arc<dyn Any + Send + Sync> = mem.clone();
    // SAFETY: the boxed slice lives in `owner` (kept by the arena and by the test); the test
    // touches it only when the engine does not (before a scatter, after a request left).
    be.attach_staging(unsafe { HostArena::new(ptr, ARENA, owner) });
    let layout = pdnode_engine::backend::Backend::kv_layout(&be).clone();
    let cfg = EngineLoopConfig {
        mode,
        max_batch_tokens,
        max_running_requests: 4,
        max_queued_requests: 16,
        context_length: 64,
        prefix_cache: false,
        lease: Duration::from_secs(10),
        vocab_size: vocab,
        eos_token_ids: vec![],
        max_output_tokens: None,
        idle_wait: Duration::from_millis(5),
        call_timeout: Duration::from_secs(30),
    };
    let engine = spawn_with_regions(Box::new(be), Vec::new(), cfg, None).unwrap();
    (engine, mem, layout)
}

/// Runs one staged prefill of a 10-token prompt (block size 4: 3 blocks) with `max_batch_tokens`
/// per step and `layer_group` (0: gathers after the steps); returns the reports, the span's
/// bytes and the record behind it, and the engine's own KV of the prompt (`read_kv`).
async fn staged(max_batch_tokens: usize, layer_group: u32, hash: bool) -> Run {
    let (engine, mem, layout) = engine(Mode::PrefillOnly, max_batch_tokens);
    let blocks = 3;
    let per_rank = layout.num_layers as usize * blocks * layout.block_layer_bytes();
    let sums_seen = Arc::new(Mutex::new(None));
    let seen = sums_seen.clone();
    let seal = StagingSeal {
        hash,
        make: Box::new(move |ranks: usize, sums: Option<&[u64]>| {
            *seen.lock().unwrap() = Some((ranks, sums.map(<[u64]>::to_vec)));
            (0..ranks).map(|r| record(r, sums.map(|s| s[r]))).collect()
        }),
    };
    let id = RequestId(7);
    let req = GenerateRequest {
        id,
        prompt_token_ids: (0..10u32).map(|i| (i * 7 + 3) % 50).collect(),
        sampling: SamplingParams {
            // More than one token: the KV is handed off (held under a lease after prefill).
            max_tokens: 4,
            temperature: 0.0,
            ..Default::default()
        },
    };
    let (mut stream, mut ready) = engine
        .add_request_staged(
            req,
            blocks,
            Box::new(|| Some(STAGING_ALIGN)),
            layer_group,
            Some(seal),
        )
        .unwrap();
    let events = tokio::time::timeout(DEADLINE, async {
        let mut done = false;
        while let Some(ev) = stream.next().await {
            match ev {
                EngineEvent::PrefillDone { .. } => {
                    done = true;
                    break;
                }
                EngineEvent::Error { error, .. } => panic!("engine error {error}"),
                _ => {}
            }
        }
        done
    })
    .await
    .expect("prefill within the deadline");
    assert!(events, "the stream ended without PrefillDone");
    let mut reports = Vec::new();
    while let Ok(Some(r)) = tokio::time::timeout(DEADLINE, ready.recv()).await {
        reports.push(format!("{r:?}"));
    }
    let kv = engine.read_kv(id, 0..layout.num_layers).await.unwrap();
    let arena = mem.lock().unwrap();
    Run {
        reports,
        span: arena[STAGING_ALIGN..STAGING_ALIGN + per_rank].to_vec(),
        behind: arena[STAGING_ALIGN + per_rank..STAGING_ALIGN + per_rank + RECORD].to_vec(),
        kv,
        sums: sums_seen.lock().unwrap().clone(),
    }
}

struct Run {
    reports: Vec<String>,
    span: Vec<u8>,
    behind: Vec<u8>,
    kv: Vec<u8>,
    sums: Option<(usize, Option<Vec<u64>>)>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loop_writes_the_seal_behind_a_fully_gathered_span() {
    // 4-token chunks (gathers after each step), one chunk with layer groups of 1 inside the
    // step, and a seal without sums.
    for (mbt, group, hash) in [(4, 0, true), (16, 1, true), (16, 0, false)] {
        let what = format!("max_batch_tokens {mbt}, layer_group {group}, hash {hash}");
        let r = staged(mbt, group, hash).await;
        assert_eq!(r.span, r.kv, "{what}: the span holds the prompt's KV");
        let want = hash.then(|| vec![pdnode_core::kvh64::kvh64(&r.span).unwrap()]);
        assert_eq!(
            r.sums,
            Some((1, want.clone())),
            "{what}: sums given to make"
        );
        assert_eq!(
            r.behind,
            record(0, want.map(|w| w[0])),
            "{what}: the record right behind the span"
        );
        assert_eq!(
            r.reports.last().map(String::as_str),
            Some("Sealed { written: true }"),
            "{what}: reports {:?}",
            r.reports
        );
        assert_eq!(
            r.reports.iter().filter(|x| x.starts_with("Sealed")).count(),
            1,
            "{what}: sealed once"
        );
    }
}

/// A decode engine's checked scatter (`EngineHandle::scatter_kv_checked`): the check runs on
/// the engine thread with the arena; without a hash, a refusal leaves the reserved blocks
/// untouched; with one, the scatter hands the check the KVH64 of what it moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checked_scatter_moves_nothing_unless_the_check_passes() {
    let (engine, mem, layout) = engine(Mode::DecodeOnly, 16);
    let id = RequestId(9);
    let blocks = engine.reserve_for_transfer(id, 10).await.unwrap();
    let layers = layout.num_layers;
    let per_rank = layers as usize * blocks.len() * layout.block_layer_bytes();
    let span: Vec<u8> = (0..per_rank).map(|i| (i * 31 % 251) as u8).collect();
    mem.lock().unwrap()[STAGING_ALIGN..STAGING_ALIGN + per_rank].copy_from_slice(&span);
    let before = engine.read_kv(id, 0..layers).await.unwrap();
    assert_ne!(before, span);

    let seen = Arc::new(Mutex::new(None));
    let s2 = seen.clone();
    let scattered = engine
        .scatter_kv_checked(
            id,
            0..layers,
            STAGING_ALIGN,
            false,
            Box::new(move |st, hashed| {
                assert!(hashed.is_none(), "no hash asked");
                *s2.lock().unwrap() = st.staging_kvh64(STAGING_ALIGN, per_rank).ok();
                false
            }),
        )
        .await
        .unwrap();
    assert!(!scattered, "the check refused, so nothing was scattered");
    assert_eq!(
        *seen.lock().unwrap(),
        Some(vec![pdnode_core::kvh64::kvh64(&span).unwrap()]),
        "the check saw the span"
    );
    assert_eq!(engine.read_kv(id, 0..layers).await.unwrap(), before);

    // Hashed: the scatter gives the check the KVH64 of what it moved.
    let want = pdnode_core::kvh64::kvh64(&span).unwrap();
    let scattered = engine
        .scatter_kv_checked(
            id,
            0..layers,
            STAGING_ALIGN,
            true,
            Box::new(move |_, hashed| hashed == Some(&[want][..])),
        )
        .await
        .unwrap();
    assert!(scattered, "the check saw the span's KVH64");
    assert_eq!(engine.read_kv(id, 0..layers).await.unwrap(), span);
    // Refused after a hashed scatter: the answer says so (the blocks are the caller's to release).
    let refused = engine
        .scatter_kv_checked(id, 0..layers, STAGING_ALIGN, true, Box::new(|_, _| false))
        .await
        .unwrap();
    assert!(!refused);
}
