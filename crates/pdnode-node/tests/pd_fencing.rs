//! Fencing and verification of the KV hand-off (docs/protocol.md, "Fencing and verification"),
//! over real UCX on loopback with the CPU backend: a put that lands after its reservation was
//! aborted never reaches a scatter nor the next reservation of the span; bytes changed after
//! the sender's checksum fail only their request; every block and span comes back.
//!
//! The late or corrupting writer is the test itself: it puts into a decode node's staging with
//! the rank regions of a KV target it kept, as a prefill node whose puts were delayed would.

use crate::common;

use common::{colocated_tokens, cpu_prompt, cpu_ucx_config, pd_pair};
use pdnode_core::{NodeId, RequestId, SamplingParams};
use pdnode_node::pd::fence::{FenceRecord, RECORD_LEN};
use pdnode_node::pd::{self, PdNode};
use pdnode_proto::v1;
use pdnode_router::{DecodeCall, KvTarget, NodeClient, PrefillCall, PrefillOutcome, ReserveKv};
use pdnode_transfer::{KvTransport, RemoteRegion, Secret, Span};
use std::time::{Duration, Instant};

async fn reserve(d: &pd::ServingNode, id: u64, ids: &[u32]) -> (KvTarget, v1::KvTarget) {
    let t = d
        .node
        .reserve_kv(ReserveKv {
            request_id: RequestId(id),
            prompt_token_ids: ids.to_vec(),
            max_tokens: 5,
            prefill_node: NodeId::new("p"),
        })
        .await
        .unwrap();
    let wire = v1::KvTarget::from(&t);
    (t, wire)
}

async fn prefill(p: &pd::ServingNode, id: u64, ids: &[u32], t: &KvTarget) -> PrefillOutcome {
    p.node
        .prefill(PrefillCall {
            request_id: RequestId(id),
            prompt_token_ids: ids.to_vec(),
            sampling: SamplingParams::greedy(5),
            target: t.clone(),
        })
        .await
        .unwrap()
}

/// Decode's tokens (first token included), or its error's message.
async fn decode(
    d: &pd::ServingNode,
    id: u64,
    ids: &[u32],
    t: &KvTarget,
    out: &PrefillOutcome,
) -> Result<Vec<u32>, String> {
    let mut s = d
        .node
        .decode(DecodeCall {
            request_id: RequestId(id),
            secret: t.secret.clone(),
            first_token_id: out.first_token_id,
            first_logprob: None,
            sampling: SamplingParams::greedy(5),
            prompt_token_ids: ids.to_vec(),
            sampler: None,
        })
        .await
        .map_err(|e| e.message)?;
    let mut got = vec![out.first_token_id];
    use futures::StreamExt;
    while let Some(c) = tokio::time::timeout(Duration::from_secs(20), s.next())
        .await
        .expect("decode stalled")
    {
        let c = c.map_err(|e| e.message)?;
        got.extend(c.token_ids);
        if c.finish.is_some() {
            break;
        }
    }
    Ok(got)
}

/// Puts `bytes` at `at` of the target's rank 0 region (then flushes), as a late prefill node
/// would: from the prefill node's own UCX worker.
fn raw_put(p: &pd::ServingNode, t: &v1::KvTarget, at: u64, bytes: &[u8]) {
    let tr = &p.transport;
    let src = tr.allocate_registered(bytes.len()).unwrap();
    // SAFETY: a fresh host region of at least `bytes.len()` bytes, not used by any transfer yet.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), src.region().addr as *mut u8, bytes.len())
    };
    let rank = &t.ranks[0];
    let remote = tr
        .connect(
            &t.ucx_worker_address,
            &RemoteRegion {
                base_addr: rank.remote_base_addr,
                len: rank.region_len,
                rkey: rank.rkey.clone(),
            },
        )
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let span = Span {
        local_offset: 0,
        remote_offset: at,
        len: bytes.len() as u64,
    };
    tr.put(&src, &remote, &[span])
        .unwrap()
        .wait(deadline)
        .unwrap();
    tr.flush(&remote).unwrap().wait(deadline).unwrap();
}

/// The KV capability a target carries (what tags its fence records).
fn cap(t: &v1::KvTarget) -> Secret {
    Secret::from_bytes(&t.secret).expect("a 16-byte capability")
}

fn per_rank(d: &pd::ServingNode, blocks: usize) -> usize {
    let l = &d.built.handle.info().kv_layout;
    l.num_layers as usize * blocks * l.block_layer_bytes()
}

async fn assert_clean(node: &PdNode) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let s = node.engine().stats().await.unwrap().scheduler;
        let st = node.staging_stats();
        if s.kv.free + s.kv.cached_unreferenced == s.kv.total
            && s.kv.leases == 0
            && st.owned == 0
            && st.quarantined == 0
            && st.arena_free_bytes == st.arena_bytes
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "blocks or staging still held: {s:?} {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.engine().check_accounting().await.unwrap().unwrap();
}

async fn wait_until(what: &str, limit: Duration, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_landing_after_its_abort_never_reaches_a_scatter_or_the_next_reservation() {
    let mut cfg = cpu_ucx_config();
    // A short lease: the quarantine of a span nobody finishes ends one lease past its lease.
    cfg.transfer.lease_ms = 2_000;
    let ids = cpu_prompt(1);
    let want = colocated_tokens(&cfg, &ids, 5).await;
    let Some((p, d)) = pd_pair(&cfg) else { return };
    let n = per_rank(&d, ids.len().div_ceil(4));

    // X is reserved, its target goes out, then it is aborted (a client hung up): its span is
    // quarantined, not handed to the next reservation.
    let (_, x) = reserve(&d, 1, &ids).await;
    assert!(
        x.fence_record && x.verify,
        "host staging asks for fence records"
    );
    assert!(
        d.node
            .abort(RequestId(1), x.secret.clone(), "client gone".into())
            .await
            .unwrap()
    );
    let f = d.node.fence_stats();
    assert_eq!((f.quarantined, f.quarantined_now), (1, 1));
    assert_eq!(d.node.staging_stats().quarantined, 1);

    // Y comes next; X's delayed put lands while Y's KV waits for its scatter.
    let (ty, y) = reserve(&d, 2, &ids).await;
    assert_ne!(
        y.staging_offset, x.staging_offset,
        "a quarantined span was reused"
    );
    assert_ne!(y.staging_generation, x.staging_generation);
    let out = prefill(&p, 2, &ids, &ty).await;
    raw_put(&p, &x, x.staging_offset, &vec![0xA5; n]);
    assert_eq!(decode(&d, 2, &ids, &ty, &out).await.unwrap(), want);

    // X's writer finishes (its fence record lands): the span comes back before its deadline.
    let rec = FenceRecord {
        generation: x.staging_generation,
        request: 1,
        len: n as u64,
        sum: None,
        aborted: false,
    };
    raw_put(&p, &x, x.staging_offset + n as u64, &rec.encode(&cap(&x)));
    wait_until(
        "X's span released by its record",
        Duration::from_secs(2),
        || d.node.fence_stats().quarantined_now == 0,
    )
    .await;
    assert_eq!(d.node.fence_stats().released_by_record, 1);

    // Z is aborted and its writer never finishes: its span waits out the fence deadline, then
    // W reuses it; Z's put lands in W's span after W's KV: W's decode refuses to scatter it
    // (W's record is intact, the bytes are not W's) and W fails alone, freeing everything.
    let (_, z) = reserve(&d, 3, &ids).await;
    assert!(
        d.node
            .abort(RequestId(3), z.secret.clone(), "client gone".into())
            .await
            .unwrap()
    );
    wait_until(
        "Z's span freed at its fence deadline",
        Duration::from_secs(10),
        || d.node.fence_stats().released_at_deadline == 1,
    )
    .await;
    let (tw, w) = reserve(&d, 4, &ids).await;
    assert_eq!(w.staging_offset, z.staging_offset, "W reuses Z's span");
    let out = prefill(&p, 4, &ids, &tw).await;
    raw_put(&p, &z, z.staging_offset, &vec![0x5A; n]);
    let e = decode(&d, 4, &ids, &tw, &out).await.unwrap_err();
    assert!(e.contains("refused before the scatter"), "{e}");
    assert_eq!(d.node.fence_stats().checksum_failures, 1);

    // A stale record of Z's generation over V's: refused as another reservation's put.
    let (tv, v) = reserve(&d, 5, &ids).await;
    let out = prefill(&p, 5, &ids, &tv).await;
    let stale = FenceRecord {
        generation: z.staging_generation,
        request: 3,
        len: n as u64,
        sum: None,
        aborted: false,
    };
    raw_put(&p, &v, v.staging_offset + n as u64, &stale.encode(&cap(&z)));
    let e = decode(&d, 5, &ids, &tv, &out).await.unwrap_err();
    assert!(e.contains("capability"), "{e}");
    assert_eq!(d.node.fence_stats().record_failures, 1);

    // The next request is not corrupted; everything comes back.
    let (tu, _) = reserve(&d, 6, &ids).await;
    let out = prefill(&p, 6, &ids, &tu).await;
    assert_eq!(decode(&d, 6, &ids, &tu, &out).await.unwrap(), want);
    assert_clean(&d.node).await;
    assert_clean(&p.node).await;
    assert_eq!(p.node.fence_stats().sources_leaked, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_fails_only_its_request_and_verify_off_lets_it_through() {
    let cfg = cpu_ucx_config();
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| cpu_prompt(10 + i)).collect();
    let mut want = Vec::new();
    for ids in &prompts {
        want.push(colocated_tokens(&cfg, ids, 5).await);
    }
    let Some((p, d)) = pd_pair(&cfg) else { return };
    let arena = d.node.staging_arena().expect("decode arena").clone();
    assert!(!arena.is_device());

    for verify in [true, false] {
        d.node.set_verify(verify);
        let base = if verify { 10 } else { 20 };
        let mut targets = Vec::new();
        for (i, ids) in prompts.iter().enumerate() {
            targets.push(reserve(&d, base + i as u64, ids).await);
        }
        let (a, b, c) = tokio::join!(
            prefill(&p, base, &prompts[0], &targets[0].0),
            prefill(&p, base + 1, &prompts[1], &targets[1].0),
            prefill(&p, base + 2, &prompts[2], &targets[2].0),
        );
        // One bit of request 1's landed KV changes after the sender's checksum.
        let at = arena.registration(0).unwrap().region().addr
            + targets[1].1.staging_offset as usize
            + 1000;
        // SAFETY: inside the decode node's host arena, in request 1's span, which no put or
        // engine command touches until request 1's decode call below.
        unsafe { *(at as *mut u8) ^= 0x10 };
        let outs = [a, b, c];
        for (i, ids) in prompts.iter().enumerate() {
            let got = decode(&d, base + i as u64, ids, &targets[i].0, &outs[i]).await;
            match (i, verify) {
                (1, true) => {
                    let e = got.unwrap_err();
                    assert!(e.contains("CRC32C"), "{e}");
                }
                (1, false) => {
                    got.expect("without verification the changed bytes are scattered");
                }
                _ => assert_eq!(got.unwrap(), want[i], "request {i} (verify {verify})"),
            }
        }
        assert_eq!(d.node.fence_stats().checksum_failures, 1);
    }
    // The failed request's span is quarantined until its deadline (its record is intact but
    // someone else wrote its bytes); its blocks are free at once.
    assert_eq!(d.node.staging_stats().owned, 0);
    assert_clean(&p.node).await;
    assert_clean(&d.node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_decode_arena_with_capped_host_staging_refuses_instead_of_growing() {
    let mut cfg = cpu_ucx_config();
    // A reservation waits a quarter of the lease for arena room before it stages on the host.
    cfg.transfer.lease_ms = 1_000;
    let ids = cpu_prompt(3);
    let want = colocated_tokens(&cfg, &ids, 5).await;
    let Some((p, d)) = pd_pair(&cfg) else { return };
    // Room for one request's host staging (one TP rank: its KV and its fence record).
    let one = (per_rank(&d, ids.len().div_ceil(4)) + RECORD_LEN) as u64;
    d.node.set_host_staging_bytes(one);
    let arena = d.node.staging_arena().expect("decode arena").clone();
    let full = arena.reserve(arena.len()).expect("the whole decode arena");

    let (ta, _) = reserve(&d, 1, &ids).await;
    assert_eq!(d.node.staging_stats().host_bytes, one);
    let e = d
        .node
        .reserve_kv(ReserveKv {
            request_id: RequestId(2),
            prompt_token_ids: ids.clone(),
            max_tokens: 5,
            prefill_node: NodeId::new("p"),
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind, pdnode_core::error::ErrorKind::Unavailable, "{e}");
    assert!(e.message.contains("host_staging_bytes"), "{e}");
    assert_eq!(
        d.node.pending_reservations(),
        1,
        "the refused one holds nothing"
    );

    // The first completes through host staging and gives its bytes back; then there is room.
    let out = prefill(&p, 1, &ids, &ta).await;
    assert_eq!(decode(&d, 1, &ids, &ta, &out).await.unwrap(), want);
    assert_eq!(d.node.staging_stats().host_bytes, 0);
    let (tb, _) = reserve(&d, 3, &ids).await;
    let out = prefill(&p, 3, &ids, &tb).await;
    assert_eq!(decode(&d, 3, &ids, &tb, &out).await.unwrap(), want);
    assert_eq!(d.node.staging_counts(), (0, 2), "both through host staging");
    drop(full);
    assert_clean(&d.node).await;
    assert_clean(&p.node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_push_frees_the_decode_span_without_waiting_for_the_fence_deadline() {
    let cfg = cpu_ucx_config();
    let ids = cpu_prompt(4);
    let want = colocated_tokens(&cfg, &ids, 5).await;
    let Some((p, d)) = pd_pair(&cfg) else { return };
    let arena = d.node.staging_arena().expect("decode arena").clone();
    for id in 1..=3u64 {
        let (t, _) = reserve(&d, id, &ids).await;
        // The router drops the prefill call at once (the client went away): the prefill node
        // abandons the push, and once its puts are over it says so with a fence record.
        let call = p.node.prefill(PrefillCall {
            request_id: RequestId(id),
            prompt_token_ids: ids.clone(),
            sampling: SamplingParams::greedy(5),
            target: t.clone(),
        });
        let _ = tokio::time::timeout(Duration::from_millis(id * 3), call).await;
        assert!(
            p.node
                .abort(RequestId(id), t.secret.clone(), "client gone".into())
                .await
                .is_ok()
        );
        assert!(
            d.node
                .abort(RequestId(id), t.secret.clone(), "client gone".into())
                .await
                .unwrap()
        );
    }
    // Well before the fence deadline (one lease past the 5 s lease).
    wait_until("abandoned spans freed", Duration::from_secs(3), || {
        arena.all_free()
    })
    .await;
    assert_eq!(d.node.fence_stats().released_at_deadline, 0);
    let (t, _) = reserve(&d, 9, &ids).await;
    let out = prefill(&p, 9, &ids, &t).await;
    assert_eq!(decode(&d, 9, &ids, &t, &out).await.unwrap(), want);
    assert_clean(&d.node).await;
    assert_clean(&p.node).await;
}

/// `transfer.verify` and `transfer.host_staging_bytes` as `pd_node` reads them from the config.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transfer_keys_reach_the_decode_node() {
    let mut cfg = cpu_ucx_config();
    cfg.transfer.verify = false;
    cfg.transfer.host_staging_bytes = 0;
    cfg.transfer.lease_ms = 1_000;
    let ids = cpu_prompt(5);
    let Some((_p, d)) = pd_pair(&cfg) else { return };
    let (_, t) = reserve(&d, 1, &ids).await;
    assert!(
        t.fence_record && !t.verify,
        "verify off: a record without a checksum"
    );
    assert!(
        d.node
            .abort(RequestId(1), t.secret.clone(), "test".into())
            .await
            .unwrap()
    );
    let arena = d.node.staging_arena().expect("decode arena").clone();
    let full = arena
        .reserve(arena.free_bytes())
        .expect("the rest of the arena");
    let e = d
        .node
        .reserve_kv(ReserveKv {
            request_id: RequestId(2),
            prompt_token_ids: ids.clone(),
            max_tokens: 5,
            prefill_node: NodeId::new("p"),
        })
        .await
        .unwrap_err();
    assert_eq!(e.kind, pdnode_core::error::ErrorKind::Unavailable, "{e}");
    drop(full);
    assert_clean(&d.node).await;
}

/// KV capabilities (docs/protocol.md, "Capabilities"): a record written by a node that was not
/// given the reservation (it knows the span and the rkey, not the capability) is refused
/// before the scatter; a `Decode` with a forged capability or after its expiry is refused; the
/// rightful request still completes and nothing is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_and_expired_capabilities_are_refused() {
    let mut cfg = cpu_ucx_config();
    cfg.transfer.lease_ms = 1_500;
    let ids = cpu_prompt(5);
    let Some((p, d)) = pd_pair(&cfg) else { return };
    let want = colocated_tokens(&cfg, &ids, 5).await;
    let n = per_rank(&d, ids.len().div_ceil(4));

    // Capabilities differ per reservation and are bound to it.
    let (ta, a) = reserve(&d, 1, &ids).await;
    let (tb, b) = reserve(&d, 2, &ids).await;
    assert_ne!(a.secret, b.secret);
    assert_eq!(a.secret.len(), 16);
    let out_b = prefill(&p, 2, &ids, &tb).await;

    // A forged Decode (B's capability presented for A) is refused; A stays claimable.
    let out = prefill(&p, 1, &ids, &ta).await;
    let forged = KvTarget {
        secret: tb.secret.clone(),
        ..ta.clone()
    };
    let e = decode(&d, 1, &ids, &forged, &out).await.unwrap_err();
    assert!(e.contains("wrong secret"), "{e}");
    assert_eq!(decode(&d, 1, &ids, &ta, &out).await.unwrap(), want);

    // B's writer is done; someone with B's span and rkey but not its capability overwrites
    // the record (a genuine-looking one, tagged under a capability of its own making).
    let out = out_b;
    let rec = FenceRecord {
        generation: b.staging_generation,
        request: 2,
        len: n as u64,
        sum: None,
        aborted: false,
    };
    let made_up = Secret::from_array([0x42; 16]);
    raw_put(&p, &b, b.staging_offset + n as u64, &rec.encode(&made_up));
    let before = d.node.fence_stats().record_failures;
    let e = decode(&d, 2, &ids, &tb, &out).await.unwrap_err();
    assert!(
        e.contains("refused before the scatter") && e.contains("capability"),
        "{e}"
    );
    assert_eq!(d.node.fence_stats().record_failures, before + 1);

    // A capability past its expiry (the lease deadline) is refused even though genuine.
    let (tc, _) = reserve(&d, 3, &ids).await;
    let out = prefill(&p, 3, &ids, &tc).await;
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    let e = decode(&d, 3, &ids, &tc, &out).await.unwrap_err();
    assert!(e.contains("expired"), "{e}");

    // The next request is served; the refused and expired ones hold nothing once fenced.
    let (td, _) = reserve(&d, 4, &ids).await;
    let out = prefill(&p, 4, &ids, &td).await;
    assert_eq!(decode(&d, 4, &ids, &td, &out).await.unwrap(), want);
    wait_until("every span back", Duration::from_secs(10), || {
        d.node.fence_stats().quarantined_now == 0 && d.node.pending_reservations() == 0
    })
    .await;
    assert_clean(&d.node).await;
    assert_clean(&p.node).await;
}
